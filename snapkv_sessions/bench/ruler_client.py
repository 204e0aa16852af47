"""``bench ruler-client``: RULER's own prediction client against an OpenAI-compatible server, scored by RULER.

The tasks are generated offline by :mod:`.ruler_data` (the server's model's tokenizer, RULER's length rule,
seed 42) and written as the JSONL files RULER's ``pred/call_api.py`` reads (``{data_dir}/{task}/validation.jsonl``
with ``index``, ``input``, ``outputs``, ``length``). ``call_api.py`` then runs as a subprocess, unchanged, with
``--server_type generic_oai_server`` (its ``OpenAIClient`` path downloads a tiktoken encoding, which fails
offline) and ``--generic_oai_server_mode chat``: each item is one ``POST /v1/chat/completions`` with the input
as the one user message, greedy (``temperature 0``, ``top_p 1``, RULER's own run settings), capped at the
task's tokens to generate. Its predictions are scored with RULER's metric functions (``string_match_all``, or
``string_match_part`` for the QA tasks) after RULER's ``postprocess_pred``, as ``bench ruler`` scores its own.

The input is RULER's as its ``base`` template makes it: the task's text with the answer prefix (" The special
magic number for ... is") at the end of the user message, since a chat request cannot start the assistant's
reply (``--no-answer-prefix`` drops it). The server applies its own chat template and policy, so this measures
the server as a client sees it, against ``bench ruler``'s in-process settings.

``call_api.py`` records neither time nor usage, so its requests go through a pass-through HTTP proxy on a free
loopback port, which forwards each body and each response unchanged and records the request's wall time, its
status and the response's ``usage``. A server error makes ``call_api.py`` retry for ever (tenacity's five tries
inside an endless loop): after :data:`FAILURES` failed requests, or past the deadline, the client is stopped
and the error named; the rows it finished are kept.

Every finished item appends one JSON line to the results file; a rerun skips the items the file holds
(:func:`row_key`). The server must be on a loopback address unless ``allow_remote``: the prompts are long
documents and a benchmark should not send them off the machine by a typo.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from ..errors import ConfigError, ModelResolveError, SnapKVError
from .ruler import Results, load_rows
from .ruler_data import _package, generate, metric, postprocess, score, task_table
from .serve import LOOPBACK, check_url, served_model  # noqa: F401 - LOOPBACK and check_url: this module's API too

FAILURES = 6  # failed requests before the client is stopped: one more than tenacity's tries for one item
SUBSET = "validation"  # call_api.py's default --subset: the file name it reads


class ClientError(SnapKVError, RuntimeError):
    """RULER's client could not finish: the server kept failing, or the deadline passed."""


def load_tokenizer(name: str):
    """The tokenizer of a model id, folder, GGUF or bundle, offline (the tasks are sized with it)."""
    from transformers import AutoTokenizer

    from ..models import resolve_model

    try:
        return AutoTokenizer.from_pretrained(resolve_model(name), local_files_only=True)
    except OSError as exc:
        raise ModelResolveError(f"tokenizer={name!r}: cannot load it offline ({exc})") from None


def row_key(r: dict) -> tuple:
    """A row's identity: the served model, the task, length and item, and whether the answer prefix was sent."""
    return (r["model"], r["task"], r["length"], r["item"], r["answer_prefix"])


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Recorder:
    """A pass-through HTTP proxy on 127.0.0.1 in front of ``target`` (the server's base URL): every POST is
    forwarded with its body and ``Authorization`` header unchanged, and answered with the server's status and
    body. Per request it records the digest of the last message's content, the status, the wall time (sent to
    answered) and the response's ``usage``."""

    def __init__(self, target: str, timeout_s: float):
        self.target, self.records, self.failures = target, [], []
        self.lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                if self.headers.get("Authorization"):
                    headers["Authorization"] = self.headers["Authorization"]
                t0 = time.perf_counter()
                try:
                    res = httpx.post(f"{recorder.target}{self.path}", content=body, headers=headers,
                                     timeout=timeout_s)
                    status, payload, kind = res.status_code, res.content, res.headers.get("content-type", "")
                except httpx.HTTPError as exc:
                    status, payload, kind = 502, json.dumps({"error": {"message": str(exc)[:500]}}).encode(), \
                        "application/json"
                recorder.record(body, status, payload, (time.perf_counter() - t0) * 1e3)
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def record(self, body: bytes, status: int, payload: bytes, wall_ms: float) -> None:
        try:
            content = json.loads(body)["messages"][-1]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            content = None
        usage = None
        if status == 200:
            try:
                usage = json.loads(payload).get("usage")
            except (ValueError, AttributeError):
                pass
        rec = {"digest": None if content is None else _digest(str(content)), "status": status,
               "wall_ms": round(wall_ms, 1), "usage": usage}
        with self.lock:
            self.records.append(rec)
            if status != 200:
                self.failures.append(payload[:500].decode("utf-8", "replace"))

    def last_ok(self, text: str) -> dict | None:
        digest = _digest(text)
        with self.lock:
            ok = [r for r in self.records if r["digest"] == digest and r["status"] == 200]
        return ok[-1] if ok else None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.server.shutdown()
        self.server.server_close()


