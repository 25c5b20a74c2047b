"""NOVA-KV and OSCAR against TurboQuant, QuaRot and KIVI on synthetic non-commuting attention data.

Run from the repository root::

    python benchmarks/bench_nova.py [--out benchmarks/results/nova.json] [--quick]

Data (``make_model`` / ``sample_sequence``)
-------------------------------------------
One layer with ``KV_HEADS`` KV heads and ``GQA`` query heads per KV head (consecutive query heads
form a group), head dimension d in {64, 128, 256} (``--quick``: {64, 128}), ``T`` tokens per
sequence, no positional structure (tokens are i.i.d. given the model). The *model* of each head is
drawn once per d from ``default_rng([MODEL_SEED, d])``; each *sequence* draws its tokens from
``default_rng([seed, d])`` with calibration seeds ``CALIB_SEED0 + i`` and disjoint held-out seeds
``HELDOUT_SEED0 + i``, so calibration and held-out data share the generator but no draws.

* Queries: ``q = x A_j^T`` with ``x ~ N(0, I_d)`` and, for query head j of the group,
  ``A_j = c (U diag(s * u_j) B_j^T + QUERY_NOISE * G_j / sqrt(d))``: ``U`` (d, r) orthonormal
  strong directions shared by the group, ``s = QUERY_STRENGTH * QUERY_DECAY**i`` (i < r =
  ``QUERY_RANK``), ``u_j ~ U(0.5, 1.5)^r`` per head, ``B_j`` (d, r) orthonormal, ``G_j`` i.i.d.
  N(0, 1). So ``Sigma_q = E[q q^T]`` (pooled over the group) is a few strong directions on an
  isotropic floor. ``c`` is set per KV head so that the scaled logit standard deviation over tokens,
  ``sqrt(tr(Sigma_q C_k) / d)``, equals ``LOGIT_STD`` (softmax neither uniform nor one-hot).
* Keys: ``k = z diag(lambda_k)^(1/2) Q_k^T + mu_k`` with ``z ~ N(0, I_d)``, ``Q_k`` a Haar-random
  rotation (independent of ``U``, so Sigma_q and C_k do not commute), variances decaying
  geometrically, ``lambda_i = KEY_SPREAD**(-i/(d-1))`` normalized to mean 1, and a channel offset
  ``mu_k = KEY_OFFSET_NOISE * N(0, 1)`` plus ``KEY_OUTLIER_OFFSET`` on ``KEY_OUTLIER_CHANNELS``
  random channels (the outlier channels of real keys).
* Values: the same construction with an independent rotation, ``VALUE_SPREAD`` and offset
  ``VALUE_OFFSET_NOISE * N(0, 1)`` (no outlier channels), independent of keys and queries.

``config.data`` records, per head and from the generator's exact Sigma_q and C_k, the normalized
commutator ``||Sigma_q C_k - C_k Sigma_q||_F / (||Sigma_q||_F ||C_k||_F)`` and the high-rate excess
of the best-aligned rotations (``data_diagnostics``), and the exact logits' variance.

Measurements
------------
1. Calibration: ``codebooks.nova.calibrate`` on the calibration sequences (defaults: g = 4, 2 bits,
   25 k-means iterations), after a warm-up on a toy problem (Numba JIT/cache load not timed).
   ``stats_seconds``: the statistics pass alone (``CalibrationStats.update`` over every sequence,
   the first pass of ``calibrate``); ``total_seconds``: the whole ``calibrate`` call (statistics,
   transforms, grouping, k-means). Best of ``FULL["calib_repeats"][d]`` runs (3, 3, 2 for
   d = 64, 128, 256; 1 with ``--quick``); this VM's timing noise is about +-25 %.
2. Held-out quality, per KV head of every held-out sequence, with the methods at their native
   2-bit settings (rates differ a little; the stored rate is reported, never a formula):

   These are the settings of the committed results (``OURS``: the modules' named variants; the
   official defaults are in README "Fidelity" and benchmarks/fidelity.py), on tables calibrated with
   ``grouping="swap"``:

   * ``nova_kv``: ``NovaKV(head, "key", gain_dtype="float16")`` / ``NovaKV(head, "value", values="vq")``;
   * ``oscar``: ``Oscar(head, role, clip_mode="quantile", rule="uniform", rows="float64")`` (INT2, groups
     of min(128, d));
   * ``turboquant_mse``: ``TurboQuantMSE(d, 2)`` (seeds 0 keys, 1 values);
   * ``quarot``: ``QuaRot(d, 2, group=d, clip_ratio=0.95, rotation="randomized", rule="exact")``;
   * ``kivi``: ``KIVI(d, 2, role, group=32, residual=32, rule="exact", value_window="block")`` (T and
     T - 320 are multiples of 32, so every token is quantized).

   ``key_bits``/``value_bits``: ``Encoded.bits_per_element`` of the whole sequence's keys/values.
   ``logit_mse``: mean over queries and tokens of ``(q . k - score)^2`` (unscaled logits) with
   ``score`` from the method's ``inner_product``; queries are every query head of the group at every
   ``LOGIT_STRIDE``-th position, against all T keys (non-causal: a property of the key code).
   ``logit_mse_rel`` divides by the mean over those queries of the variance of the exact logits
   over tokens. ``attn_rel_err_*``: ``relative_error(attention_prefill(Q, cache), exact_attention(
   Q, K, V))`` for the last ``ATTN_QUERIES`` positions of every query head of the group (causal),
   with ``QuantizedKV.build`` without a band (``no_band``) and with the 16-bit band of
   ``SINK`` + ``WINDOW`` tokens (``band``); the mean over (sequence, KV head).
   ``logit_mse_over_nova``: the method's logit MSE divided by NOVA-KV's at the same d.
   ``hook_check``: max over a few queries of ``|inner_product - q . decode(enc)|`` divided by the
   max ``|q . k|`` (the scores hook against the decoder; float32 decode rounding is ~1e-7).
3. Band accounting at ``BAND_TOKENS`` (128K = 131072) tokens, d = 128: bytes per token of NOVA-KV
   and OSCAR keys and values from encoding ``BAND_PROBE_TOKENS`` held-out tokens, then
   ``(8 * bytes_per_token * (N - 320) + 16 * d * 320) / (N * d)`` (docs/references/calibrated.md: 2.22 for
   NOVA-KV, 2.28 for OSCAR).

Nothing asserts on wall time or on which method wins; the JSON records the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numba
import numpy as np
import scipy

from codebooks.calibration import CalibrationStats
from codebooks.nova import calibrate
from kvq_ref.attention import QuantizedKV, attention_prefill, exact_attention, relative_error
from kvq_ref.kivi import KIVI
from kvq_ref.nova import NovaKV, Oscar
from kvq_ref.quarot import QuaRot
from kvq_ref.turboquant import TurboQuantMSE

DEFAULT_OUT = Path("benchmarks/results/nova.json")
QUICK_OUT = Path("benchmarks/results/nova_quick.json")

# --- data generator (see the module docstring) --------------------------------------------------
MODEL_SEED = 7
CALIB_SEED0 = 1000
HELDOUT_SEED0 = 2000
KV_HEADS = 2
GQA = 4
T = 1024
QUERY_RANK = 4
QUERY_STRENGTH = 8.0
QUERY_DECAY = 0.7
QUERY_NOISE = 1.0
LOGIT_STD = 2.0
KEY_SPREAD = 400.0
KEY_OFFSET_NOISE = 0.5
KEY_OUTLIER_CHANNELS = 4
KEY_OUTLIER_OFFSET = 4.0
VALUE_SPREAD = 100.0
VALUE_OFFSET_NOISE = 0.5

# --- run sizes ------------------------------------------------------------------------------------
FULL = {"dims": (64, 128, 256), "calib_sequences": 4, "heldout_sequences": 3,
        "calib_repeats": {64: 3, 128: 3, 256: 2}}
QUICK = {"dims": (64, 128), "calib_sequences": 4, "heldout_sequences": 1,
         "calib_repeats": {64: 1, 128: 1}}

# --- evaluation -----------------------------------------------------------------------------------
LOGIT_STRIDE = 4
ATTN_QUERIES = 64
SINK = 64
WINDOW = 256
KIVI_GROUP = 32
HOOK_CHECK_QUERIES = 16
BAND_TOKENS = 131072
BAND_PROBE_TOKENS = 64
BAND_D = 128
PUBLISHED_BAND = {"nova_kv": {"key_bits_per_token": 2 + 16 / 128, "value_bits_per_token": 2 + 32 / 128,
                              "published_total": 2.22},
                  "oscar": {"key_bits_per_token": 2 + 32 / 128, "value_bits_per_token": 2 + 32 / 128,
                            "published_total": 2.28}}
METHODS = ("nova_kv", "oscar", "turboquant_mse", "quarot", "kivi")


# ---------------------------------------------------------------------------------------------
# helpers


def sig(x: float, digits: int = 4) -> float:
    """Round ``x`` to ``digits`` significant digits (results, not tables)."""
    x = float(x)
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits - 1}e}")


def machine_info() -> dict:
    """CPU count, platform and library versions of this run."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "numba_threads": numba.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "numba": numba.__version__,
    }


