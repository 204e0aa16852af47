"""Re-executions: ``verify`` (the recorded turns run again and compared) and ``against_full`` (each turn's
reply against a full cache's)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..models import bound_model, runner_for
from ..policy import MemoryPolicy, Policy
from ..runner import Inline
from ..store import SessionStore
from ..store.blobs import unpack_positions
from ..transcript import recorded_attention


@dataclass
class Mismatch:
    turn: int | None
    field: str
    expected: object = None
    got: object = None

    def __str__(self) -> str:
        where = f"turn {self.turn}" if self.turn is not None else "session"
        if self.field in ("hash_chain", "turn_records"):  # found in the stored rows, before any re-execution
            return f"{where}: {self.field}: {self.got}"
        return f"{where}: {self.field} differs (recorded {self.expected!r}, re-executed {self.got!r})"


@dataclass
class VerifyResult:
    ok: bool
    turns_checked: int = 0
    mismatch: Mismatch | None = None
    chain_problems: list[str] = field(default_factory=list)


def verify(store: SessionStore, session_id: str, model=None, progress=None) -> VerifyResult:
    """Hash chain and seals, policy hashes, then a re-execution from the raw store compared turn by turn;
    ``progress(done, total)`` after each re-executed turn (a long verify shows it is alive).

    The first difference is reported: a reply, a kept-position set, a drift decision or the prefill tokens. A turn
    record whose seal fails is re-executed too, so the field that differs is named; one that re-executes equal is
    still reported (``turn_records``).
    """
    sess = store.get_session(session_id)
    policy = Policy.from_yaml(sess["policy_json"])
    if policy.sha256 != sess["policy_sha256"]:  # named before the session row's seal, which it also breaks
        return VerifyResult(False, 0, Mismatch(None, "policy", sess["policy_sha256"], policy.sha256))
    integrity = store.integrity(session_id)
    if integrity.messages:  # nothing to re-execute from
        return VerifyResult(False, 0, Mismatch(None, "hash_chain", None, integrity.messages[0]), integrity.problems)
    done = store.turns(session_id, status="done")
    for rec in done:
        if rec["policy_sha256"] != sess["policy_sha256"]:
            return VerifyResult(False, 0, Mismatch(rec["turn"], "policy", sess["policy_sha256"], rec["policy_sha256"]))
    checked = 0
    for rec, new in _reexecute(store, session_id, policy, bound_model(model, sess["model_id"]), done):
        checked += 1
        if progress is not None:
            progress(checked, len(done))
        mismatch = _compare(rec, new)
        if mismatch is not None:
            return VerifyResult(False, checked, mismatch, integrity.problems)
    if integrity.turns:  # a turn record edited where re-execution does not look (a timing, a retention figure)
        return VerifyResult(False, checked, Mismatch(None, "turn_records", None, integrity.turns[0]),
                            integrity.problems)
    return VerifyResult(True, checked)


def _reexecute(store: SessionStore, session_id: str, policy: Policy, model, done: list[dict]):
    """Re-run the session in a scratch in-memory store; yields (recorded turn, re-executed turn) pairs."""
    from ..session import Session

    scratch = SessionStore("sqlite://")
    if policy.memory is None:  # stored before the tiered memory existed: re-executed without it, as recorded
        policy = policy.model_copy(update={"memory": MemoryPolicy(cold=False)})
    else:  # the process's pool settings stay as they are: a tier is lost below where the record says it was
        policy = policy.model_copy(update={"memory": policy.memory.model_copy(update={"max_bytes": None,
                                                                                      "spill_dir": None})})
    chunks = _Recorded()  # each turn prefills in the chunks it recorded (they change the last bits)
    chunks.runner = runner_for(model)[0].on(chunks)
    session = Session.create(chunks.runner, policy=policy, store=scratch)
    by_user = {t["user_seq"]: t for t in done}
    # a tier lost to the byte cap depends on the process, not on the session: the re-execution loses it where
    # the live turn did, so that turn re-prefills as recorded
    lost = {e["turn"]: e["payload"]["reason"] for e in store.events(session_id) if e["kind"] == "tier_lost"}
    skip = {t["assistant_seq"] for t in done}
    for msg in store.messages(session_id):
        if msg["status"] != "active" or msg["seq"] in skip:
            continue
        rec = by_user.get(msg["seq"])
        if rec is None:
            scratch.add_message(session.id, msg["role"], msg["content"], msg["name"], msg["pinned"])
            continue
        gen = {k: v for k, v in (rec["generation"] or {}).items() if v is not None}
        if rec["turn"] in lost and session.state.cold is not None:
            session.state.cold.drop(lost[rec["turn"]])
        chunks.sizes = list((rec["segments"] or {}).get("chunks") or [])  # none recorded: the runner's own
        chunks.runner.prefill_attention = recorded_attention(rec["segments"])  # as the turn attended
        session.chat({"role": msg["role"], "content": msg["content"], "name": msg["name"]}, **gen)
        yield rec, scratch.turns(session.id)[-1]


class _Recorded(Inline):
    """The executor of a re-execution: each prefill chunk as long as the recorded turn's (:attr:`sizes`, set per
    turn); once they are used up (a record without chunks), the runner's own."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def chunk(self, most: int) -> int:
        return int(self.sizes.pop(0)) if self.sizes else most


