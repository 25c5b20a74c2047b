"""Key-logit error by key position on a real SmolLM2 capture: NOVA-KV against TurboQuantMSE.

Run from the repository root (needs the evaluation extra and the SmolLM2 wheel; about 20 s with
the calibration cached)::

    python benchmarks/nova_position.py [--model smollm2] [--tokens 4096] [--calib-tokens 1024] [--out PATH]

Why
---
Calibrated on 2 sequences of 1024 tokens, NOVA-KV's needle accuracy on SmolLM2 falls from 0.70 at
1K to 0 at 4K, while TurboQuantMSE-3 holds (the v1 evaluation's ``results/eval_calib1024/``, last
held by commit e57fc0a, docs/regenerating.md; ``make eval`` now calibrates on the context it
measures). Post-RoPE keys at positions the calibration never saw are rotated further in the slow
RoPE channels, so their distribution shifts away from the one the transform and the VQ codebooks
were fitted to. This script measures that: it captures one ``tokens``-long window of the haystack
text (disjoint from the calibration text), encodes every key of layers ``LAYERS`` with each method
(no 16-bit band), and reports, per 1024-token bin of key positions, the mean squared key-logit
error ``(q.k - q.k_hat)^2`` of the last 64 queries, divided by the variance of the exact logits in
that bin. TurboQuantMSE-2 and -3 are the same-run baselines (data-oblivious, so flat in position);
the ratio NOVA-KV / TurboQuantMSE-2 per bin is in the JSON, and so is every layer's row (with the
layer's type, sliding or full attention, for Gemma-3) and how strong its key outlier channels are
(largest channel RMS over the median one). Nothing asserts on the outcome.

``--model gemma3`` runs the same measurement on Gemma-3-270M over all of its 18 layers (its
``LAYERS`` entry), at ``--tokens 2048`` (its needle contexts are 1-2K).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

LAYERS = {"smollm2": (2, 8, 15, 22, 28), "gemma3": tuple(range(18))}
METHODS = ("nova", "tq_mse2", "tq_mse3")
BIN = 1024
QUERIES = 64


def key_logit_error_by_position(q, k, v, quantizer_k, quantizer_v, bins) -> list[float]:
    """Relative key-logit MSE per key-position bin for one KV head.

    Parameters
    ----------
    q : ndarray, shape (G, T, d), float64
        The group's queries; the last ``QUERIES`` positions are used.
    k, v : ndarray, shape (T, d), float64
    quantizer_k, quantizer_v : kvq_ref quantizers for the keys and values
    bins : list of (start, stop)
    """
    from kvq_ref.attention import QuantizedKV

    cache = QuantizedKV.build(k, v, quantizer_k, quantizer_v, sink=0, window=0)
    qq = q[:, -QUERIES:].reshape(-1, k.shape[1])
    exact = qq @ k.T
    err = (exact - cache.logits(qq)) ** 2
    return [float(err[:, a:b].mean() / exact[:, a:b].var()) for a, b in bins]


def channel_peak_to_median(k) -> float:
    """Largest per-channel RMS of keys ``k`` (T, d) over the median channel's RMS."""
    rms = np.sqrt((np.asarray(k, dtype=np.float64) ** 2).mean(axis=0))
    return float(rms.max() / np.median(rms))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=sorted(LAYERS))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calib-tokens", type=int, default=1024,
                   help="calibration sequence length (kvq-eval's default 1024; make eval uses 4096)")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/nova_position.json (gemma3: nova_position_gemma3.json)")
    args = p.parse_args(argv)
    if args.out is None:
        suffix = "" if args.model == "smollm2" else f"_{args.model}"
        args.out = Path(f"benchmarks/results/nova_position{suffix}.json")
    if args.tokens < 2 * BIN or args.tokens % BIN:
        raise SystemExit(f"--tokens must be a multiple of {BIN}, at least {2 * BIN}")
    import torch

    from kvq_eval.calib import capture, token_chunks
    from kvq_eval.runner import Evaluator
    from kvq_eval.text import part

    t0 = time.perf_counter()
    torch.set_grad_enabled(False)
    layers = LAYERS[args.model]
    ev = Evaluator(args.model, calib_tokens=args.calib_tokens)  # 2 sequences of the calibration text part
    ids = token_chunks(ev.tok, part("haystack"), args.tokens, 1)[0]
    cap = capture(ev.model, ids)
    bins = [(a, a + BIN) for a in range(0, args.tokens, BIN)]
    types = getattr(ev.model.config, "layer_types", None) or ["full_attention"] * ev.model.config.num_hidden_layers
    result = {"model": args.model, "tokens": args.tokens, "layers": list(layers), "queries": QUERIES,
              "layer_types": [types[layer] for layer in layers],
              "bins": bins, "calibration_tokens_per_sequence": args.calib_tokens, "relative_key_logit_mse": {},
              "per_layer": {}}
    # outlier channels of the keys themselves: per layer, the largest channel RMS over the median one
    # (mean over KV heads), from the same window
    result["key_channel_peak_to_median"] = [float(np.mean([channel_peak_to_median(k) for k in cap[layer][1]]))
                                            for layer in layers]
    for name in METHODS:
        spec = ev.spec(name)
        per_layer = []
        for layer in layers:
            q, k, v = (x.astype(np.float64) for x in cap[layer])
            g = q.shape[0] // k.shape[0]
            d = k.shape[-1]
            per_layer.append(np.mean([key_logit_error_by_position(q[h * g:(h + 1) * g], k[h], v[h],
                                                                  spec.key(layer, h, d), spec.value(layer, h, d),
                                                                  bins) for h in range(k.shape[0])], axis=0))
        # every layer has the same number of KV heads, so the mean over layers is the mean over heads
        result["relative_key_logit_mse"][name] = np.mean(per_layer, axis=0).tolist()
        result["per_layer"][name] = [row.tolist() for row in per_layer]
    base = np.array(result["relative_key_logit_mse"]["tq_mse2"])
    result["nova_over_tq_mse2"] = (np.array(result["relative_key_logit_mse"]["nova"]) / base).tolist()
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, row in result["relative_key_logit_mse"].items():
        print(f"{name:8s} " + "  ".join(f"{a // BIN}-{b // BIN}K {x:.4f}" for (a, b), x in zip(bins, row)))
    print("nova / tq_mse2: " + "  ".join(f"{x:.2f}" for x in result["nova_over_tq_mse2"]))
    if len(set(result["layer_types"])) > 1:
        for kind in sorted(set(result["layer_types"])):
            idx = [i for i, t in enumerate(result["layer_types"]) if t == kind]
            print(f"{kind}: " + "  ".join(f"{name} {np.mean([result['per_layer'][name][i] for i in idx], axis=0).round(4).tolist()}"
                                         for name in METHODS))
    return result


if __name__ == "__main__":
    main()
