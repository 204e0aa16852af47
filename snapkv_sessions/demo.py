"""The scripted demo conversation behind ``snapkv-sessions demo``."""

from __future__ import annotations

from collections.abc import Iterator

from .config import CompressionConfig
from .generation import GenerationConfig
from .models import load_model
from .runner import ModelRunner

SYSTEM = "You are a logistics assistant. Answer in one short sentence. Never reveal agent home addresses."
DOCUMENT = "\n".join(
    f"Parcel {1000 + i}: sender {name}, courier agent {chr(65 + i % 26)}{i * 7 % 13}, depot {i % 5}."
    for i, name in enumerate(
        ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Max", "Nia"]
    )
)
QUESTIONS = [
    f"Here is the parcel list:\n{DOCUMENT}\nWho is the courier agent for parcel 1003?",
    "And which depot does parcel 1003 leave from?",
    "Who sent parcel 1010?",
    "Summarise in one sentence what this list is about.",
]


def _delta(tok, rendered: str, cache_text: str, pin_chars: int) -> tuple[list[int], list[bool]]:
    """Tokens of the rendered chat not yet in the cache, and which of them fall in the first ``pin_chars``."""
    if not rendered.startswith(cache_text):
        raise RuntimeError("the chat template is not prefix-stable; cannot extend the cache turn by turn")
    enc = tok(rendered[len(cache_text) :], add_special_tokens=False, return_offsets_mapping=True)
    base = len(cache_text)
    return enc["input_ids"], [base + end <= pin_chars for _, end in enc["offset_mapping"]]


def run_demo(model_name: str, budget: int, window: int, max_new_tokens: int) -> Iterator[dict]:
    model, tok = load_model(model_name)
    runner = ModelRunner(model, tok)
    cfg = CompressionConfig.make(budget=budget, window=window, kernel=7)
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    state = runner.new_state()
    history = [{"role": "system", "content": SYSTEM}]
    system_chars = len(tok.apply_chat_template(history, tokenize=False))  # the system span is pinned
    cache_text = ""  # the transcript the cache holds (pending token included), as template text
    for turn, question in enumerate(QUESTIONS, start=1):
        history.append({"role": "user", "content": question})
        rendered = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        new, pinned = _delta(tok, rendered, cache_text, system_chars)
        result = runner.turn(state, new, cfg, gen, pinned=pinned)
        reply_text = tok.decode(result.tokens)
        end_text = tok.decode(state.pending) if result.stop_reason == "eos" else ""
        cache_text = rendered + reply_text + end_text
        reply = reply_text.strip()
        history.append({"role": "assistant", "content": reply_text})
        rep = result.report
        yield {
            "turn": turn,
            "user": question.splitlines()[-1],
            "reply": reply,
            "context_tokens": rep.context_tokens,
            "cache_before": rep.tokens_before[0],
            "cache_after": rep.tokens_after[0],
            "pinned_total": rep.pinned_total,
            "pinned_kept": rep.pinned_kept,
            "compression_ms": rep.total_ms,
            "prefill_ms": result.prefill_ms,
            "decode_ms": result.decode_ms,
            "kv_bytes_before": rep.kv_bytes_before,
            "kv_bytes_after": rep.kv_bytes_after,
        }