def _compare(rec: dict, new: dict) -> Mismatch | None:
    turn = rec["turn"]
    for name in ("prefill_tokens", "drift_decision"):
        if rec[name] != new[name]:
            return Mismatch(turn, name, _short(rec[name]), _short(new[name]))
    attended = [recorded_attention(r["segments"]) for r in (rec, new)]
    if attended[0] != attended[1]:
        return Mismatch(turn, "prefill_attention", attended[0], attended[1])
    recorded_chunks = (rec["segments"] or {}).get("chunks")
    if recorded_chunks is not None and recorded_chunks != (new["segments"] or {}).get("chunks"):
        return Mismatch(turn, "prefill_chunks", _short(recorded_chunks), _short(new["segments"].get("chunks")))
    if rec["decode_tokens"] + rec["pending_tokens"] != new["decode_tokens"] + new["pending_tokens"]:
        return Mismatch(turn, "reply", _short(rec["decode_tokens"] + rec["pending_tokens"]),
                        _short(new["decode_tokens"] + new["pending_tokens"]))
    if (rec["kept_positions"] is None) != (new["kept_positions"] is None):
        return Mismatch(turn, "kept_positions", rec["kept_positions"] is not None, new["kept_positions"] is not None)
    if rec["kept_positions"] is not None:
        a, b = unpack_positions(rec["kept_positions"]), unpack_positions(new["kept_positions"])
        if len(a) != len(b):
            return Mismatch(turn, "kept_positions.layers", len(a), len(b))
        for layer, (x, y) in enumerate(zip(a, b, strict=True)):
            if x.shape != y.shape or not np.array_equal(x, y):
                heads = [h for h in range(min(len(x), len(y))) if not np.array_equal(x[h], y[h])] or [0]
                return Mismatch(turn, f"kept_positions[layer {layer}, head {heads[0]}]",
                                _short(x[heads[0]].tolist()), _short(y[heads[0]].tolist()))
    return None


def _short(value, n: int = 8):
    if isinstance(value, list) and len(value) > n:
        return value[:n] + ["..."]
    return value


def against_full(store: SessionStore, session_id: str, model=None) -> list[dict]:
    """Fidelity audit: each turn's reply regenerated with an uncompressed cache, on the recorded history.

    Returns per turn the token match rate (equal tokens at equal indices over the longer reply) and the first
    divergence (index into the reply, None when identical).
    """
    from ..chat import Message
    from ..generation import GenerationConfig
    from ..models import runner_for
    from ..policy import PinPolicy
    from ..transcript import Transcript, TurnContext

    sess = store.get_session(session_id)
    runner, _ = runner_for(bound_model(model, sess["model_id"]))
    messages = store.messages(session_id, include_abandoned=False)
    fresh = Transcript(runner.tokenizer, PinPolicy())  # never advanced: every plan renders from the start
    rows = []
    for rec in store.turns(session_id, status="done"):
        history = [Message(m["role"], m["content"], m["name"], m["pinned"], m["seq"]) for m in messages
                   if m["seq"] <= rec["user_seq"]]
        plan = fresh.plan(history, TurnContext(user_seq=rec["user_seq"]))
        state = runner.new_state()
        result = runner.run(state, replace(plan, window=None), None, GenerationConfig.from_record(
            {k: v for k, v in (rec["generation"] or {}).items() if v is not None})).finish()
        full = result.tokens + (state.pending if result.stop_reason == "eos" else [])
        recorded = rec["decode_tokens"] + rec["pending_tokens"]
        longest = max(len(full), len(recorded), 1)
        same = sum(a == b for a, b in zip(full, recorded, strict=False))
        first = next((i for i, (a, b) in enumerate(zip(full, recorded, strict=False)) if a != b), None)
        if first is None and len(full) != len(recorded):
            first = min(len(full), len(recorded))
        rows.append({"turn": rec["turn"], "tokens": len(recorded), "match_rate": round(same / longest, 4),
                     "first_divergence": first, "compressed": rec["kept_positions"] is not None})
    return rows


# ---------------------------------------------------------------------- why was a fact lost?
