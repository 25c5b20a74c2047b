"""NovaKV and Oscar quantizers on calibrated synthetic heads, the NovaModel files and the CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from codebooks import TableFileError
from codebooks.cli import main as codebooks_main
from codebooks.nova import NovaModel, calibrate
from kvq_ref import Encoded, QuantizedKV, TurboQuantMSE, attention_decode
from kvq_ref.nova import NovaKV, Oscar, nearest_centroids
from tests.nova_data import generator, sequence

D = 32


@pytest.fixture(scope="module")
def calibrated():
    gen = generator(D, seed=5)
    seqs = [sequence(gen, 4, 2, 400, s) for s in range(3)]
    stats, m = calibrate(seqs, D, iterations=8, seed=1)
    return gen, m, seqs, stats


@pytest.fixture(scope="module")
def model(calibrated):
    return calibrated[:2]


@pytest.fixture(scope="module")
def held_out(model):
    gen, _ = model
    return sequence(gen, 4, 2, 300, 50)[0]


def test_scores_and_sums_never_inverse_transform_but_agree(model, held_out):
    _, m = model
    q, k, v = held_out
    for role, x, kw in (("key", k[0], {}), ("value", v[0], {"values": "vq"}), ("value", v[0], {})):
        nk = NovaKV(m.head(0, 0), role, **kw)
        enc = nk.encode(x)
        dec = nk.decode(enc).astype(np.float64)
        qq = q[0, :5]
        assert np.allclose(nk.inner_product(qq, enc), qq @ dec.T, rtol=1e-5, atol=1e-4)
        p = np.random.default_rng(0).dirichlet(np.ones(300), size=3)
        assert np.allclose(nk.accumulate(p, enc), p @ dec, rtol=1e-5, atol=1e-5)


def test_logit_error_is_coefficient_error(model, held_out):
    """Generalized Parseval through the quantizer: E_q[(q.e)^2] over queries with second moment
    Sigma_q equals ||c - c_hat||^2 per token (Monte Carlo over q, 4.5 standard errors)."""
    _, m = model
    head = m.head(0, 0)
    nk = NovaKV(head, "key")
    k = held_out[1][0][:20]
    enc = nk.encode(k)
    e = k - nk.decode(enc).astype(np.float64)
    dc = head.key.coefficients(k) - head.key.coefficients(nk.decode(enc).astype(np.float64))
    sq = head.key.forward @ head.key.forward.T  # = S V V^T S = Sigma_q (floored)
    rng = np.random.default_rng(2)
    qs = rng.multivariate_normal(np.zeros(D), sq, 200_000)
    err2 = (qs @ e.T) ** 2
    se = err2.std(axis=0, ddof=1) / math.sqrt(qs.shape[0])
    assert np.all(np.abs(err2.mean(axis=0) - np.sum(dc**2, axis=1)) <= 4.5 * se)


def test_rates_and_band_accounting(model):
    _, m = model
    x = np.random.default_rng(3).standard_normal((64, D))
    assert NovaKV(m.head(0, 0), "key").encode(x).bits_per_element == 2 + 32 / D  # float32 gain, as released
    assert NovaKV(m.head(0, 0), "key", gain_dtype="float16").encode(x).bits_per_element == 2 + 16 / D
    assert NovaKV(m.head(0, 0), "value", values="vq").encode(x).bits_per_element == 2 + 32 / D
    assert NovaKV(m.head(0, 0), "value").encode(x).bits_per_element == 2 + 64 / D  # the release's INT2
    # one group of D channels: float32 scale and zero (OSCAR's release script), float16 ones (rule="uniform")
    assert Oscar(m.head(0, 0), "key").encode(x).bits_per_element == 2 + 64 / D
    assert Oscar(m.head(0, 0), "key", rule="uniform").encode(x).bits_per_element == 2 + 32 / D
    # docs/references/calibrated.md: 2.22 (NOVA-KV) and 2.28 (OSCAR) at 128K tokens with a 16-bit band of 64 + 256 tokens and
    # d = 128, counting 16-bit gains and scales (gain_dtype="float16", rule="uniform"): per-token rates
    # from the stored layout, band tokens at 16 bits
    n, band = 131072, 64 + 256
    nova = (16 * band + (n - band) * ((2 + 16 / 128) + (2 + 32 / 128)) / 2) / n
    oscar = (16 * band + (n - band) * (2 + 32 / 128)) / n
    assert round(nova, 2) == 2.22 and round(oscar, 2) == 2.28
    # and QuantizedKV's stored accounting follows the same formula
    y = np.random.default_rng(4).standard_normal((1000, D))
    cache = QuantizedKV.build(y, y, NovaKV(m.head(0, 0), "key", gain_dtype="float16"),
                              NovaKV(m.head(0, 0), "value", values="vq"), sink=64, window=256)
    bits = cache.bits_per_element()
    expected = (16 * band + (1000 - band) * ((2 + 16 / D) + (2 + 32 / D)) / 2) / 1000
    assert bits["total"] == pytest.approx(expected, rel=1e-12)


def test_nova_beats_rotations_on_held_out_logits(model, held_out):
    _, m = model
    q, k, _ = held_out
    qq = q[:2, -50:].reshape(-1, D)
    truth = qq @ k[0].T
    errs = {}
    for name, meth in {"nova": NovaKV(m.head(0, 0), "key"), "oscar": Oscar(m.head(0, 0), "key"),
                       "tq2": TurboQuantMSE(D, 2)}.items():
        errs[name] = float(np.mean((truth - meth.inner_product(qq, meth.encode(k[0]))) ** 2))
    assert errs["nova"] < 0.5 * min(errs["oscar"], errs["tq2"]), errs


def test_attention_decode_with_nova(model, held_out):
    _, m = model
    q, k, v = held_out
    cache = QuantizedKV.build(k[0], v[0], NovaKV(m.head(0, 0), "key"), NovaKV(m.head(0, 0), "value"), sink=8, window=16)
    out = attention_decode(q[:2, -1], cache)
    assert out.shape == (2, D) and np.all(np.isfinite(out))


def test_model_files_round_trip_and_refuse_corruption(model, tmp_path):
    _, m = model
    m.save(tmp_path / "n")
    back = NovaModel.load(tmp_path / "n")
    assert back.head(0, 1).digest == m.head(0, 1).digest and back.meta == m.meta
    x = np.random.default_rng(5).standard_normal((10, D))
    assert NovaKV(back.head(0, 1), "key").encode(x) == NovaKV(m.head(0, 1), "key").encode(x)
    raw = bytearray((tmp_path / "n" / "manifest.json").read_bytes())
    raw[40] ^= 0x01
    (tmp_path / "n" / "manifest.json").write_bytes(bytes(raw))
    with pytest.raises(TableFileError, match="manifest.json"):
        NovaModel.load(tmp_path / "n")


def test_validation(model):
    _, m = model
    with pytest.raises(ValueError, match="role must be 'key' or 'value'"):
        NovaKV(m.head(0, 0), "query")
    with pytest.raises(TypeError, match="NovaHead"):
        NovaKV(np.eye(D))
    enc = NovaKV(m.head(0, 0), "key").encode(np.ones((3, D)))
    with pytest.raises(ValueError, match="config"):
        NovaKV(m.head(0, 1), "key").decode(enc)  # another head's tables (different digest)
    with pytest.raises(ValueError, match="corrupted buffer"):
        NovaKV(m.head(0, 0), "key").decode(Encoded(enc.method, enc.config, enc.shape,
                                                   {"codes": enc.arrays["codes"]}))
    with pytest.raises(ValueError, match="clip quantile must be"):
        Oscar(m.head(0, 0), clip=0.3, clip_mode="quantile")
    with pytest.raises(ValueError, match="clip ratio must be"):
        Oscar(m.head(0, 0), clip=0.0)
    with pytest.raises(ValueError, match="rule"):
        Oscar(m.head(0, 0), rule="int2")
    with pytest.raises(ValueError, match="value gains"):
        NovaKV(m.head(0, 0), "value", gain_dtype="float16")
    with pytest.raises(ValueError, match="need integer bits, g >= 1"):
        calibrate([{}], D, g=3)
    with pytest.raises(ValueError, match=r"saw 100 key tokens .* codebooks \(2\^\(bits\*g\) = 256 centroids\) need at least 256"):
        gen = generator(D, 1)
        calibrate([sequence(gen, 2, 1, 100, 0)], D)  # 100 tokens < 256 centroids


def test_cli_calibrate(tmp_path, capsys):
    gen = generator(16, seed=2)
    seqs = [sequence(gen, 2, 1, 300, s)[0] for s in range(2)]
    save_file({"layer0.q": np.stack([s[0] for s in seqs]), "layer0.k": np.stack([s[1] for s in seqs]),
               "layer0.v": np.stack([s[2] for s in seqs])}, str(tmp_path / "qkv.safetensors"))
    assert codebooks_main(["calibrate", "--qkv", str(tmp_path / "qkv.safetensors"), "--out", str(tmp_path / "c"),
                           "--iterations", "3"]) == 0
    assert "calibrated 1 heads (d=16, g=4, 2 bits) from 2 sequence(s)" in capsys.readouterr().out
    model = NovaModel.load(tmp_path / "c" / "nova_kv")
    assert model.head(0, 0).key_centroids.shape == (4, 256, 4)
    save_file({"layer0.q": np.zeros((2, 5, 16), np.float32)}, str(tmp_path / "bad.safetensors"))
    assert codebooks_main(["calibrate", "--qkv", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "d")]) == 2
    assert "layer 0 lacks tensor" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    assert codebooks_main(["calibrate", "--qkv", str(tmp_path / "junk.safetensors"), "--out", str(tmp_path / "e")]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_oscar_clip_is_symmetric_at_the_order_statistic(model):
    """Default clip: every row at +-(the (c+1)-th smallest |y|), c = int(0.96 d); quantile mode differs."""
    _, m = model
    q = Oscar(m.head(0, 0), "key", rows="float64")
    x = np.random.default_rng(8).standard_normal((40, D)) * 2
    y = q.rotate(x)
    c = int(0.96 * D)
    thr = np.sort(np.abs(y.astype(np.float32)), axis=1)[:, c].astype(np.float64)
    yc = q.clipped(y)
    assert np.array_equal(np.abs(yc).max(axis=1), thr)
    assert np.all(np.count_nonzero(np.abs(y.astype(np.float32)) > thr[:, None], axis=1) <= D - 1 - c)
    old = Oscar(m.head(0, 0), "key", clip_mode="quantile", rows="float64").clipped(y)
    assert not np.array_equal(old, yc)
    # bfloat16 rows (the release) stay within one bfloat16 step of the float64 rotation
    yb = Oscar(m.head(0, 0), "key").rotate(x)
    assert np.all(np.abs(yb - y) <= 2.0**-7 * np.abs(y) + 2.0**-7 * np.abs(x).max())


def test_release_values_are_oscar_int2_on_the_k_sigma_k_weighted_statistic(calibrated, held_out):
    """Default NovaKV values: OSCAR's INT2 after the per-layer rotation of sum_t (k^T Sigma_q k) v v^T
    (uncentred, over the layer's KV heads), checked against an independent computation."""
    _, m, seqs, stats = calibrated
    from codebooks.transforms import oscar_rotation

    num, den = np.zeros((D, D)), 0.0
    for seq in seqs:
        _, k, v = seq[0]
        for h in range(k.shape[0]):
            sq = stats.head(0, h).sigma_q
            w = np.array([kt @ sq @ kt for kt in k[h]])
            num += sum(wt * np.outer(vt, vt) for wt, vt in zip(w, v[h]))
            den += w.sum()
    want = oscar_rotation(num / den)
    for h in (0, 1):
        np.testing.assert_allclose(m.head(0, h).nova_value, want, atol=1e-9)
    _, _, v = held_out
    nv = NovaKV(m.head(0, 1), "value")
    enc = nv.encode(v[1])
    ref = Oscar(m.head(0, 1), "value", rotation="nova").encode(v[1])
    assert enc.arrays.keys() == ref.arrays.keys()
    assert all(np.array_equal(enc.arrays[a], ref.arrays[a]) for a in ref.arrays)
    np.testing.assert_array_equal(nv.decode(enc), Oscar(m.head(0, 1), "value", rotation="nova").decode(ref))
    with pytest.raises(ValueError, match="values must be"):
        NovaKV(m.head(0, 0), "value", values="int4")
    with pytest.raises(ValueError, match="role must be 'value'"):
        Oscar(m.head(0, 0), "key", rotation="nova")


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 300), g=st.sampled_from([1, 2, 3, 4, 4, 4, 5, 6, 7, 8]), k_log2=st.integers(1, 8), n_groups=st.integers(1, 5),
       seed=st.integers(0, 2**32 - 1), ties=st.booleans())
