"""Where mean-centred keys hurt: the attention sink (``kvq-eval sink``).

Mean-centring (``keyopts.CenteredKeys``) quantizes ``k - mu`` instead of ``k``. It lowers the keys'
average energy, but a token whose key sits far from the channel mean gets a larger error. On
SmolLM2 the first token is such a key (short, far from ``mu``) and, as the attention sink, it
draws most of the attention that leaves a recent-token window in the upper layers, so centring
multiplies the logit error where the softmax weight is. These functions measure that on exact
post-RoPE queries and keys; ``sink_report`` assembles them per (layer, KV head) for one captured
sequence and a quantizer bit width.
"""

from __future__ import annotations

import numpy as np

__all__ = ["outside_weights", "sink_stats", "logit_error", "sink_report", "sink_table", "attention_geometry"]


def _check(q, k, window: int, scale: float, sliding: int | None):
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] < 2:
        raise ValueError(f"k must have shape (T, d) with T >= 2, got {k.shape}")
    if q.ndim != 3 or q.shape[0] < 1 or q.shape[1:] != k.shape:
        raise ValueError(f"q must have shape (G, {k.shape[0]}, {k.shape[1]}) with G >= 1, got {q.shape}")
    if not (np.all(np.isfinite(q)) and np.all(np.isfinite(k))):
        raise ValueError("q and k must be finite")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window must be an integer >= 0, got {window!r}")
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, (int, np.integer))
                                or sliding < 1):
        raise ValueError(f"sliding must be None or an integer >= 1, got {sliding!r}")
    return q, k


