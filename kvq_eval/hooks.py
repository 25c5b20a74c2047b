"""Attention inside a transformers model: exact capture, streaming-quantized attention, a Cache.

One attention function, registered as ``"kvq"`` with transformers' ``AttentionInterface`` (and the
sdpa mask with ``AttentionMaskInterface``), reads the active ``Session``:

* no session / ``mode="off"``: stock sdpa (the function is then transparent);
* ``mode="capture"``: stock sdpa, and the post-RoPE q, k, v of every layer (before the GQA repeat)
  are recorded;
* ``mode="simulate"``: teacher-forced streaming quantization. Token t is seen by the query at
  position i in 16 bits if it is in the method's band (``t < sink`` or ``i - t < window``), else
  through the method (its ``scores`` for logits, its ``accumulate`` for values). This is what a
  decoder reading a quantized cache computes at every position, in one forward pass;
* ``mode="cache"``: decoding with a ``QuantizedCache``. The first prefill (empty cache) attends in
  full precision, as deployments that quantize after prefill do; every later call (decode steps, or
  a chunk such as a question appended to a cached document) attends over the cache's quantized
  store: float16 sink and window tokens, encoded middle tokens. The middle tokens are decoded once
  when they are written (``q . decode(k)`` equals the methods' rotated-query scores up to float32
  rounding); keys of estimator methods (QJL, TurboQuant_prod) are scored by their estimator.

Sliding-window layers (Gemma) keep their window: a key farther back than ``module.sliding_window``
is masked in every mode.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kvq_ref.common import Encoded, Quantizer
from kvq_ref.fast import decode_fast, encode_fast
from kvq_ref.turboquant import TurboQuantMSE

from .band import band_mask, n_encoded, token_group
from .methods import MethodSpec

__all__ = ["Session", "session", "register", "QuantizedCache", "ATTN_IMPLEMENTATION", "cache_kwargs",
           "concat_encoded", "effective_keys", "simulate_dense", "SIMULATION"]

ATTN_IMPLEMENTATION = "kvq"
_ACTIVE: list["Session"] = []
QUERY_BLOCK = 1024  # query positions per block in simulate mode (bounds memory at long contexts)
#: Keys per block of torch's CPU flash-attention kernel (all of them when fewer). A sliding-window
#: layer's query block reads its keys from the block boundary at or before the first one it can see:
#: the skipped blocks are fully masked for every one of its rows, so they added exactly nothing, and
#: the blocks it reads are the same blocks, summed in the same order (the results are bit-identical,
#: ``tests/kvq_eval/test_simulate.py``); it saves most of the work of a long window's local layers.
FLASH_KV_BLOCK = 512
#: Version of the simulate-mode arithmetic, recorded in every cell that used it. 1 (cells without
#: the field): dense float64 ``scores``/``accumulate`` per query block. 2: middle and band merged by
#: log-sum-exp, values read through their float32 reconstruction (7-14x per 8K layer). The
#: two agree to a float32 ulp per layer, but a window's NLL moves between them (0.009 nats per
#: token of TurboQuantMSE-4's 0.020 at 1K, ``benchmarks/results/eval_simulate.json``): an ulp flips a
#: few quantization codes in a later layer and the window ends on another, equally valid
#: realization of the quantization noise (so does any tiny change of the values).
SIMULATION = 2


@dataclass
class Session:
    """What the ``kvq`` attention function does while the session is active."""

    mode: str = "off"
    spec: MethodSpec | None = None
    cache: "QuantizedCache | None" = None
    captured: dict = field(default_factory=dict)
    dense: bool = False  # simulate mode: the dense float64 definition instead of the fast form


@contextlib.contextmanager
def session(mode: str = "off", spec: MethodSpec | None = None, cache: "QuantizedCache | None" = None,
            dense: bool = False):
    """Activate a ``Session`` (nesting is allowed; the innermost one is used). ``dense``: simulate
    with ``simulate_dense`` (the definition, for tests and benchmarks)."""
    if mode not in ("off", "capture", "simulate", "cache"):
        raise ValueError(f"mode must be off, capture, simulate or cache, got {mode!r}")
    if mode in ("simulate", "cache") and spec is None:
        raise ValueError(f"mode {mode!r} needs a MethodSpec")
    if mode == "cache" and cache is None:
        raise ValueError("mode 'cache' needs a QuantizedCache")
    s = Session(mode, spec, cache, dense=bool(dense))
    _ACTIVE.append(s)
    try:
        yield s
    finally:
        _ACTIVE.remove(s)


def _window_of(module) -> int | None:
    w = getattr(module, "sliding_window", None)
    return int(w) if w else None


def _allowed(q_pos: np.ndarray, k_pos: np.ndarray, sliding: int | None) -> np.ndarray:
    ok = k_pos[None, :] <= q_pos[:, None]
    if sliding is not None:
        ok &= q_pos[:, None] - k_pos[None, :] < sliding
    return ok


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _masked_softmax(z: np.ndarray, ok: np.ndarray, scaling: float) -> np.ndarray:
    """``_softmax(np.where(ok, z * scaling, -inf))``, formed in place in ``z`` (a C-contiguous float64
    array the caller owns) and returned.

    The same operations on the same values in the same order (each row's max and sum run over a
    contiguous row either way), so the same bits (tested); one buffer instead of five fresh ones,
    which a decode step's teacher-forced queries over an 8K cache spent most of their attention
    time allocating and filling.
    """
    z *= scaling
    np.copyto(z, -np.inf, where=~ok)
    z -= np.max(z, axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def _fused(q: Quantizer) -> bool:
    return type(q) is TurboQuantMSE and q.rotation == "hadamard"


def _encode(q: Quantizer, x: np.ndarray) -> Encoded:
    """``q.encode(x)``; TurboQuantMSE with the Hadamard rotation goes through ``kvq_ref.fast``'s
    fused kernel, which gives the same bytes (tested there and in ``tests/kvq_eval/test_simulate.py``)
    in one pass per vector instead of a dozen whole-array numpy passes."""
    return encode_fast(q, x) if _fused(q) else q.encode(x)


def _decode(q: Quantizer, enc: Encoded) -> np.ndarray:
    """``q.decode(enc)``, fused where ``_encode`` is (the same float32)."""
    return decode_fast(q, enc) if _fused(q) else q.decode(enc)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def effective_keys(km: Quantizer, enc: Encoded, d: int) -> np.ndarray:
    """float64 (T, d) rows ``K`` with ``km.scores(km.prepare_query(q), enc) == q @ K.T``.

    Every method's score is linear in the query (a rotation, a sketch projection, a coefficient
    map, plus ``q . mu`` terms), so scoring the ``d`` unit queries reads the whole linear map: for
    a decoding method ``K`` is its float64 reconstruction, for an estimator (QJL, TurboQuant_prod)
    the keys its estimator implicitly scores. ``tests/kvq_eval/test_simulate.py`` checks the
    linearity for every registered method.
    """
    return np.ascontiguousarray(km.scores(km.prepare_query(np.eye(d)), enc).T)


def _flash_lse(q, k, v, scale: float, causal: bool = False, mask=None):
    """``(softmax(q k^T * scale + mask) v, logsumexp)`` for q (g, Tq, d), k and v (Tk, d), float64.

    torch's CPU flash-attention kernel (the one behind ``scaled_dot_product_attention``, which
    also returns the log-sum-exp); ``causal`` aligns query 0 with key 0. ``mask`` is a bool
    (Tq, Tk) of allowed keys. Rows with no allowed key get output 0 and log-sum-exp -inf.
    """
    g = q.shape[0]
    kk, vv = (x.expand(1, g, *x.shape) for x in (k, v))
    add = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, -np.inf)[None, None]
    out, lse = _FLASH(q[None], kk, vv, 0.0, causal, attn_mask=add, scale=scale)
    out, lse = out[0], lse[0]
    if mask is not None:
        empty = ~mask.any(-1)
        if empty.any():
            out[:, empty], lse[:, empty] = 0.0, -np.inf
    return out, lse


def _dense_lse(q, k, v, scale: float, causal: bool = False, mask=None):
    """What ``_flash_lse`` computes, by matrix products (for torch builds without the kernel)."""
    z = (q @ k.T) * scale
    allowed = torch.ones(z.shape[-2:], dtype=torch.bool) if mask is None else mask.clone()
    if causal:
        allowed &= torch.ones_like(allowed).tril()
    z.masked_fill_(~allowed, -np.inf)
    lse = torch.logsumexp(z, -1)
    p = torch.exp(z - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ v, lse


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_partial_attention = _flash_lse if _FLASH is not None else _dense_lse


def _merge(parts):
    """Attention over the union of disjoint key sets from each set's (out, log-sum-exp)."""
    m = torch.stack([lse for _, lse in parts]).amax(0)
    w = [torch.exp(lse - m) for _, lse in parts]
    return sum(wi[..., None] * o for wi, (o, _) in zip(w, parts)) / sum(w)[..., None]