def _orthonormal(rng: np.random.Generator, d: int, r: int) -> np.ndarray:
    """A Haar-random (d, r) matrix with orthonormal columns."""
    q, rr = np.linalg.qr(rng.standard_normal((d, r)))
    return q * np.sign(np.diag(rr))


# ---------------------------------------------------------------------------------------------
# data


def make_model(d: int, kv_heads: int = KV_HEADS, gqa: int = GQA, seed: int = MODEL_SEED) -> list[dict]:
    """Draw the per-head generator parameters for head dimension ``d``.

    Parameters
    ----------
    d : int
        Head dimension.
    kv_heads, gqa : int
        KV heads, and query heads per KV head.
    seed : int
        Model seed (combined with ``d``).

    Returns
    -------
    list of dict
        Per KV head: ``A`` (gqa, d, d) query maps, ``key_basis``/``key_std``/``key_mu`` and
        ``value_basis``/``value_std``/``value_mu``, plus the analytic ``sigma_q`` (pooled over the
        group) and ``cov_k``.
    """
    rng = np.random.default_rng([seed, d])
    ramp = np.arange(d) / (d - 1)
    heads = []
    for _ in range(kv_heads):
        u = _orthonormal(rng, d, QUERY_RANK)
        s = QUERY_STRENGTH * QUERY_DECAY ** np.arange(QUERY_RANK)
        maps = []
        for _ in range(gqa):
            b = _orthonormal(rng, d, QUERY_RANK)
            mix = s * rng.uniform(0.5, 1.5, QUERY_RANK)
            maps.append((u * mix) @ b.T + QUERY_NOISE * rng.standard_normal((d, d)) / math.sqrt(d))
        maps = np.stack(maps)

        lam_k = KEY_SPREAD ** (-ramp)
        lam_k /= lam_k.mean()
        key_basis = _orthonormal(rng, d, d)
        key_mu = KEY_OFFSET_NOISE * rng.standard_normal(d)
        key_mu[rng.choice(d, KEY_OUTLIER_CHANNELS, replace=False)] += KEY_OUTLIER_OFFSET
        lam_v = VALUE_SPREAD ** (-ramp)
        lam_v /= lam_v.mean()
        value_basis = _orthonormal(rng, d, d)
        value_mu = VALUE_OFFSET_NOISE * rng.standard_normal(d)

        cov_k = (key_basis * lam_k) @ key_basis.T
        sigma_q = np.mean([a @ a.T for a in maps], axis=0)
        c = LOGIT_STD / math.sqrt(np.trace(sigma_q @ cov_k) / d)
        maps = maps * c
        heads.append({"A": maps, "key_basis": key_basis, "key_std": np.sqrt(lam_k), "key_mu": key_mu,
                      "value_basis": value_basis, "value_std": np.sqrt(lam_v), "value_mu": value_mu,
                      "sigma_q": sigma_q * c * c, "cov_k": cov_k})
    return heads


