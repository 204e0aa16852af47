"""Session audits: what each turn kept and evicted, why re-prefills happened, and whether it reproduces.

The summary functions read the store only (no torch); :func:`verify` and :func:`against_full` re-execute the
session with the model. The ``replay`` CLI command is a thin layer over this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError
from .policy import ROLES, MemoryPolicy, Policy
from .store import SessionStore
from .store.blobs import unpack_positions
from .transcript import TurnPlan

if TYPE_CHECKING:  # the runner imports torch; the audit's table commands do not
    from .runner import Selection


def _role_of(store: SessionStore, session_id: str) -> dict[int, str]:
    return {m["seq"]: m["role"] for m in store.messages(session_id)}


def _owners(rec: dict) -> tuple[tuple[int, int, int], ...]:
    """The ``(seq, start, end)`` position -> message runs of a turn's plan (none for a turn that never ran)."""
    if rec["segments"] is None:
        return ()
    return TurnPlan.from_record(rec["segments"], rec["prefill_tokens"] or []).owners


def turn_rows(store: SessionStore, session_id: str) -> list[dict]:
    """One row per turn: context, kept tokens, kept share per role, retention, drift, timings, KV bytes, and the
    tiered memory's hot, cold, streamed and recalled figures."""
    events = store.events(session_id)
    rows = []
    for t in store.turns(session_id):
        comp = t["compression"] or {}
        timings = t["timings"] or {}
        owners = _owners(t)
        context = owners[-1][2] if owners else None
        reason = next((e["payload"] for e in events if e["turn"] == t["turn"] and e["kind"] == "reprefill"), None)
        rows.append({
            "turn": t["turn"], "status": t["status"], "tokens_in": t["tokens_in"], "tokens_out": t["tokens_out"],
            "context_tokens": context,
            "kept_min": min(comp["tokens_after"]) if comp else context,
            "kept_max": max(comp["tokens_after"]) if comp else context,
            "kept_per_role": t["kept_per_role"] or {},
            "retention_min": (t["retention"] or {}).get("min_share"),
            "retention_max": (t["retention"] or {}).get("max_share"),
            "drift_score": t["drift_score"], "drift_decision": t["drift_decision"],
            "reprefill": reason,
            "compression_ms": timings.get("compression_ms"), "prefill_ms": timings.get("prefill_ms"),
            "decode_ms": timings.get("decode_ms"),
            "kv_bytes_before": comp.get("kv_bytes_before"), "kv_bytes_after": comp.get("kv_bytes_after"),
            # the tiered memory: hot and cold bytes after the compression, cold bytes streamed through the turn's
            # prefill and compression, and slots recalled from cold to hot (None without the tier)
            "tier": comp.get("tier"),
        })
    return rows


def turn_detail(store: SessionStore, session_id: str, turn: int) -> dict:
    """Kept positions of one turn, per layer and KV head, mapped back to messages and roles."""
    rec = next((t for t in store.turns(session_id) if t["turn"] == turn), None)
    if rec is None:
        from .store import StoreError

        raise StoreError(f"turn={turn}: no such turn in session {session_id!r}")
    roles = _role_of(store, session_id)
    owners = _owners(rec)
    messages = [{"seq": seq, "role": roles.get(seq, "assistant"), "start": a, "end": b} for seq, a, b in owners]
    out = {"turn": turn, "status": rec["status"], "drift_score": rec["drift_score"],
           "drift_decision": rec["drift_decision"], "messages": messages, "layers": [],
           "events": [e.to_dict() for e in store.events(session_id) if e.turn == turn]}
    if rec["kept_positions"] is None:
        return out
    before = _previous_kept(store, session_id, rec)
    for layer, kept in enumerate(unpack_positions(rec["kept_positions"])):
        heads = []
        for h, head_positions in enumerate(kept):
            per_msg = {}
            for m in messages:
                held = int(((head_positions >= m["start"]) & (head_positions < m["end"])).sum())
                per_msg[m["seq"]] = {"kept": held, "evicted": (m["end"] - m["start"]) - held}
            head = {"kept_positions": head_positions.tolist(), "per_message": per_msg}
            if before is not None:  # tiered: positions back in hot that the previous turn had sent cold
                old_context, old_kept = before
                prev = set(old_kept[layer][h].tolist())
                head["recalled"] = [int(p) for p in head_positions if p < old_context and int(p) not in prev]
            heads.append(head)
        out["layers"].append(heads)
    return out


def _previous_kept(store: SessionStore, session_id: str, rec: dict) -> tuple[int, list] | None:
    """For a tiered turn: the previous done turn's context and kept positions (None otherwise)."""
    if not (rec["compression"] or {}).get("tier") or rec["drift_decision"] == "reprefill":
        return None  # untiered, or rebuilt by a fresh prefill: nothing came back from a cold tier
    earlier = [t for t in store.turns(session_id, status="done") if t["turn"] < rec["turn"] and t["kept_positions"]]
    if not earlier:
        return None
    prev = earlier[-1]
    return (prev["compression"] or {}).get("context_tokens", 0), unpack_positions(prev["kept_positions"])