def _first_key_block(lo: int, sliding: int | None) -> int:
    """The first key a query block starting at ``lo`` reads (``FLASH_KV_BLOCK``): 0 without a sliding
    window, else the block boundary at or before ``lo - sliding + 1``, its first query's first key."""
    if sliding is None:
        return 0
    return max(0, lo - sliding + 1) // FLASH_KV_BLOCK * FLASH_KV_BLOCK


def _simulate(module, query, key, value, scaling, spec: MethodSpec):
    """Streaming-quantized attention for a full sequence (batch 1, no cache).

    Query i attends to two disjoint key sets, merged by their log-sum-exp: the middle (keys
    stored through the method: ``mid(i) = [sink, sink + n_encoded(i + 1, ...))``) through the
    method's effective keys (``effective_keys``) and float32 reconstructed values, and the band
    (the sink and the recent tokens) in float16. The middle is one causal flash-attention call
    when it is a shifted causal range (token group 1, no sliding window); otherwise it goes in
    blocks of ``QUERY_BLOCK`` queries with a mask, as does the band (a few columns per block).
    Equal to ``p_band @ v16 + accumulate(p - p_band)`` with float64 scores; the values' float32
    rounding is the only difference (the decoding cache also reads float32 reconstructions).
    """
    q = query[0].double()  # (H, T, d)
    k = key[0].double().numpy()  # (Hkv, T, d)
    v = value[0].double().numpy()
    hq, t, d = q.shape
    g = hq // k.shape[0]
    pos = np.arange(t)
    sliding = _window_of(module)
    out = torch.empty((hq, t, d), dtype=torch.float64)
    layer, sink, window = module.layer_idx, spec.sink, spec.window
    for h in range(k.shape[0]):
        km, vm = spec.key(layer, h, d), spec.value(layer, h, d)
        group = max(token_group(km), token_group(vm))
        kh, vh = _fp16(k[h]), _fp16(v[h])
        keys = effective_keys(km, _encode(km, k[h]), d) if km is not None else kh
        vals = _decode(vm, _encode(vm, v[h])).reshape(t, d).astype(np.float64) if vm is not None else vh
        keys, vals, kh, vh = (torch.from_numpy(np.ascontiguousarray(x)) for x in (keys, vals, kh, vh))
        qh = q[h * g:(h + 1) * g]
        first = sink + window  # first query with a middle when group == 1
        if group == 1 and sliding is None and first < t:
            # middle of query i = keys [sink, i - window]: causal after shifting by sink + window
            o_mid, l_mid = _partial_attention(qh[:, first:], keys[sink:t - window], vals[sink:t - window], scaling,
                                              causal=True)
            o_mid = torch.cat([torch.zeros(g, first, d, dtype=torch.float64), o_mid], 1)
            l_mid = torch.cat([torch.full((g, first), -np.inf, dtype=torch.float64), l_mid], 1)
        for lo in range(0, t, QUERY_BLOCK):
            hi = min(t, lo + QUERY_BLOCK)
            qp, qb = pos[lo:hi], qh[:, lo:hi]
            # keys before k0 are outside every query's sliding window (k0 = 0 without one): the masks
            # cover [k0, hi) only, for the same parts as over [0, hi)
            k0 = _first_key_block(lo, sliding)
            allowed = _allowed(qp, pos[k0:hi], sliding)
            band = band_mask(qp, pos[k0:hi], sink, window, group) & allowed
            if not (group == 1 and sliding is None):
                mid = torch.from_numpy(allowed & ~band)
                parts = [_partial_attention(qb, keys[k0:hi], vals[k0:hi], scaling, mask=mid)]
            elif first < t:
                parts = [(o_mid[:, lo:hi], l_mid[:, lo:hi])]
            else:
                parts = []
            local = np.flatnonzero(band.any(0))  # the sink and the recent tokens of this block
            cols = k0 + local
            if cols.size:
                idx = torch.from_numpy(cols)
                parts.append(_partial_attention(qb, kh[idx], vh[idx], scaling, mask=torch.from_numpy(band[:, local])))
            out[h * g:(h + 1) * g, lo:hi] = _merge(parts)
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0), None


