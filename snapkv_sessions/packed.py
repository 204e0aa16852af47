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

Packing also joins the projections of a layer that read the same input (q/k/v, gate/up: :func:`fuse_siblings`)
into one weight for inputs of a decode step's size, where a check at load finds each projection's own bits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

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
    from . import weights16

    if weights16.format_of(model) is not None:
        raise ConfigError("packed_weights", weights16.format_of(model),
                          "a model with 16-bit stored weights runs their own kernel; it is not packed")
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or hasattr(module, _PACKED):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or str(weight.dtype).removeprefix("torch.") not in DTYPES:
            raise ConfigError("packed_weights", f"{name}: {weight.dtype} on {weight.device}",
                              "packs fp32 or bf16 weights on the CPU only")
        with torch.no_grad():
            try:
                reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
            except RuntimeError as exc:  # oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
                unpack_linears(model)
                raise ConfigError("packed_weights", f"{name}: {weight.dtype}",
                                  f"oneDNN cannot pack it on this CPU ({str(exc)[:160]})") from None
            setattr(module, _PACKED, reordered)
        module.forward = _packed_forward(module)
        count += 1
    if count:
        fuse_siblings(model, rows)
    return count


# projections of one module that read the same input, in the order its forward calls them (Llama, Qwen2, Mistral)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def sibling_sets(model: torch.nn.Module) -> Iterator[list[torch.nn.Linear]]:
    """Each group of :data:`SIBLINGS` in ``model`` whose projections could run as one matmul: all ``nn.Linear``,
    with one input size, weight dtype, weight layout (its number of dims) and bias or none."""
    for module in model.modules():
        for names in SIBLINGS:
            parts = [getattr(module, n, None) for n in names]
            if not all(isinstance(m, torch.nn.Linear) for m in parts):
                continue
            if len({(m.in_features, m.weight.dtype, m.weight.dim(), m.bias is None) for m in parts}) == 1:
                yield parts


class Fused:
    """Sibling projections packed as one weight: for an input of at most ``rows`` rows the first sibling runs the
    one matmul and leaves the others' slices for them, keyed by the input tensor itself (per thread)."""

    def __init__(self, modules: list[torch.nn.Linear], rows: int) -> None:
        weights = [m.weight.detach() for m in modules]
        self.rows = rows
        self.splits = [int(w.shape[0]) for w in weights]
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), rows)
        biases = [m.bias for m in modules]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.stash = threading.local()  # .value: (input, [the later siblings' outputs]) after the first sibling

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """The siblings' outputs side by side: (M, in) -> (M, sum of outs)."""
        return _LINEAR(flat, self.packed, self.bias, "none", [], "")

    def run(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(self.matmul(flat).split(self.splits, dim=-1))  # each (M, out_i)


_LINEAR = torch.ops.mkldnn._linear_pointwise.default if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None


def fuse_siblings(model: torch.nn.Module, rows: int = 8) -> int:
    """Run each group of packed sibling projections (:data:`SIBLINGS`) as one matmul for inputs of at most ``rows``
    rows (a decode step): one weight read per group instead of one per projection (the 0.5B's one-row step: 24
    layers of q/k/v and gate/up, 27.6 against 24.2 ms in a micro-benchmark). Only where that gives each
    projection's own bits: checked once per shape at load, rows 1 to ``rows``; larger inputs (a prefill) run
    them apart, as before. Returns the groups fused."""
    fused, checked = 0, {}
    for parts in sibling_sets(model):
        if not all(hasattr(m, _PACKED) for m in parts) or getattr(parts[0], "_snapkv_fused", None) is not None:
            continue
        group = Fused(parts, rows)
        shape = (parts[0].in_features, parts[0].weight.dtype, tuple(group.splits), group.bias is None)
        if shape not in checked:
            checked[shape] = _same_bits(group, parts)
        if not checked[shape]:
            continue
        for i, m in enumerate(parts):
            m._snapkv_fused = group
            m.forward = _fused_forward(m, group, i)
        fused += 1
    return fused


def _same_bits(group: Fused, parts: list[torch.nn.Linear]) -> bool:
    """Whether the fused matmul gives each projection's own bits, rows 1 to ``group.rows``, on random inputs."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in range(1, group.rows + 1):
            x = torch.randn(m, parts[0].in_features, generator=gen).to(parts[0].weight.dtype)  # (M, in)
            alone = [part.forward(x) for part in parts]  # each (M, out_i), the packed forward
            if not all(torch.equal(a, b) for a, b in zip(alone, group.run(x), strict=True)):
                return False
    return True


def _fused_forward(module: torch.nn.Linear, group: Fused, index: int):
    alone = module.forward  # the packed forward of this projection alone

    def forward(x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features)."""
        flat = x.reshape(-1, x.shape[-1])  # (M, in)
        if flat.shape[0] > group.rows:
            return alone(x)
        if index == 0:
            outs = group.run(flat)  # each (M, out_i)
            group.stash.value = (x, outs[1:])
            out = outs[0]
        else:
            held = getattr(group.stash, "value", None)
            if held is None or held[0] is not x:  # called out of order, or on another input: alone
                return alone(x)
            out = held[1][index - 1]
            if index == len(group.splits) - 1:
                group.stash.value = None
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def unpack_linears(model: torch.nn.Module) -> int:
    """Give every packed ``nn.Linear`` its own forward back; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, _PACKED):
            delattr(module, _PACKED)
            if hasattr(module, "_snapkv_fused"):
                del module._snapkv_fused
            del module.forward  # the instance attribute: the class's forward shows again
            count += 1
    return count


def is_packed(model: torch.nn.Module) -> bool:
    return any(hasattr(m, _PACKED) for m in model.modules())


def sibling_group(module: torch.nn.Linear) -> Fused | None:
    """The fused group ``module`` (the first of its :data:`SIBLINGS`) runs in for small inputs, or None: what a
    caller that runs the group itself (:mod:`snapkv_sessions.decode`) calls instead of each projection."""
    return getattr(module, "_snapkv_fused", None)


def packing_of(module: torch.nn.Linear) -> tuple[int, int]:
    """Identifies how ``module`` runs now (its packed weight, its fused group; 0 for none): what a plan built over
    the model's linears is keyed by, so packing or unpacking afterwards makes it be built again."""
    weight, group = getattr(module, _PACKED, None), getattr(module, "_snapkv_fused", None)
    return (0 if weight is None else id(weight)), (0 if group is None else id(group))


def _packed_forward(module: torch.nn.Linear):
    packed = getattr(module, _PACKED)
    bias = None if module.bias is None else module.bias.detach()  # shares the bias's storage

    def forward(x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features)."""
        flat = x.reshape(-1, x.shape[-1])  # (M, in)
        out = _LINEAR(flat, packed, bias, "none", [], "")  # (M, out)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward
