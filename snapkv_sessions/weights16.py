"""Linear weights stored in 16 bits, arithmetic in fp32: the fast dtype for CPUs without native bf16.

A decode step reads every weight once, so on a CPU it takes about the weights' bytes over the memory's bandwidth.
Where the CPU multiplies bf16 natively (AVX-512 BF16, AMX) ``--dtype bfloat16`` halves those bytes. Elsewhere
(AVX2 CPUs: AMD Zen 2/3, most laptops) torch emulates bf16 matmuls, slower than fp32, so such a CPU ran fp32 and
read 2 GB a step on Qwen2.5-Coder-0.5B. Here the linears' weights are stored in 16 bits (fp16 or bf16) and a
small C kernel (``kernels/linear16.c``, built once with the system's C compiler) widens them to fp32 in registers:
the step reads half the bytes and computes in fp32, as the fp32 model does. Activations, norms, embeddings and the
KV cache stay fp32.

Two storage formats (:data:`FORMATS`): ``fp16-weights`` keeps 11 significant bits of each weight (bf16 keeps 8;
weights need precision, not range), so it is the default on such CPUs (``--dtype auto``); a model with a weight
beyond fp16's range is refused with the layer named (``bf16-weights`` takes it).

Inputs of at most :data:`SMALL_ROWS` rows (decode steps, batched or not) run the kernel, whose arithmetic for each
output is fixed whatever the batch, its row grouping or the thread count (see the kernel's header): a row decoded
in a batch equals the same row decoded alone, bit for bit, and a replay on any machine with the kernel gives the
same bits. Larger inputs (prefill chunks) are bound by arithmetic, not bytes: they widen the weight to fp32, a
block of outputs at a time, and run torch's fp32 ``linear``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .models import STORED_16

FORMATS = dict(zip(STORED_16, (torch.float16, torch.bfloat16), strict=True))  # dtype name -> how a weight is stored
_CODES = {torch.bfloat16: 0, torch.float16: 1}  # the kernel's format argument
SMALL_ROWS = 32  # inputs of at most this many rows run the kernel (a batched decode step of up to 32 slots)
WIDEN_BYTES = 4 << 20  # a larger input widens about this many bytes of fp32 weight at a time (stays in cache)
WIDEN_MIN = 256  # outputs widened at a time, at least
FP16_MAX = 65504.0
_ATTR = "_snapkv_weights16"  # on the model: its format's dtype name
SOURCE = Path(__file__).with_name("kernels") / "linear16.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
ENV = "SNAPKV_SESSIONS_CC"  # the C compiler to build the kernel with (default: cc, then gcc)


def available() -> bool:
    """Whether the kernel runs here: an x86 CPU with AVX2 (and FMA, F16C, which come with it) and a C compiler
    that builds it."""
    return _kernel() is not None


@functools.cache
def _kernel():
    """The built kernel (``linear16``, ``widen16``), or None where it cannot run. Built once per source and compiler into the
    model cache (about a second), then loaded."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    compiler = os.environ.get(ENV) or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    from .models import build_once, cache_dir

    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"linear16-{tag}.so"

    def build() -> None:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)], check=True, capture_output=True,
                           timeout=120)
            out.replace(target)  # whole or absent: a reader never loads a half-written library

    try:
        build_once(target, target.exists, build)
        # torch has loaded its OpenMP runtime (libgomp.so.1) already: the kernel's threads come from that one
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    lib.linear16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    lib.linear16.restype = ctypes.c_int
    lib.widen16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    lib.widen16.restype = ctypes.c_int
    return lib


PLAIN, BLOCKED = 0, 1  # the kernel's layouts: (N, K) rows, or blocks of 8 rows interleaved per 8 columns


