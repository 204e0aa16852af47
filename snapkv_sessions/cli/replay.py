"""``snapkv-sessions replay``: audit a stored session, and the text rendering of its rows, details and finds."""

from __future__ import annotations

import json

import click

from .. import progress
from . import _jsonable, _store, clean_errors, main, need_matplotlib, quiet_loaders


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _kv_cells(row: dict, kv: str, tiered: bool, recalling: bool = False) -> list[str]:
    tier = row.get("tier")
    if not tiered:
        return [kv]
    if not tier:
        return [kv, "-", "-"] + (["-"] if recalling else [])
    cells = [f"{tier['hot_bytes']:,}/{tier['cold_bytes']:,}", f"{tier['streamed_bytes']:,}", str(tier["recalled"])]
    if recalling:
        cells.append(_recall_cell(tier.get("recall")))
    return cells


def _recall_cell(rec: dict | None) -> str:
    """Decode-time recall of a turn: slots per step (mean/max, all layers and heads), distinct positions recalled,
    the share a cache of the previous step's recalls would hit, and bytes read per step (hot+select+recalled)."""
    if not rec:
        return "-"
    read = rec["read_bytes_per_step"]
    repeat = "-" if rec["repeat_rate"] is None else f"{rec['repeat_rate']:.0%}"
    escalated = f" esc {rec['escalated']}/{rec['steps']}" if "escalated" in rec else ""  # only where it escalates
    retakes = f"+{read['escalated']:,}" if "escalated" in read else ""
    return (f"{rec['recalled_per_step']:g}/{rec['recalled_max_step']} d{rec['distinct_recalled']} hit {repeat}"
            f"{escalated} read {read['hot']:,}+{read['select']:,}+{read['recalled']:,}{retakes}")


def _replay_table(rows: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=None, box=None, pad_edge=False)
    cols = ["turn", "context", "kept", "system", "developer", "tool_schema", "document", "user", "assistant",
            "layer min..max", "drift", "decision", "comp ms", "prefill ms", "decode ms", "KV bytes"]
    tiered = any(r.get("tier") for r in rows)
    recalling = any((r.get("tier") or {}).get("recall") for r in rows)
    if tiered:  # the attention signal beside the text drift; hot/cold bytes after the turn, cold bytes streamed,
        # slots recalled from cold to hot
        cols = cols[:11] + ["attention"] + cols[11:]
        cols = cols[:-1] + ["hot/cold KV", "streamed", "recalled"] + (["decode recall"] if recalling else [])
    for col in cols:
        table.add_column(col, justify="right" if col not in ("decision",) else "left")
    for r in rows:
        roles = r["kept_per_role"]
        kept = _fmt(r["kept_min"]) if r["kept_min"] == r["kept_max"] else f"{r['kept_min']}..{r['kept_max']}"
        ret = "-" if r["retention_min"] is None else f"{r['retention_min']:.0%}..{r['retention_max']:.0%}"
        kv = "-" if r["kv_bytes_after"] is None else f"{r['kv_bytes_before']:,}->{r['kv_bytes_after']:,}"
        decision = r["drift_decision"] if r["status"] == "done" else r["status"]
        table.add_row(str(r["turn"]), _fmt(r["context_tokens"]), kept,
                      *[("-" if k not in roles else f"{roles[k]:.0%}") for k in cols[3:9]], ret,
                      _fmt(r["drift_score"], ".3f"),
                      *([_fmt(r.get("attention_shift"), ".3f")] if tiered else []), decision or "-",
                      _fmt(r["compression_ms"], ".1f"),
                      _fmt(r["prefill_ms"], ".0f"), _fmt(r["decode_ms"], ".0f"), *_kv_cells(r, kv, tiered, recalling))
    console = Console(width=240, record=True, color_system=None, highlight=False, soft_wrap=True)  # every column
    with console.capture() as cap:
        console.print(table)
    return cap.get().rstrip()


def _find_text(found: dict) -> str:
    """Per occurrence and turn: pairs holding every token, and each evicted token's count and median margin."""
    import statistics

    lines = [f"{found['text']!r}: {len(found['occurrences'])} occurrence(s)"]
    for occ in found["occurrences"]:
        lines.append(f"  chars {occ['chars'][0]}..{occ['chars'][1]}, positions {occ['positions']}, "
                     f"tokens {occ['tokens']}")
        for t in occ["turns"]:
            lines.append(f"    turn {t['turn']}: {t['pairs_holding_all']}/{t['pairs']} layer/head pairs hold every token")
            lost: dict[int, list] = {}
            for lay in t["layers"]:
                for head in lay["heads"]:
                    for e in head["evicted"]:
                        lost.setdefault(e["position"], []).append(e["margin"])
            back = (t.get("decode_recalled") or {}).get("pairs_by_position", {})
            for pos, margins in sorted(lost.items()):
                known = [m for m in margins if m is not None]
                median = f", median margin {statistics.median(known):.3g}" if known else ""
                again = f"; decode recalled it in {back[pos]}" if pos in back else ""
                lines.append(f"      position {pos} ({occ['tokens'][occ['positions'].index(pos)]!r}): evicted in "
                             f"{len(margins)} pairs{median}{again}")
    return "\n".join(lines)


