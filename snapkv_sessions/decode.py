"""The decode step of a Llama-family model, run layer by layer from the model's own parts.

A decode step feeds one token per row. Its work is reading the weights (the linears), a small attention over the
cache and, between them, some twenty small ops per layer. Through transformers' module tree those small ops cost
more than their arithmetic: every module call, keyword and decorator runs Python per layer (on the 0.5B, bf16
with packed weights at 2.9K tokens, 120 alternating steps: 82.3 ms a step through the modules against 76.7 ms run
as below; the linears are 49 ms). :class:`DecodeStep` runs the same ops in the same order, with the same modules'
weights, norms and activation, and the same cache update and attention function as
:meth:`snapkv_sessions.runner.ModelRunner.forward`'s model call (where q/k/v run as one packed matmul, q and k are
rotated together from its output: the same ops on each element, one pass instead of two), so a step gives the
same bits: a check at first use per model compares the two paths on a scratch batch and
keeps transformers' path where they differ (or where the model is not one whose layers it knows, or carries
hooks). Replays and records therefore do not depend on which path ran. ``SNAPKV_SESSIONS_DECODE=modules`` keeps
transformers' path everywhere.

Prefill chunks (many tokens a forward) stay on transformers' path: there the matmuls dominate.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import packed, weights16
from .attention import snapkv_attention_forward

# the architectures whose decoder layers are pre-norm attention + gated MLP with rotate-half RoPE, as built here
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ENV = "SNAPKV_SESSIONS_DECODE"  # "modules": every forward through transformers' modules

Linear = Callable[[torch.Tensor], torch.Tensor]  # (M, in) -> (M, out)
Group = Callable[[torch.Tensor], Sequence[torch.Tensor]]  # (M, in) -> one (M, out_i) per projection


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the halves layout, as transformers' ``apply_rotary_pos_emb`` computes it, op for op.
    x (B, H, 1, D); cos, sin (B, 1, 1, D)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)  # (B, H, 1, D)


def _apart(modules: Sequence[torch.nn.Linear]) -> Group:
    """The projections that read one input, one by one."""
    forwards = [m.forward for m in modules]
    return lambda flat: [f(flat) for f in forwards]


def _joined(first: torch.nn.Linear) -> packed.Fused | weights16.Joined | None:
    """The one matmul that runs ``first`` and its siblings, where they have one: packed and fused
    (:func:`snapkv_sessions.packed.fuse_siblings`, checked to give each projection's own bits) or 16-bit weights
    laid out together (:class:`snapkv_sessions.weights16.Joined`, the same bits by construction)."""
    return packed.sibling_group(first) or weights16.sibling_group(first)


def _group(modules: Sequence[torch.nn.Linear]) -> Group:
    """The projections that read one input: as one matmul for a decode step's rows where they have one
    (:func:`_joined`), else one by one."""
    fused, apart = _joined(modules[0]), _apart(modules)
    if fused is None:
        return apart
    return lambda flat: fused.run(flat) if flat.shape[0] <= fused.rows else apart(flat)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parts, each called as its module's forward (no module-call overhead)."""

    attention: torch.nn.Module  # what the attention function is handed (its layer_idx, scaling)
    norm_in: Linear  # input_layernorm
    qkv: Group  # (M, H) -> q (M, Hq*D), k (M, Hkv*D), v (M, Hkv*D), one by one
    joined: packed.Fused | weights16.Joined | None  # q/k/v as one matmul (their outputs side by side), if fused
    out: Linear  # o_proj
    norm_post: Linear  # post_attention_layernorm
    gate_up: Group  # (M, H) -> gate, up (M, I) each
    act: Linear
    down: Linear


class DecodeStep:
    """One decode step (``(B, 1)`` tokens) of ``model`` from its parts; see the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        body = model.model
        self.embed = body.embed_tokens.forward
        self.rotary = body.rotary_emb
        self.norm = body.norm.forward
        self.lm_head = model.lm_head.forward
        self.head_dim: int = body.layers[0].self_attn.head_dim
        self.layers = [
            _Layer(
                attention=layer.self_attn,
                norm_in=layer.input_layernorm.forward,
                qkv=_apart([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                joined=_joined(layer.self_attn.q_proj),
                out=layer.self_attn.o_proj.forward,
                norm_post=layer.post_attention_layernorm.forward,
                gate_up=_group([layer.mlp.gate_proj, layer.mlp.up_proj]),
                act=layer.mlp.act_fn,
                down=layer.mlp.down_proj.forward,
            )
            for layer in body.layers
        ]
        self.modules = tuple(body.layers.modules())  # what a forward hook could be on, for hooked()

    def hooked(self) -> bool:
        """Whether a forward hook on one of the layers' modules would run in transformers' path and not here."""
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: object,
                 key_masks: object | None = None, recall: object | None = None) -> torch.Tensor:
        """input_ids, position_ids (B, 1) at true positions; returns the next-token logits (B, V)."""
        bsz, dim = input_ids.shape[0], self.head_dim
        h = self.embed(input_ids)  # (B, 1, H) the residual stream
        cos, sin = self.rotary(h, position_ids)  # (B, 1, D) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, D): the same for every head
        for layer in self.layers:
            x = layer.norm_in(h).view(bsz, -1)  # (B, H)
            attn = layer.attention
            joined = layer.joined
            if joined is not None and bsz <= joined.rows:  # q and k side by side: rotated together, one pass
                n_q, n_kv = joined.splits[0] // dim, joined.splits[1] // dim
                heads = joined.matmul(x).view(bsz, 1, -1, dim).transpose(1, 2)  # (B, Hq + 2 Hkv, 1, D)
                qk = _rotate(heads[:, : n_q + n_kv], cos, sin)  # (B, Hq + Hkv, 1, D)
                q, k, v = qk[:, :n_q], qk[:, n_q:], heads[:, n_q + n_kv :]  # (B, Hq | Hkv | Hkv, 1, D) views
            else:
                q, k, v = layer.qkv(x)  # (B, Hq*D), (B, Hkv*D), (B, Hkv*D)
                q = _rotate(q.view(bsz, 1, -1, dim).transpose(1, 2), cos, sin)  # (B, Hq, 1, D)
                k = _rotate(k.view(bsz, 1, -1, dim).transpose(1, 2), cos, sin)  # (B, Hkv, 1, D)
                v = v.view(bsz, 1, -1, dim).transpose(1, 2)  # (B, Hkv, 1, D)
            k, v = cache.update(k, v, attn.layer_idx)  # (B, Hkv, T, D) each: the layer's whole cache
            o, _ = snapkv_attention_forward(attn, q, k, v, None, scaling=attn.scaling, snapkv_keymask=key_masks,
                                            snapkv_recall=recall)  # (B, 1, Hq, D)
            h = h + layer.out(o.reshape(bsz, 1, -1).contiguous())  # (B, 1, H)
            gate, up = layer.gate_up(layer.norm_post(h).view(bsz, -1))  # (B, I) each
            h = h + layer.down(layer.act(gate) * up).view(bsz, 1, -1)  # (B, 1, H)
        return self.lm_head(self.norm(h))[:, -1]  # (B, V)


_LOCK = threading.Lock()


def for_model(model: torch.nn.Module) -> DecodeStep | None:
    """The model's :class:`DecodeStep` where it gives transformers' bits here, else None (checked once per model
    and packing; see the module docstring)."""
    if os.environ.get(ENV, "") == "modules" or type(model).__name__ not in ARCHITECTURES or _global_hooks():
        return None
    key = _signature(model)
    held = getattr(model, "_snapkv_decode", None)
    if held is not None and held[0] == key:
        step = held[1]
        return None if step is None or step.hooked() else step
    with _LOCK:
        try:
            step = DecodeStep(model)
        except AttributeError:  # a layer that is not built as this module expects
            step = None
        if step is not None and step.hooked():  # decided again once the hooks are gone; the check would run them
            return None
        if step is not None and not _same_bits(model, step):
            step = None
        model._snapkv_decode = (key, step)
    return step


def _signature(model: torch.nn.Module) -> tuple:
    """What a built step depends on beyond the weights' values: dtype, device, the attention implementation and
    how the first layer's linears run (packed, fused)."""
    first = model.model.layers[0]
    weight = first.self_attn.q_proj.weight
    return (weight.dtype, weight.device, model.config._attn_implementation,
            packed.packing_of(first.self_attn.q_proj), packed.packing_of(first.mlp.gate_proj))


def _global_hooks() -> bool:
    """Whether a forward hook registered for every module would run in transformers' path and not in this one."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


@torch.inference_mode()
def _same_bits(model: torch.nn.Module, step: DecodeStep) -> bool:
    """Two rows of random tokens prefilled through the model, then two decode steps each way on copies of the
    cache: equal logits and caches, bit for bit."""
    from .cache import CompactCache

    cfg = model.config
    device = model.model.embed_tokens.weight.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen).to(device)  # (2, 9): 7 prompt, 2 decoded
    positions = torch.arange(9, device=device).expand(2, 9)  # (2, 9)
    caches = []
    for _ in range(2):
        cache = CompactCache(cfg.num_hidden_layers)
        model(input_ids=ids[:, :7], position_ids=positions[:, :7], cache=cache, use_cache=True, logits_to_keep=1)
        cache.reserve(2)
        caches.append(cache)
    for i in (7, 8):
        ref = model(input_ids=ids[:, i:i + 1], position_ids=positions[:, i:i + 1], cache=caches[0], use_cache=True,
                    logits_to_keep=1).logits[:, -1]  # (2, V)
        got = step(ids[:, i:i + 1], positions[:, i:i + 1], caches[1])  # (2, V)
        if not torch.equal(ref, got):
            return False
    return all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(caches[0].layers, caches[1].layers, strict=True))