def blocked(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N/8, K/8, 8, 8): within each block of eight rows, their weights k..k+7 side by side, so a one-row
    step reads the matrix as one stream (about 1.3x the plain layout's bandwidth here); K and N multiples of 8."""
    n, k = weight.shape
    return weight.reshape(n // 8, 8, k // 8, 8).permute(0, 2, 1, 3).contiguous()  # (N/8, K/8, 8, 8)


def plain(weight: torch.Tensor) -> torch.Tensor:
    """A stored weight as (N, K): itself, or :func:`blocked`'s inverse (a copy)."""
    if weight.dim() == 2:
        return weight
    nb, kb = weight.shape[:2]
    return weight.permute(0, 2, 1, 3).reshape(nb * 8, kb * 8)  # (N, K)


def _shape(weight: torch.Tensor) -> tuple[int, int, int]:
    """(N, K, layout) of a stored weight."""
    if weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1]), PLAIN
    return int(weight.shape[0]) * 8, int(weight.shape[1]) * 8, BLOCKED


def _lib():
    lib = _kernel()
    if lib is None:
        raise ConfigError("dtype", "fp16-weights", "the 16-bit weights kernel does not run here (needs an AVX2 CPU "
                                                   "and a C compiler)")
    return lib


def small(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel: x (M, K) fp32, weight (N, K) or :func:`blocked` fp16/bf16, bias (N,) fp32 or None -> (M, N)
    fp32. The layout changes where the kernel reads, never its arithmetic: both give the same bits."""
    fn = _lib().linear16
    n, k, layout = _shape(weight)
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)  # (M, N)
    if x.shape[1] != k:
        raise ValueError(f"input has {x.shape[1]} features, the weight {k}")
    code = fn(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
              x.shape[0], k, n, _CODES[weight.dtype], layout, torch.get_num_threads())
    if code != 0:
        raise ValueError(f"linear16 refused a weight of {tuple(weight.shape)} {weight.dtype}")
    return out


def widened(weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a stored weight as plain fp32 (exact), in one pass of the kernel library: (hi - lo, K)."""
    _, k, layout = _shape(weight)
    out = torch.empty(hi - lo, k, dtype=torch.float32)  # (hi - lo, K)
    code = _lib().widen16(weight.data_ptr(), out.data_ptr(), lo, hi, k, _CODES[weight.dtype], layout,
                          torch.get_num_threads())
    if code != 0:
        raise ValueError(f"widen16 refused rows {lo}:{hi} of a weight of {tuple(weight.shape)} {weight.dtype}")
    return out


def large(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A prefill's rows: torch's fp32 linear over the weight widened a block of outputs at a time (about
    :data:`WIDEN_BYTES`, so the widened block is still in cache when the matmul reads it).
    x (M, K) fp32 -> (M, N) fp32."""
    n, k, _ = _shape(weight)
    block = max(WIDEN_MIN, WIDEN_BYTES // (4 * k)) // 8 * 8
    if n <= block:
        return F.linear(x, widened(weight, 0, n), bias)  # (M, N)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)  # (M, N)
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        out[:, lo:hi] = F.linear(x, widened(weight, lo, hi), None if bias is None else bias[lo:hi])  # (M, hi - lo)
    return out


def _forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) fp32 -> (..., out_features) fp32."""
        flat = x.reshape(-1, x.shape[-1])  # (M, in)
        run = small if flat.shape[0] <= SMALL_ROWS else large
        out = run(flat, module.weight, module.bias)  # (M, out)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def convert(model: torch.nn.Module, dtype_name: str) -> int:
    """Store every ``nn.Linear`` weight of an fp32 CPU ``model`` in ``dtype_name``'s format (:data:`FORMATS`) and
    run it through :func:`small` / :func:`large`; returns how many. An output head tied to the input embedding gets
    its own 16-bit copy (the embedding stays fp32: a lookup reads one row a token). Nothing is changed when a
    check fails: a weight beyond fp16's range (named), or a model that is not fp32 on the CPU."""
    if dtype_name not in FORMATS:
        raise ConfigError("dtype", dtype_name, f"must be one of {list(FORMATS)}")
    if not available():
        raise ConfigError("dtype", dtype_name, "the 16-bit weights kernel does not run here (needs an x86 CPU "
                                               "with AVX2 and a C compiler, `cc` or $SNAPKV_SESSIONS_CC)")
    if getattr(model, _ATTR, None) is not None:
        raise ConfigError("dtype", dtype_name, f"the model already stores its weights as {getattr(model, _ATTR)}")
    fmt = FORMATS[dtype_name]
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, m in linears:
        if m.weight.dtype != torch.float32 or m.weight.device.type != "cpu":
            raise ConfigError("dtype", dtype_name, f"{name}: converts fp32 weights on the CPU, not "
                                                   f"{m.weight.dtype} on {m.weight.device}")
        if fmt == torch.float16:
            peak = float(m.weight.detach().abs().max())
            if peak > FP16_MAX:
                raise ConfigError("dtype", dtype_name, f"{name} holds a weight of {peak:.4g}, beyond fp16's "
                                                       f"{FP16_MAX:g}; use bf16-weights")
    with torch.no_grad():
        for _, m in linears:
            # a new Parameter, not the old one converted in place: a tied embedding keeps its fp32 weight
            stored = m.weight.detach().to(fmt).contiguous()  # (N, K)
            if stored.shape[0] % 8 == 0 and stored.shape[1] % 8 == 0:
                stored = blocked(stored)  # (N/8, K/8, 8, 8)
            m.weight = torch.nn.Parameter(stored, requires_grad=False)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(m.bias.detach().float().contiguous(), requires_grad=False)
            m.forward = _forward(m)
        # what stays fp32 (embeddings, norms, biases) may be views of the loaded file's memory map, which keep the
        # whole map, and every page the conversion read, resident: own copies let it go (0.5B: RSS 3.9 -> 2.6 GiB)
        for t in (*model.parameters(), *model.buffers()):
            if t.dtype == torch.float32:
                t.data = t.data.clone()
        _join_siblings(model)  # after the copies: the joined biases' views stay views
    setattr(model, _ATTR, dtype_name)
    return len(linears)


class Joined:
    """Sibling projections (one input: q/k/v, gate/up) whose 16-bit weights lie in one tensor, each module's
    weight a view of its rows: one kernel call computes all of them, with each output's own arithmetic, so their
    outputs side by side equal each projection's own, bit for bit, at any row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, splits: list[int]) -> None:
        self.weight, self.bias, self.splits = weight, bias, splits
        self.rows = SMALL_ROWS  # where the one call is the kernel's; larger inputs run the projections apart

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """The siblings' outputs side by side: (M, in) -> (M, sum of outs), M <= :attr:`rows`."""
        return small(flat, self.weight, self.bias)

    def run(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(self.matmul(flat).split(self.splits, dim=-1))  # each (M, out_i)


def _join_siblings(model: torch.nn.Module) -> None:
    """Lay each group of sibling projections' weights (and biases) out as one tensor (:class:`Joined`)."""
    from .packed import sibling_sets

    for parts in sibling_sets(model):
        weight = torch.cat([m.weight for m in parts])  # (sum of outs, in) or blocked: (sum of outs / 8, ...)
        bias = None if parts[0].bias is None else torch.cat([m.bias for m in parts])  # (sum of outs,)
        splits, lo = [int(m.out_features) for m in parts], 0
        per = 1 if weight.dim() == 2 else 8  # outputs per leading index
        for m, n in zip(parts, splits, strict=True):
            m.weight = torch.nn.Parameter(weight[lo // per:(lo + n) // per], requires_grad=False)  # a view
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[lo:lo + n], requires_grad=False)
            lo += n
        parts[0]._snapkv_joined16 = Joined(weight, bias, splits)


def sibling_group(module: torch.nn.Linear) -> Joined | None:
    """The :class:`Joined` group ``module`` (the first of its siblings) belongs to, or None."""
    return getattr(module, "_snapkv_joined16", None)


def format_of(model: torch.nn.Module) -> str | None:
    """The dtype name a converted model's weights are stored in (:data:`FORMATS`), or None."""
    return getattr(model, _ATTR, None)
