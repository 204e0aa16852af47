"""The prepared GPU check: ``python -m snapkv_sessions.gpu.check``. Prints one JSON object.

On CUDA (default ``--model qwen2.5-coder-0.5b-instruct --dtype bf16 --lengths 16384,32768``), for each length:

* ``selection_identical``: the kept indices of the device path (fused Triton scorer where available, selection
  on the device) equal the CPU fp32 reference (torch scorer, the same shared top-k on the CPU) run on the same
  window scores;
* ``tpot_ms``: median time per output token, full cache versus the budget (10% by default), and their ratio;
* ``compression_share``: compression time (selection and gather; the window scores are part of the prefill)
  as a share of the prefill;
* ``peak_memory_bytes``: the device's peak allocated memory over the run;
* ``recall``: decode-time recall from the tier at each length (hot 20% or the budget if larger, recall 10% of
  the context): median ms per step of the full cache, the hot cache alone and hot + recall with each selector;
  whether recalling every cold slot gives the full cache's greedy tokens; summary bytes; peak memory;
* ``batched_decode``: S = 1, 2, 4, 8 sessions at the first length and the budget decoded together in decode slots
  (:mod:`snapkv_sessions.batch`): ms per step, tokens/s and the speedup over one session, and whether the first
  batched step's greedy tokens equal each session stepped alone.

``--device cpu`` runs the same code on a tiny random Llama-style GQA model at short lengths in fp32, with the
Triton kernel in Triton's interpreter when Triton is installed; the tests run it, so the check cannot rot.
Timings are taken with the device synchronised around each measured span.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m snapkv_sessions.gpu.check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when available)")
    ap.add_argument("--model", default=None, help="model id/bundle (default: Qwen on CUDA, a tiny model on CPU)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--lengths", default=None, help="comma-separated prompt lengths in tokens")
    ap.add_argument("--budget", type=float, default=0.1, help="budget ratio of the compressed run")
    ap.add_argument("--window", type=int, default=None, help="observation window (default 32; 16 on CPU)")
    ap.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per run")
    return ap.parse_args(argv)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tiny_model():
    """A 2-layer Llama-style GQA model (4 query heads, 2 KV heads) with random weights; no download."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(cfg).eval(), None


def _reference_kept(full, probe, cfg, budgets) -> list:
    """Per layer, the kept true positions of the CPU fp32 reference: the torch SnapKV scorer and the shared
    top-k (:func:`snapkv_sessions.scorers.select_layer`) on the same window scores, from the uncompressed
    state ``full``."""
    from dataclasses import replace

    from ..press import SnapKV
    from ..scorers import KeepRule, select_layer

    host = replace(full, positions=[p.cpu() for p in full.positions])  # the torch scorer reads no keys
    scorer = SnapKV.from_config(cfg, window=probe.window)
    rule = KeepRule(probe.window, full.pinned.cpu(), grow=True)
    kept = []
    for layer, pos in enumerate(host.positions):  # (B, Hkv, T) each
        if pos.shape[-1] <= budgets[layer]:
            kept.append(pos)
            continue
        idx = select_layer(scorer, probe.scores[layer].cpu().float(), host, layer, budgets[layer], rule)  # (B, Hkv, K)
        kept.append(pos.gather(-1, idx))  # (B, Hkv, K)
    return kept


