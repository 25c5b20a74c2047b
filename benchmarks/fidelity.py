"""Measured effect of every deviation from the official implementations that kvq_ref keeps as an option.

``python benchmarks/fidelity.py`` writes ``benchmarks/results/fidelity.json`` (about a minute on 2
cores). For each method, the official default and each named variant are run on the same data and
compared by stored rate (bits per element, from the stored bytes), relative error and, where codes
are comparable, the fraction of codes that agree with the default.

Data: the synthetic attention heads of ``benchmarks/bench_nova.py`` (``make_model``/``sample_sequence``:
low-rank pooled queries that do not commute with the key covariance, key channel offsets and four
outlier channels), head dimension 128, 2 KV heads x 4 query heads, calibration on 4 x 1024 tokens and
measurement on 1024 held-out tokens. Relative errors are ``||x_hat - x||^2 / ||x||^2`` over all
tokens (``rel_mse``); keys also get the logit error ``mean (q.k - score)^2 / mean (q.k)^2``
(``rel_logit_mse``, the queries of the group at every 4th position); values get the attention-output
relative error with exact keys (``attn_err``). QJL's bias: ``E|s . u| / sqrt(2/pi)`` over 300
orthogonal sketches x 2000 unit vectors (m = 256, d = 128), which is ``E[official estimate] / <q, k>``, with its standard
error, and its exact value; and the score estimates of our QJL keys and of the released rules on the
same 40 sketch draws (relative MSE, mean error).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np

from codebooks.nova import calibrate
from kvq_ref import KIVI, QuaRot, attention_decode, exact_attention
from kvq_ref.attention import QuantizedKV, relative_error
from kvq_ref.nova import NovaKV, Oscar
from kvq_ref.packing import unpack_codes
from kvq_ref.sketch import QJLSketch

OUT = Path("benchmarks/results/fidelity.json")
D = 128
_spec = importlib.util.spec_from_file_location("bench_nova", Path(__file__).with_name("bench_nova.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def sig(x, digits=4):
    return float(f"{x:.{digits}g}")


def rel_mse(x_hat, x):
    return sig(np.sum((np.asarray(x_hat, np.float64) - x) ** 2) / np.sum(x * x))


def codes_of(q, enc):
    """Every stored code of an Oscar/QuaRot/KIVI-value encoding, (N, d) ints."""
    a = enc.arrays["codes"].reshape(-1, enc.arrays["codes"].shape[-1])
    if isinstance(q, Oscar) and q.rule == "official":
        from kvq_ref.official import unpack_strided

        return unpack_strided(a, q.bits).astype(int)
    return unpack_codes(a, q.bits, q.dim).astype(int)


def record(q, x, ref_codes=None, queries=None):
    enc = q.encode(x)
    out = {"bits_per_element": sig(enc.bits_per_element), "rel_mse": rel_mse(q.decode(enc), x)}
    if queries is not None:
        truth = queries @ x.T
        out["rel_logit_mse"] = sig(np.mean((truth - q.inner_product(queries, enc)) ** 2) / np.mean(truth ** 2))
    if ref_codes is not None:
        out["code_agreement"] = sig(float(np.mean(codes_of(q, enc) == ref_codes)))
    return out, enc


def compare(variants: dict, x, queries=None) -> dict:
    """``{name: record}``; the first variant is the official default, the others' codes compared to it."""
    out, ref = {}, None
    for name, q in variants.items():
        rec, enc = record(q, x, ref, queries)
        if ref is None and not isinstance(q, NovaKV):
            ref = codes_of(q, enc)
        out[name] = rec
    return out


