r"""Token counting and encoding with the model's own vocabulary, without torch or transformers.

:class:`TokenCounter` reads a Hugging Face ``tokenizer.json``. A byte-level BPE tokenizer whose pipeline this module
can reproduce exactly (Qwen2, Llama-3, SmolLM2/GPT-2 style) is run by ``tiktoken`` with the model's vocabulary;
anything else falls back to the Rust ``tokenizers`` library. Neither path imports torch or transformers, so store
workers can budget and audit sessions cheaply.

Results equal ``tokenizers.Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids``: no BOS/EOS or
other post-processor tokens are added.

What the tiktoken path checks when it is built, falling back otherwise: a BPE model without dropout or subword
affixes over a byte-level vocabulary; merge results whose ids never decrease in merge order; a normalizer that is
absent or NFC; a pre-tokenizer of one of the shapes listed in :func:`_parse_pre_tokenizer` whose regex leaves no
text unmatched; added tokens without lstrip/rstrip/single_word. Text holding a byte the vocabulary has no token for
(SmolLM2 lacks a few control and non-UTF-8 bytes) is encoded by ``tokenizers`` instead, since tiktoken cannot drop
bytes the way ``tokenizers`` does; ordinary text never touches that path. What it assumes without checking (too costly at
load time, tested instead): each merge result encodes to itself, as in every trained or tiktoken-converted
vocabulary. Remaining differences come from Unicode data versions (Python's ``unicodedata`` for NFC, the regex
engines' ``\p{L}``/``\p{N}`` tables) and touch only recently assigned or exotic characters.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import regex  # a dependency of tiktoken; unlike `re` it knows \p{N}
import tiktoken

# GPT-2's pre-tokenizer regex, exactly as `tokenizers`' ByteLevel(use_regex=True) spells it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Characters from every Unicode class the usual split regexes distinguish: a pattern that leaves any of this text
# unmatched would make tiktoken drop it, while `tokenizers`' Split(Isolated) keeps gaps as their own pieces.
_COVERAGE_PROBE = (
    "Hello, World! it's THEY'LL x1 12345 3.14159 -7e+3 \t\n\r\n  \n\n\t x  y\u00a0z\u3000\u2028\u0085\x0b\x0c"
    "caf\u00e9 e\u0301 \u4e2d\u6587 \U0001f600\U0001f44d\U0001f3fd \u0661\u0662 \u00bd\u00b2\u2167 <|x|> {}[]()"
    "\u200b\u200d\ufeff ~`@#$%^&*_+=|\\/?;:\"' \u0915\u093f \u0627\u0644 \ud55c\uad6d\uc5b4 \u00ad \x00\x7f\x1b"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which byte-level vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


class Unsupported(ValueError):
    """The tokenizer cannot be reproduced exactly with tiktoken; the message says why."""


class _NeedsTokenizers(Exception):
    """Raised inside a tiktoken encode when a piece holds a byte without a token; the caller re-encodes the whole
    text with ``tokenizers``, which is exact by definition."""


DIGIT_CACHE_MAX = 65_536  # digit runs a counter keeps encoded (a process shares one counter per tokenizer)

class TokenCounter:
    """Counts/encodes text like the model's tokenizer, without torch.

    Build it with :meth:`from_tokenizer_json` or :meth:`from_model_dir`, never directly.

    Attributes
    ----------
    backend : str
        ``"tiktoken"`` when the vocabulary runs exactly on tiktoken, else ``"hf-tokenizers"``.
    fallback_reason : str or None
        Why the ``tokenizers`` fallback was chosen; ``None`` on the tiktoken backend.
    path : pathlib.Path
        The ``tokenizer.json`` it was built from.
    """

    backend: str
    fallback_reason: str | None
    path: Path

    def __init__(self, path: Path, spec: dict[str, Any], backend: str, fallback_reason: str | None = None) -> None:
        self.path = path
        self.backend = backend
        self.fallback_reason = fallback_reason
        self._hf: dict[bool, Any] = {}  # allow_special -> tokenizers.Tokenizer, built lazily from self.path
        if backend == "tiktoken":
            self._setup_tiktoken(spec)

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike) -> TokenCounter:
        """Load a ``tokenizer.json``; use tiktoken when that is exact, else the ``tokenizers`` fallback.

        Parameters
        ----------
        path : str or os.PathLike
            A Hugging Face fast-tokenizer file.

        Returns
        -------
        TokenCounter
            Check :attr:`backend` (and :attr:`fallback_reason`) to see which engine runs.
        """
        path = Path(path)
        spec = json.loads(path.read_text(encoding="utf-8"))
        try:
            return cls(path, spec, "tiktoken")
        except Unsupported as exc:
            return cls(path, spec, "hf-tokenizers", fallback_reason=str(exc))

    @classmethod
    def from_model_dir(cls, folder: str | os.PathLike) -> TokenCounter:
        """Load ``folder/tokenizer.json`` (a model folder such as ``resolve_model`` returns).

        Parameters
        ----------
        folder : str or os.PathLike
            A local model folder.

        Returns
        -------
        TokenCounter
        """
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in model folder {str(folder)!r}")
        return cls.from_tokenizer_json(path)

    def _setup_tiktoken(self, spec: dict[str, Any]) -> None:
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise Unsupported(f"model type {model.get('type')!r} is not BPE")
        if model.get("dropout") not in (None, 0, 0.0):
            raise Unsupported("BPE dropout is random")
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise Unsupported("BPE with subword prefix/suffix is not byte-level")

        self._nfc = _parse_normalizer(spec.get("normalizer"))
        pattern, self._digits = _parse_pre_tokenizer(spec.get("pre_tokenizer"))
        self._ranks = ranks = _mergeable_ranks(model)
        # Byte tokens a vocabulary lacks (SmolLM2 has 235 of 256: no 0xC0, 0xF5.., some control characters) are
        # dropped by `tokenizers` inside each pre-token, after which their neighbours may still merge. tiktoken
        # cannot express that, so text holding such bytes is handed to `tokenizers` (see _encode_chunk).
        self._missing = bytes(b for b in range(256) if bytes([b]) not in ranks)
        if self._missing and (model.get("unk_token") is not None or model.get("byte_fallback")):
            raise Unsupported("byte tokens are missing and the BPE maps unknown bytes to unk/byte-fallback tokens")
        self._missing_re = re.compile(b"[" + re.escape(self._missing) + b"]") if self._missing else None
        try:
            self._enc = tiktoken.Encoding(
                name=f"hf-bpe:{self.path}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
            )
        except Exception as exc:  # tiktoken's regex engine rejects some patterns other engines accept
            raise Unsupported(f"tiktoken cannot build this encoding: {exc}") from exc
        # `tokenizers` keeps text its Split regex does not match as extra pieces; tiktoken silently drops it.
        probe = "".join(c for c in _COVERAGE_PROBE if not self._has_missing(c.encode()))
        if self._enc.decode_bytes(self._enc.encode_ordinary(probe)) != probe.encode():
            raise Unsupported("the pre-tokenizer regex leaves gaps, which tiktoken would drop")

        # With ignore_merges `tokenizers` returns any whole pre-token found in the vocabulary; tiktoken does that
        # only for the tokens in its ranks, so vocabulary entries that no merge produces would differ.
        vocab: dict[str, int] = model["vocab"]
        if model.get("ignore_merges") and len(vocab) != len(ranks):
            raise Unsupported("ignore_merges with vocabulary entries that no merge produces")

        self._raw_added, self._norm_added = _added_token_matchers(spec.get("added_tokens") or [])
        self._digit_cache: dict[str, list[int]] = {}

    # -- encoding -----------------------------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of ``text``, as the Hugging Face tokenizer gives them without post-processing.

        Parameters
        ----------
        text : str
            Any text, e.g. a rendered chat template.
        allow_special : bool
            When true, special tokens written in the text (``<|im_start|>``) become their single ids; when false
            they are encoded as plain text, like ``tokenizers``' ``encode_special_tokens = True``. Non-special
            added tokens always become their ids, as in ``tokenizers``.

        Returns
        -------
        list of int
        """
        if self.backend == "tiktoken":
            try:
                return self._encode_tiktoken(text, allow_special)
            except _NeedsTokenizers:
                pass
        return self._hf_tokenizer(allow_special).encode(text, add_special_tokens=False).ids

    def _encode_tiktoken(self, text: str, allow_special: bool) -> list[int]:
        """The tiktoken path of :meth:`encode`; raises :class:`_NeedsTokenizers` on a byte without a token."""
        ids: list[int] = []
        # `tokenizers` order: added tokens marked normalized=False are cut out of the raw text; each remaining
        # segment is normalized on its own, then normalized=True added tokens are cut out of it; the rest is
        # pre-tokenized and run through BPE.
        for segment, token in _split_added(text, self._raw_added, allow_special):
            if token is not None:
                ids.append(token)
                continue
            if self._nfc:
                segment = unicodedata.normalize("NFC", segment)
            for piece, token2 in _split_added(segment, self._norm_added, allow_special):
                if token2 is not None:
                    ids.append(token2)
                else:
                    self._encode_plain(piece, ids)
        return ids

    def count(self, text: str) -> int:
        """Number of tokens in ``text`` (special tokens written in it count as one each).

        Parameters
        ----------
        text : str

        Returns
        -------
        int
        """
        return len(self.encode(text))

    def _encode_plain(self, text: str, out: list[int]) -> None:
        if self._digits is None:
            self._encode_chunk(text, out)
            return
        # Digits runs before the GPT-2 regex in `tokenizers`, so the regex never sees across a digit: encode the
        # digit pieces and the runs between them separately.
        # split() with one capturing group alternates: text between digits at even indexes, digits at odd ones.
        for i, piece in enumerate(self._digits.split(text)):
            if not piece:
                continue
            if i % 2:
                cached = self._digit_cache.get(piece)
                if cached is None:
                    cached = []
                    self._encode_chunk(piece, cached)
                    if len(self._digit_cache) < DIGIT_CACHE_MAX:  # one counter serves every session: bounded
                        self._digit_cache[piece] = cached
                out.extend(cached)
            else:
                self._encode_chunk(piece, out)

    def _encode_chunk(self, text: str, out: list[int]) -> None:
        """Pre-tokenize and BPE one run of text (no added tokens, already normalized)."""
        # Checked per chunk, after normalization: NFC can compose characters whose bytes the raw text lacked.
        if self._has_missing(text.encode("utf-8", "surrogatepass")):
            raise _NeedsTokenizers
        out.extend(self._enc.encode_ordinary(text))

    def _has_missing(self, data: bytes) -> bool:
        return self._missing_re is not None and self._missing_re.search(data) is not None

    def _hf_tokenizer(self, allow_special: bool) -> Any:
        tok = self._hf.get(allow_special)
        if tok is None:
            from tokenizers import Tokenizer  # Rust library, no torch; only the fallback needs it

            tok = Tokenizer.from_file(str(self.path))
            tok.encode_special_tokens = not allow_special
            self._hf[allow_special] = tok
        return tok

    def __repr__(self) -> str:
        why = f", fallback_reason={self.fallback_reason!r}" if self.fallback_reason else ""
        return f"TokenCounter({str(self.path)!r}, backend={self.backend!r}{why})"


