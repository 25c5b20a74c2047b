"""Stored bits as the cache holds them: band at 16 bits, middle at the method's rate, calibrated tables.

Notes
-----
Three parts make up what a deployment stores for a context of ``T`` tokens:

* the band (``kvq_eval.band``): float16, 16 bits per element;
* the middle tokens: the method's measured rate ``r`` (``method_rate``: bytes of its encoding of a
  64-token block, side information included, times 8, per element), averaged over keys and values;
* calibrated tables, per (layer, KV head, role): NOVA-KV's transform and centroid tables, OSCAR's
  rotation, the split method's outlier-channel list, mean-centred keys' channel mean
  (``table_bits``). Float arrays are counted at float32 (4 bytes per number, what a kernel loads),
  index arrays at one byte per entry (head dimensions are at most 256). Seeded rotations and
  sketches are regenerated from the seed and cost nothing.

Perplexity windows read the cache at every length 1..T, so their bits are pair-weighted
(``pair_weighted_bits``): the mean over all causal (query, key) pairs of the key's storage cost,
plus the tables spread over the ``T``-token cache. A needle cell reports the cache it decoded from
(``cache_bits``).
"""

from __future__ import annotations

import numpy as np

from .band import n_encoded, token_group

__all__ = ["method_rate", "table_bits", "spec_rates", "pair_weighted_bits", "cache_bits"]


def method_rate(quantizer, d: int) -> float:
    """Stored bits per element of ``quantizer`` on a 64-token block (every method's layout is
    data-independent; a fixed Gaussian block is encoded)."""
    x = np.random.default_rng(0).standard_normal((64, d))
    enc = quantizer.encode(x)
    return 8.0 * sum(a.nbytes for a in enc.arrays.values()) / x.size


def _nbytes32(arrays) -> int:
    return sum(4 * a.size if np.issubdtype(a.dtype, np.floating) else a.size for a in arrays)


def table_bits(quantizer) -> int:
    """Bits of calibrated tables one (layer, head, role) quantizer needs (module Notes); 0 if none."""
    from kvq_ref.nova import NovaKV, Oscar
    from kvq_ref.turboquant import TurboQuantSplit

    from .keyopts import CenteredKeys

    if isinstance(quantizer, CenteredKeys):
        return 8 * 4 * len(quantizer.mu) + table_bits(quantizer.inner)
    if isinstance(quantizer, NovaKV):
        if quantizer.int2 is not None:  # the release's value path: OSCAR INT2 on the nova_value rotation
            return 8 * 4 * quantizer.dim * quantizer.dim
        arrays = quantizer.head.arrays()
        role = quantizer.role
        return 8 * _nbytes32(a for name, a in arrays.items()
                             if name.startswith(role + ".") and not name.endswith("variances"))
    if isinstance(quantizer, Oscar):
        return 8 * 4 * quantizer.dim * quantizer.dim
    if isinstance(quantizer, TurboQuantSplit):
        return 8 * len(quantizer.outliers)
    return 0


def spec_rates(spec, n_layers: int, n_heads: int, d: int) -> dict:
    """``rate`` (mean middle bits per element over every head and both roles), ``group`` (token
    group) and ``table_bits`` (all layers and heads) of a ``MethodSpec``."""
    rates, tables, group = [], 0, 1
    for layer in range(n_layers):
        for h in range(n_heads):
            km, vm = spec.key(layer, h, d), spec.value(layer, h, d)
            rates += [method_rate(km, d), method_rate(vm, d)]
            tables += table_bits(km) + table_bits(vm)
            group = max(group, token_group(km), token_group(vm))
    return {"rate": float(np.mean(rates)), "group": group, "table_bits": int(tables)}


def pair_weighted_bits(T: int, sink: int, window: int, group: int, rate: float, tables: int,
                       n_layers: int, n_heads: int, d: int) -> dict:
    """Stored bits per element of a ``T``-token teacher-forced window (module Notes).

    Returns
    -------
    dict
        ``bits`` (pair-weighted, tables included), ``band_pairs`` (fraction of causal pairs whose key
        is in the band) and ``table_bits_per_element`` (tables over the ``T``-token cache).
    """
    n = np.arange(1, T + 1)
    mid = n_encoded(n, sink, window, group)
    pairs = n.sum()
    band_pairs = float((n - mid).sum() / pairs)
    per_elem_tables = tables / (2.0 * T * d * n_heads * n_layers)
    bits = 16.0 * band_pairs + rate * (1.0 - band_pairs) + per_elem_tables
    return {"bits": float(bits), "band_pairs": band_pairs, "table_bits_per_element": float(per_elem_tables)}


def cache_bits(cache, tables: int) -> float:
    """Bits per element a ``QuantizedCache`` holds, calibrated tables included."""
    stored = [s.bits() for s in cache.stores.values()]
    return (sum(b for b, _ in stored) + tables) / sum(e for _, e in stored)
