"""RULER's tasks, generated offline from ``nvidia-long-context-eval`` (the ``ruler`` extra), and RULER's scoring.

The package ships RULER's generator scripts (``long_context_eval/data/synthetic/niah.py``,
``variable_tracking.py``, ``common_words_extraction.py``, ``freq_words_extraction.py``, ``qa.py``), their task
table (``long_context_eval/synthetic.yaml``), templates and answer prefixes (``data/synthetic/constants.py``)
and metrics (``eval/synthetic/constants.py``). The scripts parse ``sys.argv`` at import and read a tokenizer
by path; here each is imported once as a module with its arguments given, its tokenizer replaced by the
model's own (counting the prompt as the model will see it: chat template, then the answer prefix) and its
generating functions called as ``prepare.py``'s subprocess would (template ``base``, seed 42). Two
workarounds, both outside RULER's logic:

- ``nltk.sent_tokenize`` (needle placement in essays) needs punkt data that is not available offline: a regex
  splitter (after ``.``, ``!`` or ``?`` followed by white space) stands in for it;
- the answer prefix (" The special magic numbers for ... are") starts the assistant's reply, after the chat
  template's assistant tag, as RULER's own chat templates (``data/template.py``) put it; left inside the user
  message, Qwen2.5-Coder-0.5B scored 0 on ``vt`` even with the full cache.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import random
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("niah", "variable_tracking", "common_words_extraction", "freq_words_extraction", "qa")
SEED = 42  # prepare.py: random_seed = 42 + chunk_idx, one chunk


def _package() -> Path:
    try:
        import long_context_eval
    except ImportError:
        raise ImportError("bench ruler needs RULER's generators: pip install 'snapkv-sessions[ruler]' "
                          "(nvidia-long-context-eval, wonderwords, tenacity)") from None
    return Path(long_context_eval.__file__).parent


def task_table() -> dict[str, dict]:
    """RULER's 13 tasks: ``synthetic.yaml``'s arguments merged with the kind's template, answer prefix and
    tokens to generate (as ``prepare.py`` merges them)."""
    import yaml

    pkg = _package()  # first: a clear error when the extra is not installed
    from long_context_eval.data.synthetic.constants import TASKS as BASE

    with open(pkg / "synthetic.yaml") as fh:
        custom = yaml.safe_load(fh)
    return {name: {**cfg, **BASE[cfg["task"]]} for name, cfg in custom.items()}


def sent_tokenize(text: str) -> list[str]:
    """Stands in for ``nltk.sent_tokenize`` (punkt is not available offline)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def render(tok, user: str, answer_prefix: str = "") -> str:
    """The prompt text: the chat template of the user message with the generation prompt, then the answer
    prefix as the start of the assistant's reply."""
    text = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    return text + answer_prefix


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class _Counter:
    """RULER's tokenizer interface (``text_to_tokens``) on the model's tokenizer, counting a raw RULER input
    (task template + answer prefix, as template ``base`` makes it) as the rendered prompt."""

    def __init__(self, tok, head: str):
        self.tok, self.head = tok, head

    def text_to_tokens(self, text: str) -> list[int]:
        user, prefix = split_prefix(text, self.head)
        return encode(self.tok, render(self.tok, user, prefix))


def split_prefix(text: str, head: str) -> tuple[str, str]:
    """(user message, answer prefix) of a raw RULER input: the prefix is the last occurrence of its head."""
    at = text.rfind(head)
    return (text, "") if at < 0 else (text[:at], text[at:])


def _prefix_head(cfg: dict) -> str:
    return cfg["answer_prefix"].split("{")[0]


@contextlib.contextmanager
def _script_imports(tokenizer_holder: list):
    """What the scripts import besides the package: ``nltk.tokenize.sent_tokenize``, and (run as scripts from
    their own folder) ``constants`` and ``tokenizer``. Restored after the import."""
    from long_context_eval.data import tokenizer as lce_tok
    from long_context_eval.data.synthetic import constants

    nltk, nltk_tok = types.ModuleType("nltk"), types.ModuleType("nltk.tokenize")
    nltk_tok.sent_tokenize = sent_tokenize
    nltk.tokenize = nltk_tok
    shim = types.ModuleType("tokenizer")
    shim.select_tokenizer = lambda *_: tokenizer_holder[0]
    names = {"nltk": nltk, "nltk.tokenize": nltk_tok, "constants": constants, "tokenizer": shim}
    saved = {n: sys.modules.get(n) for n in names}
    saved_select = lce_tok.select_tokenizer
    sys.modules.update(names)
    lce_tok.select_tokenizer = shim.select_tokenizer
    try:
        yield
    finally:
        lce_tok.select_tokenizer = saved_select
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


