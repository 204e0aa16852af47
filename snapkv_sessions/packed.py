"""Prepacked linear weights for CPU serving: every ``nn.Linear`` of a model runs oneDNN's matmul on a weight
reordered once into its blocked layout.

PyTorch's default fp32 ``linear`` on CPU packs the weight matrix again at every call. A decode step of one session
(one row) is bound by reading the weights, so that costs little; a batched step of a few rows
(:mod:`snapkv_sessions.scheduler`) pays it for every layer, and two rows cost nearly twice one. Packed once, the
same step with eight rows costs about twice one row instead of 2.2x, and two rows about the same as one (SmolLM2-135M,
fp32, 2 cores; ``docs/batching.md``).

In fp32 the results equal the default ``linear`` to float rounding, not bit for bit (the default runs MKL's sgemm),
so an fp32 model is packed only when asked (``snapkv-sessions serve --packed-weights``): records made with packed
weights are verified by a process that packs too. In bf16 on a CPU that runs bf16 natively (AVX-512 BF16 or AMX),
the default ``linear`` already runs oneDNN's matmul, re-packing the weight at each call: packed once, the results
are the same bits (:func:`exact`; ``tests/test_scheduler.py`` checks prompts and decode steps), and a one-row decode
step of Qwen2.5-Coder-0.5B took 91 ms against 114 ms at a 1.3K-token context (122 against 146 ms at 2.8K), so
``serve`` packs a bf16 model there unless told not to.
"""

from __future__ import annotations

import torch

from .errors import ConfigError

_PACKED = "_snapkv_packed"
DTYPES = ("float32", "bfloat16")  # the weight dtypes oneDNN's packed linear takes here


def available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def exact(dtype: torch.dtype) -> bool:
    """Whether packed weights give the default ``linear``'s bits for ``dtype`` here: bf16 on a CPU with native
    bf16 (both run the same oneDNN kernel; only the weight's reorder moves to load time)."""
    from .models import bf16_fast

    return dtype == torch.bfloat16 and available() and not torch.cuda.is_available() and bf16_fast()


def pack_linears(model: torch.nn.Module, rows: int = 8) -> int:
    """Pack every ``nn.Linear`` of ``model`` (fp32 or bf16, CPU) for batches of about ``rows`` rows; returns how many.
    (A layout packed for 8 rows served 1 to 8 rows best in our measurements, one row included.)
    Idempotent. The module's ``weight`` stays as it is (state dicts and ties are untouched); its forward reads the
    packed copy, so changing the weight afterwards needs :func:`unpack_linears` and a new pack."""
    if not available():
        raise ConfigError("packed_weights", True, "this torch build has no oneDNN (mkldnn) linear")
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or hasattr(module, _PACKED):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or str(weight.dtype).removeprefix("torch.") not in DTYPES:
            raise ConfigError("packed_weights", f"{name}: {weight.dtype} on {weight.device}",
                              "packs fp32 or bf16 weights on the CPU only")
        with torch.no_grad():
            setattr(module, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows))
        module.forward = _packed_forward(module)
        count += 1
    return count


def unpack_linears(model: torch.nn.Module) -> int:
    """Give every packed ``nn.Linear`` its own forward back; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, _PACKED):
            delattr(module, _PACKED)
            del module.forward  # the instance attribute: the class's forward shows again
            count += 1
    return count


def is_packed(model: torch.nn.Module) -> bool:
    return any(hasattr(m, _PACKED) for m in model.modules())


def _packed_forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features)."""
        flat = x.reshape(-1, x.shape[-1])  # (M, in)
        bias = None if module.bias is None else module.bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(flat, getattr(module, _PACKED), bias, "none", [], "")  # (M, out)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward
