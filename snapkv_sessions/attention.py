"""The attention function the engine runs every layer with, and the observation-window probe.

The engine registers :func:`snapkv_attention_forward` under the name ``"snapkv"`` with
``transformers.AttentionInterface`` and switches the model to it explicitly (and reversibly, see
:meth:`snapkv_sessions.runner.ModelRunner.detach`). It differs from transformers' SDPA path in two ways:

* the causal mask is built here, aligned bottom-right: the queries are the LAST ``Q`` entries of the layer's
  cache. Transformers would size its mask from layer 0 and from position ids; after compression the physical
  cache length differs from the true positions and, with a pyramid budget, from layer to layer;
* when a :class:`WindowProbe` is passed (``snapkv_probe=`` through the model's forward kwargs), the last ``W``
  queries' softmax attention over all keys is computed in fp32 and averaged over the window: O(W*T) memory per
  layer, never the T*T matrix. Those probabilities also give the window rows' output (one pass, not SDPA's
  again), which is all of a later turn's short prefill.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .recall import HotKeys

ATTN_NAME = "snapkv"


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                key_mask: torch.Tensor | None = None, split: bool = False) -> torch.Tensor:
    """Scaled dot-product attention whose queries are the last ``Q`` positions of the keys.

    Parameters
    ----------
    query : (B, Hq, Q, D)
    key, value : (B, Hkv, T, D), with T >= Q; Hq a multiple of Hkv (GQA)
    key_mask : (B, 1, 1, T) or (B, Hkv, 1, T) bool: the keys each row (and KV head) may see: several sessions
        padded into one batch (:mod:`snapkv_sessions.batch`), or the padding slots of heads that keep different
        numbers of slots (:mod:`snapkv_sessions.allocate`); None: all of them. Or, at decode, (B, Hq, 1, T) fp32
        added to the scaled logits (-inf: not seen; :func:`with_recalled`'s tail estimate)

    split : a prefill onto a cache (``Q < T``) attends in two parts merged by their log-sum-exp
        (:func:`split_prefill`) where no key mask applies, on a CPU; else through one masked SDPA. A turn records
        which ran (they differ in the last bits), so a replay runs the same.

    Returns
    -------
    (B, Q, Hq, D), the layout transformers' attention modules expect back.
    """
    q_len, t_len = query.shape[-2], key.shape[-2]
    gqa = query.shape[1] != key.shape[1]
    if q_len == 1 and query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu":
        return _decode_matmul(query, key, value, scaling, key_mask)
    if key_mask is not None and key_mask.dtype != torch.bool:
        key_mask = key_mask.to(query.dtype)  # SDPA adds a float mask of the query's dtype
    if key_mask is not None and key_mask.shape[1] not in (1, query.shape[1]):  # per KV head: to its query heads
        key_mask = key_mask.repeat_interleave(query.shape[1] // key_mask.shape[1], dim=1)  # (B, Hq, 1, T)
    if q_len == 1:  # decode: the one query sees every cached key (of its own row)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=key_mask, scale=scaling, enable_gqa=gqa)
    elif q_len == t_len and key_mask is None:  # prefill on an empty cache: plain causal
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    elif split and key_mask is None and query.device.type == "cpu":  # prefill onto a cache, in two parts
        return split_prefill(query, key, value, scaling)
    else:  # prefill onto a cache: bottom-right aligned causal mask
        mask = torch.ones(q_len, t_len, dtype=torch.bool, device=query.device).tril(t_len - q_len)  # (Q, T)
        if key_mask is not None:
            mask = mask & key_mask  # (B, H, Q, T)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()  # (B, Q, Hq, D)


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """A prefill chunk's attention onto a cache: its ``Q`` queries are the last ``Q`` of the ``T`` keys.

    One SDPA with the bottom-right causal mask computes all ``Q x T`` products and then masks them: PyTorch's CPU
    flash kernel skips masked blocks only for ``is_causal``, which aligns top-left. So the keys are taken in two
    parts: the ``T - Q`` earlier ones, which every query sees (no mask), and the chunk's own ``Q``, square and
    causal; the two outputs are merged by their log-sum-exp, in fp32. Same attention, other rounding. Measured on
    Qwen2.5-Coder-0.5B's heads (bf16, 2 cores): 175 against 333 ms per layer for 4,096 queries onto 8,192 keys.

    query (B, Hq, Q, D); key, value (B, Hkv, T, D) with T > Q. Returns (B, Q, Hq, D)."""
    if _FLASH is None:  # a torch without the kernel: the one masked SDPA
        return causal_sdpa(query, key, value, scaling)
    q_len, t_len = query.shape[-2], key.shape[-2]
    cut = t_len - q_len  # the earlier keys: every query sees them
    before, lse_before = _FLASH(query, key[:, :, :cut], value[:, :, :cut], 0.0, False, scale=scaling)  # (B, Hq, Q, D)
    own, lse_own = _FLASH(query, key[:, :, cut:], value[:, :, cut:], 0.0, True, scale=scaling)  # (B, Hq, Q), fp32
    lse = torch.logaddexp(lse_before, lse_own)  # (B, Hq, Q) the whole row's normaliser
    out = (before.float() * (lse_before - lse).exp()[..., None]
           + own.float() * (lse_own - lse).exp()[..., None])  # (B, Hq, Q, D) fp32
    return out.to(query.dtype).transpose(1, 2).contiguous()  # (B, Q, Hq, D)


def _decode_matmul(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                   key_mask: torch.Tensor | None) -> torch.Tensor:
    """One decode query per row as two matmuls, the softmax in fp32. On a CPU, PyTorch's flash kernel for bf16
    and fp16 tiles the queries in blocks, so one query costs a block's work: measured 7x (1.5K keys) to 19x (8K)
    slower than this on the 0.5B's heads. fp32 keeps SDPA (the equality tests' path).

    query (B, Hq, 1, D); key, value (B, Hkv, T, D); key_mask (B, 1 or Hkv, 1, T) bool, (B, Hq, 1, T) fp32
    additive, or None.
    Returns (B, 1, Hq, D)."""
    if _widening_exact(query.dtype, query.device.type):
        wide = _whole_buffers(key, value)
        if wide is not None:
            return _decode_products(query, *wide, scaling, key_mask, seen=key.shape[2])
    return _decode_products(query, key, value, scaling, key_mask)


def _decode_products(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     key_mask: torch.Tensor | None, seen: int | None = None) -> torch.Tensor:
    """:func:`_decode_matmul`'s two matmuls and softmax over the keys as given; ``seen``: only the first ``seen``
    slots hold keys (the others get probability 0), and ``key_mask`` covers those. Returns (B, 1, Hq, D)."""
    bsz, n_q, _, dim = query.shape
    n_kv, width = key.shape[1], key.shape[2]
    grouped = query.view(bsz, n_kv, n_q // n_kv, dim)  # (B, Hkv, G, D) the query heads of each KV head
    logits = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling  # (B, Hkv, G, C)
    seen = width if seen is None else seen
    if seen < width:
        logits[..., seen:] = float("-inf")  # the buffer's spare slots: a fill of the tail alone, in place
    held = logits[..., :seen]  # (B, Hkv, G, T) a view
    if key_mask is not None and key_mask.dtype == torch.bool:
        held.masked_fill_(~key_mask, float("-inf"))  # (B, 1 or Hkv, 1, T) broadcast over the group
    elif key_mask is not None:
        held += key_mask.float().view(bsz, n_kv, n_q // n_kv, -1)  # (B, Hq, 1, T): per query head
    probs = logits.softmax(dim=-1).to(value.dtype)  # (B, Hkv, G, C)
    out = torch.matmul(probs, value)  # (B, Hkv, G, D)
    return out.view(bsz, 1, n_q, dim)  # (B, 1, Hq, D): one position, the heads in order


# how many unused slots past the keys a decode step may read instead of copying the keys (a share of them, or
# WIDEN_MIN slots): the unused slots are zeros (CompactLayer.reserve, the slot pool) and masked out
WIDEN_SHARE, WIDEN_MIN = 0.25, 64


@functools.cache
def _widening_exact(dtype: torch.dtype, device: str) -> bool:
    """Whether reading the whole buffer gives the bits of the copied keys with this dtype's kernels here (they
    add each masked slot's exact zero after the others; a kernel that split the key axis by its length would
    not). Checked once per process on random buffers, batches and lengths; where it fails, steps copy as before."""
    gen = torch.Generator().manual_seed(0)
    for bsz, heads, group, t_len, cap in ((1, 2, 7, 7, 9), (1, 1, 4, 333, 390), (3, 2, 2, 1024, 1090)):
        buffers = [torch.randn(bsz, heads, cap, 64, generator=gen).to(dtype).to(device) for _ in range(2)]
        query = torch.randn(bsz, heads * group, 1, 64, generator=gen).to(dtype).to(device)
        keys, values = (b[:, :, :t_len] for b in buffers)  # (B, Hkv, T, D) views
        wide = _whole_buffers(keys, values)  # (B, Hkv, C, D) each; None for one head's slots (contiguous)
        if wide is None:
            continue
        copied = _decode_products(query, keys.contiguous(), values.contiguous(), 0.125, None)  # (B, 1, Hq, D)
        if not torch.equal(_decode_products(query, *wide, 0.125, None, seen=t_len), copied):
            return False
    return True


def _whole_buffers(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The buffers (B, Hkv, C, D) a decode step reads instead of the keys and values, without copying them; None
    where the step reads the views as they are.

    A cache's keys are the first ``T`` slots of a preallocated buffer ``(B, Hkv, C, D)`` (:class:`CompactLayer`,
    the slot pool), so their view is not contiguous, and a CPU ``bmm`` copies a non-contiguous operand first: at
    2.9K tokens on the 0.5B that copy cost more than the products (300 us a layer against 120). The buffer itself
    is contiguous: when at most ``WIDEN_SHARE`` of ``T`` (or ``WIDEN_MIN``) slots follow the keys in it, the step
    reads the whole buffer, the slots past ``T`` given probability 0 (:func:`_decode_products`' ``seen``). Each
    kept slot's dot product is its own, so the output is the same bits where the kernels add those zeros last
    (:func:`_widening_exact` checks that once; ``tests/test_attention.py``). Otherwise (a large reply reserve, a
    view that is not a prefix of a buffer, keys contiguous already) None."""
    t_len = key.shape[2]
    wide = _prefix_buffer(key, t_len, max(WIDEN_MIN, int(t_len * WIDEN_SHARE)))
    if wide is None or value.shape != key.shape:
        return None
    wide_v = _prefix_buffer(value, t_len, wide.shape[2] - t_len)
    if wide_v is None or wide_v.shape != wide.shape:
        return None
    return wide, wide_v


def _prefix_buffer(x: torch.Tensor, t_len: int, most_extra: int) -> torch.Tensor | None:
    """``x`` (B, H, T, D) widened to its whole buffer (B, H, C, D) when it is the first ``T`` slots of a
    contiguous one with ``0 < C - T <= most_extra``; None otherwise (``x`` contiguous already, or not such a
    view)."""
    if x.is_contiguous() or x.dim() != 4 or x.stride(3) != 1 or x.stride(2) != x.shape[3]:
        return None
    bsz, heads, _, dim = x.shape
    row = x.stride(1)  # C * D when x is a prefix of a (B, H, C, D) buffer
    if row % dim or (bsz > 1 and x.stride(0) != heads * row):
        return None
    cap = row // dim
    if not t_len < cap <= t_len + most_extra:
        return None
    end = x.storage_offset() + (bsz * heads) * row  # one past the widened view's last element
    if end * x.element_size() > x.untyped_storage().nbytes():
        return None
    return x.as_strided((bsz, heads, cap, dim), (heads * row, row, dim, 1))


def window_probs(query: torch.Tensor, key: torch.Tensor, window: int, scaling: float,
                 key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries over all keys, in fp32.

    Parameters
    ----------
    query : (B, Hq, Q, D), post-RoPE; its last ``window`` rows are the observation window
    key : (B, Hkv, T, D), post-RoPE, the whole cache of the layer (T >= Q >= window)
    key_mask : (B, Hkv, 1, T) bool, False at padding slots (which then get no attention), or None

    Returns
    -------
    (B, Hkv, G, W, T) float32: each window query's attention probability of every key, the query heads of a KV
    head together (G = Hq / Hkv).
    """
    bsz, n_q, _, dim = query.shape
    n_kv, t_len = key.shape[1], key.shape[-2]
    group = n_q // n_kv
    q_win = query[:, :, -window:, :].float().view(bsz, n_kv, group, window, dim)  # (B, Hkv, G, W, D)
    logits = torch.einsum("bhgwd,bhtd->bhgwt", q_win, key.float()) * scaling  # (B, Hkv, G, W, T)
    # window row i sits at cache index T - W + i: it sees keys up to there, not the later window rows.
    future = torch.ones(window, window, dtype=torch.bool, device=query.device).triu(1)  # (W, W)
    logits[..., t_len - window :].masked_fill_(future, float("-inf"))
    if key_mask is not None:
        logits.masked_fill_(~key_mask[:, :, None], float("-inf"))  # (B, Hkv, 1, 1, T) padding slots
    return logits.softmax(dim=-1)  # (B, Hkv, G, W, T)


def window_mean(probs: torch.Tensor) -> torch.Tensor:
    """:func:`window_probs`' (B, Hkv, G, W, T) averaged over the window: (B, Hq, T), the query heads in order."""
    bsz, n_kv, group, _, t_len = probs.shape
    return probs.mean(dim=3).reshape(bsz, n_kv * group, t_len)  # (B, Hq, T)


def attention_with_window(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                          probs: torch.Tensor, key_mask: torch.Tensor | None = None,
                          split: bool = False) -> torch.Tensor:
    """:func:`causal_sdpa`'s output, its last ``W`` rows taken from the probabilities ``probs`` (B, Hkv, G, W, T)
    of those rows, which the probe has computed anyway (W: the window, or every row of a short prefill): a later
    turn's prefill then computes its attention once, not twice. The earlier rows, if any, are causal SDPA over the
    keys before the last ``W`` (row ``i`` sits at cache index ``T - Q + i``, so they never see those keys).

    Returns (B, Q, Hq, D), as :func:`causal_sdpa`."""
    bsz, n_q, q_len, dim = query.shape
    n_kv, group, window, t_len = probs.shape[1], probs.shape[2], probs.shape[3], probs.shape[4]
    # in the values' dtype, as _decode_matmul does: fp32 (the equality tests) stays exact, bf16 uses its kernels
    weights = probs.reshape(bsz, n_kv, group * window, t_len).to(value.dtype)  # (B, Hkv, G*W, T)
    mixed = torch.matmul(weights, value)  # (B, Hkv, G*W, D)
    tail = mixed.view(bsz, n_q, window, value.shape[-1]).transpose(1, 2)  # (B, W, Hq, D)
    if q_len == window:
        return tail.contiguous()
    cut = t_len - window  # the earlier rows' keys: everything before the window
    mask = None if key_mask is None else key_mask[..., :cut]  # (B, 1 or Hkv, 1, T - W)
    head = causal_sdpa(query[:, :, : q_len - window], key[:, :, :cut], value[:, :, :cut], scaling, mask, split)
    return torch.cat([head, tail], dim=1)  # (B, Q, Hq, D)


# a prefill at most this many tokens longer than its window takes every row's output from the probe's fp32
# probabilities: SDPA's CPU kernel costs a block of queries for a few rows, while for many rows it beats the
# fp32 softmax (measured at 8K on the 0.5B's heads: 4 rows before the window cost 2.1 ms in SDPA, 1.0 ms here)
EXTRA_ROWS = 16


@dataclass
class WindowProbe:
    """Collects, for one forward pass, each layer's window-mean attention over its whole cache.

    Attributes
    ----------
    window:
        W, the number of trailing queries that observe.
    turn_start:
        True position of the first token of the prefill the probe observed.
    scores:
        ``scores[layer]`` is (B, Hq, T_layer) float32 once the forward has run.
    seconds:
        Wall time spent computing the window scores, all layers together.
    rows:
        Optional ``rows(layer, probs)``: sees each layer's window rows one by one, (B, Hkv, G, W, T) fp32, before
        they are averaged (what a reading of single rows needs; ``bench pointing``). None: nothing is kept.
    """

    window: int
    turn_start: int = 0
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    rows: Callable[[int, torch.Tensor], None] | None = None

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
               key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Keeps the layer's window-mean scores; returns the probabilities (B, Hkv, G, R, T) fp32 of the last
        ``R`` queries, from which the forward takes those rows' output: ``R`` is every query of a prefill at most
        ``EXTRA_ROWS`` longer than the window (a later turn: no few rows left for SDPA), else the window."""
        start = time.perf_counter()
        q_len = query.shape[-2]
        rows = q_len if self.window <= q_len <= self.window + EXTRA_ROWS else self.window
        probs = window_probs(query, key, rows, scaling, key_mask)  # (B, Hkv, G, R, T)
        window = probs[:, :, :, rows - self.window :]  # (B, Hkv, G, W, T) the window's rows
        self.scores[layer] = window_mean(window)  # (B, Hq, T)
        if self.rows is not None:
            self.rows(layer, window)
        self.seconds += time.perf_counter() - start
        return probs


def snapkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    snapkv_probe: WindowProbe | None = None,
    snapkv_keymask: object | None = None,
    snapkv_recall: object | None = None,
    snapkv_split: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``transformers.AttentionInterface`` function: causal SDPA plus the optional window probe.

    ``attention_mask`` is ignored on purpose (see the module docstring): the engine runs one sequence per
    cache, without padding.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # (S, 1, 1, T) a batched decode's padded slots, or (B, Hkv, 1, T) a layer's padding: read after its update
    key_mask = None if snapkv_keymask is None else snapkv_keymask.get(module.layer_idx)
    if snapkv_probe is not None:
        probs = snapkv_probe.record(module.layer_idx, query, key, scaling, key_mask)  # (B, Hkv, G, R, T)
        if snapkv_recall is None or query.shape[-2] > 1:  # the probed rows' output from their probabilities
            return attention_with_window(query, key, value, scaling, probs, key_mask, snapkv_split), None
    if snapkv_recall is not None and query.shape[-2] == 1:  # decode: also what the step recalls from the tier
        key, value, key_mask = with_recalled(snapkv_recall, module.layer_idx, query, key, value, key_mask, scaling)
    return causal_sdpa(query, key, value, scaling, key_mask, snapkv_split), None


def with_recalled(recall, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The hot keys and values (B, Hkv, T, D) with the step's recalled ones after them (B, Hkv, T + K, D), and the
    key mask over both (B, Hkv, 1, T + K): one exact softmax over hot and recalled slots together.

    With a tail estimate (:class:`~snapkv_sessions.recall.Recalled`), G more slots follow, one per query head of
    a group: a zero key, the tail's value, and the tail's logit as an additive bias that only its own query head
    sees; the mask is then that bias, (B, Hq, 1, T + K + G) fp32, 0 where a key is seen and -inf where not."""
    got = recall.extra(layer, query, HotKeys(key, key_mask, scaling))
    if got is None:
        return key, value, key_mask
    bsz, heads, t_len = key.shape[0], key.shape[1], key.shape[2]
    hot = (torch.ones(bsz, heads, 1, t_len, dtype=torch.bool, device=key.device) if key_mask is None
           else key_mask.expand(bsz, heads, 1, t_len))  # (B, Hkv, 1, T)
    key = torch.cat([key, got.keys], dim=2)  # (B, Hkv, T + K, D)
    value = torch.cat([value, got.values], dim=2)
    seen = torch.cat([hot, got.attend], dim=-1)  # (B, Hkv, 1, T + K)
    if got.tail_logit is None:
        return key, value, seen
    group = got.tail_logit.shape[-1]
    width = seen.shape[-1]
    key = torch.cat([key, key.new_zeros(bsz, heads, group, key.shape[-1])], dim=2)  # (B, Hkv, T + K + G, D)
    value = torch.cat([value, got.tail_values.to(value.dtype)], dim=2)
    blocked = torch.zeros(seen.shape, device=key.device).masked_fill(~seen, float("-inf"))  # (B, Hkv, 1, T + K)
    own = torch.eye(group, dtype=torch.bool, device=key.device)  # (G, G): query head g sees tail slot g only
    tail = got.tail_logit[..., None].expand(bsz, heads, group, group).masked_fill(~own, float("-inf"))  # (B,Hkv,G,G)
    bias = torch.cat([blocked.expand(bsz, heads, group, width), tail], dim=-1)  # (B, Hkv, G, T + K + G)
    return key, value, bias.reshape(bsz, heads * group, 1, width + group)  # (B, Hq, 1, T + K + G)


def register() -> str:
    """Register the attention function with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, snapkv_attention_forward)
    return ATTN_NAME
