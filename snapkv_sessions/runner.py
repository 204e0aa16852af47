"""ModelRunner: prefill onto a compressed cache, compress with SnapKV, decode, with true positions.

One conversation per :class:`~snapkv_sessions.state.KVState`, batch size 1. The runner owns no conversation
state itself, so one loaded model serves many states.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from . import attention, interrupts
from .attention import WindowProbe
from .cache import CompactCache, set_layer
from .config import CompressionConfig
from .errors import ConfigError, UnsupportedModelError
from .generation import Decoder, GenerationConfig
from .gpu import fused_gather
from .press import layer_budgets
from .report import CompressionReport
from .scorers import KeepRule, ScoreContext, Scorer, build_scorer, select_layer, word_ids
from .state import KVState
from .tier import ColdKV, UnionView, whole_history
from .transcript import TurnPlan, observation_window, to_ranges


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` is a decoder-only model with rotary positions."""
    cfg = model.config
    kind = getattr(cfg, "model_type", type(model).__name__)
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model={kind!r}: encoder-decoder models are not supported")
    if not any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules()):
        raise UnsupportedModelError(
            f"model={kind!r}: no rotary position embedding found; snapkv-sessions keeps each token's true "
            "position through RoPE and supports rotary decoder-only models (Llama, Qwen2, Mistral families)"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"model={kind!r}: layer_types={sorted(set(layer_types))}; only full-attention layers are supported"
        )
    if not all(hasattr(m, "layer_idx") for m in _attention_modules(model)):
        raise UnsupportedModelError(f"model={kind!r}: attention modules carry no layer_idx")