def task_file(items, answer_prefix: bool) -> list[dict]:
    """The rows of RULER's dataset JSONL (the format ``prepare.py`` writes and ``call_api.py`` reads)."""
    return [{"index": it.index, "input": it.user + (it.answer_prefix if answer_prefix else ""),
             "outputs": it.outputs, "length": it.ruler_length, "others": {}, "truncation": -1} for it in items]


def call_api(folder: Path, task: str, url: str, model: str, tokens: int, threads: int, timeout_s: float,
             deadline_s: float, recorder: Recorder, api_key: str | None) -> tuple[list[dict], str | None]:
    """Run RULER's ``pred/call_api.py`` on ``folder/data/{task}/validation.jsonl``; its predictions, and why it was
    stopped (None when it finished)."""
    script = _package() / "pred" / "call_api.py"
    cmd = [sys.executable, str(script), "--data_dir", str(folder / "data"), "--save_dir", str(folder / "pred"),
           "--benchmark", "synthetic", "--task", task, "--subset", SUBSET, "--server_type", "generic_oai_server",
           "--generic_oai_server_url", f"{url}/chat/completions", "--generic_oai_server_mode", "chat",
           "--model_name_or_path", model, "--temperature", "0", "--top_p", "1.0", "--threads", str(threads),
           "--tokens_to_generate", str(tokens), "--timeout", str(int(timeout_s))]
    env = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    if api_key:
        env["API_KEY"] = api_key  # GenericOAIURLClient sends it as the bearer key
    log = folder / "call_api.log"
    stopped = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder)
        end = time.monotonic() + deadline_s
        try:
            while proc.poll() is None:
                if len(recorder.failures) >= FAILURES:
                    stopped = (f"{len(recorder.failures)} requests failed; the server's last answer: "
                               f"{recorder.failures[-1][:300]}")
                elif time.monotonic() > end:
                    stopped = f"not finished within {deadline_s:.0f} s"
                if stopped:
                    proc.kill()
                    break
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    if stopped is None and proc.returncode != 0:
        stopped = f"call_api.py exited with {proc.returncode}: {log.read_text()[-600:]}"
    return load_rows(str(folder / "pred" / f"{task}.jsonl")), stopped


