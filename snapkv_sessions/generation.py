"""Decoding settings and the token sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError
from .store.schema import MAX_SEED


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode a reply.

    Parameters
    ----------
    max_new_tokens: hard cap on generated tokens (>= 1)
    temperature: 0 for greedy; > 0 samples (below :data:`MIN_TEMPERATURE`: greedy as well)
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
        numbers = {"max_new_tokens": (int,), "temperature": (int, float), "top_k": (int,), "top_p": (int, float)}
        for name, kinds in numbers.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ConfigError(name, value, f"must be a number ({' or '.join(k.__name__ for k in kinds)})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ConfigError("seed", self.seed, f"must be an int in 0..{MAX_SEED} or None")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) for s in self.stop):
            raise ConfigError("stop", self.stop, "must be strings")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", self.max_new_tokens, "must be >= 1")
        if not self.temperature >= 0:  # NaN too
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
        temperature = kwargs.get("temperature", 0)
        if isinstance(temperature, (int, float)) and temperature > 0 and kwargs.get("seed") is None:
            kwargs["seed"] = random.randrange(MAX_SEED + 1)
        return cls(**kwargs)

    @classmethod
    def from_record(cls, record: dict) -> GenerationConfig:
        return cls(**{**record, "stop": tuple(record.get("stop") or ())})


MIN_TEMPERATURE = 1e-4
"""Temperatures below this decode greedily (argmax), as 0 does.

