"""Golden files in the interop format, written from kvq_ref: ``kvq-codebooks golden --method M --out DIR``.

Notes
-----
The format is the interop golden format (``docs/fidelity.md``; ``tests/interop/data/README.md``): ``<DIR>/<method>/golden.json`` =
``{method, source, variant, seed, shared?, cases: [{id, family, params, inputs, outputs, notes}]}``,
every array ``{dtype, shape, b64}`` (base64 of the little-endian bytes in C order), and a complete
``facts.json``: the generator and command, the official source the rules reproduce, settings,
arithmetic, rules, what is not covered, the cases, every field and the tolerance
(``kvq_ref/data/golden_facts.json``; the rules are those the module Notes of ``kvq_ref.official``,
``kvq_ref.kivi``, ``kvq_ref.nova``, ``kvq_ref.quarot`` and ``kvq_ref.qjl`` implement). The families, field names
and shapes are those of the official golden sets, so an implementation elsewhere (C, CUDA, Rust) can
test itself against either without Python, and ``tests/interop`` reads both. The outputs are
kvq_ref's (the rules that reproduce the official code). Inputs are seeded: the same ``seed`` gives
byte-identical files.

Methods: ``kivi`` (quantizer: keys and values, 2 and 4 bits, random data with outlier channels and a
block of exact float16 half-step ties; cache: prefill + decode traces), ``oscar`` (a rotation built
as OSCAR builds it from a synthetic statistic; rotated and engineered rows: zero, constant, ties of
``|y|`` at the order statistic, an outlier), ``quarot`` (rotated, engineered and constant rows,
kernel and fake-quant paths), ``qjl`` (orthogonal and Gaussian sketches, official rules).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import numpy as np

from codebooks._version import __version__
from codebooks.transforms import oscar_rotation

from .kivi import KIVI
from .official import (QUAROT_RANGE_FLOOR, bf16_matmul, clip_index, dequant_f16, dequant_kernel, minmax_f16, oscar_dequantize,
                       oscar_quantize, oscar_threshold, pack_strided, quarot_fakequant_k, quarot_fakequant_v, to_bf16)
from .packing import pack_codes
from .qjl import official_estimate, official_sketch
from .quarot import QuaRot
from .sketch import sketch_matrix

__all__ = ["METHODS", "encode_array", "golden", "facts", "write_golden", "main"]

METHODS = ("kivi", "oscar", "quarot", "qjl")
_DTYPES = {np.dtype(t): t for t in ("float16", "float32", "float64", "int8", "uint8", "int32")}


def encode_array(a) -> dict:
    """``{dtype, shape, b64}`` of an array (float16/32/64, int8, uint8 or int32)."""
    a = np.asarray(a)
    if a.dtype not in _DTYPES:
        raise TypeError(f"golden arrays are float16/32/64, int8, uint8 or int32, got {a.dtype}")
    raw = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
    return {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "b64": base64.b64encode(raw).decode("ascii")}


def _tree(obj):
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, dict):
        return {k: _tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tree(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _case(cid, family, params, inputs, outputs, notes=""):
    return {"id": cid, "family": family, "params": params, "inputs": inputs, "outputs": outputs, "notes": notes}


def _keys_like(rng, n, d, dtype=np.float16):
    """Offset channels, a few outlier channels and heavy-tailed tokens, rounded to ``dtype``."""
    x = rng.standard_normal((n, d)) * np.exp(rng.uniform(-1, 1, d)) + rng.uniform(-2, 2, d)
    x[:, rng.choice(d, 2, replace=False)] *= 8.0
    x *= np.exp(0.3 * rng.standard_t(3, (n, 1)).clip(-5, 5))
    return x.astype(dtype)


# --- KIVI ---------------------------------------------------------------------------------------------
def _kivi_quantizer(rng, role, bits, heads, t, d, ties):
    x = np.stack([_keys_like(rng, t, d) for _ in range(heads)])
    if ties:  # groups on a half-step grid: x = mn + (k + 1/2) s hits exact float16 .5 quotients
        L = (1 << bits) - 1
        k = rng.integers(0, 2 * L + 1, x.shape) / 2.0
        x = (0.25 * k + np.where(rng.random(x.shape[:-1] + (1,)) < 0.3, 1000.0, 0.0)).astype(np.float16)
    g = 32
    axis = -2 if role == "key" else -1
    codes, scale, mn = minmax_f16(x, bits, g, axis=axis)
    q = KIVI(d, bits, role, group=g, residual=t, value_window="block")
    packed = q.encode(x).arrays["codes"]
    words = (packed.transpose(0, 2, 1, 3).reshape(heads, d, -1) if role == "key" else packed)
    return _case(f"quant-{role}-{'ties' if ties else 'random'}-b{bits}", "quantizer",
                 {"role": role, "bits": bits, "group_size": g, "n_heads": heads, "tokens": t, "head_dim": d},
                 {"x_f16": x},
                 {"codes_u8": codes, "scale_f16": scale, "mn_f16": mn,
                  "packed_i32": np.ascontiguousarray(words).view("<i4").astype(np.int32),
                  "deq_kernel_f32": dequant_kernel(codes, scale, mn, g, axis),
                  "deq_torch_ref_f16": dequant_f16(codes, scale, mn, g, axis)})


def _kivi_cache(rng, T, P, bits, d=32, R=128, g=32):
    k, v = _keys_like(rng, T, d), _keys_like(rng, T, d)
    kq, vq = KIVI(d, bits, "key", group=g, residual=R), KIVI(d, bits, "value", group=g, residual=R)
    trace = [[n, n - (0 if n == P else kq.split(n - 1)[0]), n - (0 if n == P else vq.split(n - 1)[0]),
              kq.split(n)[0], vq.split(n)[0]] for n in range(P, T + 1)]
    return _case(f"cache-T{T}-P{P}-b{bits}", "cache",
                 {"tokens": T, "prefill_tokens": P, "residual_length": R, "group_size": g, "k_bits": bits,
                  "v_bits": bits, "n_heads": 1, "head_dim": d},
                 {"k_f16": k, "v_f16": v},
                 {"n_key_quantized": kq.split(T)[0], "n_value_quantized": vq.split(T)[0],
                  "k_read_f32": kq.decode(kq.encode(k)), "v_read_f32": vq.decode(vq.encode(v)),
                  "trace_i32": np.array(trace, np.int32)}, "prefill of prefill_tokens tokens, then one per step")


def _kivi(rng):
    cases = [_kivi_quantizer(rng, role, bits, 2, 64, 64, False) for role in ("key", "value") for bits in (2, 4)]
    cases += [_kivi_quantizer(rng, role, bits, 1, 32, 32, True) for role in ("key", "value") for bits in (2, 4)]
    cases += [_kivi_cache(rng, T, P, b) for T, P, b in ((100, 37, 2), (300, 300, 2), (301, 128, 2), (260, 131, 4))]
    return cases, {}


# --- OSCAR --------------------------------------------------------------------------------------------
def _oscar_outputs(y, ratio, g):
    c = clip_index(ratio, y.shape[-1])
    out = {"clip_index": c}
    for tag, method in (("", "sort"), ("_bsearch", "bisect")):
        thr = oscar_threshold(y, c, method)
        codes, scale, zero = oscar_quantize(y, 2, g, thr)
        out.update({f"threshold{tag}_f32": thr, f"codes{tag}_u8": codes, f"packed{tag}_u8": pack_strided(codes, 2),
                    f"scale{tag}_f32": scale, f"zero{tag}_f32": zero,
                    f"deq{tag}_f32": oscar_dequantize(codes, scale, zero, g)})
    return out


def _oscar_direct_rows(rng, d, c):
    rows = [np.zeros(d), np.full(d, 0.75), to_bf16(rng.standard_normal(d)).astype(np.float64)]
    tie = to_bf16(rng.standard_normal(d)).astype(np.float64)
    tie[np.argsort(np.abs(tie))[c - 1:c + 3]] = [1.5, -1.5, 1.5, -1.5]  # |y| ties at the order statistic
    outlier = to_bf16(rng.standard_normal(d)).astype(np.float64)
    outlier[3] = 300.0
    half = np.tile([-1.0, 0.0, 0.5, 1.0], d // 4)  # scale 1/... with exact .5 code quotients
    rows += [tie, outlier, half, np.abs(rows[2]) + 1.0, np.repeat([-2.0, 2.0], d // 2), 1e-3 * rows[2]]
    return to_bf16(np.stack(rows))


def _oscar(rng, d=128):
    R = oscar_rotation(np.cov(rng.standard_normal((4 * d, d)) * np.linspace(0.2, 3.0, d), rowvar=False))
    R32 = R.astype(np.float32)
    cases = []
    for role, ratio in (("key", 0.96), ("value", 0.92)):
        x = to_bf16(_keys_like(rng, 40, d, np.float32))
        y = bf16_matmul(x, R32)
        p = {"role": role, "clip_ratio": ratio, "head_dim": d, "group_size": d}
        cases.append(_case(f"rotated-{role}", "rotated", {**p, "rows": 40}, {"x_bf16_as_f32": x},
                           {**_oscar_outputs(y, ratio, d), "y_bf16_as_f32": y}, "y = bf16(x_bf16 @ bf16(R))"))
        rows = _oscar_direct_rows(rng, d, clip_index(ratio, d))
        cases.append(_case(f"direct-{role}", "direct", {**p, "rows": rows.shape[0]}, {"y_bf16_as_f32": rows},
                           _oscar_outputs(rows, ratio, d), "zero, constant, |y| ties at the order statistic, outlier"))
    return cases, {"R_f32": R32}


# --- QuaRot -------------------------------------------------------------------------------------------
def _quarot_outputs(y, g, paths):
    out = {"y_f16": y}
    for bits in (2, 4):
        if "kernel" in paths:
            codes, scale, mn = minmax_f16(y, bits, g, range_floor=QUAROT_RANGE_FLOOR)
            k = {"codes_u8": codes, "scale_f16": scale.reshape(-1), "zero_f16": -mn.reshape(-1),
                 "deq_kernel_f32": dequant_kernel(codes, scale, mn, g), "deq_torch_ref_f16": dequant_f16(codes, scale, mn, g)}
            if bits == 4:
                k["packed_u8"] = pack_codes(codes, 4)
            out[f"kernel_b{bits}"] = k
        for clip, tag in ((1.0, "1"), (0.95, "0.95")):
            for path, fn, names in (("fakequant_k", quarot_fakequant_k, ("scale_f32", "zero_f32")),
                                    ("fakequant_v", quarot_fakequant_v, ("scale_f16", "zero_f16"))):
                if path in paths:
                    codes, scale, zero, res = fn(y, bits, clip)
                    out[f"{path}_b{bits}_clip{tag}"] = {"codes_u8": codes, names[0]: scale, names[1]: zero,
                                                        "out_f16": res}
    return out


def _quarot(rng):
    cases, all_paths = [], ["kernel", "fakequant_k", "fakequant_v"]
    for d in (64, 128):
        x = _keys_like(rng, 24, d)
        H = QuaRot(d, 2)
        pm1 = np.rint(H.rot.matrix() * np.sqrt(d)).astype(np.int8)
        p = {"head_dim": d, "rows": 24, "group_size": d, "paths": all_paths}
        cases.append(_case(f"rotated-d{d}", "rotated", p, {"x_f16": x, "hadamard_pm1_i8": pm1},
                           _quarot_outputs(H.rotate(x).astype(np.float16), d, all_paths), "y = f16(H x / sqrt(d))"))
        y = np.stack([np.zeros(d), np.tile([-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5], d // 8),
                      np.linspace(-3, 7, d), np.linspace(0.5, 1.0, d), 1000 + np.arange(d) / 8,
                      rng.standard_normal(d), 1e-3 * rng.standard_normal(d)]).astype(np.float16)
        cases.append(_case(f"direct-d{d}", "direct", {**p, "rows": 7}, {}, _quarot_outputs(y, d, all_paths),
                           "rotated rows given directly: zero row, half-step grids, offsets"))
    y = np.stack([np.full(128, v) for v in (0.0, 1.0, -3.5, 1e-3, 600.0)]).astype(np.float16)
    paths = ["kernel", "fakequant_k"]
    cases.append(_case("constant-d128", "constant", {"head_dim": 128, "rows": 5, "group_size": 128, "paths": paths},
                       {}, _quarot_outputs(y, 128, paths), "constant rows: kernel and fake-quant K"))
    return cases, {}


# --- QJL ----------------------------------------------------------------------------------------------
def _qjl(rng, d=128):
    shared = {"S_orthogonal_f32": sketch_matrix(512, d, "orthogonal", 0, 2)[0].astype(np.float32),
              "S_gaussian_f32": sketch_matrix(256, d, "gaussian", 0, 2)[0].astype(np.float32)}
    cases = []
    for name, m, m_out, n in (("orthogonal", 256, 256, 64), ("orthogonal", 512, 128, 64), ("gaussian", 256, 128, 64),
                              ("gaussian", 256, 256, 32)):
        S = shared[f"S_{name}_f32"]
        keys, queries = _keys_like(rng, n, d), (rng.standard_normal((6, d)) * 2).astype(np.float16)
        got = official_sketch(keys, S, m, m_out, 8, 32)
        outputs = {"channel_norms_f16": got["channel_norms"], "outlier_idx_u8": got["outlier_idx"],
                   "bits_in_u8": got["bits_in"], "bits_out_u8": got["bits_out"], "key_norm_f16": got["key_norm"],
                   "outlier_norm_f16": got["outlier_norm"],
                   "estimate_f64": official_estimate(queries, S, m, m_out, got, 32),
                   "exact_qk_f64": queries.astype(np.float64) @ keys.astype(np.float64).T}
        cases.append(_case(f"{name}-m{m}-mout{m_out}-n{n}", name,
                           {"sketch": f"S_{name}_f32", "m": m, "m_out": m_out, "n_outliers": 8, "group_size": 32,
                            "head_dim": d, "keys": n, "queries": 6},
                           {"keys_f16": keys, "queries_f16": queries}, outputs))
    return cases, shared


_MAKERS = {"kivi": _kivi, "oscar": _oscar, "quarot": _quarot, "qjl": _qjl}
#: per method: the official source, settings, arithmetic, rules, golden cases and fields, tolerance
FACTS_FILE = Path(__file__).resolve().parent / "data" / "golden_facts.json"


def golden(method: str, seed: int = 0) -> tuple[dict, dict]:
    """``(golden, facts)`` of ``method`` as JSON-ready dicts (arrays encoded)."""
    if method not in _MAKERS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    cases, shared = _MAKERS[method](np.random.default_rng([seed, METHODS.index(method)]))
    source = f"kvq_ref {__version__} (kvq_ref.golden)"
    g = {"method": method, "source": source, "variant": "kvq_ref", "seed": seed}
    if shared:
        g["shared"] = shared
    g["cases"] = cases
    return _tree(g), facts(method, seed)


def facts(method: str, seed: int = 0) -> dict:
    """The facts.json of ``method``'s golden file: generator, the official source the rules reproduce,
    settings, arithmetic, rules, cases, fields and tolerance (``kvq_ref/data/golden_facts.json``)."""
    if method not in _MAKERS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    data = json.loads(FACTS_FILE.read_text(encoding="utf-8"))
    entry = data["methods"][method]
    module = {"oscar": "nova"}.get(method, method)
    source = {"generator": f"kvq_ref {__version__} (kvq_ref.golden)",
              "command": f"kvq-codebooks golden --method {method} --seed {seed}", "seed": seed,
              "outputs": f"kvq_ref's, by the rules below (kvq_ref.official and kvq_ref.{module}), which reproduce "
                         "the official code bit for bit on its own golden files",
              "reproduces": entry["reproduces"]}
    return {"method": method, "source": source, "golden_format": data["golden_format"],
            **{k: v for k, v in entry.items() if k != "reproduces"}}


def write_golden(method: str, out, seed: int = 0) -> Path:
    """Write ``<out>/<method>/golden.json`` and ``facts.json``; returns the folder (deterministic bytes)."""
    g, fx = golden(method, seed)
    folder = Path(out) / method
    folder.mkdir(parents=True, exist_ok=True)
    for name, obj in (("golden.json", g), ("facts.json", fx)):
        (folder / name).write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return folder


def main(argv: list[str] | None = None) -> int:
    """``kvq-codebooks golden --method M[,M...] --out DIR [--seed S]``."""
    p = argparse.ArgumentParser(prog="kvq-codebooks golden",
                                description="Write golden files in the interop format from kvq_ref.")
    p.add_argument("--method", required=True, help=f"{', '.join(METHODS)} or all (comma-separated for several)")
    p.add_argument("--out", required=True, help="output folder (gets <method>/golden.json and facts.json)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = list(METHODS) if args.method == "all" else [m.strip() for m in args.method.split(",")]
    try:
        for m in names:
            folder = write_golden(m, args.out, args.seed)
            print(f"wrote {folder / 'golden.json'}")
    except (ValueError, TypeError) as exc:
        print(f"kvq-codebooks golden: error: {exc}", file=sys.stderr)
        return 2
    return 0
