"""Float32 rounding bounds for implementations checked against kvq_ref (float64).

Notes
-----
Unit roundoff ``u = 2^-24``. Sums of n terms use the probabilistic bound of Higham and Mary (SIAM J.
Sci. Comput. 41, 2019): if rounding errors are independent with mean zero, the error of a recursive
or blocked sum of n products is at most about ``lam * sqrt(n) * u * sum|terms|`` except with
probability ``2n exp(-lam^2 / 2)``; with ``lam = 6`` that is 3e-8 n per sum (the worst-case bound,
``n u`` instead of ``sqrt(n) u``, is 10x looser still).

Decode (``decode_tolerance``). Per row, ``x_hat = D1 P^T H_b (D2 (c[idx] * s / sqrt(b)))`` is
computed with these roundings, each a relative error <= u in the 2-norm of the vector it rounds:
the float32 level (1), the float32 constant ``1/sqrt(b)`` (1) and its product with the scale (1),
the product with the level (1), one per butterfly stage (log2 b; every stage is sqrt(2) times an
orthogonal map, so relative errors in the 2-norm add up), and kvq_ref's own rounding of its float64
result to float32 (1). Sign flips, the permutation and a float16 scale add nothing. To first order
``||impl - ref||_2 <= (log2(b) + 5) u ||ref||_2``; the bound allows ``(log2(b) + 6) u ||ref||_2``
(one u for second-order terms). Measured on the Triton kernels: at most ~3.2 u. Methods without a
Hadamard stage use ``b = 1``.

Decode attention over TurboQuantMSE (``mse_attention_tolerance``). Logit ``z_t = scale * <q', k'_t>``
where the kernel multiplies the rotated query by ``levels * norm`` for encoded tokens and the plain
query by the float16 key for band tokens: ``|dz_t| <= lam u [sqrt(d + 4) scale sum_j |q'_j k'_tj| +
sqrt(log2 b + 2) scale ||q|| ||k_t||] + 4u + lam u sqrt(n + 8)``: the dot product with the level, norm
and scale roundings, the query rotation (log2 b butterfly stages, encoded tokens only), the float32
exp (<= 2 ulp, doubled) and the running max/sum rescalings. Softmax weights then move by at most
``|dw_t| <= w_t (|dz_t| + sum_s w_s |dz_s|)`` (first order), and the output by ``sum_t |dw_t| |v_t| +
lam u sqrt(n + log2 b + 8) || sum_t w_t |y_t| ||_2``, the last term for the blocked accumulation of
the values ``y_t`` as the kernel holds them (rotated for encoded tokens), the one inverse rotation and
the final division. The query is rounded to float32 before both computations, so its rounding is not
an error. Measured errors of the Triton kernel are about 1e-3 of this bound; the bound is still 10x
below what one wrong 3-bit code does (tests/gpu).

NOVA-KV scores (``nova_score_tolerance``). ``s_t = gain_t sum_j T_j[code_tj] + q . mu`` with ``q_m = q @
inverse.T`` (d products; the float64 inverse rounded to float32, one more u), ``T_j[i] = q_m[G_j] .
c_ji`` (g products), the sum over G groups, the gain product and the offset ``q . mu`` (d products,
mu rounded): ``|ds_t| <= lam u sqrt(d + g + G + 4) gain_t sum_j sum_i (|q| @ |inverse|^T)[G_ji]
|c_j[code_tj], i| + lam u sqrt(d + 3) |q| . |mu| + u |s_t|``.

Attention, relative (``ATTENTION_RTOL``). For a float32 implementation whose internals are not
modelled term by term (the CUDA kernel: d-term dot products ~ sqrt(d) u, expf <= 2 ulp, running sums
over n tokens ~ sqrt(n) u, a float32 inverse rotation of log2(b) + 2 roundings), d <= 256, n <= 300
and logits of order 1..10 give ~1e-6 relative; measured at most 1.2e-6 (Frobenius) and 2e-6 (max
element / ``max |ref|``). 2e-5 leaves 10x for a GPU's expf and FMA contractions, while any indexing or
softmax bug (a wrong level, code, sign or weight) shows up at >= 1e-3.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["U32", "LAM", "ATTENTION_RTOL", "decode_tolerance", "mse_attention_tolerance", "nova_score_tolerance",
           "row_errors"]

U32 = 2.0**-24
LAM = 6.0
ATTENTION_RTOL = 2e-5


def _np(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def row_errors(out, ref):
    """``(||out - ref||_2, ||ref||_2)`` per row (last axis), float64."""
    out, ref = _np(out).astype(np.float64), _np(ref).astype(np.float64)
    return np.linalg.norm(out - ref, axis=-1), np.linalg.norm(ref, axis=-1)


def decode_tolerance(ref, block: int = 1, u: float = U32) -> np.ndarray:
    """Per-row bound ``(log2(block) + 6) u ||ref||_2`` on a float32 decode (module Notes).

    ref : array (..., d), kvq_ref's decode; block : the Hadamard block (``q.rot.block``, 1 if none).
    """
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 1, got {block}")
    return (math.log2(block) + 6) * u * np.linalg.norm(_np(ref).astype(np.float64), axis=-1)


def mse_attention_tolerance(q, cache, kq, vq, scale, u: float = U32) -> np.ndarray:
    """Per-query bound on ``max_j |out_j - ref_j|`` for decode attention over a TurboQuantMSE cache.

    q : (m, d) float64 (the float32-rounded queries); cache : kvq_ref.QuantizedKV; kq, vq : its methods.
    """
    K, V = cache.dequantized()
    n, d = K.shape
    log_b = (d & -d).bit_length() - 1
    enc = np.zeros(n, bool)
    enc[cache.middle] = True
    k_kernel, y_kernel = K.copy(), V.copy()  # what the kernel multiplies: rotated for encoded tokens
    if enc.any():
        k_kernel[enc] = kq.rot.apply(K[enc])
        y_kernel[enc] = vq.rot.apply(V[enc])
    q_kernel = np.where(enc[None, :, None], kq.rot.apply(q)[:, None, :], q[:, None, :])
    dot_abs = scale * np.einsum("mnd,nd->mn", np.abs(q_kernel), np.abs(k_kernel))
    rot = scale * np.linalg.norm(q, axis=1)[:, None] * np.linalg.norm(K, axis=1)[None, :] * enc
    dz = LAM * u * (math.sqrt(d + 4) * dot_abs + math.sqrt(log_b + 2) * rot) + 4 * u + LAM * u * math.sqrt(n + 8)
    z = scale * q @ K.T
    w = np.exp(z - z.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    weights = (w * dz) @ np.abs(V) + (w * dz).sum(axis=1, keepdims=True) * (w @ np.abs(V))
    accumulate = LAM * u * math.sqrt(n + log_b + 8) * np.linalg.norm(w @ np.abs(y_kernel), axis=1)
    return weights.max(axis=1) + accumulate


def nova_score_tolerance(q, head, enc, ref, u: float = U32) -> np.ndarray:
    """Per-score bound on ``|impl - ref|`` for NOVA-KV key scores, shape (m, N) (module Notes)."""
    from ..packing import unpack_codes

    d, g = head.d, head.g
    n_groups = d // g
    codes = unpack_codes(enc.arrays["codes"], head.bits * g, n_groups)
    gains = enc.arrays["gains"].astype(np.float64)
    qm_abs = np.abs(q) @ np.abs(head.key.inverse).T  # (m, d)
    cent = np.abs(head.key_centroids.astype(np.float64))  # (G, K, g)
    per_token = np.zeros((q.shape[0], codes.shape[0]))
    for j in range(n_groups):
        per_token += qm_abs[:, head.key_groups[j]] @ cent[j][codes[:, j]].T
    return (LAM * u * math.sqrt(d + g + n_groups + 4) * gains * per_token
            + LAM * u * math.sqrt(d + 3) * (np.abs(q) @ np.abs(head.key.mu))[:, None] + u * np.abs(ref))
