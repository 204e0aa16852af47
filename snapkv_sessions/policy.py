"""Session policy: budgets, windows, pins, drift and recovery, from YAML (``safe_load``) validated by pydantic v2.

This module imports no torch, so the store, the policy checks and the CLI stay light.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config import CompressionConfig, RecallConfig
from .errors import ConfigError

ROLES = ("system", "developer", "tool_schema", "document", "user", "assistant", "tool")
POLICY_DIR = Path(__file__).resolve().parent.parent / "policies"


MAX_YAML_NODES = 10_000  # a policy is a few dozen values; alias expansion past this is an attack


def _expanded_size(node: yaml.Node | None, memo: dict[int, int]) -> int:
    """Values the YAML node graph stands for once every alias is expanded (shared nodes counted per use)."""
    if node is None:
        return 0
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = MAX_YAML_NODES + 1  # a node that contains itself expands without end
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[key] = min(size, 10 * MAX_YAML_NODES)  # capped: the sum stays small however deep the nesting
    return memo[key]


class PolicyError(ConfigError):
    """A policy field has an invalid value; ``param`` is the field path (``"compression.window"``)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PinPolicy(_Strict):
    """What compression and re-prefill may never evict.

    roles: every token of a message with one of these roles
    markers: literal strings; the tokens of every occurrence inside any message
    patterns: regular expressions; the tokens of every match inside any message
    sink_tokens: the first N tokens of the session (attention sinks)
    keep_question: keep the current turn's user message through that turn's compression (when it fits)
    """

    roles: tuple[str, ...] = ("system",)
    markers: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    sink_tokens: int = Field(default=4, ge=0)
    keep_question: bool = True

    @field_validator("roles")
    @classmethod
    def _known_roles(cls, roles: tuple[str, ...]) -> tuple[str, ...]:
        for role in roles:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; roles are {list(ROLES)}")
        return roles

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pat in patterns:
            try:
                re.compile(pat)
            except re.error as exc:
                raise ValueError(f"bad regex {pat!r}: {exc}") from None
        return patterns

    @field_validator("markers")
    @classmethod
    def _non_empty(cls, markers: tuple[str, ...]) -> tuple[str, ...]:
        if any(not m for m in markers):
            raise ValueError("markers must be non-empty strings")
        return markers


class DriftPolicy(_Strict):
    """Task-shift detection from query-embedding drift (1 - max cosine similarity to the working set)."""

    embedder: Literal["minilm", "model", "none"] = "minilm"
    threshold: float = Field(default=0.75, ge=0.0, le=2.0)
    new_subject: bool = True  # a query naming only things the working set never named counts as a shift
    # a question that refers back ("How many of them...?") is a follow-up whatever its wording's embedding drift;
    # None (unstated: policies stored before it existed) is off, and new sessions state it on (Policy.stated)
    follow_ups: bool | None = None
    action: Literal["reprefill", "warn", "never"] = "reprefill"
    # which signal decides a tiered turn: ``text`` (the embedding drift, new subjects and the evidence check, read
    # before the prefill) or ``attention`` (what the window reached for that was cold, read after it:
    # snapkv_sessions.reach; the text signals are recorded beside it). Without the tier, or with
    # memory.on_shift: reprefill (a re-prefill is decided before the prefill), text decides either way.
    signal: Literal["text", "attention"] = "text"
    # on Reach.score (the cold share of the window's mass): bench detector --tier's calibration, SmolLM2 at 30%
    attention_threshold: float = Field(default=0.025, ge=0.0, le=1.0)


class RecoveryPolicy(_Strict):
    """Limits on re-prefills from the store."""

    max_reprefills: int | None = Field(default=None, ge=0)
    min_turns_between: int = Field(default=1, ge=0)


class MemoryPolicy(_Strict):
    """The tiered memory (:mod:`snapkv_sessions.tier`): what compression evicts waits in a host tier.

    cold: keep evicted KV in the host tier, so every turn's prefill sees the whole history and the hot set is
        chosen afresh from all of it (no re-prefill while the tier holds the session)
    max_bytes: the cap on the cold bytes of all sessions of this process (least recently used evicted first);
        None: a quarter of the host's memory. A session whose policy states it sets the pool's (the latest wins).
    spill_dir: write an evicted session's tier here (safetensors) instead of dropping it
    on_shift: ``tier``: a detected task shift is served by the tier (no re-prefill while it holds the
        session); ``reprefill``: drift decides re-prefills as without the tier
    recall: decode-time recall from the tier (:class:`~snapkv_sessions.config.RecallConfig`): every decode step
        also attends to the cold slots its query reaches for; None (the default): decode reads the hot slots
    refeed_reply: feed the last reply again with the next turn's tokens, so its KV is computed over the whole
        history as a full prefill's would be (exact, the default); false keeps the KV decode computed against
        the hot cache alone
    """

    cold: bool = True
    refeed_reply: bool = True
    max_bytes: int | None = Field(default=None, ge=0)
    spill_dir: str | None = None
    on_shift: Literal["tier", "reprefill"] = "tier"
    recall: RecallConfig | None = None


class LimitsPolicy(_Strict):
    """Admission limits, checked (with the torch-free token counter) before any model work."""

    max_document_tokens: int | None = Field(default=None, ge=1)
    max_session_tokens: int | None = Field(default=None, ge=1)