# -- tokenizer.json parsing ---------------------------------------------------------------------------------------


def _parse_normalizer(norm: dict[str, Any] | None) -> bool:
    """Whether NFC applies; anything but nothing/NFC (possibly inside a Sequence) is unsupported."""
    if norm is None:
        return False
    if norm.get("type") == "NFC":
        return True
    if norm.get("type") == "Sequence":
        steps = [_parse_normalizer(n) for n in norm.get("normalizers", [])]
        return any(steps)
    raise Unsupported(f"normalizer {norm.get('type')!r}")


def _byte_level(pre: dict[str, Any], use_regex: bool) -> None:
    if pre.get("type") != "ByteLevel":
        raise Unsupported(f"pre-tokenizer {pre.get('type')!r} where ByteLevel was expected")
    if pre.get("add_prefix_space"):
        raise Unsupported("ByteLevel add_prefix_space=True")
    if bool(pre.get("use_regex", True)) != use_regex:
        raise Unsupported(f"ByteLevel use_regex={pre.get('use_regex', True)} in this position")


def _parse_pre_tokenizer(pre: dict[str, Any] | None) -> tuple[str, regex.Pattern[str] | None]:
    """The tiktoken pattern, and the Digits splitter to run before it (or None).

    Accepted: ``ByteLevel(use_regex=True)`` (GPT-2); ``Sequence[Split(Regex, Isolated), ByteLevel(use_regex=False)]``
    (Qwen2, Llama-3); ``Sequence[Digits, ByteLevel(use_regex=True)]`` (SmolLM2, StarCoder).
    """
    if pre is None:
        raise Unsupported("no pre-tokenizer")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1:
        _byte_level(steps[0], use_regex=True)
        return GPT2_PATTERN, None
    if len(steps) != 2:
        raise Unsupported(f"pre-tokenizer sequence of {len(steps)} steps")
    first, second = steps
    if first.get("type") == "Split":
        pattern = (first.get("pattern") or {}).get("Regex")
        if pattern is None:
            raise Unsupported("Split on a string, not a regex")
        if first.get("behavior") != "Isolated" or first.get("invert"):
            raise Unsupported(f"Split behavior {first.get('behavior')!r} invert={first.get('invert')}")
        _byte_level(second, use_regex=False)
        return pattern, None
    if first.get("type") == "Digits":
        _byte_level(second, use_regex=True)
        # `tokenizers` splits on Rust's char::is_numeric, i.e. general categories Nd, Nl, No: \p{N}, not
        # str.isnumeric (which also takes CJK numerals such as 三).
        digits = regex.compile(r"(\p{N})" if first.get("individual_digits") else r"(\p{N}+)")
        return GPT2_PATTERN, digits
    raise Unsupported(f"pre-tokenizer {first.get('type')!r}")


