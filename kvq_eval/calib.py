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
from .models import cache_dir, slug
from .provenance import artifact_digest
from .text import part

__all__ = ["capture", "save_qkv", "CalibrationTables", "calibration_tables", "calibration_folder", "stored_digests",
           "token_chunks"]


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


def token_chunks(tok, text: str, length: int, count: int, spread: bool = False):
    """``count`` non-overlapping token id tensors (1, length) from ``text``: consecutive from its
    start, or with ``spread`` starting at ``i * (N // count)`` (``N`` tokens in all), so that short
    windows sample the whole text rather than one stretch of it."""
    ids = tok(text, return_tensors="pt").input_ids[0]
    if ids.numel() < length * count:
        raise ValueError(f"text has {ids.numel()} tokens, need {length * count} ({count} windows of {length})")
    stride = ids.numel() // count if spread else length
    return [ids[i * stride:i * stride + length].unsqueeze(0) for i in range(count)]


@dataclass(eq=False)  # hashed by identity: method instances are cached per tables object
class CalibrationTables:
    """NOVA-KV/OSCAR tables and calibration statistics of a model.

    ``model`` is calibrated with ``grouping="swap"`` (the settings of the committed ``nova``/``oscar``
    results); ``official_model()`` is the same calibration with NOVA-KV's release grouping
    (``"round_robin"``), made on first use by ``official_loader`` and kept.
    """

    model: NovaModel
    stats: CalibrationStats
    official_loader: Callable[[], "CalibrationTables | NovaModel"] | None = None
    folder: Path | None = None

    def official_tables(self) -> "CalibrationTables":
        """The ``grouping="round_robin"`` calibration (NOVA-KV's release default), computed once."""
        cached = self.__dict__.get("_official")
        if cached is None:
            if self.official_loader is None:
                raise ValueError("these calibration tables have no round_robin calibration (official_loader)")
            got = self.official_loader()  # CalibrationTables, or a bare NovaModel on these statistics
            cached = got if isinstance(got, CalibrationTables) else CalibrationTables(got, self.stats)
            self.__dict__["_official"] = cached
        return cached

    def official_model(self) -> NovaModel:
        """The ``grouping="round_robin"`` NovaModel (``official_tables().model``)."""
        return self.official_tables().model

    def digests(self, official: bool = False) -> dict:
        """``{"calibration": ..., "nova_kv": ...}``: the artifact digests (``provenance.artifact_digest``)
        of the statistics and the NOVA-KV tables a method reads; ``official`` adds the round_robin
        tables as ``"nova_kv_round_robin"``. Empty for tables not made by ``calibration_tables``."""
        if self.folder is None:
            return {}
        out = {"calibration": artifact_digest(self.folder / "calibration"),
               "nova_kv": artifact_digest(self.folder / "nova_kv")}
        if official:
            out["nova_kv_round_robin"] = artifact_digest(self.official_tables().folder / "nova_kv")
        return out

    def channel_rms(self, layer: int, head: int, role: str) -> np.ndarray:
        """Per-channel RMS of the calibration keys (or score-weighted values): outlier selection."""
        st = self.stats.head(layer, head)
        m = st.keys if role == "key" else st.values_s1
        return np.sqrt(np.diag(m.cov) + m.mean**2)


def calibration_folder(name: str, sequences: int = 2, length: int = 1024, iterations: int = 25,
                       seed: int = 0) -> Path:
    """The cache folder of a model's (swap) calibration with these settings; the round_robin one is
    ``<folder>-round_robin``. The portable numeric path (``provenance.numerics``) has folders of its
    own: its calibration is computed with other kernels, and its last bits differ."""
    from .provenance import numerics

    path = "|portable" if numerics() == "portable" else ""
    key = hashlib.sha256(f"{name}|{sequences}|{length}|{iterations}|{seed}|v2{path}".encode()).hexdigest()[:12]
    return cache_dir() / "calibration" / f"{slug(name)}-{key}"


def stored_digests(name: str, length: int, official: bool = False, seed: int = 0) -> dict | None:
    """``CalibrationTables.digests`` of the calibration already on this machine (default settings,
    ``length`` tokens per sequence, k-means ``seed``), or None when it is not (or only partly) there.
    Computes nothing."""
    folder = calibration_folder(name, length=length, seed=seed)
    parts = [folder / "calibration", folder / "nova_kv"] + ([Path(f"{folder}-round_robin") / "nova_kv"] if official else [])
    if not all((p / "manifest.json").is_file() for p in parts):
        return None
    out = {"calibration": artifact_digest(parts[0]), "nova_kv": artifact_digest(parts[1])}
    if official:
        out["nova_kv_round_robin"] = artifact_digest(parts[2])
    return out


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
    swap_folder = Path(folder) if folder is not None else calibration_folder(name, sequences, length, iterations, seed)
    folder = swap_folder if grouping == "swap" else Path(f"{swap_folder}-{grouping}")
    loader = None
    if grouping == "swap":
        def loader():
            return calibration_tables(model, tok, name, sequences, length, iterations, seed, swap_folder,
                                      grouping="round_robin")
    if (folder / "nova_kv" / "manifest.json").is_file() and (folder / "calibration" / "manifest.json").is_file():
        return CalibrationTables(NovaModel.load(folder / "nova_kv"), CalibrationStats.load(folder / "calibration"),
                                 loader, folder)
    seqs = [capture(model, ids) for ids in token_chunks(tok, part("calibration"), length, sequences)]
    d = next(iter(seqs[0].values()))[0].shape[-1]
    stats, nova = calibrate(seqs, d, iterations=iterations, seed=seed, grouping=grouping)
    nova.save(folder / "nova_kv")
    stats.save(folder / "calibration")
    return CalibrationTables(nova, stats, loader, folder)
