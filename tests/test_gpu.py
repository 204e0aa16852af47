"""GPU fast paths on CPU: the fused Triton scorer (in Triton's interpreter) equals the torch fallback, the
selection path never waits on the device, CPU code never imports CUDA-only modules, and the prepared check's
CPU mode runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import build_tiny

from snapkv_sessions import compress as compress_module
from snapkv_sessions.config import CompressionConfig
from snapkv_sessions.gpu import triton_available
from snapkv_sessions.press import select_positions, spread_over_words
from snapkv_sessions.runner import ModelRunner

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed (pip install triton)")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@needs_triton
def test_fused_scorer_equals_torch_fallback():
    code = """
import json, torch
from snapkv_sessions.gpu.triton_scores import fused_score
from snapkv_sessions.press import SnapKV
torch.manual_seed(0)
out = []
for b, hq, hkv, t, w, k, pool, red in [(1, 4, 2, 300, 16, 7, "avg", "mean"), (2, 14, 2, 200, 8, 5, "max", "max"),
                                        (1, 4, 4, 150, 8, 1, "avg", "max"), (1, 4, 2, 40, 32, 7, "max", "mean"),
                                        (1, 8, 2, 129, 1, 3, "avg", "mean")]:
    probs = torch.rand(b, hq, t).softmax(-1)
    ref = SnapKV(w, k, pool, red).score(probs, hkv)
    got = fused_score(probs, hkv, w, k, pool, red)
    out.append([list(got.shape) == list(ref.shape), float((got - ref).abs().max())])
print(json.dumps(out))
"""
    res = _run(code, TRITON_INTERPRET="1")
    assert res.returncode == 0, res.stderr[-2000:]
    for same_shape, err in json.loads(res.stdout.strip().splitlines()[-1]):
        assert same_shape and err <= 1e-7


def test_cpu_paths_never_import_cuda_only_modules():
    # (torch and transformers may import triton themselves when it is installed; our kernels stay unloaded)
    code = """
import sys, torch
from transformers import LlamaConfig, AutoModelForCausalLM
from snapkv_sessions import ModelRunner, CompressionConfig
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
runner = ModelRunner(AutoModelForCausalLM.from_config(cfg).eval())
state = runner.new_state()
runner.turn(state, list(range(1, 60)), CompressionConfig.make(budget=24, window=8))
print(sorted(m for m in sys.modules if m.startswith("snapkv_sessions.gpu.")))
"""
    res = _run(code, TRITON_INTERPRET="")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"


class _HostSync(RuntimeError):
    pass


def _forbid(*_args, **_kwargs):
    raise _HostSync("a device-to-host read in the selection path")


@pytest.mark.parametrize("method,span", [("snapkv", False), ("snapkv", True), ("streaming", False)])
def test_selection_path_never_reads_the_device(monkeypatch, method, span):
    model = build_tiny("qwen2")
    runner = ModelRunner(model)
    runner.tokenizer = None if not span else type("Tok", (), {"convert_ids_to_tokens": staticmethod(
        lambda ids: ["Ġw" if i % 3 == 0 else "x" for i in ids])})()
    state = runner.new_state()
    ids = list(range(3, 83))
    logits, probe = runner.prefill(state, ids, pinned=[i < 5 for i in range(len(ids))], window=8)
    original = compress_module._select

    def guarded(*args, **kwargs):
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
                m.setattr(torch.Tensor, name, _forbid)
            return original(*args, **kwargs)

    monkeypatch.setattr(compress_module, "_select", guarded)
    cfg = CompressionConfig.make(budget=32, window=8, method=method, span_aware=span, sinks=4)
    report = runner.compress(state, cfg, probe)
    assert report.tokens_after == [32] * 3
    if method == "snapkv":
        assert report.pinned_kept == 5


def test_host_counts_equal_device_counts():
    torch.manual_seed(0)
    scores = torch.rand(1, 2, 40)  # (B, Hkv, P)
    pinned = torch.zeros(1, 2, 40, dtype=torch.bool)
    pinned[..., :6] = True
    a = select_positions(scores, 10, 4, pinned, False, 0)
    b = select_positions(scores, 10, 4, pinned, False, 0, n_pinned=6)
    assert torch.equal(a, b)
    words = torch.tensor([0, 0, 3, 3, 3, 7, 9, 9] * 5).expand(1, 2, 40)  # (B, Hkv, P)
    assert torch.equal(spread_over_words(scores, words), spread_over_words(scores, words, num_words=41))


def test_gpu_check_cpu_mode():
    res = subprocess.run([sys.executable, "-m", "snapkv_sessions.gpu.check", "--device", "cpu", "--lengths", "256,512",
                          "--decode-steps", "4"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["device"] == "cpu" and out["dtype"] == "fp32" and out["window_scores_dtype"] == "float32"
    assert out["fused_triton_scorer"] is triton_available() and out["fused_triton_gather"] is triton_available()
    assert out["selection_identical"] is True and [r["length"] for r in out["runs"]] == [256, 512]
    for run in out["runs"]:
        assert run["layers_identical"] == "2/2" and run["tpot_ms"]["full"] > 0 and run["tpot_ms"]["budget"] > 0
        assert 0 < run["compression_share"] and run["kept_per_layer"] < run["length"]
    assert out["peak_memory_bytes"] is None
    batched = out["batched_decode"]
    assert [r["sessions"] for r in batched["rows"]] == [1, 2, 4, 8] and batched["first_step_equal_alone"] is True
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in batched["rows"])
    # decode-time recall: recalling every cold slot decodes the full cache's tokens; each selector is timed
    assert [r["length"] for r in out["recall"]] == [256, 512]
    for r in out["recall"]:
        assert r["recall_all_equals_full"] is True
        assert set(r["cells"]) == {"full", "hot", "hot+exact0.1", "hot+sparq0.1", "hot+pages0.1", "hot+lowrank0.1",
                                   "hot+lowrank0.1+mass+tail", "hot+lowrank0.1+mass+tail+esc1"}
        assert 0 <= r["cells"]["hot+lowrank0.1+mass+tail+esc1"]["escalated"] <= 4  # retakes are counted
        tail, plain = r["cells"]["hot+lowrank0.1+mass+tail"], r["cells"]["hot+lowrank0.1"]
        assert tail["summary_bytes"] > plain["summary_bytes"]  # the page means are held beside the low-rank keys
        assert r["cells"]["hot+pages0.1"]["summary_bytes"] > 0 and r["cells"]["hot"]["tpot_ms"] > 0
        assert r["cells"]["hot+lowrank0.1"]["summary_bytes"] > 0  # (its rank is the tiny model's whole head here)


@needs_triton
def test_fused_gather_equals_per_layer_gather_and_the_engine_uses_it():
    code = """