def simulate_dense(module, query, key, value, scaling, spec: MethodSpec):
    """The streaming simulation's definition, formed densely in float64 (``SIMULATION`` 1).

    Query i sees key t <= i through the method (its ``scores`` and ``accumulate``, in float64)
    unless t is in its band, where it sees the float16 key and value. (T, T) arrays per KV head:
    the reference ``_simulate`` is tested against (``tests/kvq_eval/test_simulate.py``) and
    benchmarked against (``benchmarks/eval_simulate.py``); ``session(..., dense=True)`` runs it.
    """
    q, k, v = (x[0].double().numpy() for x in (query, key, value))
    hq, t, d = q.shape
    g = hq // k.shape[0]
    pos = np.arange(t)
    out = np.empty((hq, t, d))
    allowed = np.tile(_allowed(pos, pos, _window_of(module)), (g, 1))
    for h in range(k.shape[0]):
        km, vm = spec.key(module.layer_idx, h, d), spec.value(module.layer_idx, h, d)
        band = np.tile(band_mask(pos, pos, spec.sink, spec.window, max(token_group(km), token_group(vm))), (g, 1))
        kh, vh = _fp16(k[h]), _fp16(v[h])
        qg = q[h * g:(h + 1) * g].reshape(-1, d)
        z = np.where(band, qg @ kh.T, km.scores(km.prepare_query(qg), km.encode(k[h])))
        p = _softmax(np.where(allowed, z * scaling, -np.inf))
        pb = np.where(band, p, 0.0)
        out[h * g:(h + 1) * g] = (pb @ vh + vm.accumulate(p - pb, vm.encode(v[h]))).reshape(g, t, d)
    return torch.from_numpy(out).to(query.dtype).transpose(0, 1).unsqueeze(0), None