Why 1e-4: the float32 softmax of ``logits / T`` gives a token exactly 0 probability once its logit is more than
about ``104 * T`` below the best (``exp(-104)`` is under float32's smallest subnormal). At ``T = 1e-4`` that gap is
0.0104, less than the spacing of bf16 logits anywhere above 2 in magnitude (>= 0.0156), so for a bf16 model every
temperature below the floor already samples the argmax, exact ties aside; for fp16/fp32 logits only tokens within
0.01 of the best could differ: numerical near-ties. Far below the floor ``logits / T`` leaves float32's range
(1e-300 rounds to 0 in float32 and 1e-40 to a subnormal: inf, then NaN); at and above it the quotient stays finite for
any logit under 3.4e34 in magnitude, and past that :meth:`Sampler.__call__` takes its float64 path."""


class Sampler:
    """Picks the next token from logits according to a :class:`GenerationConfig`.

    Safe for every setting the config admits: a temperature below :data:`MIN_TEMPERATURE` (0 included) is greedy,
    top-p always keeps the most likely token, and a distribution that float32 cannot hold (``logits / T`` overflows)
    is taken again in float64 from logits shifted to a maximum of 0; when even that is no distribution (NaN or +inf
    logits) the pick is the argmax. ``torch.multinomial`` only ever sees finite probabilities with a positive sum.

    The generator (seeded from ``cfg.seed``) advances once per multinomial draw and never otherwise: a greedy
    sampler has none, and a greedy fallback draws nothing. Every choice depends on the config and the logits only,
    so a replayed config (:meth:`GenerationConfig.from_record`) decodes the same reply from the same logits.
    For ordinary values the computation is the float32 one, bit for bit, that this class has always done.
    """

    def __init__(self, cfg: GenerationConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.generator: torch.Generator | None = None
        if cfg.temperature >= MIN_TEMPERATURE:
            self.generator = torch.Generator(device=device)
            if cfg.seed is not None:
                self.generator.manual_seed(cfg.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits : (V,) for the next position."""
        if self.generator is None:
            return int(logits.argmax())
        probs = self._probs(logits.float())  # (V,)
        if not _drawable(probs):  # logits / T left float32's range, or the logits hold NaN/inf
            wide = logits.double()  # (V,)
            # the same distribution (softmax is shift-invariant): every score <= 0, so nothing overflows
            probs = self._probs(wide - wide.max())  # (V,)
            if not _drawable(probs):  # no distribution at all (NaN or +inf logits): the likeliest token
                return int(logits.argmax())
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _probs(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (V,) -> the filtered sampling distribution (V,), in the dtype of ``scores``."""
        scores = scores / self.cfg.temperature  # (V,)
        if self.cfg.top_k:
            kth = scores.topk(min(self.cfg.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.cfg.top_p < 1.0:
            sorted_scores, order = scores.sort(descending=True)  # (V,)
            cum = sorted_scores.softmax(-1).cumsum(-1)  # (V,)
            drop = cum - sorted_scores.softmax(-1) >= self.cfg.top_p  # keep the smallest set reaching top_p
            # The most likely token alone reaches any top_p up to its own mass. Compared with a float32 tensor, a
            # top_p under float32's smallest subnormal (1e-300) becomes 0 and would drop every token; otherwise
            # drop[0] is False already (cum[0] - p[0] == 0 < top_p), so this changes nothing.
            drop[0] = False
            scores = scores.scatter(0, order[drop], float("-inf"))
        return scores.softmax(-1)  # (V,)


def _drawable(probs: torch.Tensor) -> bool:
    """Whether ``probs`` (V,) is something multinomial may draw from: softmax output is >= 0 or NaN, so a finite,
    positive sum means every entry is finite (one device sync)."""
    total = probs.sum()
    return bool(torch.isfinite(total) & (total > 0))


class Decoder:
    """One reply being decoded: samples each next token and says when the reply ends (EOS, a stop string, the
    length cap). A driver feeds every token that does not end the reply back to the model and hands the next
    logits to :meth:`accept`: :meth:`ModelRunner.generate` one session at a time, the scheduler
    (:mod:`snapkv_sessions.scheduler`) many in one forward. Both drive this one class, so a reply is the same
    either way.

    Parameters
    ----------
    gen : the decoding settings
    eos : end-of-sequence ids (the model's, unless ``gen.eos_token_ids`` names others)
    tokenizer : needed for stop strings only
    device : where the sampler's generator lives (that of the logits)
    """

    def __init__(self, gen: GenerationConfig, eos: Iterable[int], tokenizer: Any, device: torch.device) -> None:
        if gen.stop and tokenizer is None:
            raise ConfigError("stop", gen.stop, "stop strings need the runner to have a tokenizer")
        self.gen, self.tokenizer = gen, tokenizer
        self.eos = set(gen.eos_token_ids if gen.eos_token_ids is not None else eos)
        self.sample = Sampler(gen, device)
        self.produced: list[int] = []  # the reply so far, end token excluded
        self.last: int | None = None  # the latest sampled token
        self.reason: str | None = None  # "eos", "stop" or "length" once the reply has ended

    @property
    def done(self) -> bool:
        return self.reason is not None

    def accept(self, logits: torch.Tensor) -> int | None:
        """Sample from ``logits`` (V,); returns the token to show, or None for an end token. Once :attr:`done`,
        the last sampled token is not fed to the model: it stays pending for the next turn's prefill."""
        tok = self.last = self.sample(logits)
        if tok in self.eos:
            self.reason = "eos"
            return None
        self.produced.append(tok)
        if self.gen.stop and any(s in self.tokenizer.decode(self.produced, skip_special_tokens=True)
                                 for s in self.gen.stop):
            self.reason = "stop"
        elif len(self.produced) == self.gen.max_new_tokens:
            self.reason = "length"
        return tok


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


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` before the earliest occurrence of any stop string (all of it when none occurs).

    The earliest occurrence over all stops, whatever their order: ``cut_at_stop("abcd", ["cd", "bc"]) == "a"``.
    """
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


class TextStream:
    """Turns decoded token ids, one at a time, into the text that may be shown now.

    Each :meth:`push` decodes every id so far (``skip_special_tokens=True``, exactly as the final reply is
    decoded) and returns the new text that is safe to show: nothing while the decode ends in an incomplete
    UTF-8 sequence (``"\\ufffd"``), nothing at or past a stop string, and nothing of a tail that could still
    grow into a stop string. :meth:`finish` returns the rest, so that the pieces concatenate to
    ``cut_at_stop(decode(ids), stops)`` (then in :attr:`text`).

    The guarantee holds for decoders whose output for ``ids[:k]`` is a prefix of the output for ``ids`` (byte-level
    BPE, as for SmolLM2, Qwen2 and Llama-3); a piece is never emitted that a longer decode contradicts.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...)``)
    stops : stop strings, non-empty
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        if isinstance(stops, str) or any(not isinstance(s, str) or not s for s in stops):
            raise ConfigError("stop", stops, "must be a sequence of non-empty strings")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # shown so far; after finish(), the whole reply as shown
        self.content = ""  # the latest complete decode; after finish(), the whole reply as stored
        self.finished = False

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text newly safe to show ("" when none)."""
        if self.finished:
            raise ConfigError("token_id", token_id, "the stream is finished")
        self.ids.append(int(token_id))
        decoded = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if decoded.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
            return ""
        self.content = decoded
        return self._show(decoded[: self._safe_end(decoded)])

    def finish(self) -> str:
        """The rest of the shown text, once generation is over: the held-back tail that never became a stop."""
        self.content = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.finished = True
        final = cut_at_stop(self.content, self.stops)
        # Every emitted piece was a prefix of the final text (see _safe_end), so only the tail is left to show.
        rest = final[len(self.text):] if final.startswith(self.text) else ""
        self.text = final
        return rest

    @property
    def stopped(self) -> bool:
        """Whether the decode so far contains a stop string."""
        return any(s in self.content for s in self.stops)

    def _show(self, safe: str) -> str:
        if len(safe) <= len(self.text) or not safe.startswith(self.text):
            return ""
        piece, self.text = safe[len(self.text):], safe
        return piece

    def _safe_end(self, decoded: str) -> int:
        """Length of the prefix of ``decoded`` that no continuation can cut: it ends before the first complete stop
        and before any tail that is the start of a stop (which later text could complete)."""
        end = len(decoded)
        for stop in self.stops:
            at = decoded.find(stop)
            if at >= 0:
                end = min(end, at)
            # the longest tail that is a proper prefix of this stop starts earliest
            for k in range(min(len(stop) - 1, len(decoded)), 0, -1):
                if decoded.endswith(stop[:k]):
                    end = min(end, len(decoded) - k)
                    break
        return end