def run(url: str, tasks: list[str], lengths: list[int], n: int, tokenizer: str | None = None,
        model: str | None = None, results: str | None = None, max_new_tokens: int | None = None,
        answer_prefix: bool = True, threads: int = 1, timeout_s: float = 600.0, api_key: str | None = None,
        allow_remote: bool = False, log=print) -> dict:
    """``n`` items per task and length sent through RULER's client to the server at ``url``; one row per item."""
    url = check_url(url, allow_remote)
    table = task_table()
    for t in tasks:
        if t not in table:
            raise ConfigError("tasks", t, f"not a RULER task (one of {sorted(table)})")
    model = model or served_model(url, api_key)
    tok = load_tokenizer(tokenizer or model)
    store = Results(results, key=row_key)
    reused, t0, errors = 0, time.perf_counter(), []
    with Recorder(url, timeout_s) as recorder:
        for task in tasks:
            tokens = max_new_tokens or table[task]["tokens_to_generate"]
            for length in lengths:
                items = generate(task, tok, length, n)
                base = {"model": model, "task": task, "length": length, "answer_prefix": answer_prefix}
                todo = [it for it in items if row_key({**base, "item": it.index}) not in store.keys]
                reused += len(items) - len(todo)
                if not todo:
                    continue
                by_index = {it.index: it for it in todo}
                with tempfile.TemporaryDirectory(prefix="ruler-client-") as tmp:
                    folder = Path(tmp)
                    (folder / "data" / task).mkdir(parents=True)
                    with open(folder / "data" / task / f"{SUBSET}.jsonl", "w") as fh:
                        fh.writelines(json.dumps(r) + "\n" for r in task_file(todo, answer_prefix))
                    preds, stopped = call_api(folder, task, recorder.url, model, tokens, threads, timeout_s,
                                              len(todo) * timeout_s + 120, recorder, api_key)
                for p in preds:
                    item = by_index.get(p.get("index"))
                    if item is None:
                        continue
                    rec = recorder.last_ok(p["input"]) or {}
                    usage = rec.get("usage") or {}
                    store.add({**base, "item": item.index, "metric": metric(task),
                               "score": score(task, p.get("pred"), item.outputs), "reply": p.get("pred"),
                               "references": item.outputs, "request_ms": rec.get("wall_ms"),
                               "prompt_tokens": usage.get("prompt_tokens"),
                               "completion_tokens": usage.get("completion_tokens"), "max_tokens": tokens,
                               "ruler_length": item.ruler_length, "url": url})
                    by_index.pop(item.index)
                log(f"{task} @ {length}: {len(todo) - len(by_index)} of {len(todo)} items answered "
                    f"({(time.perf_counter() - t0) / 60:.1f} min)")
                if stopped or by_index:
                    errors.append(f"{task}@{length}: {len(by_index)} items without a prediction"
                                  + (f" ({stopped})" if stopped else ""))
                    if stopped:
                        break
            if errors:
                break
    result = {"benchmark": "ruler-client", "client": "long_context_eval/pred/call_api.py (generic_oai_server, chat)",
              "url": url, "model": model, "tasks": tasks, "lengths": lengths, "items_per_cell": n,
              "answer_prefix": answer_prefix, "results": results, "computed": store.computed, "reused": reused,
              "cells": summarise(store.rows, model, tasks, lengths, answer_prefix),
              "minutes": round((time.perf_counter() - t0) / 60, 1)}
    if errors:
        raise ClientError(f"RULER's client did not finish ({'; '.join(errors)[:800]}); the rows it finished are in "
                          f"{results or 'no results file'}")
    return result


def summarise(rows: list[dict], model: str, tasks: list[str], lengths: list[int], answer_prefix: bool) -> dict:
    """Per task and length: RULER's score of the cell (its metric function over the cell's predictions, as
    RULER's ``evaluate.py`` reports it), the items, and the request wall times and prompt tokens."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    cells = {}
    for task in tasks:
        fn = METRICS[task_table()[task]["task"]]["metric_fn"]
        for length in lengths:
            sel = sorted((r for r in rows if (r["model"], r["task"], r["length"], r["answer_prefix"])
                          == (model, task, length, answer_prefix)), key=lambda r: r["item"])
            if not sel:
                continue
            walls = [r["request_ms"] for r in sel if r.get("request_ms") is not None]
            prompts = [r["prompt_tokens"] for r in sel if r.get("prompt_tokens") is not None]
            cells[f"{task}@{length}"] = {
                "items": len(sel), "metric": fn.__name__,
                "score": float(fn([postprocess(r["reply"]) for r in sel], [r["references"] for r in sel])),
                "request_ms_mean": round(statistics.fmean(walls), 1) if walls else None,
                "request_ms_max": max(walls) if walls else None,
                "prompt_tokens_mean": round(statistics.fmean(prompts)) if prompts else None}
    return cells


def table(result: dict) -> str:
    head = f"{'task@length':<28} {'n':>3} {'metric':<18} {'score':>6} {'request s (mean)':>16} {'max':>7} {'prompt':>7}"
    lines = [head, "-" * len(head)]
    for name, c in result["cells"].items():
        mean = "-" if c["request_ms_mean"] is None else f"{c['request_ms_mean'] / 1e3:.1f}"
        top = "-" if c["request_ms_max"] is None else f"{c['request_ms_max'] / 1e3:.1f}"
        lines.append(f"{name:<28} {c['items']:>3} {c['metric']:<18} {c['score']:>6.1f} {mean:>16} {top:>7} "
                     f"{c['prompt_tokens_mean'] if c['prompt_tokens_mean'] is not None else '-'!s:>7}")
    return "\n".join(lines)