class Policy(_Strict):
    """A whole session policy. ``Policy()`` is the default policy (``policies/default.yaml``)."""

    name: str = "default"
    compression: CompressionConfig = CompressionConfig()
    min_prompt_tokens: int = Field(default=0, ge=0)
    pins: PinPolicy = PinPolicy()
    drift: DriftPolicy = DriftPolicy()
    recovery: RecoveryPolicy = RecoveryPolicy()
    limits: LimitsPolicy = LimitsPolicy()
    # None: not stated. A new session states the default (MemoryPolicy(), the tier on); a session stored before
    # the tier existed has none and runs without it, so its policy hash and its replay stay as recorded.
    memory: MemoryPolicy | None = None

    def stated(self) -> Policy:
        """This policy with every later setting stated, as a new session stores it: the tier on unless it says
        off, follow-up questions recognised unless it says not."""
        update: dict = {}
        if self.memory is None:
            update["memory"] = MemoryPolicy()
        if self.drift.follow_ups is None:
            update["drift"] = self.drift.model_copy(update={"follow_ups": True})
        return self.model_copy(update=update) if update else self

    def earlier_hashes(self) -> list[str]:
        """The hashes a session created from this policy by earlier versions stored: as given (before the tier),
        and stated before ``drift.follow_ups`` existed. An adapter that finds sessions by policy tries these."""
        out = [self.sha256]
        if self.drift.follow_ups is None:
            before = self.model_copy(update={"memory": self.memory or MemoryPolicy()})
            out.append(before.sha256)
        return [h for h in dict.fromkeys(out) if h != self.stated().sha256]

    @property
    def tiered(self) -> bool:
        return self.memory is not None and self.memory.cold

    @model_validator(mode="after")
    def _sinks_fit(self) -> Policy:
        budget = self.compression.budget
        if budget is not None and self.pins.sink_tokens >= budget - self.compression.window:
            raise ValueError(f"pins.sink_tokens={self.pins.sink_tokens} leaves no history budget "
                             f"(budget {budget} - window {self.compression.window})")
        return self

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dict(cls, data: dict) -> Policy:
        """Validate a mapping; errors become :class:`PolicyError` naming the field path and value."""
        if not isinstance(data, dict):
            raise PolicyError("policy", type(data).__name__, "must be a mapping")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _policy_error(exc, data) from None

    @classmethod
    def from_yaml(cls, text: str) -> Policy:
        try:
            size = _expanded_size(yaml.compose(text, Loader=yaml.SafeLoader), {})
            if size > MAX_YAML_NODES:  # a few aliases can stand for billions of values: refuse before building
                raise PolicyError("policy", "<yaml>", f"expands to {size} values through aliases (more than "
                                  f"{MAX_YAML_NODES}); write the policy out instead")
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError("policy", "<yaml>", f"not valid YAML: {str(exc)[:500]}") from None
        return cls.from_dict(data or {})

    @classmethod
    def load(cls, source: str | Path | dict | Policy | None) -> Policy:
        """A policy from a Policy, a dict, a YAML path, or a reference name (``default``, ``rag-qa``, ...)."""
        if source is None:
            return cls()
        if isinstance(source, Policy):
            return source
        if isinstance(source, dict):
            return cls.from_dict(source)
        path = Path(source)
        if not path.is_file() and (POLICY_DIR / f"{source}.yaml").is_file():
            path = POLICY_DIR / f"{source}.yaml"
        if not path.is_file():
            raise PolicyError("policy", str(source), "no such file, and not a reference policy name")
        return cls.from_yaml(path.read_text())

    def canonical_json(self) -> str:
        data = self.model_dump(mode="json")
        for *parents, key in _LATER_FIELDS:  # at their default: the JSON (and hash) of a policy written before
            holder = data
            for part in parents:
                holder = holder.get(part) if isinstance(holder, dict) else None
            if isinstance(holder, dict) and key in holder and holder[key] == _LATER_FIELDS[(*parents, key)]:
                del holder[key]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


# Fields added after sessions were first stored, with the value that means "as before they existed": left out of
# the canonical JSON while they hold it, so a stored policy keeps its hash. Append only.
_LATER_FIELDS: dict[tuple[str, ...], object] = {
    ("memory",): None,
    ("compression", "span_unit"): "word",
    ("drift", "follow_ups"): None,
    ("memory", "recall"): None,
    ("memory", "recall", "rank"): 16,
    ("memory", "recall", "reduce"): "max",
    ("memory", "recall", "share"): "head",
    ("memory", "recall", "tail"): "drop",
    ("memory", "recall", "tail_page"): 32,
    ("drift", "signal"): "text",
    ("drift", "attention_threshold"): 0.025,
    ("memory", "recall", "escalate"): None,
}


def _policy_error(exc: ValidationError, data: dict) -> PolicyError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and "=" in msg.split(" ", 1)[0]:
        # a model-level check names its own field first: "window=32 must be ..." inside "compression"
        field = msg.split("=", 1)[0].split(".")
        loc = field if not loc else (loc + field if loc[-1] != field[-1] else loc)
    value: object = data
    for part in loc:
        value = value.get(part) if isinstance(value, dict) else err.get("input")
    return PolicyError(".".join(loc) or "policy", value, msg)