def _mergeable_ranks(model: dict[str, Any]) -> dict[bytes, int]:
    """tiktoken ranks from a byte-level BPE: the 256 byte tokens plus every merge result, ranked by its id.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, `tokenizers` the pair that comes
    first in ``merges``; they agree when merge results' ids follow merge order. Vocabulary entries that no merge
    produces (added tokens stored in the vocab) are left out, since tiktoken would otherwise merge into them.
    """
    vocab: dict[str, int] = model.get("vocab") or {}
    try:
        as_bytes = {piece: bytes(_BYTE_OF_CHAR[c] for c in piece) for piece in vocab}
    except KeyError as exc:
        raise Unsupported(f"vocabulary is not byte-level (character {exc.args[0]!r})") from None
    ranks: dict[bytes, int] = {}
    for piece, token in vocab.items():
        if len(as_bytes[piece]) == 1:
            ranks[as_bytes[piece]] = token
    last = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = left + right
        token = vocab.get(merged)
        if token is None or left not in vocab or right not in vocab:
            raise Unsupported(f"merge {merge!r} refers to tokens missing from the vocabulary")
        # Equal ids are allowed: vocabularies converted from tiktoken (Llama-3) list every split of a token as a
        # merge. tiktoken then breaks ties leftmost where `tokenizers` takes the earlier merge, which can differ only
        # when two splits of one token overlap in a periodic piece ("ab|a|ba"); not seen in testing.
        if token < last:
            raise Unsupported(f"token ids do not follow merge priority (merge {merge!r})")
        last = token
        ranks[as_bytes[merged]] = token
    return ranks


