"""ModelRunner: prefill onto a compressed cache, compress with SnapKV, decode, with true positions.

One conversation per :class:`~snapkv_sessions.state.KVState`, batch size 1. The runner owns no conversation
state itself, so one loaded model serves many states.

Every forward of the model goes through :meth:`ModelRunner.forward` (a single session's prefill chunk or decode
step, and the batched decode step of many sessions' slots, :mod:`snapkv_sessions.batch`): one place for the
per-step extras (the window probe, the key masks of padded slots). Where the forward runs is the runner's
:class:`Executor`'s business: here, inline; under a :class:`~snapkv_sessions.scheduler.Scheduler`, on its thread
with decode steps batched. The runner never refers to a scheduler; the scheduler owns its runner and hands its
sessions a view of it bound to itself (:meth:`ModelRunner.on`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from . import attention, decode, interrupts, stats
from .attention import WindowProbe
from .cache import CompactCache, PlainDynamicCache
from .compress import Layout, Selection, compress, protect_mask
from .config import CompressionConfig
from .errors import ConfigError
from .generation import Decoder, GenerationConfig
from .recall import RecallConfig
from .report import CompressionReport
from .rotary import Rotary
from .state import KVState
from .support import check_supported, fingerprint
from .tier import TieredCache
from .transcript import MASKED, PREFILL_ATTENTION, SPLIT, TurnPlan, observation_window, to_ranges


@dataclass
class Forward:
    """One forward of the model: ``input_ids``/``position_ids`` (B, n) at true positions, over ``cache``.

    ``probe``: record the window's attention (a turn's last prefill chunk); ``key_masks``: ``key_masks.get(l)`` is
    layer ``l``'s keys each row (and KV head) may see, ``(B, 1 or Hkv, 1, T)``, read from the cache as each layer
    runs (the padded slots of a batched step, the padding of heads that keep uneven counts)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cache: object
    probe: WindowProbe | None = None
    key_masks: object | None = None  # .get(layer) -> (B, 1 or Hkv, 1, T) bool or None
    recall: object | None = None  # .extra(layer, query): a decode step's recall from the tier (recall.Recall)
    split: bool = False  # a prefill onto a cache attends in two parts (attention.split_prefill)


class Executor(Protocol):
    """Where a runner's model work runs (the model and the slots are touched by one thread at a time)."""

    def call(self, fn: Callable[[], object], remaining: int = 0) -> object:
        """``fn()``'s result (or its error), run where the model runs. ``remaining``: the tokens the calling turn
        has still to prefill, this call's included (0: not a prefill); an executor serving several sessions
        orders waiting calls by it (the scheduler: by when each turn would end alone)."""
        ...

    def decode(self, state: KVState, first_logits: torch.Tensor, decoder: Decoder) -> Iterator[int]:
        """The reply's tokens from ``first_logits``, leaving ``state`` as :meth:`ModelRunner.generate` does."""
        ...

    def chunk(self, most: int) -> int:
        """How many tokens a prefill may feed in its next forward, at most ``most`` (the runner's
        ``prefill_chunk``): fewer while other sessions' work waits on the model (the scheduler)."""
        ...