import json, torch
from snapkv_sessions.gpu.triton_gather import gather_layers
from snapkv_sessions import ModelRunner, CompressionConfig
from transformers import LlamaConfig, AutoModelForCausalLM
torch.manual_seed(0)
# views of buffers with different capacities, as a CompactCache holds them
keys = [torch.randn(1, 2, cap, 16)[:, :, :80] for cap in (100, 120, 80)]
values = [torch.randn(1, 2, cap, 16)[:, :, :80] for cap in (90, 80, 130)]
idx = torch.stack([torch.randperm(80)[:40].sort().values.expand(1, 2, 40) for _ in range(3)])
k, v = gather_layers(keys, values, idx)
ref_k = torch.stack([t.gather(2, i[..., None].expand(-1, -1, -1, 16)) for t, i in zip(keys, idx)])
ref_v = torch.stack([t.gather(2, i[..., None].expand(-1, -1, -1, 16)) for t, i in zip(values, idx)])
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
runner = ModelRunner(AutoModelForCausalLM.from_config(cfg).eval())
state = runner.new_state()
logits, probe = runner.prefill(state, list(range(1, 60)), window=8)
runner.compress(state, CompressionConfig.make(budget=24, window=8), probe)
shared = len({lay._k.untyped_storage().data_ptr() for lay in state.cache.layers}) == 1
print(json.dumps([torch.equal(k, ref_k), torch.equal(v, ref_v), shared, state.cache_lengths()]))
"""
    res = _run(code, TRITON_INTERPRET="1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [True, True, True, [24, 24]]


def test_engine_output_is_the_same_with_and_without_fast_paths():
    """One compressed two-turn run, torch fallback versus the fused paths (interpreted): same kept positions,
    same logits, same tokens."""
    if not triton_available():
        pytest.skip("triton not installed (pip install triton)")
    code = """
import json, torch
from snapkv_sessions import ModelRunner, CompressionConfig
from snapkv_sessions.generation import GenerationConfig
from transformers import LlamaConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2)
model = AutoModelForCausalLM.from_config(cfg).eval()
runner = ModelRunner(model)
state = runner.new_state()
comp = CompressionConfig.make(budget=40, window=8)
a = runner.turn(state, [i % 60 + 1 for i in range(90)], comp, GenerationConfig(max_new_tokens=6))
b = runner.turn(state, list(range(5, 30)), comp, GenerationConfig(max_new_tokens=6))
print(json.dumps({"tokens": a.tokens + b.tokens, "kept": [p.tolist() for p in state.positions]}))
"""
    runs = [_run(code, TRITON_INTERPRET=flag, SNAPKV_SESSIONS_FUSED=fused) for flag, fused in (("1", "1"), ("", "0"))]
    for res in runs:
        assert res.returncode == 0, res.stderr[-2000:]
    fast, plain = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert fast == plain and len(fast["tokens"]) == 12
