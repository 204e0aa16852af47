"""``bench dtype``: a dtype (bf16 by default, or fp16/bf16-stored weights) against fp32 weights on the same prompts,
side by side in one run: how often the greedy replies are identical, where they first differ, and the prefill and
decode time of each."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..generation import GenerationConfig
from ..models import runner_for

PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
           "Explain what a KV cache is in one sentence.", "List three prime numbers.",
           "Translate 'good morning' into Spanish.", "What does HTTP stand for?", "Give a synonym for 'quick'.",
           "How many legs does a spider have?")


@dataclass
class DtypeAgreement:
    model: str
    prompts: int
    max_new_tokens: int
    identical: int  # prompts whose reply in ``against`` equals the fp32 one token for token
    first_divergence: list[int | None] = field(default_factory=list)  # per prompt: first differing index, or None
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> prefill_ms, decode_ms_per_token
    against: str = "bfloat16"  # the dtype compared with float32

    def to_json(self) -> dict:
        return asdict(self)


def _replies(model: str, dtype: str, prompts: tuple[str, ...] | list[str], max_new_tokens: int):
    runner, _ = runner_for(model, dtype)
    tok, gen = runner.tokenizer, GenerationConfig(max_new_tokens=max_new_tokens)
    replies, prefill_s, decode_s, decoded = [], 0.0, 0.0, 0
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        ids = tok(ids, add_special_tokens=False)["input_ids"]
        state = runner.new_state()
        t0 = time.perf_counter()
        logits, _ = runner.prefill(state, ids)
        t1 = time.perf_counter()
        out = list(runner.generate(state, logits, gen))
        prefill_s, decode_s, decoded = prefill_s + t1 - t0, decode_s + time.perf_counter() - t1, decoded + len(out)
        replies.append(out)
    return replies, {"prefill_ms": round(prefill_s * 1e3 / len(prompts), 1),
                     "decode_ms_per_token": round(decode_s * 1e3 / max(decoded, 1), 1)}


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(model: str, prompts=PROMPTS, max_new_tokens: int = 24, against: str = "bfloat16") -> DtypeAgreement:
    """Greedy replies of ``model`` in float32 and in ``against`` on each prompt (one user message, the chat
    template)."""
    fp32, fp32_ms = _replies(model, "float32", prompts, max_new_tokens)
    other, other_ms = _replies(model, against, prompts, max_new_tokens)
    firsts = [_first_divergence(a, b) for a, b in zip(fp32, other, strict=True)]
    return DtypeAgreement(model, len(prompts), max_new_tokens, sum(d is None for d in firsts), firsts,
                          {"float32": fp32_ms, against: other_ms}, against)


def table(result: DtypeAgreement) -> str:
    lines = [f"{result.model}: {result.against} replies identical to fp32 on {result.identical} of "
             f"{result.prompts} prompts ({result.max_new_tokens} greedy tokens); first divergence per prompt: "
             f"{result.first_divergence}",
             f"{'dtype':<13} {'prefill ms':>11} {'decode ms/token':>16}"]
    lines += [f"{d:<13} {v['prefill_ms']:>11.1f} {v['decode_ms_per_token']:>16.1f}" for d, v in result.ms.items()]
    return "\n".join(lines)
