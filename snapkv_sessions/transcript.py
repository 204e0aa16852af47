"""Transcript: the conversation as the cache holds it, and the plan of each turn.

One object owns what the session's cache corresponds to in text: the chat-template rendering, the single
position -> message map (run-length ``(seq, start, end)`` over true positions), and pins. Each turn it
produces a frozen :class:`TurnPlan`: the tokens to prefill, who owns every position, what is pinned and
protected, the observation window and whether the cache restarts. The plan is what
:meth:`snapkv_sessions.runner.ModelRunner.run` executes and what the turns table stores
(:meth:`TurnPlan.to_record`), so a live turn and its replay run the same plan.
"""

from __future__ import annotations

import bisect
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import regex

from .chat import ChatFormatter, Message, MessagePins, RenderDiverged, TemplateError
from .errors import ConfigError, PlanError
from .policy import ROLES, PinPolicy

Range = tuple[int, int]  # [start, end) true positions (or characters, for message pins)
Run = tuple[int, int, int]  # (message seq, start, end): the positions [start, end) belong to message seq


def observation_window(window: int, n_todo: int, context: int, min_prompt_tokens: int = 0) -> int | None:
    """The turn's observation window: its last ``window`` tokens (all of them when it is shorter).

    ``n_todo`` tokens are prefilled (the previous turn's pending token included) and the context then holds
    ``context`` true positions; below ``min_prompt_tokens`` nothing observes, so nothing is compressed.
    """
    if context < min_prompt_tokens:
        return None
    return min(window, n_todo)


def to_ranges(flags: Sequence[bool], offset: int) -> tuple[Range, ...]:
    """``[start, end)`` ranges (shifted by ``offset``) where ``flags`` is set."""
    out, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((offset + start, offset + i))
            start = None
    return tuple(out)


def extend_runs(runs: list[Run], seq: int, start: int, end: int) -> None:
    """Append positions [start, end) owned by ``seq``, merging with the last run when it continues it."""
    if runs and runs[-1][0] == seq and runs[-1][2] == start:
        runs[-1] = (seq, runs[-1][1], end)
    elif end > start:
        runs.append((seq, start, end))


PATTERN_TIMEOUT_S = 1.0  # per pattern and message: a benign pattern scans a 16K-token document in milliseconds


class PatternTimeout(ConfigError):
    """A ``pins.patterns`` regex ran past its time bound on a message (catastrophic backtracking)."""


def find_pins(chunk: str, pins: PinPolicy, timeout: float = PATTERN_TIMEOUT_S) -> tuple[Range, ...]:
    """Character ranges of ``chunk`` that the policy's markers and patterns pin (empty matches ignored).

    Patterns run with a time bound (the ``regex`` package's ``timeout``): one that backtracks
    catastrophically raises :class:`PatternTimeout` instead of holding the session's lock for ever.
    """
    hits = [(m.start(), m.end()) for marker in pins.markers for m in re.finditer(re.escape(marker), chunk)]
    for pat in pins.patterns:
        try:
            hits += [(m.start(), m.end()) for m in regex.finditer(pat, chunk, timeout=timeout) if m.end() > m.start()]
        except TimeoutError:
            raise PatternTimeout("pins.patterns", pat, f"ran over {timeout:g} s on a {len(chunk)}-character message; "
                                 "nothing was stored (simplify the pattern)") from None
    return tuple(sorted(hits))


@dataclass(frozen=True)
class RenderDelta:
    """The rendering a plan was made from: the full text and the character span of each planned token."""

    text: str
    offsets: tuple[Range, ...]


MASKED, SPLIT = "masked", "split"
# how a prefill chunk attends onto a cache: one SDPA with the bottom-right causal mask, or in two parts merged by
# their log-sum-exp (attention.split_prefill); the same attention with other rounding, so each turn records it
PREFILL_ATTENTION = (MASKED, SPLIT)


def recorded_attention(segments: dict | None) -> object:
    """How a recorded turn's prefill attended (``segments.attention``); a record without it attended masked, the
    only way before it was recorded. Returned as stored: :meth:`TurnPlan.from_record` validates it."""
    return (segments or {}).get("attention", MASKED)


