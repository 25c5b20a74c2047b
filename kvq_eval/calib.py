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
from typing import Callable

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
    """NOVA-KV/OSCAR tables and calibration statistics of a model.

    ``model`` is calibrated with ``grouping="swap"`` (the settings of the committed ``nova``/``oscar``
    results); ``official_model()`` is the same calibration with NOVA-KV's release grouping
    (``"round_robin"``), made on first use by ``official_loader`` and kept.
    """

    model: NovaModel
    stats: CalibrationStats
    official_loader: Callable[[], NovaModel] | None = None

    def official_model(self) -> NovaModel:
        """The ``grouping="round_robin"`` NovaModel (NOVA-KV's release default), computed once."""
        cached = self.__dict__.get("_official")
        if cached is None:
            if self.official_loader is None:
                raise ValueError("these calibration tables have no round_robin calibration (official_loader)")
            cached = self.__dict__["_official"] = self.official_loader()
        return cached

    def channel_rms(self, layer: int, head: int, role: str) -> np.ndarray:
        """Per-channel RMS of the calibration keys (or score-weighted values): outlier selection."""
        st = self.stats.head(layer, head)
        m = st.keys if role == "key" else st.values_s1
        return np.sqrt(np.diag(m.cov) + m.mean**2)


def calibration_tables(model, tok, name: str, sequences: int = 2, length: int = 1024,
                       iterations: int = 25, seed: int = 0, folder: Path | None = None,
                       grouping: str = "swap") -> CalibrationTables:
    """Calibrate on the fixture's ``calibration`` part (cached by a hash of the settings).

    ``folder`` (default: a cache folder named by a hash of the settings) holds the ``"swap"``
    calibration; ``grouping="swap"`` (default) also attaches the lazily computed ``"round_robin"``
    one (``CalibrationTables.official_model``), cached in ``<folder>-round_robin``.
    """
    if grouping not in ("swap", "round_robin"):
        raise ValueError(f"grouping must be 'swap' or 'round_robin', got {grouping!r}")
    # the key of the committed results' (swap) calibration; round_robin lives beside it
    key = hashlib.sha256(f"{name}|{sequences}|{length}|{iterations}|{seed}|v2".encode()).hexdigest()[:12]
    swap_folder = Path(folder) if folder is not None else cache_dir() / "calibration" / f"{name}-{key}"
    folder = swap_folder if grouping == "swap" else Path(f"{swap_folder}-{grouping}")
    loader = None
    if grouping == "swap":
        def loader():
            return calibration_tables(model, tok, name, sequences, length, iterations, seed, swap_folder,
                                      grouping="round_robin").model
    if (folder / "nova_kv" / "manifest.json").is_file() and (folder / "calibration" / "manifest.json").is_file():
        return CalibrationTables(NovaModel.load(folder / "nova_kv"), CalibrationStats.load(folder / "calibration"),
                                 loader)
    seqs = [capture(model, ids) for ids in token_chunks(tok, part("calibration"), length, sequences)]
    d = next(iter(seqs[0].values()))[0].shape[-1]
    stats, nova = calibrate(seqs, d, iterations=iterations, seed=seed, grouping=grouping)
    nova.save(folder / "nova_kv")
    stats.save(folder / "calibration")
    return CalibrationTables(nova, stats, loader)
