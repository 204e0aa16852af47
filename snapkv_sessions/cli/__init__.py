"""The ``snapkv-sessions`` command line: a thin layer over the library; library errors become clean errors.

The click ``main`` group, the shared helpers and the small top-level commands (``demo``, ``resolve``) live here;
the command groups live in their modules, imported at the end so their commands register on ``main``:
``sessions`` (the stored sessions), ``replay`` (the audit and its text rendering), ``bench`` (the benchmarks),
``serve`` (the server and its options).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping

import click

from .. import progress
from ..errors import SnapKVError
from ..models import DTYPE_CHOICES


def clean_errors(fn):
    """Turn the library's own errors into a one-line CLI error (exit 1) instead of a traceback; a command run with
    ``--json`` shows no progress from anything it calls (:mod:`..progress`), so its stdout is JSON alone and its
    stderr quiet. Every command goes through here, so this is the one place that applies the rule."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with progress.quiet(bool(kwargs.get("as_json"))):
                return fn(*args, **kwargs)
        except SnapKVError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


@click.group()
@click.version_option(package_name="snapkv-sessions")
def main() -> None:
    """Recoverable per-turn SnapKV sessions over a local Hugging Face causal LM."""
    from .. import heap

    heap.keep_freed()  # every command's prefills reuse their freed activations (snapkv_sessions.heap)


PLOT_INSTALL = "pip install matplotlib (or the extra: pip install 'snapkv-sessions[demo]')"


def need_matplotlib(plot_path: str | None) -> None:
    """``--plot`` draws with matplotlib, an optional dependency: say how to install it, and whether the PNG can be
    written where it is asked for, before any work is done (not as a traceback once the figure is drawn)."""
    if not plot_path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.ClickException(f"--plot {plot_path}: matplotlib is not installed; {PLOT_INSTALL}") from None
    _check_writable("--plot", plot_path)


def _check_writable(option: str, path: str) -> None:
    """``path`` can be written as a file: its folder exists and is writable, and it is not itself a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "it is a folder; give a file name"
    elif not os.path.isdir(folder):
        problem = f"the folder {folder} does not exist"
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = f"the folder {folder} cannot be written"
    elif os.path.exists(path) and not os.access(path, os.W_OK):
        problem = "the file exists and cannot be written"
    else:
        return
    raise click.ClickException(f"{option} {path}: {problem}")


def quiet_loaders() -> None:
    """A CLI prints its own figures; the model loaders' progress bars only clutter them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@main.command()
@click.option("--model", default=None, help="Model id, folder, GGUF or bundle.  [default: qwen2.5-coder-0.5b-instruct]")
@click.option("--policy", default="default", show_default=True, help="Policy name or YAML path.")
@click.option("--budget", default=160, show_default=True, help="Override: tokens kept per layer and KV head.")
@click.option("--window", default=16, show_default=True, help="Override: observation window.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Reply length cap per turn.")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of text.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(DTYPE_CHOICES),
              help="Weights' dtype; auto: bfloat16 where the CPU or GPU runs it natively, else fp16-weights "
                   "(fp32 arithmetic over fp16-stored linear weights) on AVX2 CPUs, else float32.")
@clean_errors
def demo(model, policy, budget, window, max_new_tokens, db, as_json, dtype="auto") -> None:
    """Run a scripted multi-turn session: each question, its answer as it is decoded, and what the turn kept."""
    from ..demo import DEFAULT_MODEL, demo_policy, run_demo

    quiet_loaders()
    for row in run_demo(model or DEFAULT_MODEL, demo_policy(policy, budget, window), db, max_new_tokens,
                        stream=not as_json, dtype=dtype):
        event = row.get("event")
        if as_json:
            if event != "question":
                click.echo(json.dumps(row))
        elif event == "session":
            click.echo(f"session {row['session_id']} on {row['model']} (policy {row['policy']}) "
                       f"stored in {row['store']}")
        elif event == "question":
            click.echo(f"\nturn {row['turn']} ({row['note']})\n  user: {row['user']}\n  assistant: ", nl=False)
        elif event == "piece":
            click.echo(row["text"].replace("\n", "\n             "), nl=False)
            sys.stdout.flush()
        elif event == "verified":
            click.echo(f"\nhash chain {'intact' if row['hash_chain_ok'] else 'BROKEN: ' + str(row['problems'])}; "
                       f"audit it with `snapkv-sessions replay {row['session_id']}`")
        else:
            roles = ", ".join(f"{r} {v:.0%}" for r, v in row["kept_per_role"].items())
            click.echo(
                f"\n  context {row['context_tokens']} tok with the reply -> cache {row['cache_after']} per layer/head; "
                f"kept {roles}; "
                f"compression {row['compression_ms']:.1f} ms; drift {row['decision']}; "
                f"re-prefill {'yes' if row['reprefill'] else 'no'}; "
                f"expected {row['expected']!r}: {'found' if row['correct'] else 'NOT found'}"
            )


def _store(db: str | None):
    """The store of a read-only command: a given path or URL must already hold a database."""
    from ..store import SessionStore

    return SessionStore(db, must_exist=db is not None)


def _jsonable(obj):
    import datetime

    if isinstance(obj, Mapping):  # plain dicts and the store's records
        return {k: _jsonable(v) for k, v in obj.items() if not isinstance(v, (bytes, bytearray))}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, datetime.datetime):
        return obj.isoformat()
    return obj


@main.command("resolve")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def resolve(model: str, as_json: bool) -> None:
    """Resolve (and convert once) a model; print the folder it loads from."""
    from ..models import resolve_model

    path = resolve_model(model)
    click.echo(json.dumps({"model": model, "path": path}) if as_json else path)


# the command groups register on ``main`` as they are imported; they import the helpers above
from . import bench, replay, serve, sessions  # noqa: E402, F401