def sample_sequence(model: list[dict], seed: int, tokens: int = T) -> dict:
    """One sequence of the generator, in the layout ``calibrate`` reads.

    Parameters
    ----------
    model : list of dict
        From ``make_model``.
    seed : int
        Sequence seed (combined with d).
    tokens : int

    Returns
    -------
    dict
        ``{0: (q, k, v)}`` with ``q`` float32 (Hq, T, d) and ``k, v`` float32 (Hkv, T, d).
    """
    d = model[0]["key_mu"].shape[0]
    rng = np.random.default_rng([seed, d])
    qs, ks, vs = [], [], []
    for hd in model:
        for a in hd["A"]:
            qs.append(rng.standard_normal((tokens, d)) @ a.T)
        ks.append((rng.standard_normal((tokens, d)) * hd["key_std"]) @ hd["key_basis"].T + hd["key_mu"])
        vs.append((rng.standard_normal((tokens, d)) * hd["value_std"]) @ hd["value_basis"].T + hd["value_mu"])
    return {0: tuple(np.stack(x).astype(np.float32) for x in (qs, ks, vs))}


def _high_rate_excess(sq: np.ndarray, ck: np.ndarray, basis: np.ndarray) -> float:
    """``(prod_i (R^T Sigma_q R)_ii (R^T C_k R)_ii / (det Sigma_q det C_k))^(1/d)`` for ``R = basis``.

    The factor by which the high-rate key-logit distortion of the orthogonal transform ``R`` (with
    the ideal bit allocation) exceeds the bound NOVA-KV attains (``codebooks.transforms`` Notes);
    1 iff ``R`` diagonalizes both.
    """
    dq = np.einsum("ij,ik,kj->j", basis, sq, basis)
    dk = np.einsum("ij,ik,kj->j", basis, ck, basis)
    logdet = np.linalg.slogdet(sq)[1] + np.linalg.slogdet(ck)[1]
    return float(np.exp((np.sum(np.log(dq)) + np.sum(np.log(dk)) - logdet) / sq.shape[0]))


