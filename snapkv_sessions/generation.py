"""Decoding settings and the token sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode a reply.

    Parameters
    ----------
    max_new_tokens: hard cap on generated tokens (>= 1)
    temperature: 0 for greedy; > 0 samples
    top_k: keep the k most likely tokens before sampling (0 = all)
    top_p: nucleus sampling mass in (0, 1]
    seed: seeds the sampler's own ``torch.Generator``, so a seeded reply is reproducible
    stop: stop strings; decoding stops once the reply text contains one (the caller trims the text)
    eos_token_ids: end-of-sequence ids; ``None`` takes the model's generation config
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", self.max_new_tokens, "must be >= 1")
        if self.temperature < 0:
            raise ConfigError("temperature", self.temperature, "must be >= 0")
        if self.top_k < 0:
            raise ConfigError("top_k", self.top_k, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", self.top_p, "must be in (0, 1]")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("stop", self.stop, "stop strings must be non-empty")

    def record(self) -> dict:
        """The stored form (the turn's ``generation``): enough to decode the same reply again."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed, "stop": list(self.stop)}

    @classmethod
    def from_call(cls, kwargs: dict) -> GenerationConfig:
        """From a ``chat(**kwargs)`` call: a clear error for an unknown parameter, a seed drawn (and so
        recorded) for a sampled reply, so that every turn can be re-executed."""
        kwargs = dict(kwargs)
        if isinstance(kwargs.get("stop"), (list, str)):
            kwargs["stop"] = (kwargs["stop"],) if isinstance(kwargs["stop"], str) else tuple(kwargs["stop"])
        unknown = sorted(set(kwargs) - {"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop"})
        if unknown:
            raise ConfigError(unknown[0], kwargs[unknown[0]], "is not a generation parameter")
        if kwargs.get("temperature", 0) > 0 and kwargs.get("seed") is None:
            kwargs["seed"] = random.randrange(2**31)
        return cls(**kwargs)

    @classmethod
    def from_record(cls, record: dict) -> GenerationConfig:
        return cls(**{**record, "stop": tuple(record.get("stop") or ())})


class Sampler:
    """Picks the next token from logits according to a :class:`GenerationConfig`."""

    def __init__(self, cfg: GenerationConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.generator: torch.Generator | None = None
        if cfg.temperature > 0:
            self.generator = torch.Generator(device=device)
            if cfg.seed is not None:
                self.generator.manual_seed(cfg.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits : (V,) for the next position."""
        if self.generator is None:
            return int(logits.argmax())
        scores = logits.float() / self.cfg.temperature  # (V,)
        if self.cfg.top_k:
            kth = scores.topk(min(self.cfg.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.cfg.top_p < 1.0:
            sorted_scores, order = scores.sort(descending=True)  # (V,)
            cum = sorted_scores.softmax(-1).cumsum(-1)  # (V,)
            drop = cum - sorted_scores.softmax(-1) >= self.cfg.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)  # (V,)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def stream_text(tokenizer, token_ids: Iterable[int]) -> Iterator[str]:
    """Turn a token iterator into text pieces, never splitting a multi-byte character."""
    ids: list[int] = []
    emitted = ""
    for tok in token_ids:
        ids.append(tok)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            continue
        if len(text) > len(emitted):
            yield text[len(emitted) :]
            emitted = text
