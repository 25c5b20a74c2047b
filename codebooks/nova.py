"""NOVA-KV / OSCAR calibration: statistics -> transforms -> equal-volume groups -> VQ codebooks.

``calibrate(sequences)`` makes two passes over captured Q/K/V: the first accumulates
``CalibrationStats`` (mergeable), the second maps the keys and values of every head into their
NOVA-KV coefficients, splits each token into an RMS gain and a shape, groups the coefficients into
equal-volume groups of ``g`` and trains one k-means codebook of ``2^(bits*g)`` centroids per group
on the shapes (REFERENCE.md section 9: g = 4 at 2 bits, 256 centroids, 25 iterations). For the
values of NOVA-KV's release (OSCAR's rotation and INT2) it also builds, per layer, the rotation
``R = U H P_br`` of the uncentred value statistic ``sum_t w_t v_t v_t^T`` with ``w_t = k_t^T Sigma_q
k_t`` (the expected squared logit of token t under the head's pooled queries), pooled over the
layer's KV heads and all calibration tokens (``nova_value_statistic``). The result,
a ``NovaModel``, saves to and loads from an artifact folder of kind ``"nova_kv"`` that kernels and
``kvq_ref.NovaKV``/``kvq_ref.Oscar`` read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .artifacts import fail, load_artifacts, save_artifacts
from .calibration import CalibrationStats
from .grouping import equal_volume_groups
from .transforms import KeyTransform, ValueTransform, head_transforms, oscar_rotation
from .vq import gain_shape_split, train_group_codebooks

__all__ = ["NovaHead", "NovaModel", "calibrate", "head_coefficients", "nova_value_statistic"]

KIND = "nova_kv"


@dataclass(frozen=True, eq=False)
class NovaHead:
    """Everything the NOVA-KV and OSCAR quantizers of one (layer, KV head) need.

    Attributes
    ----------
    key, value : KeyTransform, ValueTransform
    key_groups, value_groups : ndarray, int64, shape (d // g, g)
        Equal-volume groups of coefficient indices.
    key_centroids, value_centroids : ndarray, float32, shape (d // g, 2**(bits*g), g)
        One codebook per group, trained on gain-normalized coefficients.
    oscar_key, oscar_value : ndarray, float64, shape (d, d)
        OSCAR rotations ``R = U H P_br``.
    nova_value : ndarray, float64, shape (d, d)
        The rotation NOVA-KV's release uses for values (module docstring), shared by a layer's heads.
    bits, g : int
        Bits per coefficient and group size.
    """

    key: KeyTransform
    value: ValueTransform
    key_groups: np.ndarray
    value_groups: np.ndarray
    key_centroids: np.ndarray
    value_centroids: np.ndarray
    oscar_key: np.ndarray
    oscar_value: np.ndarray
    nova_value: np.ndarray
    bits: int
    g: int

    @property
    def d(self) -> int:
        return self.key.mu.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array, by a stable name (what the artifact folder stores)."""
        return {
            "key.mu": self.key.mu, "key.forward": self.key.forward, "key.inverse": self.key.inverse,
            "key.variances": self.key.variances, "value.mu": self.value.mu, "value.basis": self.value.basis,
            "value.variances": self.value.variances, "key.groups": self.key_groups,
            "value.groups": self.value_groups, "key.centroids": self.key_centroids,
            "value.centroids": self.value_centroids, "oscar.key": self.oscar_key, "oscar.value": self.oscar_value,
            "nova.value": self.nova_value,
        }

    @property
    def digest(self) -> str:
        """sha256 over all arrays (identifies the head's tables in quantizer configs)."""
        h = hashlib.sha256(f"{self.bits},{self.g}".encode())
        for name, arr in self.arrays().items():
            h.update(name.encode())
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()


def head_coefficients(head: NovaHead, role: str, x: np.ndarray) -> np.ndarray:
    """NOVA-KV coefficients of keys (role "key") or values (role "value"), float64 (N, d)."""
    return (head.key if role == "key" else head.value).coefficients(x)


@dataclass
class NovaModel:
    """NOVA-KV/OSCAR tables of every calibrated (layer, KV head)."""

    heads: dict
    meta: dict

    def head(self, layer: int, head: int) -> NovaHead:
        try:
            return self.heads[(layer, head)]
        except KeyError:
            raise KeyError(f"no NOVA-KV tables for layer {layer}, KV head {head}; have {sorted(self.heads)}") from None

    def save(self, folder):
        """Write an artifact folder of kind ``"nova_kv"``."""
        entries, arrays = [], {}
        for (layer, h), hd in sorted(self.heads.items()):
            name = f"layer{layer}.head{h}"
            own = {f"{name}.{k}": v for k, v in hd.arrays().items()}
            arrays.update(own)
            entries.append({"name": name, "layer": layer, "head": h, "d": hd.d, "bits": hd.bits, "g": hd.g,
                            "key_floor": hd.key.floor, "key_n_floored": hd.key.n_floored, "arrays": list(own)})
        entries.append({"name": "meta", **self.meta, "arrays": []})
        return save_artifacts(folder, KIND, entries, arrays)

    @classmethod
    def load(cls, folder) -> "NovaModel":
        """Read what ``save`` wrote (``TableFileError`` on any corruption or inconsistency)."""
        art = load_artifacts(folder, KIND)
        heads, meta = {}, {}
        for e in art.entries:
            if e["name"] == "meta":
                meta = {k: v for k, v in e.items() if k not in ("name", "arrays")}
                continue
            a = {k.split(".", 2)[-1]: np.array(v) for k, v in art.arrays.items() if k.startswith(e["name"] + ".")}
            try:
                hd = NovaHead(
                    key=KeyTransform(a["key.mu"], a["key.forward"], a["key.inverse"], a["key.variances"],
                                     float(e["key_floor"]), int(e["key_n_floored"])),
                    value=ValueTransform(a["value.mu"], a["value.basis"], a["value.variances"]),
                    key_groups=a["key.groups"], value_groups=a["value.groups"],
                    key_centroids=a["key.centroids"], value_centroids=a["value.centroids"],
                    oscar_key=a["oscar.key"], oscar_value=a["oscar.value"], nova_value=a["nova.value"],
                    bits=int(e["bits"]), g=int(e["g"]))
            except KeyError as exc:
                fail(art.folder / "manifest.json", f"{e['name']} lacks array {exc}")
            _validate(hd, art.folder / "manifest.json", e["name"])
            heads[(int(e["layer"]), int(e["head"]))] = hd
        return cls(heads, meta)


def _validate(hd: NovaHead, path, name: str) -> None:
    d, g = hd.d, hd.g
    k = 2 ** (hd.bits * g)
    for grp in (hd.key_groups, hd.value_groups):
        if grp.shape != (d // g, g) or not np.array_equal(np.sort(grp.ravel()), np.arange(d)):
            fail(path, f"{name}: groups are not a partition of the {d} coefficients into groups of {g}")
    for cen in (hd.key_centroids, hd.value_centroids):
        if cen.shape != (d // g, k, g):
            fail(path, f"{name}: centroids have shape {cen.shape}, expected {(d // g, k, g)}")
    for nm, m in (("key.forward", hd.key.forward), ("oscar.key", hd.oscar_key), ("oscar.value", hd.oscar_value),
                  ("nova.value", hd.nova_value)):
        if m.shape != (d, d):
            fail(path, f"{name}: {nm} has shape {m.shape}")
    if not np.allclose(hd.key.forward @ hd.key.inverse, np.eye(d), atol=1e-6 * max(1.0, np.abs(hd.key.forward).max()
                                                                                  * np.abs(hd.key.inverse).max())):
        fail(path, f"{name}: key.forward and key.inverse are not inverses")


def nova_value_statistic(sequences: list, stats: CalibrationStats) -> dict:
    """Per layer, ``sum_t w_t v_t v_t^T / sum_t w_t`` with ``w_t = k_t^T Sigma_q k_t`` (uncentred), over
    every KV head of the layer and every token of ``sequences`` (``Sigma_q`` the head's, from ``stats``).

    Returns ``{layer: (d, d) float64}``; a layer whose weights are all 0 raises ValueError.
    """
    acc: dict = {}
    for seq in sequences:
        for layer, (_, k, v) in seq.items():
            k = np.asarray(k, dtype=np.float64)
            v = np.asarray(v, dtype=np.float64)
            for h in range(k.shape[0]):
                sq = stats.head(layer, h).sigma_q
                w = np.einsum("td,de,te->t", k[h], sq, k[h])
                m, tot = acc.get(layer, (0.0, 0.0))
                acc[layer] = (m + (v[h] * w[:, None]).T @ v[h], tot + float(w.sum()))
    out = {}
    for layer, (m, tot) in acc.items():
        if not tot > 0:
            raise ValueError(f"layer {layer}: the value statistic has no weight (all k^T Sigma_q k are 0)")
        out[layer] = m / tot
    return out


def calibrate(sequences: Iterable, d: int, g: int = 4, bits: int = 2, iterations: int = 25, seed: int = 0,
              grouping: str = "round_robin", max_train_tokens: int = 32768, scale: float | None = None):
    """Calibrate NOVA-KV and OSCAR from captured attention inputs.

    Parameters
    ----------
    sequences : iterable of dict, re-iterable (a list)
        Each item maps ``layer -> (q, k, v)`` with ``q`` (Hq, T, d) and ``k, v`` (Hkv, T, d) of one
        calibration sequence (post-RoPE, before the GQA repeat).
    d : int
        Head dimension.
    g, bits : int
        Coefficients per VQ group and bits per coefficient (``bits * g <= 8``).
    iterations, seed : int
        k-means settings (deterministic).
    grouping : str
        Equal-volume grouping heuristic (see ``codebooks.grouping``): ``"round_robin"``, the stratified
        grouping of NOVA-KV's release (default); ``"swap"`` refines greedy groups by pairwise swaps
        (a smaller grouping gap; its effect is in benchmarks/results/fidelity.json).
    max_train_tokens : int
        Tokens per head used to train the codebooks (the first ones, in sequence order).
    scale : float, optional
        Attention logit scale (default 1/sqrt(d)).

    Returns
    -------
    stats : CalibrationStats
    model : NovaModel
    """
    sequences = list(sequences)
    if not sequences:
        raise ValueError("sequences must contain at least one calibration sequence")
    if isinstance(bits, bool) or not isinstance(bits, int) or not isinstance(g, int) or bits < 1 or g < 1 \
            or bits * g > 8 or d % g:
        raise ValueError(f"need integer bits, g >= 1 with bits*g <= 8 and g dividing d={d}; got bits={bits}, g={g}")
    stats = CalibrationStats(d)
    for seq in sequences:
        for layer, (q, k, v) in seq.items():
            stats.update(layer, q, k, v, scale=scale)
    heads = {}
    value_rotations = {layer: oscar_rotation(w) for layer, w in nova_value_statistic(sequences, stats).items()}
    for (layer, h), st in sorted(stats.heads.items()):
        st.check(min_tokens=max(d + 1, 2 ** (bits * g)),
                 why=f"the transforms (d + 1 = {d + 1}) and codebooks (2^(bits*g) = {2 ** (bits * g)} centroids)")
        tr = head_transforms(st)
        keys = np.concatenate([np.asarray(seq[layer][1][h], dtype=np.float64) for seq in sequences])[:max_train_tokens]
        vals = np.concatenate([np.asarray(seq[layer][2][h], dtype=np.float64) for seq in sequences])[:max_train_tokens]
        parts = {}
        for role, tf, x in (("key", tr["key"], keys), ("value", tr["value"], vals)):
            grp = equal_volume_groups(np.maximum(tf.variances, 1e-300), g, method=grouping)
            _, shapes = gain_shape_split(tf.coefficients(x))
            books = train_group_codebooks(shapes, grp.groups, bits_per_coef=bits, iterations=iterations,
                                          seed=seed + 7919 * (2 * (layer * 1000 + h) + (role == "value")))
            parts[role] = (grp.groups.astype(np.int64), np.stack([b.centroids for b in books]).astype(np.float32))
        heads[(layer, h)] = NovaHead(tr["key"], tr["value"], parts["key"][0], parts["value"][0], parts["key"][1],
                                     parts["value"][1], tr["oscar_key"], tr["oscar_value"], value_rotations[layer],
                                     bits, g)
    meta = {"d": d, "g": g, "bits": bits, "iterations": iterations, "seed": seed, "grouping": grouping,
            "max_train_tokens": max_train_tokens, "sequences": len(sequences)}
    return stats, NovaModel(heads, meta)
