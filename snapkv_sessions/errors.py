"""Errors raised by snapkv-sessions.

Every error names the parameter (or field) and the value that caused it, so that a caller never has to read a
torch traceback to find out what was wrong.
"""

from __future__ import annotations

import reprlib


class SnapKVError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(SnapKVError, ValueError):
    """A parameter or configuration field has a value the engine cannot use.

    Parameters
    ----------
    param:
        The parameter or field path, for example ``"budget"`` or ``"compression.window"``.
    value:
        The offending value.
    reason:
        Why the value is rejected.
    """

    def __init__(self, param: str, value: object, reason: str) -> None:
        self.param = param
        self.value = value
        self.reason = reason
        super().__init__(f"{param}={bounded_repr(value)}: {reason}")


REPR_LIMIT = 200  # characters of a rejected value an error message shows


def bounded_repr(value: object, limit: int = REPR_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters (with the full length named): an error message stays short
    whatever the input (a 2 MB message, a YAML alias bomb)."""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        text = _SHORT.repr(value)  # reprlib never expands a huge or deeply shared container
    else:
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - a value whose repr fails is still named
            text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple, _SHORT.maxstring = 4, 20, 20, 20, 300


class UnsupportedModelError(SnapKVError, ValueError):
    """The model cannot be driven by the engine (no rotary positions, sliding-window layers, ...)."""


class BudgetError(ConfigError):
    """The pinned positions alone do not fit in the budget of some layer."""


class ModelResolveError(SnapKVError, RuntimeError):
    """A model name, path or bundle could not be resolved into a loadable folder."""


class PlanError(SnapKVError, LookupError):
    """A recorded turn plan does not match the stored messages (they were altered), or has no plan."""