def _detail_text(detail: dict) -> str:
    lines = [f"turn {detail['turn']} ({detail['status']}): drift {_fmt(detail['drift_score'], '.3f')}, "
             f"decision {detail['drift_decision']}"]
    for e in detail["events"]:
        if e["kind"] in ("drift", "attention_shift", "reprefill", "error", "abandoned", "recovered"):
            lines.append(f"  event {e['kind']}: {json.dumps(e['payload'], sort_keys=True)}")
    if detail.get("reach"):
        reach = detail["reach"]
        lines.append(f"  attention shift {reach['score']:.3f} (window mass on what was cold, median over the upper "
                     f"layers' KV heads), recalled share of the new hot set {reach['recalled']:.3f}")
    if not detail["layers"]:
        lines.append("  no compression this turn (the cache fit its budget)")
        return "\n".join(lines)
    lines.append("  kept / context tokens per message, min..max over layers and KV heads:")
    for m in detail["messages"]:
        held = [h["per_message"][m["seq"]]["kept"] for layer in detail["layers"] for h in layer]
        size = m["end"] - m["start"]
        lines.append(f"    msg {m['seq']:>3} {m['role']:<11} positions [{m['start']}, {m['end']}): kept "
                     f"{min(held)}..{max(held)} of {size}")
    recall = (detail.get("recall") or {})
    if recall:
        lines.append(f"  decode recalled from the tier per step: {recall['recalled_per_step']:g} slots (max "
                     f"{recall['recalled_max_step']}), {recall['distinct_recalled']} distinct, "
                     f"{recall['selector']} selector; --find TEXT names the tokens")
        if "escalated" in recall:
            lines.append(f"  decode steps taken again over the whole history (a near-tie): {recall['escalated']} of "
                         f"{recall['steps']}, {recall['refed']} tokens fed again")
    recalled = [len(h["recalled"]) for layer in detail["layers"] for h in layer if "recalled" in h]
    if recalled:
        lines.append(f"  recalled from the cold tier to hot: {min(recalled)}..{max(recalled)} positions per layer "
                     f"and KV head ({sum(recalled)} in all; --json lists them)")
    return "\n".join(lines)


@main.command("replay")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--turn", type=int, default=None, help="Detail one turn: kept positions mapped to messages.")
@click.option("--verify", "do_verify", is_flag=True, help="Check the hash chain, then re-execute and compare.")
@click.option("--against", type=click.Choice(["full"]), default=None, help="Fidelity audit against a full cache.")
@click.option("--plot", "plot_path", default=None, help="Write a retention heatmap + drift timeline PNG (matplotlib).")
@click.option("--find", "find_text", default=None,
              help="Where TEXT's tokens were held or evicted after each compression (with --turn: that turn's), "
                   "and the score margin each evicted token lost by.")
@click.option("--model", default=None, help="Model for --verify/--against/--find (default: the session's).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def replay(session_id, db, turn, do_verify, against, plot_path, find_text, model, as_json) -> None:
    """Audit a session: per-turn retention, drift and timings; verify or compare re-executions."""
    from .. import audit

    need_matplotlib(plot_path)
    store = _store(db)
    session_id = store.resolve_id(session_id)
    if find_text is not None:
        quiet_loaders()
        found = audit.find(store, session_id, find_text, turn, model)
        click.echo(json.dumps(found, indent=2) if as_json else _find_text(found))
        return
    if do_verify:
        quiet_loaders()
        with progress.task("replay --verify: re-executing the session") as shown:

            def turn_done(done: int, total: int) -> None:
                shown.update(completed=done, total=total)
                shown.log(f"re-executed turn {done} of {total}")

            result = audit.verify(store, session_id, model, progress=turn_done)
        payload = {"ok": result.ok, "turns_checked": result.turns_checked,
                   "mismatch": None if result.mismatch is None else {
                       "turn": result.mismatch.turn, "field": result.mismatch.field,
                       "recorded": result.mismatch.expected, "reexecuted": result.mismatch.got}}
        click.echo(json.dumps(payload, indent=2) if as_json else (
            f"verified: hash chain intact, {result.turns_checked} turns re-executed identically" if result.ok
            else f"MISMATCH {result.mismatch}"))
        if not result.ok:
            raise SystemExit(1)
        return
    if against == "full":
        quiet_loaders()
        rows = audit.against_full(store, session_id, model)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        else:
            for r in rows:
                first = ("identical" if r["first_divergence"] is None
                         else f"first divergence at token {r['first_divergence']}")
                click.echo(f"turn {r['turn']}: {r['tokens']} tokens, match {r['match_rate']:.0%}, {first}"
                           f"{'' if r['compressed'] else ' (uncompressed turn)'}")
        return
    if plot_path:
        from ..policy import Policy

        threshold = Policy.from_yaml(store.get_session(session_id)["policy_json"]).drift.threshold
        shown = audit.plot(store, session_id, plot_path, turn=turn, threshold=threshold)
        click.echo(json.dumps({"plot": plot_path, "turn": shown}) if as_json else f"wrote {plot_path} (turn {shown})")
        return
    if turn is not None:
        detail = audit.turn_detail(store, session_id, turn)
        click.echo(json.dumps(_jsonable(detail), indent=2) if as_json else _detail_text(detail))
        return
    rows = audit.turn_rows(store, session_id)
    click.echo(json.dumps(_jsonable(rows), indent=2) if as_json else _replay_table(rows))