def _stock(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def kvq_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function (see the module docstring)."""
    s = _ACTIVE[-1] if _ACTIVE else None
    scaling = module.scaling if scaling is None else scaling
    if s is None or s.mode == "off":
        return _stock(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError("kvq attention evaluates one sequence at a time (batch size 1)")
    if s.mode == "capture":
        s.captured.setdefault(module.layer_idx, []).append(
            tuple(x[0].detach().float().numpy().copy() for x in (query, key, value)))
        return _stock(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if s.mode == "simulate":
        return (simulate_dense if s.dense else _simulate)(module, query, key, value, scaling, s.spec)
    return s.cache.attend(module, query, scaling, attention_mask, key, value, kwargs)


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` with the keyword the installed transformers takes for a KV cache in
    ``model(...)`` and ``model.generate(...)``: ``cache`` from 5.x on, ``past_key_values`` before."""
    return {_cache_keyword(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class) -> str:
    # looked up once per model class: decoding calls cache_kwargs at every generated token
    import inspect

    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def register() -> str:
    """Register the ``kvq`` attention and mask functions; returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvq_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def concat_encoded(method: Quantizer, parts: list[Encoded]) -> Encoded:
    """Concatenate encodings of consecutive token chunks (every array along axis 0).

    Valid for methods whose stored arrays lead with the token axis (or with whole token groups
    when chunks hold whole groups); the result is checked against the method's layout.
    """
    if len(parts) == 1:
        return parts[0]
    shape = (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])
    arrays = {k: np.concatenate([p.arrays[k] for p in parts], axis=0) for k in parts[0].arrays}
    enc = Encoded(parts[0].method, parts[0].config, shape, arrays)
    method._check(enc)
    return enc


def _make_cache_base():
    from transformers import DynamicCache

    return DynamicCache


def _make_growing_layer():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys/values are prefix views of buffers whose capacity
        doubles: a decode step writes its token instead of concatenating the whole layer (two
        copies of every cached state per layer and step: about half of a SmolLM2 decode step at
        8K in a profile here). Same states, same lengths; the first write fills its buffer
        exactly, so an exact prefill's attention sees contiguous tensors."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.keys.shape[-2] if self.keys.dim() == key_states.dim() else 0
            end = n + key_states.shape[-2]
            buf = getattr(self, "_buf", None)
            if buf is None or end > buf[0].shape[-2] or buf[0].data_ptr() != self.keys.data_ptr():
                cap = max(end, 2 * n)  # a foreign keys tensor (crop, reorder) is copied in first
                buf = tuple(x.new_empty(x.shape[:-2] + (cap, x.shape[-1])) for x in (key_states, value_states))
                if n:
                    buf[0][..., :n, :], buf[1][..., :n, :] = self.keys, self.values
                self._buf = buf
            buf[0][..., n:end, :], buf[1][..., n:end, :] = key_states, value_states
            self.keys, self.values = buf[0][..., :end, :], buf[1][..., :end, :]
            return self.keys, self.values

    return GrowingLayer


_GrowingLayer = _make_growing_layer()


class _Rows:
    """A growable float64 (n, d) row buffer: ``append`` copies only the new rows (capacity
    doubles), ``rows`` is a view.

    Decoded middle tokens live here, in float64, the dtype the float64 queries are scored in:
    concatenating a float32 array at every decode step copied the whole middle twice per step
    (the concatenation, then the cast of the matmul); the store's writes and attention took about
    half of a SmolLM2 decode step at 8K in a profile here."""

    def __init__(self, d: int):
        self._buf = np.empty((0, d))
        self.n = 0

    def append(self, x: np.ndarray) -> None:
        end = self.n + x.shape[0]
        if end > self._buf.shape[0]:
            buf = np.empty((max(end, 2 * self._buf.shape[0], 64), self._buf.shape[1]))
            buf[: self.n] = self._buf[: self.n]
            self._buf = buf
        self._buf[self.n:end] = x  # float32 reconstructions are exact in float64
        self.n = end

    @property
    def rows(self) -> np.ndarray:
        return self._buf[: self.n]

    def __deepcopy__(self, memo):
        out = _Rows.__new__(_Rows)
        out._buf, out.n = self._buf[: self.n].copy(), self.n
        return out


class _Store:
    """One layer's quantized store: per KV head, float16 sink/window tokens and encoded middle."""

    def __init__(self, spec: MethodSpec, layer: int, n_heads: int, d: int):
        self.spec, self.layer, self.d = spec, layer, d
        self.n = 0  # tokens written
        self.sink_k = [np.empty((0, d)) for _ in range(n_heads)]
        self.sink_v = [np.empty((0, d)) for _ in range(n_heads)]
        self.win_k = [np.empty((0, d)) for _ in range(n_heads)]
        self.win_v = [np.empty((0, d)) for _ in range(n_heads)]
        self.enc_k: list[Encoded | None] = [None] * n_heads
        self.enc_v: list[Encoded | None] = [None] * n_heads
        # decoded middle tokens, kept so that each decode step does not decode again; keys of
        # estimator methods (QJL sketches) are always scored through the method instead
        self.dec_k = [_Rows(d) for _ in range(n_heads)]
        self.dec_v = [_Rows(d) for _ in range(n_heads)]
        self.n_mid = 0

    def write(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append new tokens (Hkv, T, d); tokens leaving the window are encoded in chunks."""
        spec = self.spec
        for h in range(k.shape[0]):
            kk, vv = k[h], v[h]
            take = max(0, min(spec.sink - self.sink_k[h].shape[0], kk.shape[0]))
            self.sink_k[h] = np.concatenate([self.sink_k[h], _fp16(kk[:take])])
            self.sink_v[h] = np.concatenate([self.sink_v[h], _fp16(vv[:take])])
            self.win_k[h] = np.concatenate([self.win_k[h], kk[take:]])
            self.win_v[h] = np.concatenate([self.win_v[h], vv[take:]])
            km, vm = spec.key(self.layer, h, self.d), spec.value(self.layer, h, self.d)
            # the band rule shared with simulate mode (kvq_eval.band): whole token groups leave
            n_out = n_encoded(self.win_k[h].shape[0], 0, spec.window, max(token_group(km), token_group(vm)))
            if n_out:
                # one call for all whole groups: what encoding group by group and concatenating gives
                old_k, old_v = self.win_k[h][:n_out], self.win_v[h][:n_out]
                self.win_k[h], self.win_v[h] = self.win_k[h][n_out:], self.win_v[h][n_out:]
                new_k, new_v = _encode(km, old_k), _encode(vm, old_v)
                self.enc_k[h] = concat_encoded(km, ([self.enc_k[h]] if self.enc_k[h] else []) + [new_k])
                self.enc_v[h] = concat_encoded(vm, ([self.enc_v[h]] if self.enc_v[h] else []) + [new_v])
                if not km.estimator:
                    self.dec_k[h].append(_decode(km, new_k))
                self.dec_v[h].append(_decode(vm, new_v))
        self.n += k.shape[1]
        self.n_mid = self.enc_k[0].shape[0] if self.enc_k[0] is not None else 0

    def positions(self, h: int):
        """(sink positions, middle positions, window positions)."""
        s = self.sink_k[h].shape[0]
        return np.arange(s), np.arange(s, s + self.n_mid), np.arange(s + self.n_mid, self.n)

    def bits(self) -> tuple[float, int]:
        """(stored bits, elements) over keys and values of this layer."""
        nbytes = 0
        for h in range(len(self.sink_k)):
            nbytes += 2 * (self.sink_k[h].size + self.sink_v[h].size + self.win_k[h].size + self.win_v[h].size)
            nbytes += sum(e.nbytes for e in (self.enc_k[h], self.enc_v[h]) if e is not None)
        return 8.0 * nbytes, 2 * self.n * self.d * len(self.sink_k)


class QuantizedCache(_make_cache_base()):
    """A transformers ``DynamicCache`` that also keeps a quantized store of every layer.

    ``update`` stores the new full-precision states (so stock attention still works) and writes
    them to the layer's store, where tokens leaving the method's 16-bit window are encoded in
    whole token groups (``kvq_eval.band``). Inside ``session(mode="cache", ...)`` the ``kvq`` attention reads the store, so
    ``model.generate(..., **cache_kwargs(model, QuantizedCache(spec)))`` decodes over the quantized
    cache.

    Parameters
    ----------
    spec : MethodSpec
    exact_prefill : bool
        The first forward call over an empty cache attends in full precision (default True).
    """

    def __init__(self, spec: MethodSpec, exact_prefill: bool = True, **kwargs):
        from transformers.cache_utils import DynamicLayer

        super().__init__(**kwargs)
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:
            self.layer_class_to_replicate = _GrowingLayer  # plain DynamicLayers only (not sliding)
        self.spec = spec
        self.exact_prefill = exact_prefill
        self.stores: dict[int, _Store] = {}
        self._first = True

    @classmethod
    def from_cache(cls, cache, spec: MethodSpec) -> "QuantizedCache":
        """A quantized cache holding what a (full-precision) ``DynamicCache`` holds: one exact
        prefill can then be shared by every method. Later calls attend over the quantized store."""
        out = cls(spec)
        for layer_idx, layer in enumerate(cache.layers):
            out.update(layer.keys, layer.values, layer_idx)
        out._first = False
        return out

    def fork(self) -> "QuantizedCache":
        """An independent copy (stores and full-precision states; the spec is shared): what a
        second ``from_cache`` of the same cache gives, without encoding the tokens again."""
        return copy.deepcopy(self, {id(self.spec): self.spec})

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0 and self.stores.get(0) is not None and self.stores[0].n > 0:
            self._first = False
        k = key_states[0].detach().double().numpy()
        v = value_states[0].detach().double().numpy()
        store = self.stores.setdefault(layer_idx, _Store(self.spec, layer_idx, k.shape[0], k.shape[-1]))
        store.write(k, v)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def bits_per_element(self) -> float:
        """Stored bits per element of every layer's keys and values (band at 16 bits)."""
        bits = [s.bits() for s in self.stores.values()]
        return sum(b for b, _ in bits) / sum(n for _, n in bits)

    def attend(self, module, query, scaling, attention_mask, key, value, kwargs):
        """Attention of the new queries over the store (or exact, for the first prefill)."""
        if self._first and self.exact_prefill:
            return _stock(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        store = self.stores[module.layer_idx]
        q = query[0].double().numpy()
        hq, tq, d = q.shape
        n_kv = len(store.sink_k)
        g = hq // n_kv
        q_pos = np.arange(store.n - tq, store.n)
        out = np.empty((hq, tq, d))
        sliding = _window_of(module)
        for h in range(n_kv):
            km, vm = self.spec.key(module.layer_idx, h, d), self.spec.value(module.layer_idx, h, d)
            p_s, p_m, p_w = store.positions(h)
            qg = q[h * g:(h + 1) * g].reshape(-1, d)
            band_k = np.concatenate([store.sink_k[h], _fp16(store.win_k[h])])
            band_v = np.concatenate([store.sink_v[h], _fp16(store.win_v[h])])
            pos = np.concatenate([p_s, p_w, p_m])
            z = np.empty((qg.shape[0], pos.size))
            z[:, : band_k.shape[0]] = qg @ band_k.T
            if p_m.size:
                z[:, band_k.shape[0]:] = (km.scores(km.prepare_query(qg), store.enc_k[h]) if km.estimator
                                          else qg @ store.dec_k[h].rows.T)
            ok = np.tile(_allowed(q_pos, pos, sliding), (g, 1))
            p = _masked_softmax(z, ok, scaling)
            o = p[:, : band_k.shape[0]] @ band_v
            if p_m.size:
                o = o + p[:, band_k.shape[0]:] @ store.dec_v[h].rows
            out[h * g:(h + 1) * g] = o.reshape(g, tq, d)
        return torch.from_numpy(out).to(query.dtype).transpose(0, 1).unsqueeze(0), None
