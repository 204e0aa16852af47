"""``bench compile``: a decode step eager against ``torch.compile``, side by side in one process.

Issue 30 asked whether compiling the static batched step (inductor on CPU, CUDA graphs on a GPU) brings decode
closer to its bytes bound. This measures it where it can be measured without our cache code in the way: the
plain model over a transformers ``StaticCache`` (fixed shapes, so one graph serves every step), prefilled with
the same random prompt, then ``steps`` greedy steps of ``rows`` rows, eager and compiled, twice each in turn
(eager, compiled, eager, compiled) so that drift of a shared machine falls on both. The compiled step is checked
against the eager one: the same greedy tokens at every step, and the largest logit difference.

A step's bytes bound is the weights plus the keys and values it reads, at the machine's memory bandwidth; the
table gives both times so the ratio shows what compiling recovers of the Python and dispatch overhead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError


@dataclass
class CompileRow:
    rows: int  # sessions fed per step
    eager_ms_p50: float
    compiled_ms_p50: float
    speedup: float  # eager / compiled: above 1 the compiled step is faster
    compile_s: float  # the first compiled step: tracing and code generation
    tokens_equal: bool  # the compiled step chose eager's greedy token at every step of every row
    max_logit_diff: float  # the largest |compiled - eager| over the steps' logits


@dataclass
class CompileResult:
    model: str
    dtype: str
    backend: str
    context: int
    steps: int
    threads: int
    rows: list[CompileRow]

    def to_json(self) -> dict:
        return asdict(self)


def _decode(model, forward: Callable, ids: torch.Tensor, steps: int) -> tuple[list[float], torch.Tensor, float]:
    """Prefill ``ids`` (B, T) into a fresh static cache eagerly, then ``steps`` greedy steps through ``forward``.
    Returns each step's seconds after the first, the steps' logits (steps, B, V) and the first step's seconds."""
    from transformers import StaticCache

    batch, context = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=context + steps)
    out = model(input_ids=ids, cache=cache, use_cache=True, cache_position=torch.arange(context))
    nxt = out.logits[:, -1:].argmax(-1)  # (B, 1)
    times, logits = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        out = forward(input_ids=nxt, cache=cache, use_cache=True,
                      cache_position=torch.tensor([context + i]), position_ids=torch.full((batch, 1), context + i))
        step_logits = out.logits[:, -1].float()  # (B, V)
        nxt = step_logits.argmax(-1, keepdim=True)  # (B, 1)
        times.append(time.perf_counter() - t0)
        logits.append(step_logits)
    return times[1:], torch.stack(logits), times[0]  # (steps, B, V)


def measure(model, name: str, rows: Sequence[int], context: int, steps: int, backend: str = "inductor",
            seed: int = 0) -> CompileResult:
    """Eager against ``torch.compile(model.forward, backend=backend, dynamic=False)`` for each row count."""
    if context < 1 or steps < 3 or not rows or min(rows) < 1:
        raise ConfigError("compile", {"rows": list(rows), "context": context, "steps": steps},
                          "give rows >= 1, a context >= 1 and at least 3 steps")
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    with torch.inference_mode():
        for n in rows:
            ids = torch.randint(0, vocab, (n, context), generator=gen)  # (n, context)
            compiled = torch.compile(model.forward, backend=backend, dynamic=False)
            eager_s, compiled_s, firsts = [], [], []
            for _ in range(2):  # eager, compiled, eager, compiled: the machine's drift falls on both
                times, eager_logits, _ = _decode(model, model.forward, ids, steps)
                eager_s += times
                times, compiled_logits, first = _decode(model, compiled, ids, steps)
                compiled_s += times
                firsts.append(first)  # the first round's includes the compile
            e, c = statistics.median(eager_s), statistics.median(compiled_s)
            same = torch.equal(eager_logits.argmax(-1), compiled_logits.argmax(-1))
            out.append(CompileRow(n, round(e * 1e3, 1), round(c * 1e3, 1), round(e / c, 3), round(firsts[0], 1), same,
                                  round(float((eager_logits - compiled_logits).abs().max()), 5)))
            torch._dynamo.reset()  # the next row count compiles its own graph from scratch
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return CompileResult(name, dtype, backend, context, steps, torch.get_num_threads(), out)


def run(model: str, rows: Sequence[int], context: int, steps: int, dtype: str | None = None,
        backend: str = "inductor") -> CompileResult:
    from ..models import STORED_16, load_model, resolve_dtype

    dtype = resolve_dtype(dtype)
    if dtype in STORED_16:  # a torch dtype: torch.compile does not trace the 16-bit weights' C kernel
        dtype = "float32"
    loaded, _ = load_model(model, dtype=dtype)
    return measure(loaded, model, rows, context, steps, backend)


def table(result: CompileResult) -> str:
    lines = [f"{result.model} ({result.dtype}), {result.context}-token context, {result.steps} steps, backend "
             f"{result.backend}, {result.threads} threads",
             f"{'rows':>4} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8} {'compile s':>10} {'tokens equal':>13}"]
    lines += [f"{r.rows:>4} {r.eager_ms_p50:>9} {r.compiled_ms_p50:>12} {r.speedup:>8} {r.compile_s:>10} "
              f"{str(r.tokens_equal):>13}" for r in result.rows]
    return "\n".join(lines)