_MODULES: dict[str, types.ModuleType] = {}


def _module(kind: str, cfg: dict) -> types.ModuleType:
    """The kind's generator script as a module, imported once (niah builds a 6M-word list at import), with the
    arguments prepare.py would give it; later tasks of the kind reset the task arguments (:func:`_configure`)."""
    if kind in _MODULES:
        return _MODULES[kind]
    path = _package() / "data" / "synthetic" / f"{kind}.py"
    argv = ["ruler", "--save_dir", os.devnull, "--save_name", "x", "--tokenizer_path", "-", "--max_seq_length", "1",
            "--tokens_to_generate", str(cfg["tokens_to_generate"]), "--num_samples", "1",
            "--random_seed", str(SEED), "--template", cfg["template"] + cfg["answer_prefix"]]
    for k, v in cfg["args"].items():
        argv += [f"--{k}", str(v)]
    holder = [None]
    saved_argv, state = sys.argv, _rng_state()
    sys.argv = argv
    try:
        with _script_imports(holder), _quiet():
            spec = importlib.util.spec_from_file_location(f"_ruler_{kind}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
    finally:
        sys.argv = saved_argv
        _rng_restore(state)
    _MODULES[kind] = mod
    return mod


def _configure(mod: types.ModuleType, kind: str, cfg: dict, length: int) -> None:
    """Set the module's arguments for one task and length, as a fresh ``python {kind}.py ...`` run would."""
    a = mod.args
    a.max_seq_length, a.random_seed = length, SEED
    a.tokens_to_generate = cfg["tokens_to_generate"]
    a.template = cfg["template"] + cfg["answer_prefix"]  # model_template_type "base" + answer prefix (prepare.py)
    for k, v in cfg["args"].items():
        setattr(a, k, v)
    if kind == "niah":  # niah.py's module level, after parse_args
        a.num_needle_k = max(a.num_needle_k, a.num_needle_q)
        if a.type_haystack == "essay":
            essay = (_package() / "data" / "synthetic" / "json" / "PaulGrahamEssays.json").read_text()
            import json

            mod.haystack = re.sub(r"\s+", " ", json.loads(essay)["text"]).split(" ")
        elif a.type_haystack == "repeat":
            mod.haystack = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
        else:
            mod.haystack = mod.needle
    if kind == "qa":  # qa.py's module level: the dataset read at import
        a.pre_samples = 0
        folder = _package() / "data" / "synthetic" / "json"
        read = mod.read_squad if a.dataset == "squad" else mod.read_hotpotqa
        mod.QAS, mod.DOCS = read(str(folder / f"{a.dataset}.json"))


def _raw_samples(mod: types.ModuleType, kind: str, cfg: dict, length: int, n: int) -> list[dict]:
    """The script's own sample generation (each script's ``main`` without the file)."""
    a = mod.args
    if kind == "niah":
        return mod.generate_samples(num_samples=n, max_seq_length=length, save_dir=None)
    if kind == "variable_tracking":
        icl = mod.sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500, incremental=5,
                                              num_chains=a.num_chains, num_hops=a.num_hops)[0]
        return mod.sys_vartrack_w_noise_random(num_samples=n, max_seq_length=length, num_chains=a.num_chains,
                                               num_hops=a.num_hops, icl_example=icl)
    if kind == "common_words_extraction":
        return mod.sys_word_pair_random(num_samples=n, max_seq_length=length, save_dir=None)
    if kind == "freq_words_extraction":
        return mod.sys_kwext(num_samples=n, max_seq_length=length, incremental=10)
    return mod.generate_samples(num_samples=n, max_seq_length=length, save_dir=None)