@dataclass(frozen=True)
class TurnPlan:
    """One turn's prefill and compression, as data.

    Attributes
    ----------
    tokens: ids to prefill after the previous turn's pending token (which the runner feeds first)
    first_position: true position of ``tokens[0]``
    owners: ``(seq, start, end)`` runs over every true position of the context through this prefill
    pinned: true-position ranges of ``tokens`` that compression must never evict
    protect: true-position ranges kept through this turn's compression only, when they fit (the question)
    window: the observation window, or None (this turn does not compress)
    reprefill: the cache restarts empty before this prefill (recovery: the store rebuilds it)
    chunks: tokens each forward of the prefill feeds (pending ones included), as the recorded turn ran it; None
        (a live plan): the runner sizes them (:meth:`~snapkv_sessions.runner.ModelRunner.run` records them)
    attention: how the recorded prefill attended onto the cache (``masked``, ``split``; a record without it:
        ``masked``, the only way before it was recorded); None (a live plan): the runner's own
    render: how the tokens were rendered (live plans only; not recorded)
    """

    tokens: tuple[int, ...]
    first_position: int
    owners: tuple[Run, ...] = ()
    pinned: tuple[Range, ...] = ()
    protect: tuple[Range, ...] = ()
    window: int | None = None
    reprefill: bool = False
    chunks: tuple[int, ...] | None = field(default=None, compare=False)
    attention: str | None = field(default=None, compare=False)
    render: RenderDelta | None = field(default=None, compare=False, repr=False)

    @property
    def end_position(self) -> int:
        """True position after the last prefilled token: the context length once the prefill ran."""
        return self.first_position + len(self.tokens)

    def pinned_flags(self) -> list[bool]:
        """One pinned flag per token of :attr:`tokens`."""
        flags = [False] * len(self.tokens)
        for start, end in self.pinned:
            for pos in range(max(start, self.first_position), min(end, self.end_position)):
                flags[pos - self.first_position] = True
        return flags

    def to_record(self) -> dict:
        """The stored form (the turns table's ``segments``); the tokens are stored beside it."""
        return {"pinned": [list(r) for r in self.pinned], "protect": [list(r) for r in self.protect],
                "window": self.window, "reprefill": self.reprefill, "owners": [list(r) for r in self.owners]}

    @classmethod
    def from_record(cls, record: dict, tokens: Sequence[int]) -> TurnPlan:
        """The plan a turn record stores (``segments`` and ``prefill_tokens``).

        Records written before the owners were stored have none: such a plan has ``owners=()`` and
        ``first_position=-1``, and :meth:`Transcript.attach` fills both in from the stored messages.
        """
        if not isinstance(record, dict):
            raise PlanError(f"segments={str(record)[:80]!r}: a turn record without its plan")
        owners = tuple((int(s), int(a), int(b)) for s, a, b in record.get("owners") or [])
        first = owners[-1][2] - len(tokens) if owners else -1
        chunks = record.get("chunks")  # records written before the chunks were stored have none
        if chunks is not None and (not isinstance(chunks, list) or not chunks
                                   or not all(type(c) is int and c > 0 for c in chunks)):
            raise PlanError(f"segments.chunks={str(chunks)[:80]!r}: must be a list of positive token counts")
        attention = recorded_attention(record)
        if attention not in PREFILL_ATTENTION:
            raise PlanError(f"segments.attention={str(attention)[:80]!r}: must be one of {list(PREFILL_ATTENTION)}")
        return cls(tokens=tuple(int(t) for t in tokens), first_position=first, owners=owners,
                   pinned=tuple((int(a), int(b)) for a, b in record.get("pinned") or []),
                   protect=tuple((int(a), int(b)) for a, b in record.get("protect") or []),
                   window=record.get("window"), reprefill=bool(record.get("reprefill")),
                   chunks=None if chunks is None else tuple(chunks), attention=attention)


@dataclass(frozen=True)
class TurnContext:
    """What planning a turn needs besides the messages: whose turn it is and how the cache stands."""

    user_seq: int
    pending: int = 0  # tokens sampled last turn, not yet in the cache (fed before the plan's tokens)
    refed: int = 0  # history a tiered prefill may feed again (the reply, and as far back as its window reaches)
    reprefill: bool = False
    window: int = 32
    min_prompt_tokens: int = 0