_TOKENIZER_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokenizer_digest(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary and chat template (once per tokenizer object: hashing a 150K-entry
    vocabulary takes a fraction of a second)."""
    if tokenizer is None:
        return "none"
    try:
        return _TOKENIZER_DIGESTS[tokenizer]
    except (KeyError, TypeError):
        pass
    text = json.dumps([sorted(tokenizer.get_vocab().items()), getattr(tokenizer, "chat_template", None)],
                      default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()
    with contextlib.suppress(TypeError):  # an object that cannot be weakly referenced is hashed every time
        _TOKENIZER_DIGESTS[tokenizer] = digest
    return digest


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


@dataclass
class TurnResult:
    """What :meth:`ModelRunner.run` (or :meth:`ModelRunner.turn`) did."""

    tokens: list[int]  # the reply (decoded, or fed when forced), end token excluded
    stop_reason: str | None  # "eos", "stop", "length"; None when the reply was forced
    report: CompressionReport | None
    prefill_ms: float
    decode_ms: float
    prompt_tokens: int
    prefill_end: int = 0  # true positions in the cache after the prefill: the turn's context
    protect_applied: bool | None = None  # None: no compression ran; else whether the plan's protect fit
    kept: list[torch.Tensor] | None = None  # positions[l] (B, Hkv, K) right after the compression, if it ran


@dataclass(frozen=True)
class Selection:
    """One layer's selection, for an observer (:attr:`ModelRunner.observer`).

    positions (B, Hkv, T): true positions of the layer's slots (the whole history when tiered); scores
    (B, Hkv, T - W): the scorer's scores of the history slots; chosen (B, Hkv, K): the kept slots; keep_mask (N,):
    the positions forced in (pins and this turn's protected question).
    """

    layer: int
    positions: torch.Tensor
    scores: torch.Tensor
    chosen: torch.Tensor
    keep_mask: torch.Tensor


class TurnRun:
    """A turn whose prefill and compression ran: iterate to decode the reply, or :meth:`finish` to run it all.

    With ``forced`` (a recorded reply, replay), those tokens are fed instead of sampled: all but the last
    one are decoded into the cache and the last one is left pending, exactly as the live turn left them.
    """

    def __init__(self, runner: ModelRunner, state: KVState, logits: torch.Tensor, gen: GenerationConfig | None,
                 forced: Sequence[int] | None, result: TurnResult) -> None:
        self.runner, self.state, self.logits, self.gen, self.forced = runner, state, logits, gen, forced
        self.result = result

    def __iter__(self) -> Iterator[int]:
        t0 = time.perf_counter()
        if self.forced is None:
            for tok in self.runner.generate(self.state, self.logits, self.gen):
                self.result.tokens.append(tok)
                yield tok
            self.result.stop_reason = self.state.last_stop_reason
        else:
            for tok in self.forced[:-1]:
                self.runner.step(self.state, tok)
                self.result.tokens.append(tok)
                yield tok
            self.state.pending = [int(t) for t in self.forced[-1:]]
        self.result.decode_ms = (time.perf_counter() - t0) * 1e3

    def finish(self) -> TurnResult:
        for _ in self:
            pass
        return self.result


class ModelRunner:
    """Drives a Hugging Face causal LM over compressed, growing caches.

    Parameters
    ----------
    model:
        A rotary decoder-only ``PreTrainedModel``. The runner switches it to the ``"snapkv"`` attention
        function (registered through ``transformers.AttentionInterface``); :meth:`detach` switches it back.
    tokenizer:
        Optional; needed only for stop strings and text helpers.
    prefill_chunk:
        Prefill long inputs in chunks of this many tokens (exact: the causal mask is built per chunk), which
        bounds the activation memory.
    cache:
        ``"compact"`` (default): :class:`~snapkv_sessions.cache.CompactCache`, preallocated, decode writes in
        place; ``"dynamic"``: transformers' DynamicCache (concatenates at every step).
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, prefill_chunk: int = 4096, cache: str = "compact") -> None:
        if cache not in ("compact", "dynamic"):
            raise ConfigError("cache", cache, "must be 'compact' or 'dynamic'")
        self.cache_kind = cache
        # Set by a Scheduler (snapkv_sessions.scheduler) that serves many sessions on this model: every forward
        # and compression then runs on its thread, and decode steps run batched with other sessions'.
        self.scheduler = None
        # Called after each layer's selection with a Selection (the audit's --find reads the scores through it);
        # None in normal use, which then never computes anything for it.
        self.observer: Callable[[Selection], None] | None = None
        check_supported(model)
        if prefill_chunk < 1:
            raise ConfigError("prefill_chunk", prefill_chunk, "must be >= 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self._original_attn = model.config._attn_implementation
        model.set_attn_implementation(attention.register())
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else cfg.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            (eos,) if eos is not None else ()
        )

    @property
    def fingerprint(self) -> str:
        """What a session is bound to: the architecture's shape and the tokenizer's vocabulary and template.

        Two loads of the same model (by name, folder or object) agree; another model or tokenizer does not.
        """
        cfg = self.model.config
        keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rope_theta", "intermediate_size")
        shape = json.dumps({k: getattr(cfg, k, None) for k in keys}, sort_keys=True, default=str)
        return hashlib.sha256(f"{shape}:{_tokenizer_digest(self.tokenizer)}".encode()).hexdigest()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def detach(self) -> None:
        """Give the model back its original attention implementation."""
        self.model.set_attn_implementation(self._original_attn)

    def new_state(self, tiered: bool = False) -> KVState:
        """An empty conversation state; ``tiered`` keeps what compression evicts in a host tier
        (:mod:`snapkv_sessions.tier`), so every prefill sees the whole history."""
        if self.cache_kind == "compact":
            return KVState(cache=CompactCache(self.num_layers), cold=ColdKV.empty(self.num_layers) if tiered else None)
        if tiered:
            raise ConfigError("cache", self.cache_kind, "the tiered memory needs the 'compact' cache")
        from transformers import DynamicCache

        return KVState(cache=DynamicCache(config=self.model.config))

    # ---------------------------------------------------------------- prefill / decode

    def _serial(self, fn: Callable[[], object]):
        """``fn()``, on the scheduler's thread between two decode steps when one is attached (the model and the
        slots are touched by one thread only); here otherwise."""
        return fn() if self.scheduler is None else self.scheduler.call(fn)

    def _forward(self, state: KVState, ids: list[int], probe: WindowProbe | None, *, whole: bool = False) -> torch.Tensor:
        """Feed ``ids`` at their true positions. ``whole``: a prefill of a tiered state, which attends to the whole
        history (hot and cold); decode reads the hot cache alone."""
        return self._serial(lambda: self._forward_now(state, ids, probe, whole))

    @torch.inference_mode()
    def _forward_now(self, state: KVState, ids: list[int], probe: WindowProbe | None, whole: bool) -> torch.Tensor:
        start = state.next_position
        input_ids = torch.tensor([ids], device=self.device)  # (1, n)
        position_ids = torch.arange(start, start + len(ids), device=self.device)[None]  # (1, n) true positions
        with whole_history(state) if whole else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                cache=state.cache,
                use_cache=True,
                logits_to_keep=1,
                snapkv_probe=probe,
            )
        state.cache = out.cache
        return out.logits[0, -1]  # (V,)

    @torch.inference_mode()
    def prefill(
        self,
        state: KVState,
        ids: Sequence[int],
        *,
        pinned: bool | Sequence[bool] = False,
        window: int | None = None,
    ) -> tuple[torch.Tensor, WindowProbe | None]:
        """Feed ``state.pending`` and then ``ids`` onto the cache at their true positions.

        Parameters
        ----------
        ids: the new tokens
        pinned: ``True`` pins all of ``ids``; a sequence of bools (same length) pins some
        window: observe the last ``window`` queries (for :meth:`compress`); None observes nothing

        Returns
        -------
        The next-token logits (V,), and the probe holding each layer's window scores (or None).
        """
        ids = [int(t) for t in ids]
        flags = [bool(pinned)] * len(ids) if isinstance(pinned, bool) else [bool(p) for p in pinned]
        if len(flags) != len(ids):
            raise ConfigError("pinned", f"{len(flags)} flags", f"must match the {len(ids)} tokens given")
        n_todo = len(state.pending) + len(ids)
        if not n_todo:
            raise ConfigError("ids", ids, "nothing to prefill")
        if window is not None and window > n_todo:
            raise ConfigError("window", window, f"is longer than the prompt ({n_todo} tokens to prefill)")
        pending, pending_flags = state.take_pending()
        todo, todo_flags = pending + ids, pending_flags + flags
        probe = WindowProbe(window, turn_start=state.next_position) if window is not None else None
        # Chunk, keeping the observation window inside the last chunk.
        bounds = list(range(0, len(todo), self.prefill_chunk)) + [len(todo)]
        if probe is not None and len(bounds) > 2 and bounds[-1] - bounds[-2] < window:
            cut = bounds[-1] - window  # >= 0: the window fits the prompt (checked above)
            bounds = [b for b in bounds[:-1] if b < cut] + [cut, bounds[-1]]
        logits = None
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if lo == hi:
                continue
            last = hi == len(todo)
            interrupts.check()  # a deadline or a client gone stops a long prefill between chunks
            logits = self._forward(state, todo[lo:hi], probe if last else None, whole=True)
            state.append(todo[lo:hi], todo_flags[lo:hi], self.num_kv_heads, self.device)
        return logits, probe

    @torch.inference_mode()
    def step(self, state: KVState, token: int) -> torch.Tensor:
        """Feed one token at its true position; returns the next-token logits (V,)."""
        logits = self._forward(state, [token], None)
        state.append([token], [False], self.num_kv_heads, self.device)
        return logits

    def generate(
        self, state: KVState, first_logits: torch.Tensor, gen: GenerationConfig | None = None
    ) -> Iterator[int]:
        """Decode from ``first_logits`` (the prefill's), yielding token ids as they come.

        The end token (EOS) is not yielded. The last sampled token is left in ``state.pending`` (not yet in
        the cache): the next prefill feeds it first, so the transcript stays whole. ``state`` gets
        ``last_stop_reason`` set to ``"eos"``, ``"stop"`` or ``"length"``. With a :attr:`scheduler` attached, the
        steps run batched with other sessions' (the same tokens: one :class:`Decoder` logic either way).
        """
        decoder = Decoder(gen or GenerationConfig(), self.eos_token_ids, self.tokenizer, first_logits.device)
        if self.scheduler is not None:
            yield from self.scheduler.decode(state, first_logits, decoder)
            return
        if isinstance(state.cache, CompactCache):
            state.cache.reserve(decoder.gen.max_new_tokens)  # once: no decode step reallocates
        logits = first_logits
        while True:
            tok = decoder.accept(logits)
            if tok is not None:
                yield tok
            if decoder.done:
                break
            logits = self.step(state, tok)
        state.pending, state.last_stop_reason = [decoder.last], decoder.reason

    # ---------------------------------------------------------------- compression

    @torch.inference_mode()
    def compress(
        self, state: KVState, cfg: CompressionConfig, probe: WindowProbe, protect: torch.Tensor | None = None
    ) -> CompressionReport:
        """Keep, per layer and KV head, the history the probe's window attends to, plus the window.

        Layers whose cache already fits their budget are left alone. Pinned positions are always kept;
        ``protect`` (N,) bool over true positions is kept for this compression only (the current question).
        """
        # The keep mask lives on the host (pins are known there); the selection gets a device copy, and the
        # pin count comes from the host copy, so choosing slots never waits on the device.
        keep_host = state.pinned.cpu() if protect is None else state.pinned.cpu() | protect[: state.next_position].cpu()
        keep_mask = keep_host.to(self.device)  # (N,)
        window = probe.window
        budgets = layer_budgets(cfg, self.num_layers, state.next_position)
        # a tiered state is compressed as a whole: hot and cold together, every position of the history
        source = state if state.cold is None else UnionView(state, state.cold)
        report = CompressionReport(
            context_tokens=state.next_position,
            window=window,
            budgets=budgets,
            tokens_before=source.cache_lengths(),
            tokens_after=[],
            pinned_total=int(state.pinned.sum()),
            score_ms=probe.seconds * 1e3,
            kv_bytes_before=source.kv_bytes(),
        )
        history = self._history_attention(source, probe)  # a device scalar: read once, at the end
        # the scorer the config names (snapkv_sessions.scorers): on CUDA the "snapkv" key builds the fused
        # Triton scorer, elsewhere the torch one (equal scores)
        scorer = build_scorer(cfg, ScoreContext(window, self.num_kv_heads, self.device, self.tokenizer))
        # pins plus protected tokens in the history part (all but the window) are never evicted, so every
        # layer and head holds all of them: the host count is the count of every head
        rule = KeepRule(window, keep_mask, grow=cfg.pin_overflow == "grow",
                        n_pinned=int(keep_host[: state.next_position - window].sum()))
        chosen: dict[int, torch.Tensor] = {}  # layer -> (B, Hkv, K) slots to keep
        t0 = time.perf_counter()
        for layer in range(self.num_layers):
            length = source.positions[layer].shape[-1]
            if probe.scores[layer].shape[-1] != length:
                raise ConfigError("probe", f"layer {layer}", "was recorded on another cache length; compress "
                                  "right after the prefill that observed")
            if length > budgets[layer]:
                chosen[layer] = self._select(source, probe, scorer, rule, layer, budgets[layer])  # (B, Hkv, K)
        t1 = time.perf_counter()
        acted = bool(chosen)  # a cache that fits every budget is left alone, and costs nothing
        if isinstance(source, UnionView) and (chosen or source.cold.nbytes):
            source.keep(chosen)  # hot: the chosen slots; cold: the rest
            acted = True
        elif chosen:
            self._gather(state, chosen)
        if acted:
            report.select_ms = (t1 - t0) * 1e3
            report.gather_ms = (time.perf_counter() - t1) * 1e3
        self._fill_report(report, state, probe, history)
        if state.cold is not None:
            report.tier = {**state.cold.stats.to_dict(), "hot_bytes": state.kv_bytes(),
                           "cold_bytes": state.cold.nbytes}
        state.reports.append(report)
        return report

    def _gather(self, state: KVState, chosen: dict[int, torch.Tensor]) -> None:
        """Keep the chosen slots: every layer in one fused launch where it applies, else layer by layer."""
        layers = state.cache.layers
        fused = None
        if (isinstance(state.cache, CompactCache) and len(chosen) == len(layers)
                and len({idx.shape for idx in chosen.values()}) == 1):
            fused = fused_gather(self.device)  # Triton on CUDA; None elsewhere
        if fused is not None:
            idx = torch.stack([chosen[layer] for layer in range(len(layers))])  # (L, B, Hkv, K)
            keys, values = fused([lay.keys for lay in layers], [lay.values for lay in layers], idx)  # (L, B, Hkv, K, D)
            state.cache.replace_all(keys, values)
        else:
            for layer, idx in chosen.items():
                lay = layers[layer]
                rows = idx[..., None].expand(-1, -1, -1, lay.keys.shape[-1])  # (B, Hkv, K, D)
                set_layer(lay, lay.keys.gather(2, rows), lay.values.gather(2, rows))  # (B, Hkv, K, D) each
        for layer, idx in chosen.items():
            state.positions[layer] = state.positions[layer].gather(-1, idx)  # (B, Hkv, K)

    def _fill_report(self, report: CompressionReport, state: KVState, probe: WindowProbe,
                     history: torch.Tensor | None) -> None:
        """Per-layer counts for the report, read from the device in one transfer after all layers are done."""
        report.tokens_after = state.cache_lengths()
        report.kept = [[n] * self.num_kv_heads for n in report.tokens_after]
        pinned = state.pinned.to(self.device)  # (N,)
        new = torch.stack([(p[0] >= probe.turn_start).sum(-1) for p in state.positions])  # (L, Hkv)
        held = torch.stack([pinned[p[0]].sum(-1).min() for p in state.positions])  # (L,) fewest pins over heads
        # counts stay below 2**24, so float32 carries them exactly alongside the attention mass
        parts = [new.flatten().float(), held.float()]
        if history is not None:
            parts.append(history.float().reshape(1))
        values = torch.cat(parts).tolist()
        n_new = new.numel()
        report.kept_new = [[int(v) for v in values[i : i + new.shape[1]]] for i in range(0, n_new, new.shape[1])]
        report.pinned_kept = int(min(values[n_new : n_new + held.numel()]))
        report.history_attention = values[-1] if history is not None else None
        report.kv_bytes_after = state.kv_bytes()

    def _select(self, state: KVState | UnionView, probe: WindowProbe, scorer: Scorer, rule: KeepRule, layer: int,
                budget: int) -> torch.Tensor:
        """Sorted slot indices to keep in one layer, (B, Hkv, K): the shared top-k. No host synchronisation."""
        chosen = select_layer(scorer, probe.scores[layer], state, layer, budget, rule)  # (B, Hkv, K)
        if self.observer is not None:
            scores = scorer.score(probe.scores[layer], state, layer)  # (B, Hkv, T - W), as the top-k saw them
            self.observer(Selection(layer, state.positions[layer], scores, chosen, rule.keep_mask))
        return chosen

    def _word_ids(self, state: KVState) -> torch.Tensor:
        """(N,) word index of every true position: a new word starts at a token that begins with whitespace."""
        if self.tokenizer is None:
            raise ConfigError("span_aware", True, "needs the runner to have a tokenizer")
        return word_ids(self.tokenizer, state.token_ids, self.device)  # (N,)

    @staticmethod
    def _history_attention(state: KVState | UnionView, probe: WindowProbe, sinks: int = 4) -> torch.Tensor | None:
        """Window attention mass on the slots that predate this prefill, sinks excluded, mean over layers.

        A 0-d device tensor (not read here: the caller reads it with the rest of the report)."""
        if probe.turn_start <= sinks or not probe.scores:
            return None
        masses = []
        for layer, scores in probe.scores.items():  # (B, Hq, T)
            pos = state.positions[layer]  # (B, Hkv, T)
            old = (pos < probe.turn_start) & (pos >= sinks)  # (B, Hkv, T) slots from earlier turns, no sinks
            old = old.repeat_interleave(scores.shape[1] // pos.shape[1], dim=1)  # (B, Hq, T)
            masses.append((scores * old).sum(-1).mean())
        return torch.stack(masses).mean()

    # ---------------------------------------------------------------- one turn

    def run(self, state: KVState, plan: TurnPlan, compression: CompressionConfig | None,
            gen: GenerationConfig | None = None, forced: Sequence[int] | None = None) -> TurnRun:
        """Execute ``plan``: prefill its tokens at their true positions, compress with its window; the
        returned :class:`TurnRun` decodes the reply (or feeds ``forced``, a recorded one) when iterated.

        Live turns, replays, re-prefills, ``--verify`` and the session benchmarks all run turns through here.
        """
        if plan.first_position != state.next_position + len(state.pending):
            raise ConfigError("plan.first_position", plan.first_position, f"the state's next token goes to position "
                              f"{state.next_position + len(state.pending)}")
        t0 = time.perf_counter()
        if state.cold is not None:
            state.cold.begin_turn(state)
            # the last reply's KV was decoded against the hot cache alone: feed it again, over the whole history;
            # a turn shorter than its window also feeds again the history its window reaches back over
            short = plan.window - len(state.pending) - len(plan.tokens) if plan.window and compression else 0
            state.cold.rewind(state, short)
        logits, probe = self.prefill(state, plan.tokens, pinned=plan.pinned_flags(), window=plan.window)
        result = TurnResult(tokens=[], stop_reason=None, report=None, prefill_ms=(time.perf_counter() - t0) * 1e3,
                            decode_ms=0.0, prompt_tokens=len(plan.tokens), prefill_end=state.next_position)
        if probe is not None:
            protect = self._protect_mask(state, plan, compression, probe.window)
            result.report = self._serial(lambda: self.compress(state, compression, probe, protect))
            result.protect_applied = protect is not None
            result.kept = list(state.positions)  # decode rebinds positions[l], so these stay as compressed
        if state.cold is not None:
            state.cold.decode_start = state.next_position
        return TurnRun(self, state, logits, gen, forced, result)

    def _protect_mask(self, state: KVState, plan: TurnPlan, cfg: CompressionConfig, window: int) -> torch.Tensor | None:
        """(N,) bool: the plan's protected positions, when they fit beside the pins in every layer's budget."""
        if not plan.protect:
            return None
        mask = torch.zeros(state.next_position, dtype=torch.bool)  # (N,)
        for start, end in plan.protect:
            mask[start:end] = True
        budgets = layer_budgets(cfg, self.num_layers, state.next_position)
        if int((mask | state.pinned.cpu()).sum()) > min(budgets) - window:
            return None
        return mask

    def turn(
        self,
        state: KVState,
        ids: Sequence[int],
        compression: CompressionConfig | None,
        gen: GenerationConfig | None = None,
        *,
        pinned: bool | Sequence[bool] = False,
    ) -> TurnResult:
        """Prefill ``ids``, compress with this turn's observation window, and decode the reply.

        The engine-level form of :meth:`run`: the plan is built from the tokens, with the same window rule as a
        session's (the turn's last ``compression.window`` tokens, all of them when the turn is shorter).
        """
        ids = [int(t) for t in ids]
        flags = [bool(pinned)] * len(ids) if isinstance(pinned, bool) else [bool(p) for p in pinned]
        if len(flags) != len(ids):
            raise ConfigError("pinned", f"{len(flags)} flags", f"must match the {len(ids)} tokens given")
        first = state.next_position + len(state.pending)
        refed = state.cold.refeedable(state) if state.cold is not None else 0  # a tiered prefill may feed history again
        window = None
        if compression is not None:
            window = observation_window(compression.window, refed + len(state.pending) + len(ids), first + len(ids))
        plan = TurnPlan(tokens=tuple(ids), first_position=first, pinned=to_ranges(flags, first), window=window)
        return self.run(state, plan, compression, gen).finish()