@dataclass
class Item:
    """One RULER sample, split for the three settings."""

    task: str
    index: int
    context: str  # the user message up to the question (the haystack and the task's instructions)
    question: str  # the rest of the user message
    answer_prefix: str  # the start of the assistant's reply
    outputs: list[str]  # the references
    ruler_length: int  # RULER's count: prompt tokens + tokens to generate (<= the requested length)
    extra: list[tuple[str, list[str]]] = field(default_factory=list)  # more questions on this haystack (multi-turn)

    @property
    def user(self) -> str:
        return self.context + self.question


def generate(task: str, tok, length: int, n: int) -> list[Item]:
    """``n`` items of ``task`` at ``length`` tokens (prompt + tokens to generate, RULER's definition), with the
    model's tokenizer and chat template. Deterministic: the same items for the same tokenizer and length."""
    table = task_table()
    if task not in table:
        raise ValueError(f"task={task!r}: not a RULER task (one of {sorted(table)})")
    cfg = table[task]
    kind = cfg["task"]
    mod = _module(kind, cfg)
    _configure(mod, kind, cfg, length)
    head = _prefix_head(cfg)
    mod.TOKENIZER = _Counter(tok, head)
    state = _rng_state()
    import numpy as np

    random.seed(SEED)
    np.random.seed(SEED)
    try:
        with _quiet():
            raw = _raw_samples(mod, kind, cfg, length, n)
    finally:
        _rng_restore(state)
    out = []
    for row in raw:
        user, prefix = split_prefix(row["input"], head)
        context, question = split_question(user, cfg)
        item = Item(task, row["index"], context, question, prefix, list(row["outputs"]), row["length"])
        if kind == "niah":
            item.extra = niah_extra_questions(item, cfg)
        out.append(item)
    return out


def split_question(user: str, cfg: dict) -> tuple[str, str]:
    """(context, question): the question starts where the template's text after ``{context}`` starts (its last
    occurrence; niah's single-needle wording replaces "are all" and "are" with "is")."""
    tail = cfg["template"].split("{context}")[1].split("{")[0]
    for head in (tail, tail.replace("are all", "is").replace("are", "is")):
        at = user.rfind(head)
        if at >= 0:
            return user[:at], user[at:]
    raise ValueError(f"no question found after the context ({tail!r})")


_NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")


def niah_extra_questions(item: Item, cfg: dict, most: int = 2) -> list[tuple[str, list[str]]]:
    """Further questions on the same haystack for the multi-turn setting: keys of needles the item's question
    does not ask, each asked with the task's single-key wording (all its values expected)."""
    if cfg["args"].get("type_haystack") == "needle":
        return []  # the haystack is made of distractor needles: every key would qualify
    values: dict[str, list[str]] = {}
    kind_of: dict[str, str] = {}
    for kind, key, value in _NEEDLE.findall(item.context):
        values.setdefault(key, []).append(value)
        kind_of[key] = kind
    asked = [k for k in values if k in item.question]
    out = []
    for key in [k for k in values if k not in asked][:most]:
        kind = kind_of[key]
        many = len(values[key]) > 1
        noun = kind if many else kind[:-1]
        verb = "are all" if many else "is"
        out.append((f"\nWhat {verb} the special magic {noun} for {key} mentioned in the provided text?",
                    values[key]))
    return out


# ---------------------------------------------------------------- scoring (RULER's own: eval/synthetic/constants.py)

def metric(task: str) -> str:
    """``string_match_part`` for the QA tasks, ``string_match_all`` for the others (RULER's table)."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    return METRICS[task_table()[task]["task"]]["metric_fn"].__name__


def score(task_or_metric: str, reply: str, refs: list[str]) -> float:
    """RULER's per-sample score, 0-100, of one reply after RULER's ``postprocess_pred``."""
    from long_context_eval.eval.synthetic import constants

    name = task_or_metric if task_or_metric.startswith("string_match") else metric(task_or_metric)
    fn = getattr(constants, f"{name}_per_sample")
    return float(fn([postprocess(reply)], [refs])[0])


def postprocess(reply: str) -> str:
    """RULER's ``postprocess_pred`` (eval/evaluate.py): strip, control characters to newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", (reply or "").strip()).strip()


@contextlib.contextmanager
def _quiet():
    """The scripts print each length tried and a tqdm bar."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _rng_state():
    import numpy as np

    return random.getstate(), np.random.get_state()


def _rng_restore(state) -> None:
    import numpy as np

    random.setstate(state[0])
    np.random.set_state(state[1])
