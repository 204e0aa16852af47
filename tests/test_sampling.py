"""The sampler (issue 29): numerically safe for every temperature, top-p and top-k the config admits, greedy below
:data:`MIN_TEMPERATURE`, and unchanged, bit for bit, for ordinary values."""

from __future__ import annotations

import pytest
import torch

from snapkv_sessions.generation import MIN_TEMPERATURE, GenerationConfig, Sampler

V = 96
F32_MAX = torch.finfo(torch.float32).max
TEMPERATURES = [1e-300, 1e-40, 1e-8, MIN_TEMPERATURE / 2, MIN_TEMPERATURE, MIN_TEMPERATURE * 1.01, 0.5, 1.0, 2.0]
TOP_PS = [1e-300, 1e-40, 1e-8, 0.5, 1.0]
TOP_KS = [0, 1, 5]


def _logit_sets() -> dict[str, torch.Tensor]:
    """(V,) float32 logits: ordinary, of large magnitude, at float32's limit, with masked (-inf) entries, bf16."""
    g = torch.Generator().manual_seed(0)
    ordinary = torch.randn(V, generator=g) * 4  # (V,)
    masked = ordinary.clone()
    masked[::3] = float("-inf")  # a vocabulary mask, as some models emit
    extreme = (torch.linspace(-1.0, 1.0, V, dtype=torch.float64) * F32_MAX).float()  # (V,) both ends of float32
    return {"ordinary": ordinary, "large": torch.randn(V, generator=g) * 1e30, "extreme": extreme, "masked": masked,
            "bf16": (torch.randn(V, generator=g) * 8).bfloat16()}


LOGITS = _logit_sets()


@pytest.mark.parametrize("name", list(LOGITS))
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_every_setting_gives_a_valid_token_and_tiny_temperature_is_argmax(name, temperature):
    logits = LOGITS[name]
    best = int(logits.argmax())
    for top_p in TOP_PS:
        for top_k in TOP_KS:
            cfg = GenerationConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=1)
            sample = Sampler(cfg, logits.device)
            tokens = [sample(logits) for _ in range(4)]
            assert all(isinstance(t, int) and 0 <= t < V and logits[t] > float("-inf") for t in tokens)
            if temperature < MIN_TEMPERATURE or top_k == 1 or top_p <= 1e-8:
                assert tokens == [best] * 4, (temperature, top_p, top_k)  # one candidate: the argmax


def test_below_the_floor_is_greedy_and_draws_nothing():
    for temperature in (1e-300, 1e-40, 1e-8, MIN_TEMPERATURE / 2):
        sample = Sampler(GenerationConfig(temperature=temperature, top_k=40, top_p=0.9, seed=3), torch.device("cpu"))
        assert sample.generator is None
        for logits in LOGITS.values():
            assert sample(logits) == int(logits.argmax())
    assert Sampler(GenerationConfig(temperature=MIN_TEMPERATURE, seed=3), torch.device("cpu")).generator is not None


def test_logits_beyond_float32_over_temperature_still_sample_their_distribution():
    """3e38 / 0.5 overflows float32: the float64 path samples the same distribution: two equal best tokens, the
    rest impossible."""
    logits = torch.full((V,), -F32_MAX)  # (V,)
    logits[[10, 50]] = F32_MAX
    picks = {Sampler(GenerationConfig(temperature=0.5, seed=s), logits.device)(logits) for s in range(64)}
    assert picks == {10, 50}
    top_p = {Sampler(GenerationConfig(temperature=0.5, top_p=1e-300, seed=s), logits.device)(logits) for s in range(16)}
    assert len(top_p) == 1 and top_p <= {10, 50}  # top_p keeps one token, one of the two best


def test_non_finite_logits_give_the_argmax_and_never_raise():
    nan = LOGITS["ordinary"].clone()
    nan[7] = float("nan")
    inf = LOGITS["ordinary"].clone()
    inf[9] = float("inf")
    for logits in (nan, inf, torch.full((V,), float("-inf")), torch.full((V,), float("nan"))):
        for temperature in (MIN_TEMPERATURE, 1.0, 2.0):
            token = Sampler(GenerationConfig(temperature=temperature, top_p=0.5, seed=0), logits.device)(logits)
            assert token == int(logits.argmax())
    assert Sampler(GenerationConfig(temperature=1.0, seed=0), inf.device)(inf) == 9


def test_a_replayed_config_decodes_the_same_tokens():
    logits = [LOGITS["extreme"], LOGITS["ordinary"], LOGITS["large"], LOGITS["masked"]] * 3
    for cfg in (GenerationConfig(temperature=1e-300, top_p=1e-300, seed=4),
                GenerationConfig(temperature=MIN_TEMPERATURE, top_p=1e-300, seed=4),
                GenerationConfig(temperature=2.0, top_k=5, top_p=0.7, seed=4)):
        again = GenerationConfig.from_record(cfg.record())
        first, second = Sampler(cfg, torch.device("cpu")), Sampler(again, torch.device("cpu"))
        assert [first(x) for x in logits] == [second(x) for x in logits]


def test_nan_temperature_is_refused():
    from snapkv_sessions.errors import ConfigError

    with pytest.raises(ConfigError, match="temperature"):
        GenerationConfig(temperature=float("nan"))


def _old_sample(cfg: GenerationConfig, generator: torch.Generator, logits: torch.Tensor) -> int:
    """The sampler as it was before issue 29, for ordinary values."""
    scores = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = scores.topk(min(cfg.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) >= cfg.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(0.9, 20, 1.0), (1.2, 0, 0.8), (0.7, 0, 0.9), (0.8, 40, 1.0), (1.5, 5, 0.95), (2.0, 0, 1.0),
                          (MIN_TEMPERATURE, 0, 1.0), (0.3, 3, 1e-6)])
def test_ordinary_settings_sample_exactly_as_before(temperature, top_k, top_p):
    """A regression guard for the recorded replies: the same tokens as the old code, draw for draw."""
    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(V, generator=g) * s for s in (1, 3, 10, 30)] * 8  # (V,) each
    for seed in range(5):
        cfg = GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        new, old = Sampler(cfg, torch.device("cpu")), torch.Generator().manual_seed(seed)
        assert [new(x) for x in steps] == [_old_sample(cfg, old, x) for x in steps]