def data_diagnostics(model: list[dict]) -> dict:
    """How far Sigma_q and C_k are from commuting, per KV head (analytic, from the generator).

    Returns
    -------
    dict
        ``commutator``: ``||Sigma_q C_k - C_k Sigma_q||_F / (||Sigma_q||_F ||C_k||_F)``;
        ``sigma_q_condition``, ``cov_k_condition``: condition numbers; ``high_rate_excess_identity``,
        ``high_rate_excess_key_klt``, ``high_rate_excess_query_eig``: ``_high_rate_excess`` of the
        identity, of the eigenbasis of C_k and of the eigenbasis of Sigma_q.
    """
    keys = ("commutator", "sigma_q_condition", "cov_k_condition", "high_rate_excess_identity",
            "high_rate_excess_key_klt", "high_rate_excess_query_eig")
    out = {k: [] for k in keys}
    for hd in model:
        sq, ck = hd["sigma_q"], hd["cov_k"]
        comm = np.linalg.norm(sq @ ck - ck @ sq) / (np.linalg.norm(sq) * np.linalg.norm(ck))
        out["commutator"].append(sig(comm, 3))
        out["sigma_q_condition"].append(sig(np.linalg.cond(sq), 3))
        out["cov_k_condition"].append(sig(np.linalg.cond(ck), 3))
        out["high_rate_excess_identity"].append(sig(_high_rate_excess(sq, ck, np.eye(sq.shape[0])), 3))
        out["high_rate_excess_key_klt"].append(sig(_high_rate_excess(sq, ck, np.linalg.eigh(ck)[1]), 3))
        out["high_rate_excess_query_eig"].append(sig(_high_rate_excess(sq, ck, np.linalg.eigh(sq)[1]), 3))
    return out


# ---------------------------------------------------------------------------------------------
# calibration


def warm_up() -> None:
    """Compile or load every Numba kernel the timed calls use (toy calibration and encodes)."""
    model = make_model(16, kv_heads=1, gqa=2, seed=MODEL_SEED + 1)
    seqs = [sample_sequence(model, 1, tokens=300)]
    _, nova = calibrate(seqs, 16, grouping="swap")
    head = nova.head(0, 0)
    k = seqs[0][0][1][0]
    for m in (NovaKV(head, "key", gain_dtype="float16"), NovaKV(head, "value", values="vq"), Oscar(head, "key", **OURS["oscar"]),
              TurboQuantMSE(16, 2), QuaRot(16, 2, group=16, **OURS["quarot"])):
        m.inner_product(k[:4], m.encode(k))


def stats_pass(sequences: list[dict], d: int) -> CalibrationStats:
    """The first pass of ``calibrate``: ``CalibrationStats.update`` over every sequence and layer."""
    stats = CalibrationStats(d)
    for seq in sequences:
        for layer, (q, k, v) in seq.items():
            stats.update(layer, q, k, v)
    return stats


