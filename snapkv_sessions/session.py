"""Session: ``chat(msg)`` turn after turn over a compressed cache, with the store as the source of truth.

Every message is committed before any compute (write-ahead); the reply and its turn record commit atomically
after it. The cache can always be rebuilt from the store by replaying the recorded turns exactly (the same
prefills, compressions and decode steps), which is how a session reopens in a new process and how a worker
catches up with turns another worker ran.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .chat import ChatFormatter, Message, TemplateError
from .drift import Assessment, DriftMonitor
from .errors import ConfigError
from .generation import GenerationConfig
from .models import load_model
from .policy import ROLES, Policy
from .report import CompressionReport
from .runner import ModelRunner
from .store import SessionStore, StoreError
from .store.blobs import pack_positions
from .store.tokens import TokenCounter

_MODELS: dict[str, tuple] = {}  # name -> (model, tokenizer), loaded once per process


class AdmissionError(ConfigError):
    """A message would exceed a policy limit; nothing was stored and no model work was done."""


@dataclass
class Reply:
    """What one turn produced."""

    text: str
    turn: int
    session_id: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    context_tokens: int
    cache_tokens: list[int]
    kept_per_role: dict[str, float]
    timings: dict[str, float]
    report: CompressionReport | None
    stop_reason: str
    events: list[tuple[str, dict]] = field(default_factory=list)


def _runner_for(model) -> tuple[ModelRunner, str]:
    if isinstance(model, ModelRunner):
        return model, str(getattr(model.model.config, "_name_or_path", "model"))
    if isinstance(model, tuple):
        return ModelRunner(*model), str(getattr(model[0].config, "_name_or_path", "model"))
    if isinstance(model, str):
        if model not in _MODELS:
            _MODELS[model] = load_model(model)
        return ModelRunner(*_MODELS[model]), model
    raise ConfigError("model", type(model).__name__, "must be a model name, (model, tokenizer) or a ModelRunner")


def _counter_for(tokenizer) -> TokenCounter | None:
    """The torch-free counter built from the model's tokenizer.json, when the tokenizer came from a folder."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "")))
    try:
        return TokenCounter.from_model_dir(folder)
    except (FileNotFoundError, OSError, ValueError):
        return None


def _runs(owners: list[int]) -> list[list[int]]:
    """[[message seq, first position, end position], ...] run-length form of a position -> message map."""
    out: list[list[int]] = []
    for pos, seq in enumerate(owners):
        if out and out[-1][0] == seq and out[-1][2] == pos:
            out[-1][2] = pos + 1
        else:
            out.append([seq, pos, pos + 1])
    return out


def _ranges(flags: list[bool], offset: int) -> list[list[int]]:
    """[[start, end), ...] true-position ranges where ``flags`` is set."""
    out, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append([offset + start, offset + i])
            start = None
    return out


def _flags(ranges: list[list[int]], offset: int, n: int) -> list[bool]:
    flags = [False] * n
    for start, end in ranges:
        for p in range(max(start, offset), min(end, offset + n)):
            flags[p - offset] = True
    return flags