def outside_weights(q, k, window: int, scale: float, sliding: int | None = None) -> np.ndarray:
    """Exact attention weights on the keys a ``window``-token recent band leaves quantized.

    Parameters
    ----------
    q : array_like, shape (G, T, d)
        Post-RoPE queries of the G query heads that share the KV head, at positions 0..T-1.
    k : array_like, shape (T, d)
        The KV head's post-RoPE keys, T >= 2.
    window : int >= 0
        Keys at least ``window`` positions older than the query (``i - j >= window``) count as
        outside the band (no sink tokens kept).
    scale : float > 0
        The attention's logit scale (``d ** -0.5`` for SmolLM2).
    sliding : int, optional
        The layer's sliding window (keys with ``i - j >= sliding`` are not attended at all).

    Returns
    -------
    ndarray, shape (G, T, T), float64
        ``p_ij``, the causal softmax of ``scale * q_i . k_j`` over the attended keys, kept where
        ``i - j >= window`` and 0 elsewhere (rows are not renormalised).
    """
    q, k = _check(q, k, window, scale, sliding)
    T = k.shape[0]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = j <= i
    if sliding is not None:
        allowed &= (i - j) < sliding
    z = np.where(allowed, scale * np.einsum("gtd,sd->gts", q, k), -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.where((i - j) >= window, p, 0.0)


def sink_stats(q, k, mu, window: int, scale: float, sliding: int | None = None) -> dict:
    """How much of the outside-window attention the first token takes, and how far it sits from ``mu``.

    Parameters
    ----------
    q, k, window, scale, sliding
        As in ``outside_weights``.
    mu : array_like, shape (d,)
        The channel mean ``CenteredKeys`` subtracts (the calibration mean of this head's keys).

    Returns
    -------
    dict
        ``sink_share``: the share of the outside-window weight on token 0 (``sum p_i0 / sum p_ij``
        over every query and outside key; 0 when no weight is outside); ``sink_norm`` and
        ``sink_offset``: ``||k_0||`` and ``||k_0 - mu||``; ``key_rms`` and ``centred_rms``:
        ``sqrt(mean_t ||k_t||^2)`` and ``sqrt(mean_t ||k_t - mu||^2)``.

    Notes
    -----
    A scale-equivariant quantizer (TurboQuantMSE codes the direction and stores the norm) has an
    error proportional to the norm of what it codes, so centring scales token 0's error by
    ``sink_offset / sink_norm`` and the average one by ``centred_rms / key_rms``.
    """
    q, k = _check(q, k, window, scale, sliding)
    mu = np.asarray(mu, dtype=np.float64)
    if mu.shape != (k.shape[1],) or not np.all(np.isfinite(mu)):
        raise ValueError(f"mu must be {k.shape[1]} finite numbers, got shape {mu.shape}")
    return _stats(outside_weights(q, k, window, scale, sliding), k, mu)


def _stats(w, k, mu) -> dict:
    total = float(w.sum())
    return {"sink_share": float(w[..., 0].sum()) / total if total > 0 else 0.0,
            "sink_norm": float(np.linalg.norm(k[0])), "sink_offset": float(np.linalg.norm(k[0] - mu)),
            "key_rms": float(np.sqrt(np.mean(np.sum(k * k, axis=1)))),
            "centred_rms": float(np.sqrt(np.mean(np.sum((k - mu) ** 2, axis=1))))}


def logit_error(q, k, k_hat, window: int, scale: float, sliding: int | None = None) -> float:
    """Attention-weighted mean squared logit error of ``k_hat`` on the keys outside the band.

    ``sum_gij p_ij (scale * q_i . (k_hat_j - k_j))^2 / sum_gij p_ij`` with ``p`` from
    ``outside_weights`` (exact keys); 0 when no weight is outside. ``k_hat`` has ``k``'s shape.
    """
    q, k = _check(q, k, window, scale, sliding)
    k_hat = np.asarray(k_hat, dtype=np.float64)
    if k_hat.shape != k.shape or not np.all(np.isfinite(k_hat)):
        raise ValueError(f"k_hat must be finite with shape {k.shape}, got {k_hat.shape}")
    return _error(outside_weights(q, k, window, scale, sliding), q, k, k_hat, scale)


def _error(w, q, k, k_hat, scale: float) -> float:
    total = float(w.sum())
    if total == 0:
        return 0.0
    e = scale * np.einsum("gtd,sd->gts", q, k_hat - k)
    return float((w * e * e).sum() / total)


def sink_report(captured: dict, stats, bits: int, window: int, scales: dict, slidings: dict | None = None) -> dict:
    """Per (layer, KV head): ``sink_stats`` and TurboQuantMSE-``bits``'s logit error, plain and centred.

    Parameters
    ----------
    captured : dict
        ``{layer: (q (Hq, T, d), k (Hkv, T, d), ...)}``, one sequence (``kvq_eval.calib.capture``).
    stats : codebooks.calibration.CalibrationStats
        Supplies each head's key mean (``stats.head(layer, head).keys.mean``).
    bits : int
        TurboQuantMSE bits, seeded as the evaluation's ``tq_mse<bits>`` keys.
    window : int
        The recent band left exact (``outside_weights``).
    scales, slidings : dict
        ``{layer: logit scale}`` and ``{layer: sliding window or None}``.

    Returns
    -------
    dict
        ``{"bits", "window", "tokens", "heads": [...], "totals": {...}}``; each head row holds
        ``layer``, ``head``, the ``sink_stats`` keys, ``err_plain`` and ``err_centred``
        (``logit_error``); ``totals`` holds both errors pooled over heads with their weights
        (each head's outside weight), and the number of heads where centring raises the error.
    """
    from kvq_ref.turboquant import TurboQuantMSE

    from .keyopts import CenteredKeys
    from .methods import _seed

    slidings = slidings or {}
    rows, num, den = [], {"plain": 0.0, "centred": 0.0}, 0.0
    tokens = None
    for layer in sorted(captured):
        q, k = (np.asarray(a, dtype=np.float64) for a in captured[layer][:2])
        if q.ndim != 3 or k.ndim != 3 or k.shape[0] < 1 or q.shape[0] % k.shape[0] or q.shape[1:] != k.shape[1:]:
            raise ValueError(f"layer {layer}: q must be (Hq, T, d) and k (Hkv, T, d) with Hkv | Hq, "
                             f"got {q.shape} and {k.shape}")
        tokens = k.shape[1]
        g = q.shape[0] // k.shape[0]
        for h in range(k.shape[0]):
            qh, kh = q[h * g:(h + 1) * g], k[h]
            mu = np.asarray(stats.head(layer, h).keys.mean, dtype=np.float64)
            scale = float(scales[layer])
            w = outside_weights(qh, kh, window, scale, slidings.get(layer))  # once per head: (G, T, T)
            if mu.shape != (kh.shape[1],) or not np.all(np.isfinite(mu)):
                raise ValueError(f"layer {layer} head {h}: the key mean must be {kh.shape[1]} finite numbers")
            inner = TurboQuantMSE(kh.shape[1], bits, seed=_seed(layer, h, "key"))
            centred = CenteredKeys(inner, tuple(mu))
            row = {"layer": int(layer), "head": h, **_stats(w, kh, mu),
                   "err_plain": _error(w, qh, kh, inner.decode(inner.encode(kh)), scale),
                   "err_centred": _error(w, qh, kh, centred.decode(centred.encode(kh)), scale)}
            weight = float(w.sum())
            num["plain"] += weight * row["err_plain"]
            num["centred"] += weight * row["err_centred"]
            den += weight
            rows.append(row)
    if not rows:
        raise ValueError("captured holds no layer")
    worse = sum(r["err_centred"] > r["err_plain"] for r in rows)
    return {"bits": int(bits), "window": int(window), "tokens": int(tokens), "heads": rows,
            "totals": {"err_plain": num["plain"] / den if den else 0.0,
                       "err_centred": num["centred"] / den if den else 0.0,
                       "heads": len(rows), "heads_centring_worse": int(worse)}}


SINK_HEADER = ("model", "tokens", "recent window", "bits", "KV heads",
               "first token's share of the outside weight: median, max", "heads where centring raises the error",
               "logit error, plain keys", "logit error, mean-centred keys", "ratio")


def sink_table(reports) -> str:
    """Markdown summary of ``sink_report`` results, one row per ``(model, report)`` of ``reports``
    (``report`` None: a row of "–", not computed yet).

    The shares are over heads (each head's ``sink_share``); the logit errors are the pooled
    ``totals`` (``logit_error`` weighted by each head's outside attention weight), and ratio is
    centred over plain. ``ValueError`` when a report lacks a field.
    """
    lines = ["| " + " | ".join(SINK_HEADER) + " |", "|" + "---|" * len(SINK_HEADER)]
    for model, rep in reports:
        if rep is None:
            lines.append("| " + " | ".join([model] + ["–"] * (len(SINK_HEADER) - 1)) + " |")
            continue
        try:
            shares = np.array([r["sink_share"] for r in rep["heads"]], dtype=np.float64)
            if not shares.size:
                raise ValueError("no head")
            tot = rep["totals"]
            plain, centred = float(tot["err_plain"]), float(tot["err_centred"])
            cells = [model, str(int(rep["tokens"])), str(int(rep["window"])), str(int(rep["bits"])), str(int(tot["heads"])),
                     f"{100 * np.median(shares):.1f} %, {100 * shares.max():.1f} %",
                     f"{int(tot['heads_centring_worse'])} of {int(tot['heads'])}",
                     f"{plain:.4f}", f"{centred:.4f}", f"{centred / plain:.2f}x" if plain > 0 else "–"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{model}: not a kvq-eval sink report ({type(exc).__name__}: {exc})") from None
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attention_geometry(model) -> tuple[dict, dict]:
    """``({layer: logit scale}, {layer: sliding window or None})`` of a transformers model's attention
    modules (those with ``layer_idx`` and ``scaling``), the arguments ``sink_report`` needs."""
    from .hooks import _window_of

    attn = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
    if not attn:
        raise ValueError("model has no attention module with layer_idx and scaling")
    return {l: float(m.scaling) for l, m in attn.items()}, {l: _window_of(m) for l, m in attn.items()}