def _tpot(runner, state, logits, steps: int) -> float:
    """Median ms per decode step (greedy), the device synchronised around each step."""
    device = runner.device
    state.cache.reserve(steps + 1) if hasattr(state.cache, "reserve") else None
    times, tok = [], int(logits.argmax())
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        logits = runner.step(state, tok)
        tok = int(logits.argmax())  # the sampled token is needed on the host anyway
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(runner, length: int, budget: float, window: int, steps: int) -> dict:
    import torch

    from ..config import CompressionConfig
    from ..press import layer_budgets

    device = runner.device
    gen = torch.Generator().manual_seed(length)
    vocab = runner.model.config.vocab_size
    ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
    pinned = [i < 4 for i in range(length)]  # the sinks, to exercise the pin path
    state = runner.new_state()
    _sync(device)
    t0 = time.perf_counter()
    logits, probe = runner.prefill(state, ids, pinned=pinned, window=window)
    _sync(device)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    full = copy.deepcopy(state)
    cfg = CompressionConfig.make(budget_ratio=budget, window=window)
    _sync(device)
    t1 = time.perf_counter()
    runner.compress(state, cfg, probe)
    _sync(device)
    compress_ms = (time.perf_counter() - t1) * 1e3
    reference = _reference_kept(full, probe, cfg, layer_budgets(cfg, runner.num_layers, length))
    identical = [bool(torch.equal(p.cpu(), r)) for p, r in zip(state.positions, reference, strict=True)]
    del probe
    tpot_full = _tpot(runner, full, logits, steps)
    del full
    tpot_budget = _tpot(runner, state, logits, steps)
    return {
        "length": length, "kept_per_layer": state.cache_lengths()[0], "prefill_ms": round(prefill_ms, 1),
        "compress_ms": round(compress_ms, 2), "compression_share": round(compress_ms / prefill_ms, 4),
        "selection_identical": all(identical), "layers_identical": f"{sum(identical)}/{len(identical)}",
        "tpot_ms": {"full": round(tpot_full, 3), "budget": round(tpot_budget, 3),
                    "speedup": round(tpot_full / tpot_budget, 3)},
    }


