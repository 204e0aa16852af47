"""A warm start: the first request is served as fast as the second.

What a first request initialises on its own (the model's weights paged in from the memory-mapped file, oneDNN's
kernels chosen per shape, the allocator's pools, the tokenizer's and the chat template's compiled paths, the drift
embedder loaded, the batched step's buffers) happens at start-up instead, by serving a throwaway session the same
way a request would: a long first turn (prefilled in the server's chunks, compressed, decoded a few tokens in a
decode slot) and a short follow-up (the tier, the follow-up check). It runs on a private SQLite store in a
temporary folder that is deleted after, so the server's store never sees it, and it is bounded: ``tokens`` caps
the document, ``max_new_tokens`` the replies.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..session import Session
from ..store import SessionStore

MAX_WARM_TOKENS = 8192  # a warm-up longer than this would delay start-up for little more warmth


@dataclass(frozen=True)
class WarmReport:
    """What the warm start did: the document's tokens and each turn's wall time, in order (the first turn pays
    for whatever was not initialised yet; the second shows the path warm)."""

    tokens: int
    turn_s: list[float] = field(default_factory=list)
    total_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        turns = ", ".join(f"{s:.1f} s" for s in self.turn_s)
        return f"warm start: a {self.tokens}-token document and a follow-up ({turns}) in {self.total_s:.1f} s"


def document(tokenizer, tokens: int) -> str:
    """A delivery log of about ``tokens`` tokens (never more): plain lines, varied so nothing repeats exactly."""
    cities = ("Lisbon", "Porto", "Madrid", "Lyon", "Turin", "Ghent", "Bremen", "Gdansk", "Tallinn", "Cork")
    lines: list[str] = []
    n = 0
    while True:
        i = len(lines)
        line = (f"Parcel {1000 + 7 * i}: left the {cities[i % len(cities)]} depot at "
                f"{8 + i % 10:02d}:{(13 * i) % 60:02d}, {2 + i % 9} items, {(37 * i) % 90 + 10}.{i % 100:02d} EUR.")
        cost = len(tokenizer(line + "\n", add_special_tokens=False)["input_ids"])
        if n + cost > tokens:
            return "\n".join(lines)
        lines.append(line)
        n += cost


def warm_up(runner, model_id: str, policy, release: Callable[[Session], None], tokens: int = 1024,
            max_new_tokens: int = 4) -> WarmReport:
    """Serve a throwaway two-turn session on ``runner`` (the server's own, the scheduler's view when it batches)
    under ``policy``, then ``release`` it as the server lets a session go; nothing reaches the server's store."""
    if not 1 <= tokens <= MAX_WARM_TOKENS:
        raise ConfigError("warm_tokens", tokens, f"must be in 1..{MAX_WARM_TOKENS}")
    limit = policy.limits.max_document_tokens
    tokens = min(tokens, limit) if limit is not None else tokens
    folder = Path(tempfile.mkdtemp(prefix="snapkv-warm-"))
    t0 = time.perf_counter()
    turn_s: list[float] = []
    store = SessionStore(str(folder / "warm.db"))
    try:
        session = Session.create_on(runner, model_id, policy, store, {"title": "warm start"})
        doc = document(runner.tokenizer, tokens)
        for msg in (f"{doc}\n\nWhich parcel left the Lisbon depot first?", "And the last one?"):
            t = time.perf_counter()
            session.chat(msg, max_new_tokens=max_new_tokens)
            turn_s.append(round(time.perf_counter() - t, 2))
        release(session)
    finally:
        store.close()
        shutil.rmtree(folder, ignore_errors=True)
    return WarmReport(len(runner.tokenizer(doc, add_special_tokens=False)["input_ids"]), turn_s,
                      round(time.perf_counter() - t0, 2))