class Inline:
    """The executor of a runner alone: model work runs on the caller's thread, one decode step at a time."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def call(self, fn: Callable[[], object], remaining: int = 0) -> object:
        return fn()

    def chunk(self, most: int) -> int:
        return most

    def decode(self, state: KVState, first_logits: torch.Tensor, decoder: Decoder) -> Iterator[int]:
        if isinstance(state.cache, CompactCache):
            state.cache.reserve(decoder.gen.max_new_tokens)  # once: no decode step reallocates
        logits, last = first_logits, time.perf_counter()  # last: when the latest logits were ready
        while True:
            tok = decoder.accept(logits)
            if tok is not None:
                yield tok
            if decoder.done:
                break
            t0 = time.perf_counter()
            logits = self.runner.step(state, tok)
            now = time.perf_counter()
            if stats.active():  # the step read every hot slot of every layer; the gap includes the reader's time
                stats.emit(stats.DecodeStepStat(1, 1, now - t0, state.kv_bytes(), (now - last,)))
            last = now
        state.pending, state.last_stop_reason = [decoder.last], decoder.reason


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
    prefilled: int = 0  # tokens run through the model by the prefill: the plan's, plus any fed again
    protect_applied: bool | None = None  # None: no compression ran; else whether the plan's protect fit
    kept: list[torch.Tensor] | None = None  # positions[l] (B, Hkv, K) right after the compression, if it ran
    chunks: list[int] | None = None  # tokens each forward of the prefill fed (what a replay feeds again)
    attention: str = MASKED  # how the prefill attended onto the cache (PREFILL_ATTENTION; a replay does the same)


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
        recalled = self.state.cache.decode_done(self.state)  # what decode recalled from a tier, if it did
        report = self.result.report
        if recalled is not None and report is not None and report.tier is not None:
            report.tier = {**report.tier, "recall": recalled}

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
        Prefill long inputs in chunks of at most this many tokens (the causal mask is built per chunk), which
        bounds the activation memory. Fewer while the executor has other sessions' work waiting
        (:meth:`Executor.chunk`); a turn records the chunks it ran and a replay runs the same ones, since the
        chunking changes the last bits of the keys and logits.
    cache:
        ``"compact"`` (default): :class:`~snapkv_sessions.cache.CompactCache`, preallocated, decode writes in
        place; ``"dynamic"``: transformers' DynamicCache (concatenates at every step).
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, prefill_chunk: int = 4096, cache: str = "compact") -> None:
        if cache not in ("compact", "dynamic"):
            raise ConfigError("cache", cache, "must be 'compact' or 'dynamic'")
        self.cache_kind = cache
        self.executor: Executor = Inline(self)
        # Called after each layer's selection with a Selection (the audit's --find reads the scores through it);
        # None in normal use, which then never computes anything for it.
        self.observer: Callable[[Selection], None] | None = None
        # Called at each decode step's recall from the tier with (layer, recalled true positions (B, Hkv, K), -1
        # where a head attends to fewer): the audit's --find; None in normal use.
        self.recall_observer: Callable[[int, torch.Tensor], None] | None = None
        # Called at each observed prefill's layer with its window rows (B, Hkv, G, W, T) fp32, before they are
        # averaged: bench pointing; None in normal use.
        self.rows_observer: Callable[[int, torch.Tensor], None] | None = None
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
        self.rotary = Rotary.of(model)  # the model's RoPE: a recall selector may summarise keys before it
        # how this runner's live prefills attend onto a cache (a replay runs what its record says): in two parts
        # for bf16 and fp16 on a CPU, where it halves a long chunk's attention; fp32 (the equality tests'
        # reference) keeps the one masked SDPA
        weight = next(model.parameters())
        self.prefill_attention = (SPLIT if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16,
                                                                                           torch.float16)
                                  else MASKED)
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else cfg.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            (eos,) if eos is not None else ()
        )

    def on(self, executor: Executor) -> ModelRunner:
        """This runner's model, tokenizer and settings, its work run by ``executor`` (a scheduler binds its
        sessions' runner so); this runner is not changed."""
        view = copy.copy(self)
        view.executor = executor
        return view

    @property
    def fingerprint(self) -> str:
        """What a session is bound to (:func:`snapkv_sessions.support.fingerprint`)."""
        return fingerprint(self.model, self.tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def layout(self) -> Layout:
        return Layout(self.num_layers, self.num_kv_heads, self.device, self.tokenizer)

    def detach(self) -> None:
        """Give the model back its original attention implementation."""
        self.model.set_attn_implementation(self._original_attn)

    def new_state(self, tiered: bool = False, refeed_reply: bool = True, recall: RecallConfig | None = None) -> KVState:
        """An empty conversation state; ``tiered`` keeps what compression evicts in a host tier
        (:class:`~snapkv_sessions.tier.TieredCache`), so every prefill sees the whole history; ``refeed_reply``:
        a tier feeds each reply again with the next turn (exact), or keeps the KV decode computed; ``recall``: decode
        also attends to the cold slots each step's query reaches for (:mod:`snapkv_sessions.recall`)."""
        if self.cache_kind == "compact":
            if not tiered:
                return KVState(cache=CompactCache(self.num_layers))
            cache = TieredCache(self.num_layers, recall=recall, rotary=self.rotary)
            cache.cold.refeed_reply = refeed_reply
            return KVState(cache=cache)
        if tiered or recall is not None:
            raise ConfigError("cache", self.cache_kind, "the tiered memory needs the 'compact' cache")
        return KVState(cache=PlainDynamicCache(config=self.model.config))

    # ---------------------------------------------------------------- the one forward path

    @torch.inference_mode()
    def forward(self, step: Forward) -> torch.Tensor:
        """Run the model once; returns the last position's next-token logits of every row, (B, V). A decode step
        (one token a row, no probe) runs layer by layer from the model's parts where that gives the same bits
        (:mod:`snapkv_sessions.decode`)."""
        if step.input_ids.shape[1] == 1 and step.probe is None:
            fast = decode.for_model(self.model)
            if fast is not None:
                return fast(step.input_ids, step.position_ids, step.cache, step.key_masks, step.recall)  # (B, V)
        out = self.model(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            cache=step.cache,
            use_cache=True,
            logits_to_keep=1,
            snapkv_probe=step.probe,
            snapkv_keymask=step.key_masks,
            snapkv_recall=step.recall,
            snapkv_split=step.split,
        )
        return out.logits[:, -1]  # (B, V)

    def _forward(self, state: KVState, ids: list[int], probe: WindowProbe | None, *, whole: bool = False,
                 remaining: int = 0, split: bool = False) -> torch.Tensor:
        """Feed ``ids`` at their true positions. ``whole``: a prefill, which attends to whatever the state's memory
        holds of the history (a tier's cold part too); decode reads the hot cache alone. ``remaining``: the
        prefill's tokens from these on (the executor's order); ``split``: a prefill attends in two parts."""
        return self.executor.call(lambda: self._forward_now(state, ids, probe, whole, split), remaining)

    @torch.inference_mode()
    def _forward_now(self, state: KVState, ids: list[int], probe: WindowProbe | None, whole: bool,
                     split: bool = False) -> torch.Tensor:
        start = state.next_position
        input_ids = torch.tensor([ids], device=self.device)  # (1, n)
        position_ids = torch.arange(start, start + len(ids), device=self.device)[None]  # (1, n) true positions
        masks = state.cache.key_masks()  # a layer whose heads keep uneven counts hides its padding slots
        if whole:
            with state.cache.attending(state):
                logits = self.forward(Forward(input_ids, position_ids, state.cache, probe, masks,
                                              split=split))  # (1, V)
        else:  # decode: the hot slots, and what the step recalls from a tier
            recall = state.cache.recall(state) if len(ids) == 1 else None
            logits = self.forward(Forward(input_ids, position_ids, state.cache, probe, masks, recall))  # (1, V)
        return logits[0]  # (V,)

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
        logits, probe, _ = self._prefill(state, ids, pinned, window, None, state.attention or self.prefill_attention)
        return logits, probe

    def _prefill(self, state: KVState, ids: Sequence[int], pinned: bool | Sequence[bool], window: int | None,
                 chunks: Sequence[int] | None, attention: str = MASKED,
                 ) -> tuple[torch.Tensor, WindowProbe | None, list[int]]:
        """:meth:`prefill`, in the ``chunks`` given (a recorded turn's: tokens per forward, the pending ones
        included) or, when None, in chunks of at most :attr:`prefill_chunk` the executor sizes one by one; also
        returns the chunks it ran. The observation window always lies in the last chunk. ``attention``: one of
        :data:`PREFILL_ATTENTION`."""
        if attention not in PREFILL_ATTENTION:
            raise ConfigError("attention", attention, f"must be one of {list(PREFILL_ATTENTION)}")
        ids = [int(t) for t in ids]
        flags = [bool(pinned)] * len(ids) if isinstance(pinned, bool) else [bool(p) for p in pinned]
        if len(flags) != len(ids):
            raise ConfigError("pinned", f"{len(flags)} flags", f"must match the {len(ids)} tokens given")
        n_todo = len(state.pending) + len(ids)
        if not n_todo:
            raise ConfigError("ids", ids, "nothing to prefill")
        if window is not None and window > n_todo:
            raise ConfigError("window", window, f"is longer than the prompt ({n_todo} tokens to prefill)")
        if chunks is not None and (sum(chunks) != n_todo or min(chunks, default=0) < 1
                                   or (window is not None and chunks[-1] < window)):
            raise ConfigError("chunks", list(chunks), f"must be positive, sum to the {n_todo} tokens "
                              "to prefill and end with a chunk holding the observation window")
        pending, pending_flags = state.take_pending()
        todo, todo_flags = pending + ids, pending_flags + flags
        probe = (WindowProbe(window, turn_start=state.next_position, rows=self.rows_observer)
                 if window is not None else None)
        logits, lo, ran = None, 0, []
        while lo < n_todo:
            if chunks is not None:
                hi = lo + chunks[len(ran)]
            else:
                hi = min(n_todo, lo + max(1, self.executor.chunk(self.prefill_chunk)))
                if probe is not None and hi < n_todo and n_todo - hi < window:  # the window in the last chunk
                    hi = n_todo - window if n_todo - window > lo else n_todo
            interrupts.check()  # a deadline or a client gone stops a long prefill between chunks
            logits = self._forward(state, todo[lo:hi], probe if hi == n_todo else None, whole=True,
                                   remaining=n_todo - lo, split=attention == SPLIT)
            state.append(todo[lo:hi], todo_flags[lo:hi], self.num_kv_heads, self.device)
            ran.append(hi - lo)
            lo = hi
        return logits, probe, ran

    @torch.inference_mode()
    def step(self, state: KVState, token: int) -> torch.Tensor:
        """Feed one token at its true position; returns the next-token logits (V,)."""
        logits = self._forward(state, [token], None)
        if state.cache.retake(state, logits):  # a near-tie under recall: the step again, over the whole history
            state.cache.rewind_decoded(state)
            return self.prefill(state, [token])[0]  # (V,): the turn's decoded tokens fed again with it
        state.append([token], [False], self.num_kv_heads, self.device)
        return logits

    def generate(
        self, state: KVState, first_logits: torch.Tensor, gen: GenerationConfig | None = None
    ) -> Iterator[int]:
        """Decode from ``first_logits`` (the prefill's), yielding token ids as they come.

        The end token (EOS) is not yielded. The last sampled token is left in ``state.pending`` (not yet in
        the cache): the next prefill feeds it first, so the transcript stays whole. ``state`` gets
        ``last_stop_reason`` set to ``"eos"``, ``"stop"`` or ``"length"``. Under a scheduler's executor the steps
        run batched with other sessions' (the same tokens: one :class:`Decoder` logic either way).
        """
        decoder = Decoder(gen or GenerationConfig(), self.eos_token_ids, self.tokenizer, first_logits.device)
        yield from self.executor.decode(state, first_logits, decoder)

    # ---------------------------------------------------------------- compression

    def compress(
        self, state: KVState, cfg: CompressionConfig, probe: WindowProbe, protect: torch.Tensor | None = None
    ) -> CompressionReport:
        """Keep, per layer and KV head, the history the probe's window attends to, plus the window
        (:func:`snapkv_sessions.compress.compress`). Pinned positions are always kept; ``protect`` (N,) bool
        over true positions is kept for this compression only (the current question)."""
        return self.executor.call(lambda: compress(state, cfg, probe, self.layout, protect, self.observer))

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
        # a turn shorter than its window reaches back over the history (a tier feeds it again, with the last reply)
        reach = plan.window - len(state.pending) - len(plan.tokens) if plan.window and compression else 0
        state.cache.begin_turn(state, reach)
        prefilled = len(state.pending) + len(plan.tokens)
        attention = plan.attention if plan.attention is not None else self.prefill_attention  # a record's, or ours
        state.attention = attention
        logits, probe, chunks = self._prefill(state, plan.tokens, plan.pinned_flags(), plan.window, plan.chunks,
                                              attention)
        result = TurnResult(tokens=[], stop_reason=None, report=None, prefill_ms=(time.perf_counter() - t0) * 1e3,
                            decode_ms=0.0, prompt_tokens=len(plan.tokens), prefill_end=state.next_position,
                            prefilled=prefilled, chunks=chunks, attention=attention)
        if probe is not None:
            protect = protect_mask(state, plan.protect, compression, self.num_layers, probe.window)
            result.report = self.compress(state, compression, probe, protect)
            result.protect_applied = protect is not None
            result.kept = state.held()  # decode rebinds positions[l], so these stay as compressed (-1: padding)
        state.cache.prefill_done(state)
        if self.recall_observer is not None:
            state.cache.observe_recall(self.recall_observer)
        return TurnRun(self, state, logits, gen, forced, result)

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
        refed = state.cache.refeedable(state)  # a tiered prefill may feed history again
        window = None
        if compression is not None:
            window = observation_window(compression.window, refed + len(state.pending) + len(ids), first + len(ids))
        plan = TurnPlan(tokens=tuple(ids), first_position=first, pinned=to_ranges(flags, first), window=window)
        return self.run(state, plan, compression, gen).finish()
