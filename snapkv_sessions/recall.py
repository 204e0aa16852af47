"""Decode-time recall from the cold tier: two-stage attention, so decode reads what each step needs.

SnapKV's hot set is one guess, made from the observation window before decode starts. On a tiered session the
evicted tokens are still held, exactly, in the host tier (:class:`~snapkv_sessions.tier.ColdKV`). At every
decode step, per layer and KV head, a :class:`Selector` scores the cold slots with the step's query (the query
heads of a GQA group reduced by their max: a slot any of them reaches for is recalled), the top ``k`` come back,
and attention runs one exact softmax over the hot slots (this turn's decoded tokens among them) and the recalled
ones (:func:`snapkv_sessions.attention.causal_sdpa`). Recalling every cold slot is full attention; recalling
none is the tiered decode as before.

Selectors, by registry key (:func:`register_selector` adds one):

* ``"exact"``: full dot products over the cold keys (the reference; reads every cold key per step);
* ``"sparq"``: SparQ's approximation (Ribar et al., 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference",
  arXiv:2312.04985): the ``channels`` largest components of ``|q|`` score every cold key on those channels only,
  then the top ``k`` are attended exactly (reads ``channels / D`` of the cold keys);
* ``"pages"``: Quest's bounds (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
  Inference", arXiv:2406.10774): the cold slots of each head in pages of ``page`` consecutive slots, each page
  summarised by its keys' per-channel min and max; a page's bound ``sum_d max(q_d min_d, q_d max_d)`` ranks it
  and the best ``ceil(k / page)`` pages come back whole (the summary is ``2 / page`` of the cold keys: what
  would stay on a device while the tier stays on the host);
* ``"lowrank"``: ShadowKV's observation (Sun et al., 2024, "ShadowKV: KV Cache in Shadows for High-Throughput
  Long-Context LLM Inference", arXiv:2410.21465) that a head's keys before RoPE are close to low rank: per cold
  layer and turn, the cold keys with their rotation undone (:class:`~snapkv_sessions.rotary.Rotary`) are fitted
  at rank ``rank`` (their top right singular vectors), ``A (C, r) @ V (r, D)``; each step rebuilds the
  approximate keys from it and scores the query on them as rotated back to their true positions, then attends to
  the top ``k`` exactly (the summary is ``r / D`` of the cold keys plus ``r x D`` per head: the compact one that
  ranks well; on a host, the cos and sin of every cold slot are kept for the turn too, in fp32).

Where the bytes live: on a CPU the tier is host memory and a recall is a direct gather. On CUDA the cold part
is page-locked host memory; this module gathers it where it lies (the device copy of recalled pages, and a
device cache of recently recalled ones, are not built: no GPU was lent to measure them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .cache import gather_slots
from .config import BUILTIN_SELECTORS, RecallConfig
from .errors import ConfigError
from .rotary import Rotary


class Selector(Protocol):
    """Chooses, for one layer's decode step, the cold slots each KV head recalls."""

    def choose(self, query: torch.Tensor, keys: torch.Tensor, real: torch.Tensor | None, k: int,
               positions: torch.Tensor) -> torch.Tensor:
        """Slots to recall.

        Parameters
        ----------
        query : (B, Hkv, G, D) the step's query, grouped by KV head (post-RoPE)
        keys : (B, Hkv, C, D) the layer's cold keys (post-RoPE)
        real : (B, Hkv, C) bool, False at padding slots of heads keeping uneven counts (never recalled), or None
        k : slots to recall per head, 1 <= k <= C
        positions : (B, Hkv, C) long, each cold slot's true position

        Returns
        -------
        (B, Hkv, K) long slot indices into ``keys``, and (B, Hkv, K) bool: which of them to attend to (False: a
        head with fewer real slots than K). Deterministic for the same inputs (replay re-executes it).
        """
        ...

    def summary_bytes(self, keys: torch.Tensor) -> int:
        """Bytes of one layer's cold tier the selector needs where it scores (on a device, what would stay there):
        its summary, or the cold keys themselves for a selector that scores them."""
        ...

    def read_bytes(self, keys: torch.Tensor, k: int) -> int:
        """Bytes one step reads of one layer's cold tier to choose (not counting the recalled slots)."""
        ...


