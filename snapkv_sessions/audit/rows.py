"""Per-turn rows and one turn's detail, read from the store alone (no model)."""

from __future__ import annotations

import numpy as np

from ..store import SessionStore
from ..store.blobs import unpack_positions
from ..transcript import TurnPlan


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
            # the attention signal beside the text one (snapkv_sessions.reach): the share of the window's mass on
            # what was cold before the turn, and of the new hot set that came back from cold (None without a tier)
            "attention_shift": (comp.get("reach") or {}).get("score"),
            "recalled_share": (comp.get("reach") or {}).get("recalled"),
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
        from ..store import StoreError

        raise StoreError(f"turn={turn}: no such turn in session {session_id!r}")
    roles = _role_of(store, session_id)
    owners = _owners(rec)
    messages = [{"seq": seq, "role": roles.get(seq, "assistant"), "start": a, "end": b} for seq, a, b in owners]
    out = {"turn": turn, "status": rec["status"], "drift_score": rec["drift_score"],
           "drift_decision": rec["drift_decision"], "messages": messages, "layers": [],
           "events": [e.to_dict() for e in store.events(session_id) if e.turn == turn]}
    reach = (rec["compression"] or {}).get("reach")
    if reach is not None:  # the attention signal: its score and recalled share, per layer and KV head
        out["reach"] = reach
    recall = ((rec["compression"] or {}).get("tier") or {}).get("recall")
    if recall is not None:  # decode-time recall from the tier: the turn's figures (absent when decode read hot alone)
        out["recall"] = recall
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
            head_positions = head_positions[head_positions >= 0]  # -1: padding of heads keeping uneven counts
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
            mat[layer, head_positions[(head_positions >= 0) & (head_positions < context)]] += 1.0 / per_head.shape[0]
    return mat, role_at
