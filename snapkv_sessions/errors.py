"""Errors raised by snapkv-sessions.

Every error names the parameter (or field) and the value that caused it, so that a caller never has to read a
torch traceback to find out what was wrong.
"""

from __future__ import annotations


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
        super().__init__(f"{param}={value!r}: {reason}")


class UnsupportedModelError(SnapKVError, ValueError):
    """The model cannot be driven by the engine (no rotary positions, sliding-window layers, ...)."""


class BudgetError(ConfigError):
    """The pinned positions alone do not fit in the budget of some layer."""


class ModelResolveError(SnapKVError, RuntimeError):
    """A model name, path or bundle could not be resolved into a loadable folder."""


class PlanError(SnapKVError, LookupError):
    """A recorded turn plan does not match the stored messages (they were altered), or has no plan."""