def test_nearest_centroids_is_the_first_argmin_of_the_summed_squares(n, g, k_log2, n_groups, seed, ties):
    """The numba kernels against numpy: distances summed over the group's coordinates in order from
    0.0 (explicitly, one coordinate at a time), the first smallest index. g = 4 (NOVA-KV's groups)
    has its own 16-token kernel and is drawn more often; n covers partial blocks of 16. Exact ties are forced with duplicated
    centroids and shapes sitting on a centroid, and shapes on the float32 grid of the centroids
    make many distances equal."""
    rng = np.random.default_rng(seed)
    k = 2**k_log2
    d = g * n_groups
    groups = rng.permutation(d).reshape(n_groups, g).astype(np.int64)
    centroids = rng.standard_normal((n_groups, k, g)).astype(np.float32).astype(np.float64)
    shapes = rng.standard_normal((n, d))
    if ties:
        centroids[:, k // 2] = centroids[:, 0]  # the same point twice: index 0 must win
        for r in range(0, n, 3):  # rows exactly on a centroid of each group
            for j in range(n_groups):
                shapes[r, groups[j]] = centroids[j, rng.integers(k)]
        shapes[1::5] = np.round(shapes[1::5])
    out = np.empty((n, n_groups), dtype=np.uint8)
    nearest_centroids(shapes, groups, centroids, out)
    for j in range(n_groups):
        dist = np.zeros((n, k))
        for t in range(g):
            dist += (shapes[:, groups[j, t], None] - centroids[None, j, :, t]) ** 2
        np.testing.assert_array_equal(out[:, j], np.argmin(dist, axis=1))
