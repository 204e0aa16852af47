"""``snapkv-sessions sessions``: list, show, delete and export stored sessions (no model, no torch)."""

from __future__ import annotations

import json
import sys

import click

from . import _jsonable, _store, clean_errors, main


@main.group()
def sessions() -> None:
    """Inspect stored sessions (no model, no torch)."""


@sessions.command("list")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def sessions_list(db, as_json) -> None:
    """List sessions: id, model, policy, turns, messages."""
    rows = [{k: r[k] for k in ("id", "created_at", "model_id", "title", "turns_done", "messages")}
            for r in _store(db).list_sessions()]
    if as_json:
        click.echo(json.dumps(_jsonable(rows), indent=2))
        return
    for r in rows:
        click.echo(f"{r['id']}  {r['created_at']:%Y-%m-%d %H:%M}  turns {r['turns_done']:>3}  "
                   f"messages {r['messages']:>3}  {r['model_id']}  {r['title'] or ''}")


@sessions.command("show")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def sessions_show(session_id, db, as_json) -> None:
    """Show a session's messages with their token spans, and check its hash chain."""
    store = _store(db)
    session_id = store.resolve_id(session_id)
    data = store.export(session_id)
    data["hash_chain_problems"] = store.verify(session_id)
    if as_json:
        click.echo(json.dumps(_jsonable(data), indent=2))
        if data["hash_chain_problems"]:
            sys.exit(1)
        return
    sess = data["session"]
    click.echo(f"session {sess['id']}  model {sess['model_id']}  turns {sess['turns_done']}  "
               f"policy {sess['policy_sha256'][:12]}")
    for m in data["messages"]:
        span = f"[{m['token_start']}, {m['token_end']})" if m["token_start"] is not None else "[not fed]"
        flag = " (abandoned)" if m["status"] != "active" else ""
        text = m["content"].replace("\n", " ")
        click.echo(f"{m['seq']:>4} {m['role']:<11} {span:<14} {text[:80]}{flag}")
    problems = data["hash_chain_problems"]
    click.echo("hash chain intact" if not problems else "hash chain BROKEN: " + "; ".join(problems))
    if problems:
        sys.exit(1)


@sessions.command("delete")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def sessions_delete(session_id, db, as_json) -> None:
    """Delete a session and everything recorded for it."""
    store = _store(db)
    session_id = store.resolve_id(session_id)
    store.delete_session(session_id)
    click.echo(json.dumps({"deleted": session_id}) if as_json else f"deleted {session_id}")


@sessions.command("export")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="JSON (the only format; accepted for uniformity).")
@clean_errors
def sessions_export(session_id, db, as_json) -> None:
    """Export a session (messages, turns, events) as JSON."""
    store = _store(db)
    click.echo(json.dumps(_jsonable(store.export(store.resolve_id(session_id))), indent=2))