def time_calibration(sequences: list[dict], d: int, repeats: int):
    """Best-of-``repeats`` wall times of the statistics pass and of the whole ``calibrate``.

    Returns
    -------
    record : dict
        ``d``, ``stats_seconds``, ``total_seconds`` (best), the per-repeat times and the sizes.
    model : codebooks.nova.NovaModel
        The calibrated model (calibration is deterministic; the last run's).
    """
    stats_t, total_t = [], []
    model = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        stats_pass(sequences, d)
        stats_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _, model = calibrate(sequences, d, grouping="swap")
        total_t.append(time.perf_counter() - t0)
    q, k, _ = sequences[0][0]
    record = {"d": d, "stats_seconds": sig(min(stats_t)), "total_seconds": sig(min(total_t)),
              "repeats": repeats, "stats_repeat_seconds": [sig(t) for t in stats_t],
              "total_repeat_seconds": [sig(t) for t in total_t],
              "kv_heads": k.shape[0], "query_heads": q.shape[0],
              "tokens_per_head": len(sequences) * k.shape[1]}
    return record, model


# ---------------------------------------------------------------------------------------------
# evaluation


#: The named options that give the settings of the committed results (module docstring).
OURS = {"oscar": dict(clip_mode="quantile", rule="uniform", rows="float64"),
        "quarot": dict(clip_ratio=0.95, rotation="randomized", rule="exact"),
        "kivi": dict(rule="exact", value_window="block")}


def make_methods(model, d: int) -> dict:
    """``{method name: (key quantizer factory, value quantizer factory)}`` taking the KV head index."""
    return {
        "nova_kv": (lambda h: NovaKV(model.head(0, h), "key", gain_dtype="float16"),
                    lambda h: NovaKV(model.head(0, h), "value", values="vq")),
        "oscar": (lambda h: Oscar(model.head(0, h), "key", **OURS["oscar"]),
                  lambda h: Oscar(model.head(0, h), "value", **OURS["oscar"])),
        "turboquant_mse": (lambda h: TurboQuantMSE(d, 2, seed=0), lambda h: TurboQuantMSE(d, 2, seed=1)),
        "quarot": (lambda h: QuaRot(d, 2, group=d, **OURS["quarot"]),
                   lambda h: QuaRot(d, 2, group=d, seed=1, **OURS["quarot"])),
        "kivi": (lambda h: KIVI(d, 2, "key", KIVI_GROUP, KIVI_GROUP, **OURS["kivi"]),
                 lambda h: KIVI(d, 2, "value", KIVI_GROUP, KIVI_GROUP, **OURS["kivi"])),
    }


