"""Session audits: what each turn kept and evicted, why re-prefills happened, and whether it reproduces.

The summary functions read the store only (no torch); :func:`verify` and :func:`against_full` re-execute the
session with the model. The ``replay`` CLI command is a thin layer over this module.
"""

from .find import find
from .plot import plot
from .rows import retention_matrix, turn_detail, turn_rows
from .verify import Mismatch, VerifyResult, against_full, verify

__all__ = ["Mismatch", "VerifyResult", "against_full", "find", "plot", "retention_matrix", "turn_detail", "turn_rows",
           "verify"]