def _top(scores: torch.Tensor, real: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` of ``scores`` (B, Hkv, C) per head, padding never chosen: (indices, attend) (B, Hkv, k), in no
    particular order (attention sums over them; unsorted is a third faster and as deterministic)."""
    if real is not None:
        scores = scores.masked_fill(~real, float("-inf"))
    best = scores.topk(k, dim=-1, sorted=False)  # (B, Hkv, k)
    return best.indices, best.values > float("-inf")


def slot_mask(idx: torch.Tensor, attend: torch.Tensor, cold: int) -> torch.Tensor:
    """(B, Hkv, C) bool: the slots ``idx`` (B, Hkv, K) where ``attend``. A slot may repeat in ``idx`` (a short last
    page is padded with the last slot, not attended): counted, not scattered, so a repeat never hides it."""
    hits = torch.zeros(*idx.shape[:2], cold, dtype=torch.int16, device=idx.device)  # (B, Hkv, C)
    return hits.scatter_add_(-1, idx, attend.to(torch.int16)) > 0


class SlotSelector:
    """A selector that scores every cold slot for every query head (:meth:`logits`); :meth:`choose` takes the top
    ``k`` by the group's max. :class:`Recall` can also weigh the same scores by attention mass (``reduce: mass``)."""

    def logits(self, query: torch.Tensor, keys: torch.Tensor, real: torch.Tensor | None,
               positions: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, G, C): each query head's estimate of ``q . k`` for every cold slot (unscaled, as the exact dot
        product would be), same arguments as :meth:`Selector.choose`."""
        raise NotImplementedError

    def choose(self, query, keys, real, k, positions):
        return _top(self.logits(query, keys, real, positions).amax(dim=2), real, k)  # max over the group


@dataclass(frozen=True)
class Exact(SlotSelector):
    """Every cold key scored by the step's query: the reference selector."""

    def logits(self, query, keys, real, positions):
        return torch.einsum("bhgd,bhcd->bhgc", query, keys.to(query.dtype))  # (B, Hkv, G, C)

    def summary_bytes(self, keys: torch.Tensor) -> int:
        return keys.numel() * keys.element_size()  # it scores every cold key

    def read_bytes(self, keys: torch.Tensor, k: int) -> int:
        return keys.numel() * keys.element_size()


@dataclass(frozen=True)
class SparQ(SlotSelector):
    """SparQ's first stage: score on the ``channels`` largest components of the group's ``|q|``."""

    channels: int = 16

    def partial(self, query: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The products on the group's ``channels`` strongest channels (B, Hkv, G, C), and each query head's share
        of its ``|q|`` those channels carry (B, Hkv, G)."""
        r = min(self.channels, query.shape[-1])
        dims = query.abs().sum(dim=2).topk(r, dim=-1).indices  # (B, Hkv, r) the head's strongest channels
        q_r = query.gather(-1, dims[:, :, None].expand(-1, -1, query.shape[2], -1))  # (B, Hkv, G, r)
        k_r = keys.gather(-1, dims[:, :, None].expand(-1, -1, keys.shape[2], -1)).to(query.dtype)  # (B, Hkv, C, r)
        kept = q_r.abs().sum(-1) / query.abs().sum(-1).clamp_min(1e-12)  # (B, Hkv, G)
        return torch.einsum("bhgr,bhcr->bhgc", q_r, k_r), kept

    def choose(self, query, keys, real, k, positions):
        return _top(self.partial(query, keys)[0].amax(dim=2), real, k)  # the partial products, as SparQ ranks

    def logits(self, query, keys, real, positions):
        partial, kept = self.partial(query, keys)  # (B, Hkv, G, C), (B, Hkv, G)
        # SparQ's temperature: the partial products stand in for the full one scaled by sqrt(||q||_1 / ||q_r||_1)
        return partial * kept.clamp_min(1e-12).rsqrt()[..., None]  # (B, Hkv, G, C)

    def summary_bytes(self, keys: torch.Tensor) -> int:
        return keys.numel() * keys.element_size()  # the channels change every step: every cold key is needed

    def read_bytes(self, keys: torch.Tensor, k: int) -> int:
        return keys.numel() * keys.element_size() * min(self.channels, keys.shape[-1]) // keys.shape[-1]


def page_slots(pages: torch.Tensor, page: int, cold: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of whole ``pages`` (B, Hkv, n) of ``page`` consecutive cold slots, out of ``cold``: (slots,
    attend) (B, Hkv, n * page), ``attend`` False past the last slot (the last page may be short)."""
    slots = (pages[..., None] * page + torch.arange(page, device=pages.device)).flatten(2)  # (B, Hkv, n*page)
    return slots.clamp(max=cold - 1), slots < cold


@dataclass
class Pages:
    """Quest's page bounds over the cold slots of each head; the best pages are recalled whole."""

    page: int = 16
    # the summaries already built: (the cold keys they summarise, low, high); the tier replaces a cold layer
    # whole and never writes one in place, so the keys tensor itself says whether a summary is current
    _memo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)

    def bounds(self, keys: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per page the keys' min and max per channel, (B, Hkv, Np, D) each; padding slots left out. Built once
        per cold layer and turn."""
        for held, low, high in self._memo:
            if held is keys:
                return low, high
        bsz, heads, cold, dim = keys.shape
        n_pages = -(-cold // self.page)
        pad = n_pages * self.page - cold
        k = keys.float()
        ok = torch.ones(bsz, heads, cold, dtype=torch.bool, device=keys.device) if real is None else real
        if pad:
            k = torch.cat([k, k.new_zeros(bsz, heads, pad, dim)], dim=2)  # (B, Hkv, Np * page, D)
            ok = torch.cat([ok, ok.new_zeros(bsz, heads, pad)], dim=2)
        k = k.view(bsz, heads, n_pages, self.page, dim)  # (B, Hkv, Np, page, D)
        ok = ok.view(bsz, heads, n_pages, self.page, 1)
        low = k.masked_fill(~ok, float("inf")).amin(dim=3)  # (B, Hkv, Np, D)
        high = k.masked_fill(~ok, float("-inf")).amax(dim=3)  # (B, Hkv, Np, D)
        self._memo.append((keys, low, high))
        return low, high

    def choose(self, query, keys, real, k, positions):
        low, high = self.bounds(keys, real)  # (B, Hkv, Np, D)
        q = query.float()[:, :, :, None]  # (B, Hkv, G, 1, D)
        bound = torch.maximum(q * low[:, :, None], q * high[:, :, None]).sum(-1).amax(dim=2)  # (B, Hkv, Np)
        bound = bound.nan_to_num(nan=float("-inf"))  # a page of padding alone: inf * 0
        n_pages = min(-(-k // self.page), bound.shape[-1])
        pages = _top(bound, None, n_pages)[0]  # (B, Hkv, n)
        slots, attend = page_slots(pages, self.page, keys.shape[2])  # (B, Hkv, n*page) each
        if real is not None:
            attend &= real.gather(-1, slots)
        return slots, attend

    def summary_bytes(self, keys: torch.Tensor) -> int:
        n_pages = -(-keys.shape[2] // self.page)
        return 2 * keys.shape[0] * keys.shape[1] * n_pages * keys.shape[-1] * keys.element_size()

    def read_bytes(self, keys: torch.Tensor, k: int) -> int:
        return self.summary_bytes(keys)


@dataclass
class LowRank(SlotSelector):
    """A rank-``rank`` fit of each head's cold keys before RoPE; each step scores on the keys it rebuilds."""

    rank: int = 16
    rotary: Rotary | None = None
    # (the cold keys summarised, A, V, cos/sin at their positions); current while the keys tensor is (as Pages)
    _memo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]] = field(default_factory=list, repr=False)

    def factors(self, keys: torch.Tensor, real: torch.Tensor | None,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        """``A`` (B, Hkv, C, r) and ``V`` (B, Hkv, r, D) with ``A @ V`` the best rank-r fit of the pre-RoPE cold
        keys (padding slots fitted as zeros: they repeat a real slot), and the cos/sin at the slots' positions
        (None without a rotary). Built once per cold layer and turn."""
        for held, a, v, cos_sin in self._memo:
            if held is keys:
                return a, v, cos_sin
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(positions, keys.shape[-1])
        pre = keys.float()  # (B, Hkv, C, D)
        if cos_sin is not None:
            pre = self.rotary.apply(pre, positions, inverse=True, cos_sin=cos_sin)
        if real is not None:
            pre = pre.masked_fill(~real[..., None], 0.0)
        # the top right singular vectors from the D x D Gram matrix's eigenvectors: the same fit as an SVD of the
        # tall C x D keys, at a seventh of its time (it is built once per cold layer and turn)
        r = min(self.rank, *pre.shape[-2:])
        _, vecs = torch.linalg.eigh(pre.transpose(-1, -2) @ pre)  # (B, Hkv, D, D), eigenvalues ascending
        v = vecs[..., -r:].flip(-1).transpose(-1, -2).contiguous()  # (B, Hkv, r, D) the r strongest directions
        a = pre @ v.transpose(-1, -2)  # (B, Hkv, C, r) the keys' coordinates on them
        self._memo.append((keys, a, v, cos_sin))
        return a, v, cos_sin

    def logits(self, query, keys, real, positions):
        a, v, cos_sin = self.factors(keys, real, positions)
        approx = a @ v  # (B, Hkv, C, D) the pre-RoPE keys, rebuilt
        if cos_sin is None:
            return query.float() @ approx.transpose(-1, -2)  # (B, Hkv, G, C)
        return self.rotary.scores(query, approx, positions, cos_sin)  # (B, Hkv, G, C) as if rotated to their positions

    def summary_bytes(self, keys: torch.Tensor) -> int:
        bsz, heads, cold, dim = keys.shape
        r = min(self.rank, cold, dim)
        return bsz * heads * (cold * r + r * dim) * keys.element_size()  # A and V, in the cache's dtype

    def read_bytes(self, keys: torch.Tensor, k: int) -> int:
        return self.summary_bytes(keys)


SelectorFactory = Callable[[RecallConfig, Rotary | None], Selector]
SELECTORS: dict[str, SelectorFactory] = {}


def register_selector(name: str, factory: SelectorFactory, *, replace: bool = False) -> None:
    """Make ``memory.recall.selector: name`` build ``factory(recall_config, rotary)`` (``rotary``: the model's
    :class:`~snapkv_sessions.rotary.Rotary`, or None)."""
    if not name or not isinstance(name, str):
        raise ConfigError("memory.recall.selector", name, "a selector key must be a non-empty string")
    if name in SELECTORS and not replace:
        raise ConfigError("memory.recall.selector", name, "is already registered; pass replace=True to override it")
    SELECTORS[name] = factory


register_selector("exact", lambda cfg, rotary: Exact())
register_selector("sparq", lambda cfg, rotary: SparQ(cfg.channels))
register_selector("pages", lambda cfg, rotary: Pages(cfg.page))
register_selector("lowrank", lambda cfg, rotary: LowRank(cfg.rank, rotary))
assert tuple(SELECTORS) == BUILTIN_SELECTORS, "config.BUILTIN_SELECTORS must name the built-in selectors"

__all__ = ["SELECTORS", "BatchRecall", "ColdAttention", "Exact", "HotKeys", "LowRank", "PageMeans", "Pages", "Recall",
           "RecallConfig", "RecallStats", "Recalled", "SlotSelector", "SparQ", "attention_mass", "gather_slots",
           "page_slots", "register_selector", "slot_mask", "tail_estimate"]


@dataclass
class RecallStats:
    """What one turn's decode recalled (reset when the turn starts).

    steps: decode steps that recalled; recalled: slots recalled and attended, all steps, layers and heads;
    max_step: the most recalled in one step (all layers and heads); repeats: recalled slots that the same layer
    and head also recalled the step before (what a device cache of the last step's recalls would have hit);
    read_*: bytes read per step, summed over steps: the hot cache, the selector's reads of the tier (its
    summary, or the cold keys it scores), and the recalled keys and values; escalated: steps taken again over
    the whole history (``escalate``), refed: the tokens those retakes fed again (each step's own included),
    read_escalated: what the retakes read (the hot cache and every cold key and value, once each), summed.
    """

    steps: int = 0
    recalled: int = 0
    max_step: int = 0
    repeats: int = 0
    read_hot: int = 0
    read_select: int = 0
    read_recalled: int = 0
    escalated: int = 0
    refed: int = 0
    read_escalated: int = 0
    distinct: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, Hkv, C) recalled this turn
    last: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, Hkv, C) recalled last step

    def to_dict(self) -> dict:
        steps = max(self.steps, 1)
        distinct = sum(int(m.sum()) for m in self.distinct.values())
        return {"steps": self.steps, "recalled_per_step": round(self.recalled / steps, 1),
                "recalled_max_step": self.max_step, "distinct_recalled": distinct,
                "repeat_rate": round(self.repeats / self.recalled, 4) if self.recalled else None,
                "read_bytes_per_step": {"hot": self.read_hot // steps, "select": self.read_select // steps,
                                        "recalled": self.read_recalled // steps}}


@dataclass(frozen=True)
class Recalled:
    """What one layer's decode step recalls from the tier, for the attention function
    (:func:`snapkv_sessions.attention.with_recalled`).

    keys, values : (B, Hkv, K, D) the recalled slots, in the query's dtype
    attend : (B, Hkv, 1, K) bool, which of them each head attends to
    tail_values : (B, Hkv, G, D) or None: per query head of a group, the estimated mean value of the cold slots
        not recalled, weighted by the attention each would get (``tail: pages``)
    tail_logit : (B, Hkv, G) fp32 or None: the log of their total unnormalised attention (the logsumexp of their
        scaled logits), -inf where nothing is left out; one more slot per query head with this logit and that
        value stands for all of them in the softmax
    """

    keys: torch.Tensor
    values: torch.Tensor
    attend: torch.Tensor
    tail_values: torch.Tensor | None = None
    tail_logit: torch.Tensor | None = None


@dataclass
class PageMeans:
    """Each page of ``page`` consecutive cold slots summarised by its mean value: the tail's estimate of the value
    of any slot in it (built once per cold layer and turn, like :class:`Pages`' bounds)."""

    page: int = 32
    _memo: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)

    def means(self, values: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """(B, Hkv, Np, D) fp32: the mean over each page's real slots (0 for a page of padding alone)."""
        for held, means in self._memo:
            if held is values:
                return means
        bsz, heads, cold, dim = values.shape
        n_pages = -(-cold // self.page)
        pad = n_pages * self.page - cold
        ok = torch.ones(bsz, heads, cold, device=values.device) if real is None else real.float()  # (B, Hkv, C)
        v = values.float() * ok[..., None]  # (B, Hkv, C, D) padding slots zeroed
        v = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(bsz, heads, n_pages, self.page, dim)
        count = torch.nn.functional.pad(ok, (0, pad)).view(bsz, heads, n_pages, self.page).sum(-1)  # (B, Hkv, Np)
        means = v.sum(dim=3) / count.clamp_min(1.0)[..., None]  # (B, Hkv, Np, D)
        self._memo.append((values, means))
        return means

    def nbytes(self, values: torch.Tensor) -> int:
        """Bytes of the summary, in the cache's dtype: what would stay on a device."""
        bsz, heads, cold, dim = values.shape
        return bsz * heads * -(-cold // self.page) * dim * values.element_size()


def tail_estimate(att: ColdAttention, recalled: torch.Tensor, means: torch.Tensor,
                  page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cold slots a step leaves out, as one slot per query head: (values (B, Hkv, G, D), logit (B, Hkv, G)).

    att: the step's :class:`ColdAttention` (padding already weighs 0); recalled (B, Hkv, C) bool, the slots
    attended exactly; means (B, Hkv, Np, D) :class:`PageMeans`. A left-out slot ``i`` would take ``exp(s_i)`` of
    the softmax's sum (``s_i`` its scaled logit) and add ``exp(s_i) v_i``; with ``v_i`` its page's mean, their sum
    is ``exp(logit) * values``. Exact when the logits are and ``page`` is 1."""
    bsz, heads, group, cold = att.weights.shape
    left = att.weights * ~recalled[:, :, None]  # (B, Hkv, G, C) exp(s - top) of the tail's slots
    total = left.sum(-1)  # (B, Hkv, G)
    logit = att.top + total.log()  # (B, Hkv, G): -inf when nothing is left out
    whole = cold // page * page
    per_page = left[..., :whole].unflatten(-1, (whole // page, page)).sum(-1)  # (B, Hkv, G, whole pages)
    if whole < cold:  # the last page is short
        per_page = torch.cat([per_page, left[..., whole:].sum(-1, keepdim=True)], dim=-1)  # (B, Hkv, G, Np)
    values = torch.einsum("bhgp,bhpd->bhgd", per_page, means) / total.clamp_min(1e-30)[..., None]  # (B, Hkv, G, D)
    return values, logit


class Recall:
    """The recall of one session's decode: per layer, the cold slots each KV head's step query reaches for.

    Built by the tiered cache for its decode forwards (:meth:`~snapkv_sessions.tier.TieredCache.recall`) and
    read by the attention function (``snapkv_recall=``): :meth:`extra` returns the recalled keys and values.
    ``observer(layer, positions)`` (tests, the audit) gets each step's recalled true positions (B, Hkv, K), -1
    where a head attends to fewer.
    """

    def __init__(self, cfg: RecallConfig, cold, stats: RecallStats, rotary: Rotary | None = None,
                 decode_start: int = 0) -> None:
        self.cfg, self.cold, self.stats = cfg, cold, stats
        self.selector = SELECTORS[cfg.selector](cfg, rotary)
        for param, value, wants in (("reduce", cfg.reduce, "mass"), ("tail", cfg.tail, "pages")):
            if value == wants and not callable(getattr(self.selector, "logits", None)):
                raise ConfigError(f"memory.recall.{param}", value,
                                  f"needs a selector with per-slot logits; {cfg.selector!r} has none")
        self.tail = PageMeans(cfg.tail_page) if cfg.tail == "pages" else None
        self.context = 0  # true positions at this step (set by the cache before each step)
        self.observer: Callable[[int, torch.Tensor], None] | None = None
        self._step_total = 0
        # the first true position whose KV decode computed under recall: everything before it is exact (the
        # prefill's, or fed again by a retake); decode starts where the prefill ended
        self.exact_until = decode_start

    def begin_step(self, context: int, hot_bytes: int) -> None:
        self.end()  # the previous step's total counts toward the most recalled in one step
        self._step_total = 0
        self.context = context
        self.stats.steps += 1
        self.stats.read_hot += hot_bytes

    def retake(self, logits: torch.Tensor) -> bool:
        """Whether the step that gave ``logits`` (V,) must be taken again over the whole history: its two best
        logits are within ``escalate`` of each other, a near-tie that the selection's error, or the approximate KV
        of the tokens decoded since the last exact point, could flip. The caller then feeds those tokens and the
        step's own again as a prefill over hot and cold (:meth:`~snapkv_sessions.tier.TieredCache.rewind_decoded`),
        which makes the step the full cache's."""
        margin = self.cfg.escalate
        if margin is None or logits.shape[-1] < 2:
            return False
        top = logits.float().topk(2).values  # (2,)
        return float(top[0] - top[1]) < margin

    def retaken(self, tokens: int, hot_bytes: int) -> None:
        """Count a retake that feeds ``tokens`` again (the step's own included) over the hot cache and the whole
        tier, and move the exact point past them."""
        stats = self.stats
        stats.escalated += 1
        stats.refed += tokens
        stats.read_escalated += hot_bytes + self.cold.nbytes
        self.exact_until += tokens

    def end(self) -> None:
        self.stats.max_step = max(self.stats.max_step, self._step_total)

    def report(self) -> dict:
        """The turn's figures for its record: the stats, the selector, and the bytes of the cold tier the selector
        needs where it scores (its summary, or the cold keys: what would stay on a device)."""
        self.end()
        held = sum(self.selector.summary_bytes(part.keys) + (0 if self.tail is None else self.tail.nbytes(part.values))
                   for part in self.cold.layers if part is not None)
        tail = {} if self.tail is None else {"tail_page": self.tail.page}
        out = {**self.stats.to_dict(), "summary_bytes": held, "selector": self.cfg.selector, **tail}
        if self.cfg.escalate is not None:  # stated only where a policy escalates: earlier records stay as they were
            stats = self.stats
            out["escalated"], out["refed"] = stats.escalated, stats.refed
            out["read_bytes_per_step"]["escalated"] = stats.read_escalated // max(stats.steps, 1)
        return out

    def extra(self, layer: int, query: torch.Tensor, hot: HotKeys | None = None) -> Recalled | None:
        """What ``layer`` recalls this step (:class:`Recalled`); None when the layer has nothing cold, or the budget
        is 0 and the tail is dropped.

        ``query`` (B, Hq, 1, D): the step's query, post-RoPE; ``hot``: the layer's hot keys this step (needed by
        ``reduce: mass``, which normalises each query head's attention over them, and by the tail's estimate,
        for the softmax scale)."""
        part = self.cold.layers[layer]
        if part is None:
            return None
        keys, values = part.keys, part.values  # (B, Hkv, C, D), on the host; the model's device on a CPU
        k = min(self.cfg.slots(self.context), keys.shape[2])
        if k <= 0 and self.tail is None:
            return None
        if (self.cfg.reduce == "mass" or self.tail is not None) and hot is None:
            raise ValueError("reduce: mass and the tail's estimate need the layer's hot keys "
                             "(Recall.extra(..., hot=HotKeys(...)))")
        bsz, n_q, _, dim = query.shape
        heads = keys.shape[1]
        grouped = query.view(bsz, heads, n_q // heads, dim)  # (B, Hkv, G, D)
        cold_keys = keys.to(query.device)
        real = None if part.real is None else part.real.to(query.device)
        positions = part.positions.to(query.device)  # (B, Hkv, C)
        att = None
        if self.cfg.reduce == "max":
            idx, attend = self.selector.choose(grouped, cold_keys, real, max(k, 0), positions)
        if self.cfg.reduce == "mass" or self.tail is not None:
            logits = self.selector.logits(grouped, cold_keys, real, positions)  # (B, Hkv, G, C)
            att = ColdAttention.of(grouped, logits, real, hot)
        if self.cfg.reduce == "mass":
            mass = att.mass()  # (B, Hkv, C)
            idx, attend = _top(mass, real, k) if self.cfg.share == "head" else _top_shared(mass, real, k)
            self.stats.read_select += hot.keys.numel() * hot.keys.element_size()  # the hot keys once more
        recalled = slot_mask(idx, attend, keys.shape[2])  # (B, Hkv, C)
        cold_values = values.to(query.device)
        rec_k = gather_slots(cold_keys, idx).to(query.dtype)  # (B, Hkv, K, D)
        rec_v = gather_slots(cold_values, idx).to(query.dtype)
        self._account(layer, recalled, cold_keys, k)
        tail_values = tail_logit = None
        if self.tail is not None:
            means = self.tail.means(cold_values, real)  # (B, Hkv, Np, D)
            tail_values, tail_logit = tail_estimate(att, recalled, means, self.tail.page)
            tail_values = tail_values.to(query.dtype)  # (B, Hkv, G, D)
            self.stats.read_select += self.tail.nbytes(cold_values)
        if self.observer is not None:
            self.observer(layer, positions.gather(-1, idx).masked_fill(~attend, -1))  # (B, Hkv, K)
        return Recalled(rec_k, rec_v, attend[:, :, None], tail_values, tail_logit)

    def _account(self, layer: int, now: torch.Tensor, keys: torch.Tensor, k: int) -> None:
        """Count one layer's step: ``now`` (B, Hkv, C) bool, the slots it recalled."""
        stats = self.stats
        n = int(now.sum())
        stats.recalled += n
        self._step_total += n
        stats.read_select += self.selector.read_bytes(keys, k)
        stats.read_recalled += 2 * n * keys.shape[-1] * keys.element_size()
        before = stats.last.get(layer)
        if before is not None and before.shape == now.shape:
            stats.repeats += int((before & now).sum())
        stats.last[layer] = now
        seen = stats.distinct.get(layer)
        stats.distinct[layer] = now if seen is None or seen.shape != now.shape else seen | now


@dataclass(frozen=True)
class HotKeys:
    """A layer's hot keys at a decode step, as attention sees them: ``keys`` (B, Hkv, T, D) post-RoPE, ``mask``
    (B, 1 or Hkv, 1, T) bool or None (the keys each row and head may see), ``scaling`` the softmax scale."""

    keys: torch.Tensor
    mask: torch.Tensor | None
    scaling: float

    def row(self, i: int) -> HotKeys:
        """Row ``i`` of a batched step, as that session's own step would see it."""
        return HotKeys(self.keys[i : i + 1], None if self.mask is None else self.mask[i : i + 1], self.scaling)


@dataclass(frozen=True)
class ColdAttention:
    """Each query head's softmax over the hot keys and every cold slot, the cold part kept unnormalised:
    ``weights`` (B, Hkv, G, C) fp32 ``exp(s - top)`` for the scaled logit ``s`` of every cold slot (the selector's
    estimate; 0 at padding), ``top`` (B, Hkv, G) the shift (the largest logit, hot or cold), ``total`` (B, Hkv, G)
    the sum of ``exp(s - top)`` over hot and cold: each head's normaliser. The mass (``reduce: mass``) and the
    tail's estimate (``tail: pages``) both read it, so a step takes the exponentials once."""

    weights: torch.Tensor
    top: torch.Tensor
    total: torch.Tensor

    @classmethod
    def of(cls, query: torch.Tensor, logits: torch.Tensor, real: torch.Tensor | None, hot: HotKeys) -> ColdAttention:
        """query (B, Hkv, G, D); logits (B, Hkv, G, C) unscaled; real (B, Hkv, C) bool or None."""
        s = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # (B, Hkv, G, C)
        torch.mul(logits, hot.scaling, out=s)  # scaled and widened in one pass
        if real is not None:
            s.masked_fill_(~real[:, :, None], float("-inf"))
        # the hot logits in the cache's dtype, widened after: only the normaliser reads them, and widening the
        # hot keys every step would copy the whole hot cache
        warm = (query @ hot.keys.to(query.dtype).transpose(-1, -2)).float().mul_(hot.scaling)  # (B, Hkv, G, T)
        if hot.mask is not None:
            warm.masked_fill_(~hot.mask, float("-inf"))  # (B, 1 or Hkv, 1, T) over the group
        top = torch.maximum(s.amax(-1), warm.amax(-1))  # (B, Hkv, G)
        top = torch.where(top.isfinite(), top, 0.0)  # a head that sees nothing: weights 0, not NaN
        weights = s.sub_(top[..., None]).exp_()  # (B, Hkv, G, C)
        total = weights.sum(-1) + (warm - top[..., None]).exp().sum(-1)  # (B, Hkv, G)
        return cls(weights, top, total)

    def mass(self) -> torch.Tensor:
        """(B, Hkv, C) fp32: the attention probability each cold slot gets, summed over its group's query heads."""
        return (self.total.reciprocal()[:, :, None] @ self.weights).squeeze(2)  # (B, Hkv, 1, G) @ (B, Hkv, G, C)


def attention_mass(query: torch.Tensor, logits: torch.Tensor, real: torch.Tensor | None, hot: HotKeys) -> torch.Tensor:
    """The attention probability each cold slot would get from its GQA group: per query head, a softmax over the
    hot keys (exact) and every cold slot (``logits``, the selector's estimate), summed over the group's heads.

    query (B, Hkv, G, D); logits (B, Hkv, G, C) unscaled; real (B, Hkv, C) bool or None. Returns (B, Hkv, C) fp32,
    0 at padding slots."""
    return ColdAttention.of(query, logits, real, hot).mass()


def _top_shared(scores: torch.Tensor, real: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` times the heads of ``scores`` (B, Hkv, C) over all heads of a row together, padding never
    chosen: (indices, attend) (B, Hkv, W), W the most any head got (``attend`` False past a head's own)."""
    if real is not None:
        scores = scores.masked_fill(~real, float("-inf"))
    bsz, heads, cold = scores.shape
    flat = scores.reshape(bsz, heads * cold)  # (B, Hkv * C)
    best = flat.topk(min(k * heads, heads * cold), dim=-1)  # (B, k * Hkv)
    chosen = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, best.indices, best.values > float("-inf"))
    chosen = chosen.view(bsz, heads, cold)  # (B, Hkv, C)
    width = max(int(chosen.sum(-1).max()), 1)
    return _top(scores.masked_fill(~chosen, float("-inf")), None, width)


class BatchRecall:
    """The recalls of a batched decode step's slots (:mod:`snapkv_sessions.batch`): each slot recalls from its
    own tier (None: a slot without recall); rows are padded to the slot that recalls the most, the padding hidden
    by the mask, so each row equals its session's step taken alone."""

    def __init__(self, recalls: list[Recall | None]) -> None:
        self.recalls = recalls

    def extra(self, layer: int, query: torch.Tensor, hot: HotKeys | None = None) -> Recalled | None:
        """``query`` (n, Hq, 1, D); returns the rows' recalls stacked (keys and values (n, Hkv, K, D), the mask
        (n, Hkv, 1, K), the tails (n, Hkv, G, ...) with logit -inf in a row without one), or None."""
        got = [None if rec is None else rec.extra(layer, query[i : i + 1], None if hot is None else hot.row(i))
               for i, rec in enumerate(self.recalls)]
        present = [g for g in got if g is not None]
        if not present:
            return None
        width = max(g.keys.shape[2] for g in present)
        like = present[0]
        bsz = len(got)
        heads, dim = like.keys.shape[1], like.keys.shape[-1]
        group = query.shape[1] // heads
        keys = like.keys.new_zeros(bsz, heads, width, dim)  # (n, Hkv, K, D)
        values = like.values.new_zeros(bsz, heads, width, like.values.shape[-1])
        attend = torch.zeros(bsz, heads, 1, width, dtype=torch.bool, device=like.keys.device)  # (n, Hkv, 1, K)
        tails = any(g.tail_logit is not None for g in present)
        tail_values = like.values.new_zeros(bsz, heads, group, like.values.shape[-1]) if tails else None
        tail_logit = torch.full((bsz, heads, group), float("-inf"), device=like.keys.device) if tails else None
        for i, g in enumerate(got):
            if g is None:
                continue
            k = g.keys.shape[2]
            keys[i, :, :k], values[i, :, :k], attend[i, :, :, :k] = g.keys[0], g.values[0], g.attend[0]
            if g.tail_logit is not None:
                tail_values[i], tail_logit[i] = g.tail_values[0], g.tail_logit[0]
        return Recalled(keys, values, attend, tail_values, tail_logit)