def evaluate(model, heldout: list[dict], d: int, log=sys.stderr) -> tuple[list[dict], dict]:
    """Rates, logit MSE and attention errors of every method on the held-out sequences.

    Parameters
    ----------
    model : codebooks.nova.NovaModel
    heldout : list of dict
        Sequences from ``sample_sequence``.
    d : int

    Returns
    -------
    results : list of dict
        One row per method (see the module docstring for the fields).
    exact : dict
        ``logit_var``: mean variance over tokens of the exact logits of the logit-MSE queries.
    """
    methods = make_methods(model, d)
    acc = {m: {"key_bits": [], "value_bits": [], "sq_err": 0.0, "count": 0, "no_band": [], "band": [],
               "hook": 0.0, "seconds": 0.0} for m in methods}
    logit_var = []
    for seq in heldout:
        q, k, v = seq[0]
        g = q.shape[0] // k.shape[0]
        for h in range(k.shape[0]):
            K, V = k[h].astype(np.float64), v[h].astype(np.float64)
            Q = q[h * g:(h + 1) * g].astype(np.float64)  # (g, T, d)
            Ql = Q[:, ::LOGIT_STRIDE].reshape(-1, d)
            exact_logits = Ql @ K.T
            logit_var.append(float(np.mean(np.var(exact_logits, axis=1))))
            Qa = Q[:, -ATTN_QUERIES:]
            ref = exact_attention(Qa, K, V)
            for name, (kf, vf) in methods.items():
                t0 = time.perf_counter()
                km, vm = kf(h), vf(h)
                ek, ev = km.encode(K), vm.encode(V)
                a = acc[name]
                a["key_bits"].append(ek.bits_per_element)
                a["value_bits"].append(ev.bits_per_element)
                scores = km.inner_product(Ql, ek)
                a["sq_err"] += float(np.sum((exact_logits - scores) ** 2))
                a["count"] += scores.size
                qh = Ql[:HOOK_CHECK_QUERIES]
                via_decode = qh @ km.decode(ek).astype(np.float64).T
                a["hook"] = max(a["hook"], float(np.max(np.abs(scores[:HOOK_CHECK_QUERIES] - via_decode))
                                                 / np.max(np.abs(exact_logits[:HOOK_CHECK_QUERIES]))))
                for tag, sink, window in (("no_band", 0, 0), ("band", SINK, WINDOW)):
                    cache = QuantizedKV.build(K, V, km, vm, sink=sink, window=window)
                    a[tag].append(relative_error(attention_prefill(Qa, cache), ref))
                a["seconds"] += time.perf_counter() - t0
    var = float(np.mean(logit_var))
    rows = []
    for name, a in acc.items():
        mse = a["sq_err"] / a["count"]
        rows.append({"d": d, "method": name, "key_bits": sig(np.mean(a["key_bits"]), 6),
                     "value_bits": sig(np.mean(a["value_bits"]), 6), "logit_mse": sig(mse),
                     "logit_mse_rel": sig(mse / var), "attn_rel_err_no_band": sig(np.mean(a["no_band"])),
                     "attn_rel_err_band": sig(np.mean(a["band"])), "hook_check": sig(a["hook"], 3),
                     "eval_seconds": sig(a["seconds"], 3)})
        print(f"  d={d} {name:<15} logit mse {mse:.4g}  attn err {np.mean(a['no_band']):.4g} / "
              f"{np.mean(a['band']):.4g} (band)  [{a['seconds']:.1f} s]", file=log, flush=True)
    nova = next(r for r in rows if r["method"] == "nova_kv")["logit_mse"]
    for r in rows:
        r["logit_mse_over_nova"] = sig(r["logit_mse"] / nova)
    return rows, {"logit_var": sig(var)}


def band_accounting(model, heldout: list[dict], d: int) -> dict:
    """Bits per element at ``BAND_TOKENS`` tokens with the 16-bit band, from measured bytes per token.

    Returns
    -------
    dict
        Per method (``nova_kv``, ``oscar``): bytes per token of keys and values (from encoding
        ``BAND_PROBE_TOKENS`` held-out tokens of KV head 0), the per-token rates, the rates at
        ``BAND_TOKENS`` tokens with ``SINK + WINDOW`` float16 tokens, their mean, and the
        published values (docs/references/calibrated.md).
    """
    _, k, v = heldout[0][0]
    K, V = k[0, :BAND_PROBE_TOKENS], v[0, :BAND_PROBE_TOKENS]
    head = model.head(0, 0)
    n, band = BAND_TOKENS, SINK + WINDOW
    out = {"d": d, "tokens": n, "band_tokens": band, "probe_tokens": BAND_PROBE_TOKENS,
           "formula": "(8 * bytes_per_token * (tokens - band_tokens) + 16 * d * band_tokens) / (tokens * d)"}
    for name, cls in (("nova_kv", NovaKV), ("oscar", Oscar)):
        rec = {}
        for role, x in (("key", K), ("value", V)):
            enc = cls(head, role).encode(x)
            per_tok = enc.nbytes / BAND_PROBE_TOKENS
            rec[f"{role}_bytes_per_token"] = per_tok
            rec[f"{role}_bits_per_token_element"] = 8 * per_tok / d
            rec[f"{role}_bits_with_band"] = sig((8 * per_tok * (n - band) + 16 * d * band) / (n * d), 6)
        rec["total_bits_with_band"] = sig((rec["key_bits_with_band"] + rec["value_bits_with_band"]) / 2, 6)
        rec["reference"] = PUBLISHED_BAND[name]
        out[name] = rec
    return out


# ---------------------------------------------------------------------------------------------
# report


