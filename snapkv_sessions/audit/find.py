"""Where a text's tokens were held or evicted after each compression, and by what score margin."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..store import SessionStore

if TYPE_CHECKING:
    from ..compress import Selection


def find(store: SessionStore, session_id: str, text: str, turn: int | None = None, model=None) -> dict:
    """Every occurrence of ``text`` in the session: after each compression (or only ``turn``'s), which of its
    tokens each layer and KV head held, and the score margin by which each evicted token lost.

    The session's done turns are replayed from the store (their recorded plans and replies, nothing written),
    with an observer on the selection: a token's margin is the lowest score the layer/head kept by rank (pins and
    the protected question left out) minus the token's own score. A pinned or window token is never evicted.
    """
    import torch

    from .. import stats
    from ..models import bound_model, runner_for
    from ..session import Session

    if not isinstance(text, str) or not text:
        raise ConfigError("text", text, "must be a non-empty string")
    runner, _ = runner_for(bound_model(model, store.get_session(session_id).model_id))
    captured: dict[int, list] = {}
    selections: list = []  # the turn being replayed: its selections, filed under it when its TurnStat comes
    recalls: dict[int, list] = {}  # turn -> per layer, per KV head, true positions decode recalled from the tier
    stepping: dict[int, list[set[int]]] = {}  # the turn being replayed: layer -> per head, recalled so far

    class FileByTurn:
        def record(self, stat: stats.Stat) -> None:
            if isinstance(stat, stats.TurnStat) and stat.session_id == session_id:
                captured[stat.turn] = list(selections)
                selections.clear()
                if stepping:
                    recalls[stat.turn] = {layer: heads for layer, heads in stepping.items()}
                stepping.clear()

    def recalled(layer: int, positions: torch.Tensor) -> None:  # (B, Hkv, K), -1: a head attending to fewer
        heads = stepping.setdefault(layer, [set() for _ in range(positions.shape[1])])
        for h, row in enumerate(positions[0].tolist()):
            heads[h].update(p for p in row if p >= 0)

    runner.observer = lambda sel: selections.append(_detach(sel))
    runner.recall_observer = recalled
    try:
        with stats.sinks(FileByTurn()), torch.inference_mode():
            session = Session.rebuild(session_id, runner, store)
    finally:
        runner.observer = None
        runner.recall_observer = None
    captured = {t: sels for t, sels in captured.items() if sels}  # turns whose cache fitted chose nothing
    transcript = session.transcript
    spans = [(m.start(), m.end()) for m in re.finditer(re.escape(text), transcript.text)]
    occurrences = []
    for start, end in spans:
        positions = sorted({int(p) for p in transcript.char_pos[start:end] if p >= 0})
        ids = session.state.token_ids
        pieces = [runner.tokenizer.decode([ids[p]]) if p < len(ids) else "" for p in positions]
        turns = [_held(t, sels, positions) for t, sels in sorted(captured.items())
                 if (turn is None or t == turn) and positions and positions[-1] < _context(sels)]
        for t in turns:  # which of the evicted tokens decode recalled from the tier, layer by layer and head by head
            if t["turn"] in recalls:
                t["decode_recalled"] = _decode_recalled(t, recalls[t["turn"]])
        occurrences.append({"chars": [start, end], "positions": positions, "tokens": pieces, "turns": turns})
    return {"session_id": session_id, "text": text, "occurrences": occurrences}


def _decode_recalled(held: dict, per_layer: dict[int, list[set[int]]]) -> dict:
    """Of the occurrence's tokens this turn's compression evicted, those a decode step recalled: per position, the
    layer/head pairs that recalled it, and the pairs that recalled every evicted token."""
    by_position: dict[int, int] = {}
    whole = 0
    for lay in held["layers"]:
        heads = per_layer.get(lay["layer"], [])
        for h, head in enumerate(lay["heads"]):
            evicted = [e["position"] for e in head["evicted"]]
            got = heads[h] if h < len(heads) else set()
            for p in evicted:
                if p in got:
                    by_position[p] = by_position.get(p, 0) + 1
            whole += bool(evicted) and all(p in got for p in evicted)
    return {"pairs_recalling_every_evicted": whole, "pairs_by_position": dict(sorted(by_position.items()))}


def _detach(sel: Selection) -> Selection:
    """A host copy of one layer's selection (batch 0 kept as a batch of one)."""
    from ..compress import Selection

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
