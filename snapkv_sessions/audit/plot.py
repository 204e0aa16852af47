"""The retention heatmap and drift timeline of a session (matplotlib)."""

from __future__ import annotations

import numpy as np

from ..policy import ROLES
from ..store import SessionStore
from .rows import retention_matrix, turn_rows

ROLE_COLOURS = {"system": "#d62728", "developer": "#ff7f0e", "tool_schema": "#9467bd", "document": "#1f77b4",
                "user": "#2ca02c", "assistant": "#7f7f7f", "tool": "#8c564b"}


def plot(store: SessionStore, session_id: str, path: str, turn: int | None = None, threshold: float | None = None) -> int:
    """Retention heatmap (layer x position, role spans coloured) and drift timeline, as a PNG. Returns the turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    turns = [t for t in store.turns(session_id) if t["kept_positions"] is not None]
    if not turns:
        from ..store import StoreError

        raise StoreError(f"session_id={session_id!r}: no compressed turn to plot")
    turn = turn if turn is not None else turns[-1]["turn"]
    mat, role_at = retention_matrix(store, session_id, turn)
    fig, (ax_heat, ax_roles, ax_drift) = plt.subplots(
        3, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [6, 0.5, 2.5]}, constrained_layout=True)
    im = ax_heat.imshow(mat, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax_heat.set_ylabel("layer")
    ax_heat.set_title(f"session {session_id[:8]}: share of KV heads keeping each position after turn {turn}")
    fig.colorbar(im, ax=ax_heat, fraction=0.02)
    colours = [matplotlib.colors.to_rgb(ROLE_COLOURS.get(r, "#000000")) for r in role_at]
    ax_roles.imshow(np.array(colours)[None], aspect="auto", interpolation="nearest")
    ax_roles.set_yticks([])
    ax_roles.set_xlabel("true position")
    present = [r for r in ROLES if r in set(role_at)]
    ax_roles.legend(handles=[Patch(color=ROLE_COLOURS[r], label=r) for r in present], ncol=len(present),
                    loc="upper center", bbox_to_anchor=(0.5, -1.2), fontsize=8, frameon=False)
    rows = turn_rows(store, session_id)
    xs = [r["turn"] for r in rows if r["drift_score"] is not None]
    ys = [r["drift_score"] for r in rows if r["drift_score"] is not None]
    ax_drift.plot(xs, ys, marker="o", color="#1f77b4", label="drift score")
    re_x = [r["turn"] for r in rows if r["drift_decision"] == "reprefill"]
    re_y = [r["drift_score"] for r in rows if r["drift_decision"] == "reprefill"]
    ax_drift.scatter(re_x, re_y, s=120, facecolors="none", edgecolors="#d62728", label="re-prefill")
    if threshold is not None:
        ax_drift.axhline(threshold, color="#d62728", linestyle="--", linewidth=1, label="threshold")
    ax_drift.set_xlabel("turn")
    ax_drift.set_ylabel("drift")
    ax_drift.set_xticks([r["turn"] for r in rows])
    ax_drift.legend(fontsize=8, loc="upper left")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return turn


# ---------------------------------------------------------------------- re-execution