def retention_matrix(store: SessionStore, session_id: str, turn: int) -> tuple[np.ndarray, list[str]]:
    """(layers, context) share of KV heads holding each position after ``turn``'s compression; role per position."""
    rec = next(t for t in store.turns(session_id) if t["turn"] == turn)
    roles = _role_of(store, session_id)
    owners = _owners(rec)
    context = owners[-1][2]
    role_at = [""] * context
    for seq, a, b in owners:
        role_at[a:b] = [roles.get(seq, "assistant")] * (b - a)
    kept = unpack_positions(rec["kept_positions"])
    mat = np.zeros((len(kept), context))
    for layer, per_head in enumerate(kept):
        for head_positions in per_head:
            mat[layer, head_positions[head_positions < context]] += 1.0 / per_head.shape[0]
    return mat, role_at


ROLE_COLOURS = {"system": "#d62728", "developer": "#ff7f0e", "tool_schema": "#9467bd", "document": "#1f77b4",
                "user": "#2ca02c", "assistant": "#7f7f7f", "tool": "#8c564b"}


def plot(store: SessionStore, session_id: str, path: str, turn: int | None = None, threshold: float | None = None) -> int:
    """Retention heatmap (layer x position, role spans coloured) and drift timeline, as a PNG. Returns the turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    turns = [t for t in store.turns(session_id) if t["kept_positions"] is not None]
    if not turns:
        from .store import StoreError

        raise StoreError(f"session_id={session_id!r}: no compressed turn to plot")
    turn = turn if turn is not None else turns[-1]["turn"]
    mat, role_at = retention_matrix(store, session_id, turn)
    fig, (ax_heat, ax_roles, ax_drift) = plt.subplots(
        3, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [6, 0.5, 2.5]}, constrained_layout=True)
    im = ax_heat.imshow(mat, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax_heat.set_ylabel("layer")
    ax_heat.set_title(f"session {session_id[:8]}: share of KV heads keeping each position after turn {turn}")
    fig.colorbar(im, ax=ax_heat, fraction=0.02)
    colours = [matplotlib.colors.to_rgb(ROLE_COLOURS.get(r, "#000000")) for r in role_at]
    ax_roles.imshow(np.array(colours)[None], aspect="auto", interpolation="nearest")
    ax_roles.set_yticks([])
    ax_roles.set_xlabel("true position")
    present = [r for r in ROLES if r in set(role_at)]
    ax_roles.legend(handles=[Patch(color=ROLE_COLOURS[r], label=r) for r in present], ncol=len(present),
                    loc="upper center", bbox_to_anchor=(0.5, -1.2), fontsize=8, frameon=False)
    rows = turn_rows(store, session_id)
    xs = [r["turn"] for r in rows if r["drift_score"] is not None]
    ys = [r["drift_score"] for r in rows if r["drift_score"] is not None]
    ax_drift.plot(xs, ys, marker="o", color="#1f77b4", label="drift score")
    re_x = [r["turn"] for r in rows if r["drift_decision"] == "reprefill"]
    re_y = [r["drift_score"] for r in rows if r["drift_decision"] == "reprefill"]
    ax_drift.scatter(re_x, re_y, s=120, facecolors="none", edgecolors="#d62728", label="re-prefill")
    if threshold is not None:
        ax_drift.axhline(threshold, color="#d62728", linestyle="--", linewidth=1, label="threshold")
    ax_drift.set_xlabel("turn")
    ax_drift.set_ylabel("drift")
    ax_drift.set_xticks([r["turn"] for r in rows])
    ax_drift.legend(fontsize=8, loc="upper left")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return turn


# ---------------------------------------------------------------------- re-execution


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
    for rec, new in _reexecute(store, session_id, policy, model if model is not None else sess["model_id"], done):
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
    from .session import Session

    scratch = SessionStore("sqlite://")
    if policy.memory is None:  # stored before the tiered memory existed: re-executed without it, as recorded
        policy = policy.model_copy(update={"memory": MemoryPolicy(cold=False)})
    else:  # the process's pool settings stay as they are: a tier is lost below where the record says it was
        policy = policy.model_copy(update={"memory": policy.memory.model_copy(update={"max_bytes": None,
                                                                                      "spill_dir": None})})
    session = Session.create(model, policy=policy, store=scratch)
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
        session.chat({"role": msg["role"], "content": msg["content"], "name": msg["name"]}, **gen)
        yield rec, scratch.turns(session.id)[-1]


def _compare(rec: dict, new: dict) -> Mismatch | None:
    turn = rec["turn"]
    for name in ("prefill_tokens", "drift_decision"):
        if rec[name] != new[name]:
            return Mismatch(turn, name, _short(rec[name]), _short(new[name]))
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
    from .chat import Message
    from .generation import GenerationConfig
    from .models import runner_for
    from .policy import PinPolicy
    from .transcript import Transcript, TurnContext

    sess = store.get_session(session_id)
    runner, _ = runner_for(model if model is not None else sess["model_id"])
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


def find(store: SessionStore, session_id: str, text: str, turn: int | None = None, model=None) -> dict:
    """Every occurrence of ``text`` in the session: after each compression (or only ``turn``'s), which of its
    tokens each layer and KV head held, and the score margin by which each evicted token lost.

    The session's done turns are replayed from the store (their recorded plans and replies, nothing written),
    with an observer on the selection: a token's margin is the lowest score the layer/head kept by rank (pins and
    the protected question left out) minus the token's own score. A pinned or window token is never evicted.
    """
    import torch

    from . import stats
    from .models import runner_for
    from .session import Session

    if not isinstance(text, str) or not text:
        raise ConfigError("text", text, "must be a non-empty string")
    runner, _ = runner_for(model if model is not None else store.get_session(session_id).model_id)
    captured: dict[int, list] = {}
    selections: list = []  # the turn being replayed: its selections, filed under it when its TurnStat comes

    class FileByTurn:
        def record(self, stat: stats.Stat) -> None:
            if isinstance(stat, stats.TurnStat) and stat.session_id == session_id:
                captured[stat.turn] = list(selections)
                selections.clear()

    runner.observer = lambda sel: selections.append(_detach(sel))
    try:
        with stats.sinks(FileByTurn()), torch.inference_mode():
            session = Session.rebuild(session_id, runner, store)
    finally:
        runner.observer = None
    captured = {t: sels for t, sels in captured.items() if sels}  # turns whose cache fitted chose nothing
    transcript = session.transcript
    spans = [(m.start(), m.end()) for m in re.finditer(re.escape(text), transcript.text)]
    occurrences = []
    for start, end in spans:
        positions = sorted({int(p) for p in transcript.char_pos[start:end] if p >= 0})
        ids = session.state.token_ids
        pieces = [runner.tokenizer.decode([ids[p]]) if p < len(ids) else "" for p in positions]
        occurrences.append({"chars": [start, end], "positions": positions, "tokens": pieces,
                            "turns": [_held(t, sels, positions) for t, sels in sorted(captured.items())
                                      if (turn is None or t == turn) and positions and positions[-1] < _context(sels)]})
    return {"session_id": session_id, "text": text, "occurrences": occurrences}


def _detach(sel: Selection) -> Selection:
    """A host copy of one layer's selection (batch 0 kept as a batch of one)."""
    from .runner import Selection

    return Selection(sel.layer, sel.positions[:1].cpu(), sel.scores[:1].float().cpu(), sel.chosen[:1].cpu(),
                     sel.keep_mask.cpu())


