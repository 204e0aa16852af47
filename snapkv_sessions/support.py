"""What a model must be for the engine to drive it, and the fingerprint a session is bound to."""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref

import torch

from .errors import UnsupportedModelError


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` is a decoder-only model with rotary positions."""
    cfg = model.config
    kind = getattr(cfg, "model_type", type(model).__name__)
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model={kind!r}: encoder-decoder models are not supported")
    if not any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules()):
        raise UnsupportedModelError(
            f"model={kind!r}: no rotary position embedding found; snapkv-sessions keeps each token's true "
            "position through RoPE and supports rotary decoder-only models (Llama, Qwen2, Mistral families)"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"model={kind!r}: layer_types={sorted(set(layer_types))}; only full-attention layers are supported"
        )
    if not all(hasattr(m, "layer_idx") for m in _attention_modules(model)):
        raise UnsupportedModelError(f"model={kind!r}: attention modules carry no layer_idx")


_TOKENIZER_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokenizer_digest(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary and chat template (once per tokenizer object: hashing a 150K-entry
    vocabulary takes a fraction of a second)."""
    if tokenizer is None:
        return "none"
    try:
        return _TOKENIZER_DIGESTS[tokenizer]
    except (KeyError, TypeError):
        pass
    text = json.dumps([sorted(tokenizer.get_vocab().items()), getattr(tokenizer, "chat_template", None)],
                      default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()
    with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced is hashed every time
        _TOKENIZER_DIGESTS[tokenizer] = digest
    return digest


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


def fingerprint(model: torch.nn.Module, tokenizer) -> str:
    """What a session is bound to: the architecture's shape and the tokenizer's vocabulary and template.

    Two loads of the same model (by name, folder or object) agree; another model or tokenizer does not.
    """
    cfg = model.config
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rope_theta", "intermediate_size")
    shape = json.dumps({k: getattr(cfg, k, None) for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(f"{shape}:{_tokenizer_digest(tokenizer)}".encode()).hexdigest()