class Transcript:
    """The rendered conversation the cache holds and the position -> message map, across turns.

    Attributes
    ----------
    text: the rendered conversation the cache holds, the pending token included
    char_pos: (len(text),) int64, the true position of the token covering each character (-1: none)
    runs: ``(seq, start, end)`` runs over every true position fed or pending
    """

    def __init__(self, tokenizer, pins: PinPolicy) -> None:
        self.tokenizer = tokenizer
        self.formatter = ChatFormatter(tokenizer)
        self.pin_policy = pins
        self.reset()

    def reset(self) -> None:
        """The cache restarted empty."""
        self.text = ""
        self.char_pos = np.zeros(0, dtype=np.int64)
        self.runs: list[Run] = []

    def copy_from(self, other: Transcript) -> None:
        """Hold what ``other`` holds (a fork starting from a copy of its source's cache)."""
        self.text, self.char_pos, self.runs = other.text, other.char_pos.copy(), list(other.runs)

    @property
    def length(self) -> int:
        """True positions the transcript covers (the cache's, plus its pending token)."""
        return self.runs[-1][2] if self.runs else 0

    # ------------------------------------------------------------------ pins, once per message

    @property
    def searches(self) -> bool:
        """Whether the policy names markers or patterns (else a message's pins are its role's alone)."""
        return bool(self.pin_policy.markers or self.pin_policy.patterns)

    def message_pins(self, prefix: Callable[[], list[Message]], message: Message) -> MessagePins:
        """Pins of ``message`` rendered after ``prefix()`` (the active messages before it, read only if needed).

        Raises :class:`PatternTimeout` (naming the pattern and the message) when a pattern runs too long.
        """
        if not self.searches:
            return MessagePins("", ())  # nothing to search for: no render needed
        text, spans = self.formatter.render([*prefix(), message], generation_prompt=False)
        _, start, end = spans[-1]
        chunk = text[start:end]
        try:
            return MessagePins(MessagePins.digest(chunk), find_pins(chunk, self.pin_policy))
        except PatternTimeout as exc:
            who = f"{message.role} message" + (f" {message.name!r}" if message.name else "")
            raise PatternTimeout(exc.param, exc.value, f"{exc.reason.split('; ')[0]} ({who}); nothing was stored "
                                 "(simplify the pattern)") from None

    def commit_pins(self, prefix: Callable[[], list[Message]], message: Message, room: int | None,
                    budget: int | None = None) -> MessagePins:
        """``message``'s pins, found once as it is committed; refused (:class:`AdmissionError`, before anything is
        stored) when they alone could never fit ``room``, the history slots the tightest layer keeps (None: no
        fixed room, as under ``pin_overflow: grow`` or a budget ratio): stored, such a message would fail every
        later turn. ``budget``: the policy's, named in the error."""
        from .admission import AdmissionError

        pins = self.message_pins(prefix, message)
        if room is None:
            return pins
        pinned = self.pinned_tokens(prefix, message, pins)
        if pinned - 2 > room:  # its turn may tokenize the span's two ends a token apart
            raise AdmissionError("compression.budget", budget, f"the {message.role} message alone pins {pinned} "
                                 f"tokens and a layer keeps {room} history tokens (pin_overflow: error)")
        return pins

    def pinned_tokens(self, prefix: Callable[[], list[Message]], message: Message, pins: MessagePins) -> int:
        """Tokens of ``message``'s rendered span that its role or its markers and patterns pin (the span
        tokenized on its own: within a token or two of what its turn will prefill)."""
        policy = self.pin_policy
        if not (message.role in policy.roles or message.pinned or pins.ranges):
            return 0
        msgs = [*prefix(), message]
        text, spans = self.formatter.render(msgs, generation_prompt=False)
        _, start, end = spans[-1]
        ids, offsets = self._delta(text[:end], start, self._plain_ranges(msgs, text[:end], spans, start))
        if message.role in policy.roles or message.pinned:
            return len(ids)
        hits = [(start + a, start + b) for a, b in pins.ranges]
        return sum(any(s < e and a < t for s, t in hits) for a, e in offsets)

    def reply_pins(self, msgs: list[Message], content: str) -> MessagePins | None:
        """Pins of the model's reply to ``msgs``. A reply is never refused: when a pattern runs too long on it,
        its markers still pin and the patterns do not (with a warning); None when the template rejects it."""
        reply = Message(role="assistant", content=content)
        try:
            return self.message_pins(lambda: msgs, reply)
        except TemplateError:
            return None  # searched for again when the reply is planned
        except PatternTimeout as exc:
            warnings.warn(str(exc), RuntimeWarning, stacklevel=3)
            text, spans = self.formatter.render([*msgs, reply], generation_prompt=False)
            chunk = text[spans[-1][1]: spans[-1][2]]
            markers_only = self.pin_policy.model_copy(update={"patterns": ()})
            return MessagePins(MessagePins.digest(chunk), find_pins(chunk, markers_only))

    def _hits(self, msgs: list[Message], text: str, spans, base: int) -> list[Range]:
        """Absolute pinned character ranges of the messages rendered at or after character ``base``."""
        hits: list[Range] = []
        if not self.searches:
            return hits
        for i, (seq, start, end) in enumerate(spans):
            if seq is None or end <= base:
                continue
            pins = msgs[i].pins
            if pins is None or pins.span != MessagePins.digest(text[start:end]):
                pins = self.message_pins(lambda i=i: msgs[:i], msgs[i])
            hits += [(start + a, start + b) for a, b in pins.ranges]
        return hits

    # ------------------------------------------------------------------ planning

    @cached_property
    def _control_texts(self) -> tuple[str, ...]:
        """The tokenizer's special tokens as text (``<|im_start|>``...): only the template may produce them."""
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        return tuple(t.content for t in added.values() if getattr(t, "special", False) and t.content)

    def _plain_ranges(self, msgs: list[Message], text: str, spans, base: int) -> list[Range]:
        """Character ranges past ``base`` of message content that spells a special token: they are tokenized as
        plain text, so content can never forge a control token (a role, an end of turn)."""
        out: list[Range] = []
        for i, (seq, start, end) in enumerate(spans):
            if seq is None or end <= base:
                continue
            content = msgs[i].for_template()["content"]
            if not any(c in content for c in self._control_texts):
                continue
            at = text.find(content, start, end)
            if at < 0:
                raise TemplateError("msg.content", content[:80], "spells a control token and the chat template "
                                    "does not keep content verbatim, so it cannot be kept plain text")
            if at + len(content) > base:
                out.append((max(at, base), at + len(content)))
        return out

    def _delta(self, text: str, base: int, plain: list[Range]) -> tuple[list[int], list[Range]]:
        """Token ids of ``text`` from character ``base`` on, and each token's character span. The ``plain``
        ranges are tokenized without special-token parsing; the rest (the template's own markup) with it."""
        pieces, pos = [], base
        for start, end in plain:
            pieces += [(pos, start, False), (start, end, True)]
            pos = end
        pieces.append((pos, len(text), False))
        ids: list[int] = []
        offsets: list[Range] = []
        for start, end, literal in pieces:
            if end <= start:
                continue
            enc = self.tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True,
                                 **({"split_special_tokens": True} if literal else {}))
            ids += enc["input_ids"]
            offsets += [(start + a, start + b) for a, b in enc["offset_mapping"]]
        return ids, offsets

    def plan(self, msgs: list[Message], ctx: TurnContext) -> TurnPlan:
        """The next turn's plan: the rendering of ``msgs`` past what the cache holds (all of it on re-prefill)."""
        text, spans = self.formatter.render(msgs, generation_prompt=True)
        base = 0 if ctx.reprefill else len(self.text)
        if not ctx.reprefill and not text.startswith(self.text):
            raise RenderDiverged("tokenizer.chat_template", "transcript", "the cache is not a prefix of the render")
        ids, offsets = self._delta(text, base, self._plain_ranges(msgs, text, spans, base))
        first = 0 if ctx.reprefill else self.length
        starts = [a for _, a, _ in spans]
        owners = []
        for start, _ in offsets:
            seq, a, b = spans[max(0, bisect.bisect_right(starts, start) - 1)]
            owners.append(seq if seq is not None and a <= start < b else ctx.user_seq + 1)  # the reply's prompt
        roles = {m.seq: m for m in msgs}
        hits = self._hits(msgs, text, spans, base)
        pins = self.pin_policy
        pinned = [(o in roles and (roles[o].role in pins.roles or roles[o].pinned)) or first + i < pins.sink_tokens
                  or any(s < end and start < e for s, e in hits)
                  for i, (o, (start, end)) in enumerate(zip(owners, offsets, strict=True))]
        protect = [pins.keep_question and o == ctx.user_seq for o in owners]
        runs = [] if ctx.reprefill else list(self.runs)
        for i, owner in enumerate(owners):
            extend_runs(runs, owner, first + i, first + i + 1)
        # the window may reach back over everything this prefill feeds, as a full prefill's would
        pending = 0 if ctx.reprefill else ctx.pending + ctx.refed
        window = observation_window(ctx.window, pending + len(ids), first + len(ids), ctx.min_prompt_tokens)
        return TurnPlan(tokens=tuple(ids), first_position=first, owners=tuple(runs), pinned=to_ranges(pinned, first),
                        protect=to_ranges(protect, first), window=window, reprefill=ctx.reprefill,
                        render=RenderDelta(text, tuple(offsets)))

    def attach(self, plan: TurnPlan, msgs: list[Message], ctx: TurnContext) -> TurnPlan:
        """A recorded plan with its rendering, checked: the stored messages must render to its tokens."""
        if plan.render is not None:
            return plan
        again = self.plan(msgs, ctx)
        if again.tokens != plan.tokens:
            raise PlanError(f"turn plan at position {again.first_position}: the stored messages no longer render "
                            "to the recorded prefill tokens")
        if not plan.owners:  # a legacy record: where it starts and who owns what come from the re-plan
            return replace(plan, first_position=again.first_position, owners=again.owners, render=again.render)
        return replace(plan, render=again.render)

    # ------------------------------------------------------------------ advancing

    def advance(self, plan: TurnPlan) -> None:
        """The cache now holds the plan's tokens (after a restart, when the plan re-prefills)."""
        if plan.reprefill:
            self.reset()
        text, offsets = plan.render.text, plan.render.offsets
        grown = np.full(len(text), -1, dtype=np.int64)
        grown[: len(self.char_pos)] = self.char_pos
        for i, (start, end) in enumerate(offsets):
            grown[start:end] = plan.first_position + i
        self.char_pos = grown
        self.text = text
        self.runs = list(plan.owners)

    def extend_reply(self, seq: int, tokens: list[int]) -> None:
        """The reply's tokens (decoded into the cache, or pending) follow, owned by message ``seq``."""
        start = self.length
        extend_runs(self.runs, seq, start, start + len(tokens))
        tail = self.tokenizer.decode(tokens, skip_special_tokens=False)
        self.char_pos = np.concatenate([self.char_pos, np.full(len(tail), -1, dtype=np.int64)])
        self.text += tail

    # ------------------------------------------------------------------ reading the map

    def spans(self) -> dict[int, Range]:
        """First and end true position of every message the transcript holds."""
        out: dict[int, Range] = {}
        for seq, start, end in self.runs:
            out[seq] = (out[seq][0], end) if seq in out else (start, end)
        return out

    def _owner_roles(self, context: int, roles: dict[int, str]) -> np.ndarray:
        """(context,) the index in ROLES of the role owning each of the first ``context`` true positions; a seq
        missing from ``roles`` is the reply being written."""
        return np.concatenate([np.full(min(b, context) - a, ROLES.index(roles.get(s, "assistant")))
                               for s, a, b in self.runs if a < context])

    def kept_per_role(self, kept: list[np.ndarray], context: int, roles: dict[int, str]) -> dict[str, float]:
        """Share of each role's first ``context`` positions still held, averaged over layers and KV heads.

        ``kept[l]`` is (Hkv, K) true positions, -1 at padding slots (heads keeping uneven counts); a seq missing
        from ``roles`` is the reply being written.
        """
        owner_role = self._owner_roles(context, roles)  # (context,)
        total = np.bincount(owner_role, minlength=len(ROLES)).astype(float)
        held = sum(np.bincount(owner_role[k[(k >= 0) & (k < context)]], minlength=len(ROLES)) for k in kept) / (
            len(kept) * kept[0].shape[0])
        return {r: round(float(held[i] / total[i]), 4) for i, r in enumerate(ROLES) if total[i] > 0}

    def pinned_per_role(self, kept: list[np.ndarray], context: int, roles: dict[int, str],
                        pinned: np.ndarray) -> dict[str, tuple[int, float]]:
        """Per role with pinned positions among the first ``context``: (pinned tokens, retention), the retention
        being the share of them held by the layer and KV head holding fewest (a pin is never evicted: 1.0).

        ``kept`` as for :meth:`kept_per_role`; ``pinned`` (N >= context,) bool over true positions.
        """
        owner_role = self._owner_roles(context, roles)  # (context,)
        pins = np.asarray(pinned[:context], dtype=bool)  # (context,)
        total = np.bincount(owner_role[pins], minlength=len(ROLES))  # (R,) pinned positions per role
        if not total.any():
            return {}
        fewest = total.copy()
        for layer in kept:  # (Hkv, K)
            for head in layer:  # (K,)
                k = head[(head >= 0) & (head < context)]
                k = k[pins[k]]  # the pinned positions this head holds
                fewest = np.minimum(fewest, np.bincount(owner_role[k], minlength=len(ROLES)))
        return {r: (int(total[i]), round(float(fewest[i] / total[i]), 4)) for i, r in enumerate(ROLES) if total[i]}