_AddedMatcher = tuple[re.Pattern[str], dict[str, int], frozenset[str]] | None


def _added_token_matchers(added: list[dict[str, Any]]) -> tuple[_AddedMatcher, _AddedMatcher]:
    """Matchers for the added tokens cut from raw text and from normalized text: (regex, ids, special contents)."""
    groups: tuple[dict[str, int], dict[str, int]] = ({}, {})
    special: set[str] = set()
    for tok in added:
        content = tok["content"]
        if not content:
            continue
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
            raise Unsupported(f"added token {content!r} uses lstrip/rstrip/single_word")
        # `tokenizers` defaults `normalized` to True for non-special tokens.
        normalized = bool(tok.get("normalized", not tok.get("special")))
        groups[normalized][content] = tok["id"]
        if tok.get("special"):
            special.add(content)

    def matcher(table: dict[str, int]) -> _AddedMatcher:
        if not table:
            return None
        # `tokenizers` finds added tokens leftmost-longest; an alternation sorted longest-first does the same.
        alternation = "|".join(re.escape(c) for c in sorted(table, key=len, reverse=True))
        return re.compile(alternation), table, frozenset(special & table.keys())

    return matcher(groups[False]), matcher(groups[True])


def _split_added(text: str, matcher: _AddedMatcher, allow_special: bool) -> Iterator[tuple[str, int | None]]:
    """(text, None) runs and ("", id) added tokens, in order; skipped specials stay inside their text run."""
    if matcher is None:
        if text:
            yield text, None
        return
    pattern, ids, special = matcher
    start = 0
    for m in pattern.finditer(text):
        content = m.group()
        # Like `tokenizers` with encode_special_tokens: the match still consumes the text (so no overlapping added
        # token is found inside it) but is left to the model as plain text.
        if not allow_special and content in special:
            continue
        if m.start() > start:
            yield text[start : m.start()], None
        yield "", ids[content]
        start = m.end()
    if start < len(text):
        yield text[start:], None