def kivi(rng, x_k, x_v) -> dict:
    out = {}
    for bits in (2, 4):
        for role, x in (("key", x_k), ("value", x_v)):
            res = {}
            for name, q in {"official": KIVI(D, bits, role), "rule=exact": KIVI(D, bits, role, rule="exact"),
                            "value_window=block": KIVI(D, bits, role, value_window="block")}.items():
                if role == "key" and name == "value_window=block":
                    continue
                enc = q.encode(x)
                res[name] = {"quantized_tokens": q.split(x.shape[0])[0],
                             "bits_per_element": sig(enc.bits_per_element), "rel_mse": rel_mse(q.decode(enc), x)}
                nq = q.split(x.shape[0])[0]
                res[name]["rel_mse_quantized_tokens"] = rel_mse(q.decode(enc)[:nq], x[:nq])
            off, ex = KIVI(D, bits, role), KIVI(D, bits, role, rule="exact")
            ca = unpack_codes(off.encode(x).arrays["codes"], bits, off.encode(x).arrays["codes"].shape[-1] * 8 // bits)
            cb = unpack_codes(ex.encode(x).arrays["codes"], bits, ex.encode(x).arrays["codes"].shape[-1] * 8 // bits)
            res["rule=exact"]["code_agreement"] = sig(float(np.mean(ca == cb)))
            out[f"{role}_b{bits}"] = res
    return out


def quarot(x_k) -> dict:
    out = {}
    for bits in (2, 4):
        variants = {"official": QuaRot(D, bits),
                    "rule=exact": QuaRot(D, bits, rule="exact"),
                    "rule=exact,clip_ratio=0.95": QuaRot(D, bits, rule="exact", clip_ratio=0.95),
                    "rotation=randomized": QuaRot(D, bits, rotation="randomized"),
                    "earlier default (randomized, exact, clip 0.95)": QuaRot(D, bits, rule="exact", clip_ratio=0.95,
                                                                             rotation="randomized")}
        res = compare(variants, x_k)
        for name in ("rotation=randomized", "earlier default (randomized, exact, clip 0.95)"):
            res[name].pop("code_agreement")  # another rotation: codes of other coordinates
        out[f"b{bits}"] = res
    return out


def oscar(model, x_k, x_v, queries) -> dict:
    out = {}
    for h in (0, 1):
        head = model.head(0, h)
        for role, x in (("key", x_k[h]), ("value", x_v[h])):
            variants = {"official": Oscar(head, role),
                        "clip_mode=quantile": Oscar(head, role, clip_mode="quantile"),
                        "threshold=bisect": Oscar(head, role, threshold="bisect"),
                        "rule=uniform": Oscar(head, role, rule="uniform"),
                        "rows=float64": Oscar(head, role, rows="float64"),
                        "earlier default (quantile, uniform, float64)": Oscar(head, role, clip_mode="quantile",
                                                                              rule="uniform", rows="float64")}
            out[f"head{h}_{role}"] = compare(variants, x, queries[h] if role == "key" else None)
    return out


def nova(model_rr, model_swap, x_k, x_v, queries, q_last) -> dict:
    out = {}
    for h in (0, 1):
        keys = {"official (round_robin, float32 gain)": NovaKV(model_rr.head(0, h), "key"),
                "gain_dtype=float16": NovaKV(model_rr.head(0, h), "key", gain_dtype="float16"),
                "grouping=swap": NovaKV(model_swap.head(0, h), "key"),
                "earlier default (swap, float16 gain)": NovaKV(model_swap.head(0, h), "key", gain_dtype="float16")}
        res = {}
        ref = None
        for name, q in keys.items():
            rec, enc = record(q, x_k[h], queries=queries[h])
            codes = unpack_codes(enc.arrays["codes"], 8, D // 4)
            rec["index_agreement"] = sig(float(np.mean(codes == ref))) if ref is not None else 1.0
            ref = codes if ref is None else ref
            res[name] = rec
        res["grouping_gap"] = {"round_robin": sig(_gap(model_rr.head(0, h))), "swap": sig(_gap(model_swap.head(0, h)))}
        out[f"head{h}_key"] = res
        vals = {"official (OSCAR INT2 on the k^T Sigma_q k statistic)": NovaKV(model_rr.head(0, h), "value"),
                "values=vq": NovaKV(model_rr.head(0, h), "value", values="vq")}
        res = {}
        for name, q in vals.items():
            rec, _ = record(q, x_v[h])
            cache = QuantizedKV.build(x_k[h], x_v[h], None, q)
            rec["attn_err"] = sig(relative_error(attention_decode(q_last[h], cache),
                                                 exact_attention(q_last[h][:, None, :], x_k[h], x_v[h],
                                                                 causal=False)[:, 0]))
            res[name] = rec
        out[f"head{h}_value"] = res
    return out


def _gap(head):
    lam = np.maximum(head.key.variances, 1e-300)
    v = np.log(lam)[head.key_groups].mean(axis=1)
    return float(np.mean(np.exp(v - v.max())) / math.exp(np.mean(v) - v.max()) - 1.0)


def qjl_bias(trials: int = 300, units: int = 2000) -> dict:
    """The official estimator's bias with orthogonal rows: E[est] / <q, k> = E|s . u| / sqrt(2/pi) for a unit
    u (QJL's constant assumes Gaussian rows); E|s . u| by Monte Carlo over ``trials`` sketches (256 rows)
    against ``units`` random unit vectors each; the standard error is that of the per-sketch means."""
    rng = np.random.default_rng(11)
    means = []
    for s in range(trials):
        S = QJLSketch(256, D, "orthogonal", seed=s, stream=2).S
        u = rng.standard_normal((D, units))
        u /= np.linalg.norm(u, axis=0, keepdims=True)
        means.append(np.abs(S @ u).mean())
    means = np.array(means)
    kappa, se = means.mean(), means.std(ddof=1) / math.sqrt(trials)
    c = math.sqrt(2 / math.pi)
    return {"trials": trials, "m": 256, "d": D, "E_abs_s_dot_u": sig(kappa, 6), "standard_error": sig(se, 2),
            "official_bias_measured": sig(kappa / c, 6), "official_bias_standard_error": sig(se / c, 2),
            "official_bias_exact": sig(QJLSketch(256, D, "orthogonal").kappa / c, 6),
            "unbiased_constant": "divides by the exact kappa of the rows: E[est] = <q, k>"}


def qjl_estimators(k, queries, seeds: int = 40) -> dict:
    """Our QJL keys against the released rules (``official_sketch``/``official_estimate``) on the same
    orthogonal sketch draws (m = m_out = 256, 8 outliers per 32 tokens): relative MSE of the score
    estimates and their mean relative error (bias), over ``seeds`` sketches."""
    from kvq_ref.qjl import QJL, official_estimate, official_sketch

    keys = k[:256].astype(np.float16).astype(np.float64)
    q = queries[:32].astype(np.float16).astype(np.float64)
    truth = q @ keys.T
    errs = {"ours (unbiased)": [], "ours, constant=official": [], "official rules": []}
    for s in range(seeds):
        for name, const in (("ours (unbiased)", "unbiased"), ("ours, constant=official", "official")):
            m = QJL(D, m=256, m_outlier=256, seed=s, constant=const)
            errs[name].append(m.inner_product(q, m.encode(keys)) - truth)
        S = QJL(D, m=256, m_outlier=256, seed=s).sketches[0].S
        errs["official rules"].append(official_estimate(q, S, 256, 256, official_sketch(keys, S, 256, 256)) - truth)
    out = {"seeds": seeds, "keys": keys.shape[0], "queries": q.shape[0]}
    for name, e in errs.items():
        e = np.array(e)  # (seeds, queries, keys)
        mean_err = e.mean(axis=0)  # per (query, key), over sketches: the bias
        out[name] = {"rel_mse": sig(np.mean(e ** 2) / np.mean(truth ** 2)),
                     "bias_over_rms_truth": sig(np.mean(mean_err) / math.sqrt(np.mean(truth ** 2)), 3),
                     "bias_standard_error": sig(e.mean(axis=(1, 2)).std(ddof=1) / math.sqrt(seeds)
                                                / math.sqrt(np.mean(truth ** 2)), 2)}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    hm = bench.make_model(D)
    calib = [bench.sample_sequence(hm, bench.CALIB_SEED0 + i) for i in range(4)]
    held = bench.sample_sequence(hm, bench.HELDOUT_SEED0)[0]
    q, k, v = (np.asarray(a, np.float64) for a in held)
    _, rr = calibrate(calib, D)
    _, swap = calibrate(calib, D, grouping="swap")
    g = q.shape[0] // k.shape[0]
    queries = [q[h * g:(h + 1) * g, ::4].reshape(-1, D) for h in range(k.shape[0])]
    q_last = [q[h * g:(h + 1) * g, -1] for h in range(k.shape[0])]
    rng = np.random.default_rng(0)
    result = {"data": "benchmarks/bench_nova.py generator, d=128, 2 KV heads x 4 query heads, 4 x 1024 calibration "
                      "tokens, 1024 held-out tokens", "d": D,
              "kivi": kivi(rng, k[0, :300], v[0, :300]),
              "quarot": quarot(k[0]),
              "oscar": oscar(rr, k, v, queries),
              "nova_kv": nova(rr, swap, k, v, queries, q_last),
              "qjl": {"official_constant_bias": qjl_bias(), "estimators": qjl_estimators(k[0], queries[0])}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