def _context(sels: list[Selection]) -> int:
    """True positions the compression saw: its latest position plus one (slots are fewer once compressed)."""
    return int(sels[0].positions.max()) + 1


def _held(turn: int, sels: list[Selection], positions: list[int]) -> dict:
    """Per layer and KV head: the occurrence's tokens held, and the evicted ones with the margin they lost by."""
    import torch

    wanted = torch.tensor(positions)
    layers = []
    for sel in sels:
        layer, keep = sel.layer, sel.keep_mask
        pos, scores, chosen = sel.positions[0], sel.scores[0], sel.chosen[0]  # (Hkv, T), (Hkv, T - W), (Hkv, K)
        hist = scores.shape[-1]
        heads = []
        for h in range(pos.shape[0]):
            kept_slots = chosen[h]
            kept = set(pos[h, kept_slots].tolist())
            ranked = [int(s) for s in kept_slots.tolist() if s < hist and not keep[pos[h, s]]]
            floor = float(scores[h, ranked].min()) if ranked else None
            lost = []
            for p in wanted.tolist():
                if p in kept:
                    continue
                where = (pos[h] == p).nonzero()
                if len(where) == 0:  # evicted by an earlier compression: this one never saw it
                    lost.append({"position": p, "score": None, "margin": None, "gone_before": True})
                    continue
                score = float(scores[h, int(where[0, 0])])
                lost.append({"position": p, "score": score, "margin": None if floor is None else floor - score})
            heads.append({"held": len(positions) - len(lost), "evicted": lost})
        layers.append({"layer": layer, "heads": heads})
    whole = sum(h["held"] == len(positions) for lay in layers for h in lay["heads"])
    pairs = sum(len(lay["heads"]) for lay in layers)
    return {"turn": turn, "pairs_holding_all": whole, "pairs": pairs, "layers": layers}
