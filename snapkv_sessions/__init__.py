"""snapkv-sessions: recoverable per-turn SnapKV compression of a local causal LM's KV cache."""

from .config import CompressionConfig
from .errors import BudgetError, ConfigError, ModelResolveError, SnapKVError, UnsupportedModelError
from .generation import GenerationConfig
from .models import BUNDLES, load_model, resolve_model
from .press import SnapKV, layer_budgets, select_positions
from .report import CompressionReport
from .runner import ModelRunner, TurnResult
from .state import KVState

__all__ = [
    "BUNDLES",
    "BudgetError",
    "CompressionConfig",
    "CompressionReport",
    "ConfigError",
    "GenerationConfig",
    "KVState",
    "ModelResolveError",
    "ModelRunner",
    "SnapKV",
    "SnapKVError",
    "TurnResult",
    "UnsupportedModelError",
    "layer_budgets",
    "load_model",
    "resolve_model",
    "select_positions",
]

__version__ = "0.1.0"