def summary_lines(result: dict) -> list[str]:
    """Human-readable summary of ``result``."""
    lines = ["calibration (best of repeats):"]
    for c in result["calibration"]:
        lines.append(f"  d={c['d']:<4} stats {c['stats_seconds']:7.3g} s   total {c['total_seconds']:7.3g} s"
                     f"   ({c['tokens_per_head']} tokens x {c['kv_heads']} KV heads, {c['repeats']} run(s))")
    lines += ["", f"{'d':>4} {'method':<15} {'key b':>6} {'val b':>6} {'logit mse':>10} {'rel':>8} "
                  f"{'/nova':>7} {'attn err':>9} {'w/ band':>9}"]
    for r in result["results"]:
        lines.append(f"{r['d']:>4} {r['method']:<15} {r['key_bits']:>6.3f} {r['value_bits']:>6.3f} "
                     f"{r['logit_mse']:>10.4g} {r['logit_mse_rel']:>8.3g} {r['logit_mse_over_nova']:>7.3g} "
                     f"{r['attn_rel_err_no_band']:>9.4g} {r['attn_rel_err_band']:>9.4g}")
    ba = result["band_accounting"]
    lines += ["", f"band accounting at {ba['tokens']} tokens, d={ba['d']}, {ba['band_tokens']} band tokens:"]
    for name in ("nova_kv", "oscar"):
        rec = ba[name]
        lines.append(f"  {name:<8} keys {rec['key_bits_with_band']:.4f}  values {rec['value_bits_with_band']:.4f}"
                     f"  mean {rec['total_bits_with_band']:.4f}  (published {rec['reference']['published_total']})")
    lines.append(f"total runtime {result['runtime_seconds']:.1f} s")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON output (default {DEFAULT_OUT}, or {QUICK_OUT} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: d in {64, 128}, one held-out sequence, one calibration run per d")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run all measurements, write the JSON file and print the summary."""
    args = parse_args(argv)
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    size = QUICK if args.quick else FULL
    start = time.perf_counter()
    warm_up()
    calib_seeds = [CALIB_SEED0 + i for i in range(size["calib_sequences"])]
    held_seeds = [HELDOUT_SEED0 + i for i in range(size["heldout_sequences"])]
    calibration, results, data, band = [], [], {}, None
    for d in size["dims"]:
        gen = make_model(d)
        calib = [sample_sequence(gen, s) for s in calib_seeds]
        held = [sample_sequence(gen, s) for s in held_seeds]
        print(f"d={d}: calibrating ...", file=sys.stderr, flush=True)
        record, model = time_calibration(calib, d, size["calib_repeats"][d])
        calibration.append(record)
        rows, exact = evaluate(model, held, d)
        results.extend(rows)
        data[str(d)] = {**data_diagnostics(gen), **exact}
        if d == BAND_D:
            band = band_accounting(model, held, d)
    result = {
        "benchmark": "nova_kv",
        "command": shlex.join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(),
        "quick": args.quick,
        "config": {
            "d": list(size["dims"]), "T": T, "kv_heads": KV_HEADS, "query_heads_per_kv_head": GQA, "layers": 1,
            "sequences": {"calibration": size["calib_sequences"], "heldout": size["heldout_sequences"]},
            "seeds": {"model": MODEL_SEED, "calibration": calib_seeds, "heldout": held_seeds,
                      "rule": "numpy.random.default_rng([seed, d])"},
            "generator": {"query_rank": QUERY_RANK, "query_strength": QUERY_STRENGTH, "query_decay": QUERY_DECAY,
                          "query_noise": QUERY_NOISE, "logit_std": LOGIT_STD, "key_spread": KEY_SPREAD,
                          "key_offset_noise": KEY_OFFSET_NOISE, "key_outlier_channels": KEY_OUTLIER_CHANNELS,
                          "key_outlier_offset": KEY_OUTLIER_OFFSET, "value_spread": VALUE_SPREAD,
                          "value_offset_noise": VALUE_OFFSET_NOISE},
            "calibrate": {"g": 4, "bits": 2, "iterations": 25, "grouping": "swap", "repeats": size["calib_repeats"]},
            "evaluation": {"logit_stride": LOGIT_STRIDE, "attn_queries": ATTN_QUERIES, "sink": SINK,
                           "window": WINDOW, "kivi_group": KIVI_GROUP, "kivi_residual": KIVI_GROUP,
                           "quarot_group": "d", "oscar_group": "min(128, d)"},
            "data": data,
        },
        "calibration": calibration,
        "results": results,
        "band_accounting": band,
    }
    result["runtime_seconds"] = sig(time.perf_counter() - start)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(summary_lines(result)))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