class Session:
    """A multi-turn conversation whose KV cache is compressed with SnapKV after every turn.

    Build one with :meth:`create` or :meth:`open`, never directly.
    """

    def __init__(self, session_id: str, store: SessionStore, runner: ModelRunner, policy: Policy,
                 model_id: str, on_pending: str = "answer") -> None:
        if runner.tokenizer is None:
            raise ConfigError("model", model_id, "a Session needs the model's tokenizer")
        if on_pending not in ("answer", "report"):
            raise ConfigError("on_pending", on_pending, "must be 'answer' or 'report'")
        self.id = session_id
        self.store = store
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.policy = policy
        self.model_id = model_id
        self.on_pending = on_pending
        self.formatter = ChatFormatter(self.tokenizer)
        self.counter = _counter_for(self.tokenizer)
        self.drift = DriftMonitor(policy.drift.embedder, runner.model, self.tokenizer,
                                  subjects=policy.drift.new_subject)
        self.recovered: Reply | None = None
        self._reset()

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, model, policy: str | dict | Policy | None = None, store: SessionStore | str | None = None,
               system: str | None = None, title: str | None = None, redis_url: str | None = None,
               history: list | None = None) -> Session:
        """A new session. ``model``: bundle/hub name, folder, ``(model, tokenizer)`` or a ModelRunner.

        ``history`` (messages of any role, OpenAI-style dicts accepted) is committed before the first turn, as
        if the conversation had happened; the first turn prefills it whole.
        """
        policy = Policy.load(policy)
        store = store if isinstance(store, SessionStore) else SessionStore(store, redis_url=redis_url)
        runner, model_id = _runner_for(model)
        sid = store.create_session(model_id, policy.canonical_json(), policy.sha256, title=title)
        session = cls(sid, store, runner, policy, model_id)
        if system is not None:
            session.add_message({"role": "system", "content": system})
        for msg in history or []:
            message = Message.coerce(msg)
            store.add_message(sid, message.role, message.content, message.name, message.pinned)
        return session

    @classmethod
    def open(cls, session_id: str, model=None, store: SessionStore | str | None = None,
             redis_url: str | None = None, on_pending: str = "answer") -> Session:
        """Reopen a stored session: its cache is rebuilt exactly by replaying the recorded turns.

        A turn left pending by a crashed worker is answered (``on_pending="answer"``) or closed as abandoned
        and reported in the events (``"report"``).
        """
        store = store if isinstance(store, SessionStore) else SessionStore(store, redis_url=redis_url)
        row = store.get_session(session_id)
        runner, model_id = _runner_for(model if model is not None else row["model_id"])
        policy = Policy.from_yaml(row["policy_json"])
        session = cls(session_id, store, runner, policy, row["model_id"], on_pending=on_pending)
        with store.lock(session_id):
            session._sync()
        return session

    def _reset(self) -> None:
        """Forget everything model-side; the next use replays the store from the start."""
        self._restart_cache()
        self.drift.reset()
        self.turns_applied = 0

    def _restart_cache(self) -> None:
        self.state = self.runner.new_state()
        self.owners: list[int] = []  # message seq of every fed (or pending) token, by true position
        self.cache_text = ""  # the rendered conversation the cache holds, pending token included
        self.char_pos = np.zeros(0, dtype=np.int64)  # true position of the token covering each character

    def _advance_text(self, text: str, offsets: list[tuple[int, int]], first_pos: int, tail: str) -> None:
        """The cache now holds ``text`` (tokens at ``offsets`` from ``first_pos`` on) followed by ``tail``."""
        grown = np.full(len(text) + len(tail), -1, dtype=np.int64)
        grown[: len(self.char_pos)] = self.char_pos
        for i, (start, end) in enumerate(offsets):
            grown[start:end] = first_pos + i
        self.char_pos = grown
        self.cache_text = text + tail

    # ------------------------------------------------------------------ messages

    def add_message(self, msg: str | dict | Message) -> int:
        """Commit a non-turn message (system, developer, tool_schema, document); it is fed with the next turn."""
        message = Message.coerce(msg, default_role="system")
        if message.role in ("user", "assistant"):
            raise ConfigError("msg.role", message.role, "user messages go through chat(); assistant ones are replies")
        return self._commit(message)

    def add_history(self, msg: str | dict | Message) -> int:
        """Commit a message of an exchange that happened outside this session (any role, user and assistant
        included), as ``Session.create(history=...)`` does; it is fed to the cache with the next turn."""
        return self._commit(Message.coerce(msg))

    def _commit(self, message: Message) -> int:
        """Admit ``message`` against the policy limits and append it to the store under the session lock."""
        self._admit(message)
        with self.store.lock(self.id):
            return self.store.add_message(self.id, message.role, message.content, message.name, message.pinned)["seq"]

    def add_document(self, text: str, name: str | None = None, pinned: bool = False) -> int:
        """Commit a document; it enters the cache with the next turn (pinned documents are never evicted)."""
        return self.add_message(Message(role="document", content=text, name=name, pinned=pinned))

    def messages(self, include_abandoned: bool = False) -> list[Message]:
        return [Message(role=r["role"], content=r["content"], name=r["name"], pinned=r["pinned"], seq=r["seq"])
                for r in self.store.messages(self.id, include_abandoned=include_abandoned)]

    def verify(self) -> list[str]:
        """Problems in the stored hash chain (empty when intact)."""
        return self.store.verify(self.id)

    def count_tokens(self, text: str) -> int:
        """Content tokens of ``text`` (tiktoken over the model's own vocabulary; Hugging Face otherwise)."""
        if self.counter is not None:
            return self.counter.count(text)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _admit(self, message: Message) -> None:
        limits = self.policy.limits
        if limits.max_document_tokens is None and limits.max_session_tokens is None:
            return
        n = self.count_tokens(message.content)
        if message.role == "document" and limits.max_document_tokens is not None and n > limits.max_document_tokens:
            raise AdmissionError("limits.max_document_tokens", limits.max_document_tokens,
                                 f"document {message.name!r} has {n} tokens")
        if limits.max_session_tokens is not None:
            total = n + sum(self.count_tokens(m.content) for m in self.messages())
            if total > limits.max_session_tokens:
                raise AdmissionError("limits.max_session_tokens", limits.max_session_tokens,
                                     f"the session would hold {total} content tokens")

    # ------------------------------------------------------------------ turns

    def chat(self, msg: str | dict | Message, **generation) -> Reply:
        """One turn: commit ``msg``, prefill it onto the compressed cache, compress, decode, commit the reply."""
        for _ in self.stream(msg, **generation):
            pass
        return self.last_reply

    def stream(self, msg: str | dict | Message, **generation) -> Iterator[str]:
        """Like :meth:`chat`, yielding the reply's text pieces as they are decoded (``last_reply`` after)."""
        message = Message.coerce(msg)
        if message.role not in ("user", "tool"):
            raise ConfigError("msg.role", message.role, "a turn starts with a user or tool message")
        gen = self._generation(generation)
        self._admit(message)
        with self.store.lock(self.id):
            self._sync()
            turn, row = self.store.begin_turn(self.id, message.content, message.name, self.policy.sha256,
                                              self.model_id, self._gen_record(gen), gen.seed, role=message.role)
            yield from self._run(turn, row["seq"], gen)

    def _generation(self, kwargs: dict) -> GenerationConfig:
        if "stop" in kwargs and isinstance(kwargs["stop"], (list, str)):
            kwargs["stop"] = (kwargs["stop"],) if isinstance(kwargs["stop"], str) else tuple(kwargs["stop"])
        unknown = set(kwargs) - {"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop"}
        if unknown:
            raise ConfigError(sorted(unknown)[0], kwargs[sorted(unknown)[0]], "is not a generation parameter")
        if kwargs.get("temperature", 0) > 0 and kwargs.get("seed") is None:
            kwargs["seed"] = random.randrange(2**31)  # recorded, so the turn can be re-executed
        return GenerationConfig(**kwargs)

    @staticmethod
    def _gen_record(gen: GenerationConfig) -> dict:
        return {"max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_k": gen.top_k,
                "top_p": gen.top_p, "seed": gen.seed, "stop": list(gen.stop)}

    def _run(self, turn: int, user_seq: int, gen: GenerationConfig) -> Iterator[str]:
        try:
            yield from self._compute(turn, user_seq, gen)
        except BaseException as exc:  # an error or an abandoned stream: no half turn
            if isinstance(exc, Exception):
                self.store.add_event(self.id, "error", {"type": type(exc).__name__, "message": str(exc)}, turn=turn)
            reason = "stream closed before the reply" if isinstance(exc, GeneratorExit) else type(exc).__name__
            self.store.abandon_turn(self.id, turn, reason=reason)
            self._reset()  # the cache may hold part of the turn; it is rebuilt from the store on next use
            raise

    def _active_messages(self, up_to_seq: int | None = None) -> list[Message]:
        msgs = self.messages()
        return [m for m in msgs if up_to_seq is None or m.seq <= up_to_seq]

    def _delta(self, text: str, spans, assistant_seq: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Tokens of ``text`` past what the cache holds, their owner message, and their character offsets."""
        if not text.startswith(self.cache_text):
            raise TemplateError("tokenizer.chat_template", "transcript", "the cache is not a prefix of the render")
        base = len(self.cache_text)
        enc = self.tokenizer(text[base:], add_special_tokens=False, return_offsets_mapping=True)
        owners, offsets = [], []
        for start, end in enc["offset_mapping"]:
            pos = base + start
            owner = next((s for s, a, b in spans if a <= pos < b), None)
            owners.append(assistant_seq if owner is None else owner)
            offsets.append((base + start, base + end))
        return enc["input_ids"], owners, offsets

    def _pins(self, text: str, spans, msgs: list[Message], owners: list[int], offsets, first_pos: int,
              user_seq: int) -> tuple[list[bool], list[bool]]:
        """Pinned flags (policy roles, pinned messages, markers, patterns, sinks) and this turn's protect flags."""
        pins = self.policy.pins
        by_seq = {m.seq: m for m in msgs}
        hits: list[tuple[int, int]] = []
        for seq, a, b in spans:
            if seq is None:
                continue
            chunk = text[a:b]
            for marker in pins.markers:
                hits += [(a + m.start(), a + m.end()) for m in re.finditer(re.escape(marker), chunk)]
            for pat in pins.patterns:
                hits += [(a + m.start(), a + m.end()) for m in re.finditer(pat, chunk) if m.end() > m.start()]
        pinned, protect = [], []
        for i, (owner, (start, end)) in enumerate(zip(owners, offsets, strict=True)):
            msg = by_seq.get(owner)
            flag = msg is not None and (msg.role in pins.roles or msg.pinned)
            flag = flag or first_pos + i < pins.sink_tokens or any(s < end and start < e for s, e in hits)
            pinned.append(flag)
            protect.append(pins.keep_question and owner == user_seq)
        return pinned, protect

    def _window(self, n_todo: int, context: int) -> int | None:
        if context < self.policy.min_prompt_tokens:
            return None
        return min(self.policy.compression.window, n_todo)

    def _protect_mask(self, protect_ranges: list[list[int]], window: int) -> torch.Tensor | None:
        """The question's positions, kept this turn only if they fit beside the pins in every layer's budget."""
        if not protect_ranges:
            return None
        mask = torch.zeros(self.state.next_position, dtype=torch.bool)
        for start, end in protect_ranges:
            mask[start:end] = True
        from .press import layer_budgets

        budgets = layer_budgets(self.policy.compression, self.runner.num_layers, self.state.next_position)
        if int((mask | self.state.pinned).sum()) > min(budgets) - window:
            return None
        return mask

    def _compute(self, turn: int, user_seq: int, gen: GenerationConfig) -> Iterator[str]:
        t_start = time.perf_counter()
        msgs = self._active_messages()
        query = next(m.content for m in msgs if m.seq == user_seq)
        assessment = self._assess(query)
        decision = self._decide(assessment, turn)
        events: list[tuple[str, dict]] = []
        if assessment.score is not None:
            events.append(("drift", {**assessment.to_dict(), "decision": decision}))
        if decision == "reprefill":  # the store is the source of truth: rebuild the whole prompt from it
            self._restart_cache()
        text, spans = self.formatter.render(msgs, generation_prompt=True)
        assistant_seq = user_seq + 1
        ids, owners, offsets = self._delta(text, spans, assistant_seq)
        first_pos = self.state.next_position + len(self.state.pending)
        pinned, protect = self._pins(text, spans, msgs, owners, offsets, first_pos, user_seq)
        n_todo = len(self.state.pending) + len(ids)
        window = self._window(n_todo, first_pos + len(ids))
        segments = {"pinned": _ranges(pinned, first_pos), "protect": _ranges(protect, first_pos), "window": window,
                    "reprefill": decision == "reprefill"}
        logits, report, kept = self._prefill_compress(ids, pinned, segments)
        self.owners.extend(owners)
        self._advance_text(text, offsets, first_pos, "")
        prefill_end = self.state.next_position
        kept_per_role = self._kept_per_role(kept, prefill_end, msgs) if kept is not None else {}
        t_prefill = time.perf_counter()
        if decision == "reprefill":
            self.drift.reset()
            events.append(("reprefill", {"drift_score": assessment.score, "missing_terms": assessment.missing_terms,
                                         "tokens_reprefilled": len(ids), "ms": round((t_prefill - t_start) * 1e3, 2)}))
        self.drift.observe(query)
        tokens: list[int] = []
        emitted = ""
        for tok in self.runner.generate(self.state, logits, gen):
            tokens.append(tok)
            piece = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if not piece.endswith("\ufffd") and len(piece) > len(emitted):
                yield piece[len(emitted):]
                emitted = piece
        t_end = time.perf_counter()
        self._finish(turn, assistant_seq, text, ids, prefill_end, tokens, report, kept, kept_per_role, segments, gen,
                     {"prefill_ms": (t_prefill - t_start) * 1e3, "decode_ms": (t_end - t_prefill) * 1e3},
                     assessment, decision, events)

    def _assess(self, query: str) -> Assessment:
        if not self.state.positions:
            return Assessment(None, None, [])
        kept = [p[0].cpu().numpy() for p in self.state.positions]
        return self.drift.assess(query, self.cache_text, self.char_pos, kept)

    def _decide(self, assessment: Assessment, turn: int) -> str:
        """kept | reprefill | warn | ignored | limited | n/a, from the policy's drift and recovery sections."""
        if assessment.score is None:
            return "n/a"
        if assessment.score <= self.policy.drift.threshold:
            return "kept"
        if all(n == self.state.next_position for n in self.state.cache_lengths()):
            return "kept"  # nothing was evicted: a re-prefill would rebuild the same cache
        action = self.policy.drift.action
        if action != "reprefill":
            return "warn" if action == "warn" else "ignored"
        recovery = self.policy.recovery
        prior = [t["turn"] for t in self.store.turns(self.id, status="done") if t["drift_decision"] == "reprefill"]
        if recovery.max_reprefills is not None and len(prior) >= recovery.max_reprefills:
            return "limited"
        if prior and turn - prior[-1] < recovery.min_turns_between:
            return "limited"
        return "reprefill"

    def _prefill_compress(self, ids: list[int], pinned: list[bool], segments: dict):
        """The prefill and compression of one turn; the same calls live and in replay, so replay is exact."""
        window = segments["window"]
        logits, probe = self.runner.prefill(self.state, ids, pinned=pinned, window=window)
        report, kept = None, None
        if probe is not None:
            protect = self._protect_mask(segments["protect"], window)
            report = self.runner.compress(self.state, self.policy.compression, probe, protect)
            segments["protect_applied"] = protect is not None
            kept = [p[0].cpu().numpy() for p in self.state.positions]
        return logits, report, kept

    def _finish(self, turn, assistant_seq, text, ids, prefill_end, tokens, report, kept, kept_per_role, segments, gen,
                timings, assessment: Assessment, decision: str, events: list[tuple[str, dict]]):
        state = self.state
        decode_tokens = state.token_ids[prefill_end:]
        pending = list(state.pending)
        self.owners.extend([assistant_seq] * (len(decode_tokens) + len(pending)))
        content = self.tokenizer.decode(tokens, skip_special_tokens=True)
        shown = content
        for stop in gen.stop:
            if stop in shown:
                shown = shown[: shown.index(stop)]
        timings["compression_ms"] = report.total_ms if report else 0.0
        segments["owners"] = _runs(self.owners[:prefill_end])  # position -> message map of this turn's context
        record = {
            "prefill_tokens": ids, "decode_tokens": decode_tokens, "pending_tokens": pending,
            "segments": segments, "tokens_in": len(ids), "tokens_out": len(tokens),
            "kept_per_role": kept_per_role, "retention": self._retention(report),
            "kept_positions": pack_positions(kept) if kept is not None else None,
            "compression": report.to_dict() if report else None, "drift_score": assessment.score,
            "drift_decision": decision,
            "timings": timings, "stop_reason": state.last_stop_reason,
        }
        if report and report.compressed:
            events.append(("compression", {k: v for k, v in report.to_dict().items() if k not in ("kept", "kept_new")}))
        msg = self.store.finish_turn(self.id, turn, content, record, events, self._spans())
        if msg["seq"] != assistant_seq:
            raise StoreError(f"session_id={self.id!r}: assistant message got seq {msg['seq']}, expected {assistant_seq}")
        self._advance_text(text, [], 0, self.tokenizer.decode(decode_tokens + pending, skip_special_tokens=False))
        self.turns_applied = turn
        self.last_reply = Reply(
            text=shown, turn=turn, session_id=self.id, token_ids=tokens, prompt_tokens=len(ids),
            completion_tokens=len(tokens), context_tokens=state.next_position + len(pending),
            cache_tokens=state.cache_lengths(), kept_per_role=kept_per_role, timings=timings, report=report,
            stop_reason=state.last_stop_reason, events=events)

    def _spans(self) -> dict[int, tuple[int, int]]:
        spans: dict[int, list[int]] = {}
        for pos, seq in enumerate(self.owners):
            lo_hi = spans.setdefault(seq, [pos, pos + 1])
            lo_hi[1] = pos + 1
        return {seq: (a, b) for seq, (a, b) in spans.items()}

    def _kept_per_role(self, kept: list[np.ndarray], context: int, msgs: list[Message]) -> dict[str, float]:
        """Share of each role's context tokens (the first ``context`` positions) still held after compression,
        averaged over layers and KV heads."""
        roles = {m.seq: m.role for m in msgs}  # the reply being written is not stored yet: "assistant" below
        owner_role = np.array([ROLES.index(roles.get(s, "assistant")) for s in self.owners[:context]])
        total = np.bincount(owner_role, minlength=len(ROLES)).astype(float)
        held = sum(np.bincount(owner_role[k.reshape(-1)], minlength=len(ROLES)) for k in kept) / (
            len(kept) * kept[0].shape[0])
        return {r: round(float(held[i] / total[i]), 4) for i, r in enumerate(ROLES) if total[i] > 0}

    def _retention(self, report: CompressionReport | None) -> dict | None:
        if report is None:
            return None
        shares = [a / report.context_tokens for a in report.tokens_after]
        return {"tokens_after": report.tokens_after, "budgets": report.budgets, "min_share": round(min(shares), 4),
                "max_share": round(max(shares), 4)}

    # ------------------------------------------------------------------ replay / sync

    def _sync(self) -> None:
        """Bring the cache up to the store: replay done turns not applied here; resolve a pending one."""
        for rec in self.store.turns(self.id, status="done"):
            if rec["turn"] > self.turns_applied:
                self._replay(rec)
        pending = self.store.pending_turn(self.id)
        if pending is None:
            return
        if self.on_pending == "report":
            self.store.abandon_turn(self.id, pending["turn"], reason="worker died before the reply; reported on open")
            return
        self.store.add_event(self.id, "recovered", {"answered_pending_turn": pending["turn"]}, turn=pending["turn"])
        gen = GenerationConfig(**{**pending["generation"], "stop": tuple(pending["generation"]["stop"])})
        for _ in self._run(pending["turn"], pending["user_seq"], gen):
            pass
        self.recovered = self.last_reply

    def _replay(self, rec: dict) -> None:
        """Re-execute one recorded turn: same prefill, compression and decode steps, reply tokens forced."""
        segments = rec["segments"]
        ids = rec["prefill_tokens"]
        if segments.get("reprefill"):
            self._restart_cache()
            self.drift.reset()
        first_pos = self.state.next_position + len(self.state.pending)
        pinned = _flags(segments["pinned"], first_pos, len(ids))
        msgs = self._active_messages(up_to_seq=rec["user_seq"])
        text, spans = self.formatter.render(msgs, generation_prompt=True)
        got, owners, offsets = self._delta(text, spans, rec["user_seq"] + 1)
        if got != ids:
            raise StoreError(f"session_id={self.id!r} turn {rec['turn']}: the stored messages no longer render to "
                             "the recorded prefill tokens")
        self._prefill_compress(ids, pinned, dict(segments))
        self.owners.extend(owners)
        self._advance_text(text, offsets, first_pos, "")
        self.drift.observe(next(m.content for m in msgs if m.seq == rec["user_seq"]))
        with torch.inference_mode():
            for tok in rec["decode_tokens"]:
                self.runner.step(self.state, tok)
        self.state.pending = list(rec["pending_tokens"])
        self.owners.extend([rec["user_seq"] + 1] * (len(rec["decode_tokens"]) + len(rec["pending_tokens"])))
        self._advance_text(text, [], 0, self.tokenizer.decode(rec["decode_tokens"] + rec["pending_tokens"],
                                                              skip_special_tokens=False))
        self.turns_applied = rec["turn"]


__all__ = ["AdmissionError", "Reply", "Session"]
