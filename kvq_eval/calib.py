"""Capture of exact attention inputs, and calibration of NOVA-KV/OSCAR on a disjoint text part.

``capture(model, ids)`` runs the model once with the ``kvq`` attention in capture mode and returns
every layer's post-RoPE q (Hq, T, d), k and v (Hkv, T, d). ``save_qkv`` writes them in the format
``kvq-codebooks calibrate --qkv`` reads. ``calibration_tables`` calibrates on the fixture's
``calibration`` part (never on evaluation text) and caches the result under the cache folder.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from codebooks.calibration import CalibrationStats
from codebooks.nova import NovaModel, calibrate

from .hooks import register, session
from .models import cache_dir
from .text import part

__all__ = ["capture", "save_qkv", "CalibrationTables", "calibration_tables", "token_chunks"]


def capture(model, ids) -> dict:
    """{layer: (q, k, v)} float32 arrays of one forward pass over ``ids`` (1, T)."""
    import torch

    register()
    prev = model.config._attn_implementation
    model.set_attn_implementation("kvq")
    try:
        with session("capture") as s, torch.no_grad():
            model(ids)
    finally:
        model.set_attn_implementation(prev)
    return {layer: parts[0] for layer, parts in s.captured.items()}


def save_qkv(sequences: list[dict], path) -> Path:
    """Write captured sequences as ``layer{L}.q/.k/.v`` tensors with a leading sequence axis."""
    from safetensors.numpy import save_file

    tensors = {}
    for layer in sorted(sequences[0]):
        for i, name in enumerate("qkv"):
            tensors[f"layer{layer}.{name}"] = np.stack([s[layer][i] for s in sequences]).astype(np.float32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def token_chunks(tok, text: str, length: int, count: int):
    """``count`` consecutive, non-overlapping token id tensors (1, length) from ``text``."""
    import torch

    ids = tok(text, return_tensors="pt").input_ids[0]
    if ids.numel() < length * count:
        raise ValueError(f"text has {ids.numel()} tokens, need {length * count}")
    return [ids[i * length:(i + 1) * length].unsqueeze(0) for i in range(count)]


@dataclass(eq=False)  # hashed by identity: method instances are cached per tables object
class CalibrationTables:
    """NOVA-KV/OSCAR tables and calibration statistics of a model."""

    model: NovaModel
    stats: CalibrationStats

    def channel_rms(self, layer: int, head: int, role: str) -> np.ndarray:
        """Per-channel RMS of the calibration keys (or score-weighted values): outlier selection."""
        st = self.stats.head(layer, head)
        m = st.keys if role == "key" else st.values_s1
        return np.sqrt(np.diag(m.cov) + m.mean**2)


def calibration_tables(model, tok, name: str, sequences: int = 2, length: int = 1024,
                       iterations: int = 25, seed: int = 0, folder: Path | None = None) -> CalibrationTables:
    """Calibrate on the fixture's ``calibration`` part (cached by a hash of the settings)."""
    key = hashlib.sha256(f"{name}|{sequences}|{length}|{iterations}|{seed}|v2".encode()).hexdigest()[:12]
    folder = Path(folder) if folder is not None else cache_dir() / "calibration" / f"{name}-{key}"
    if (folder / "nova_kv" / "manifest.json").is_file() and (folder / "calibration" / "manifest.json").is_file():
        return CalibrationTables(NovaModel.load(folder / "nova_kv"), CalibrationStats.load(folder / "calibration"))
    seqs = [capture(model, ids) for ids in token_chunks(tok, part("calibration"), length, sequences)]
    d = next(iter(seqs[0].values()))[0].shape[-1]
    # grouping="swap": the settings of the committed NOVA-KV results (calibrate's default is the release's round_robin)
    stats, nova = calibrate(seqs, d, iterations=iterations, seed=seed, grouping="swap")
    nova.save(folder / "nova_kv")
    stats.save(folder / "calibration")
    return CalibrationTables(nova, stats)
