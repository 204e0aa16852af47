"""``snapkv-sessions serve``: an OpenAI-compatible HTTP server over sessions (FastAPI, uvicorn, SSE).

Needs the ``serve`` extra: ``pip install 'snapkv-sessions[serve]'``.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import sse_starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"snapkv_sessions.serve needs {exc.name!r}: pip install 'snapkv-sessions[serve]'") from exc

from .app import ServeOptions, create_app
from .service import Capacity, Service, owner_of

__all__ = ["Capacity", "ServeOptions", "Service", "create_app", "owner_of"]
