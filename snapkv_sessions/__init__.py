"""snapkv-sessions: recoverable per-turn SnapKV compression of a local causal LM's KV cache.

Names are imported lazily (PEP 562), so ``import snapkv_sessions.store`` or the policy module never pulls in
torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BUNDLES": "models",
    "BudgetError": "errors",
    "CompressionConfig": "config",
    "CompressionReport": "report",
    "ConfigError": "errors",
    "GenerationConfig": "generation",
    "KVState": "state",
    "ModelResolveError": "errors",
    "ModelRunner": "runner",
    "Policy": "policy",
    "PolicyError": "policy",
    "Reply": "session",
    "SCORERS": "scorers",
    "ScoreContext": "scorers",
    "Scorer": "scorers",
    "Session": "session",
    "SessionStore": "store",
    "SnapKV": "press",
    "SnapKVError": "errors",
    "SpanAware": "scorers",
    "StreamingLLM": "scorers",
    "TurnResult": "runner",
    "UnsupportedModelError": "errors",
    "layer_budgets": "press",
    "load_model": "models",
    "register_scorer": "scorers",
    "resolve_model": "models",
    "select_positions": "press",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'snapkv_sessions' has no attribute {name!r}")
    module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
    return getattr(module, name)