def recall(runner, length: int, budget: float, window: int, steps: int, ratio: float = 0.1) -> dict:
    """Decode-time recall from the tier (:mod:`snapkv_sessions.recall`) at ``length``: median ms per step of the
    full cache, the hot cache alone and hot + recall (each selector), from copies of one tiered prefill; whether
    recalling every cold slot gives the full cache's greedy tokens; the selectors' summary bytes; peak memory."""
    import torch

    from ..config import CompressionConfig, RecallConfig
    from ..recall import SELECTORS

    device = runner.device
    gen = torch.Generator().manual_seed(length + 1)
    ids = torch.randint(0, runner.model.config.vocab_size, (length,), generator=gen).tolist()
    base = runner.new_state(tiered=True)
    logits, probe = runner.prefill(base, ids, window=window)
    cfg = CompressionConfig.make(budget_ratio=budget, window=window)

    def decoded(state, rc, n: int) -> tuple[list[int], float, dict]:
        state.cache.recall_config = rc
        state.cache.prefill_done(state)
        state.cache.reserve(n + 1)
        toks, times, tok = [], [], int(logits.argmax())
        for _ in range(n):
            _sync(device)
            t0 = time.perf_counter()
            tok = int(runner.step(state, tok).argmax())
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            toks.append(tok)
        return toks, statistics.median(times), state.cache.decode_done(state) or {}

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    full_tokens, full_ms, _ = decoded(base.clone(), None, steps)
    cells = {"full": {"tpot_ms": round(full_ms, 3)}}
    variants = [("hot", None), ("recall_all", RecallConfig.make(ratio=1.0))]
    variants += [(f"hot+{name}{ratio}", RecallConfig.make(ratio=ratio, selector=name)) for name in SELECTORS]
    variants.append((f"hot+lowrank{ratio}+mass+tail", RecallConfig.make(ratio=ratio, selector="lowrank", reduce="mass",
                                                                       tail="pages")))
    # the same with near-ties retaken exactly over the whole history (the retakes' share is in the figures)
    variants.append((f"hot+lowrank{ratio}+mass+tail+esc1", RecallConfig.make(ratio=ratio, selector="lowrank",
                                                                            reduce="mass", tail="pages", escalate=1.0)))
    same_as_full = None
    for name, rc in variants:
        state = base.clone()
        runner.compress(state, cfg, probe)
        toks, ms, figures = decoded(state, rc, steps)
        if name == "recall_all":
            same_as_full = toks == full_tokens
            continue
        cells[name] = {"tpot_ms": round(ms, 3), "tpot_vs_full": round(ms / full_ms, 3),
                       "hot_bytes": state.kv_bytes(), "summary_bytes": figures.get("summary_bytes", 0),
                       "read_bytes_per_step": figures.get("read_bytes_per_step"),
                       **({"escalated": figures["escalated"]} if "escalated" in figures else {})}
    return {"length": length, "budget_ratio": budget, "recall_ratio": ratio, "recall_all_equals_full": same_as_full,
            "cells": cells, "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else None}


def batched(runner, length: int, budget: float, window: int, steps: int, sizes=(1, 2, 4, 8)) -> dict:
    """Batched decode (:class:`~snapkv_sessions.batch.SlotPool`): median ms per step with S sessions of ``length``
    tokens compressed to ``budget`` decoding together, tokens/s, the speedup over S=1, and whether the first
    step's greedy tokens equal each session stepped alone."""
    import torch

    from ..batch import SlotPool
    from ..config import CompressionConfig

    device, vocab = runner.device, runner.model.config.vocab_size
    cfg = CompressionConfig.make(budget_ratio=budget, window=window)
    states, first = [], []
    for i in range(max(sizes)):
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(i)).tolist()
        state = runner.new_state()
        logits, probe = runner.prefill(state, ids, window=window)
        runner.compress(state, cfg, probe)
        states.append(state)
        first.append(int(logits.argmax()))
    alone = [int(runner.step(copy.deepcopy(s), t).argmax()) for s, t in zip(states, first, strict=True)]
    rows = []
    for size in sizes:
        pool = SlotPool(runner.num_layers, size)
        for state in states[:size]:
            pool.admit(state, steps + 1)
        tokens, times = first[:size], []
        for step in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            logits = pool.step(runner, tokens)  # (S, V)
            tokens = logits.argmax(-1).tolist()
            times.append((time.perf_counter() - t0) * 1e3)
            if step == 0 and size == max(sizes):
                equal = tokens == alone
        rows.append({"sessions": size, "step_ms": round(statistics.median(times), 3),
                     "tokens_per_s": round(size * 1e3 / statistics.median(times), 1)})
        del pool
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 2)
    return {"length": length, "rows": rows, "first_step_equal_alone": equal}


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    want_cpu = args.device == "cpu"
    if want_cpu and os.environ.get("TRITON_INTERPRET") is None:
        # Triton's interpreter runs the fused kernel on CPU tensors; it must be set before Triton is imported
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from ..runner import ModelRunner
    from . import fused_gather, fused_scorer

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    on_cuda = device.type == "cuda"
    dtype_name = args.dtype or ("bf16" if on_cuda else "fp32")
    lengths = [int(x) for x in (args.lengths or ("16384,32768" if on_cuda else "512,1024")).split(",")]
    args.window = args.window or (32 if on_cuda else 16)
    model_name = args.model or ("qwen2.5-coder-0.5b-instruct" if on_cuda else "tiny")
    t_start = time.perf_counter()
    if model_name == "tiny":
        model, tok = _tiny_model()
    else:
        from ..models import load_model

        model, tok = load_model(model_name)
    model = model.to(device=device, dtype=getattr(torch, DTYPES[dtype_name]))
    runner = ModelRunner(model, tok)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    fused = fused_scorer(device, args.window, 7, "avg", "mean") is not None
    runs = [measure(runner, n, args.budget, args.window, args.decode_steps) for n in lengths]
    result = {
        "check": "snapkv_sessions.gpu.check", "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "torch": torch.__version__, "model": model_name, "dtype": dtype_name, "window_scores_dtype": "float32",
        "budget_ratio": args.budget, "window": args.window, "decode_steps": args.decode_steps,
        "fused_triton_scorer": fused, "fused_triton_gather": fused_gather(device) is not None, "runs": runs,
        "selection_identical": all(r["selection_identical"] for r in runs),
        "batched_decode": batched(runner, lengths[0], args.budget, args.window, min(args.decode_steps, 16)),
        "recall": [recall(runner, n, max(args.budget, 0.2), args.window, min(args.decode_steps, 16)) for n in lengths],
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if on_cuda else None,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    out = main()
    sys.exit(0 if out["selection_identical"] and all(r["recall_all_equals_full"] for r in out["recall"]) else 1)
