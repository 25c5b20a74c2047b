"""Protocol pieces without a model: the band rule, stored-bits accounting, needle sampling, mean-centred keys,
the keys' structure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvq_eval.accounting import method_rate, pair_weighted_bits, table_bits
from kvq_eval.band import Band, band_mask, n_encoded, parse_band, token_group
from kvq_eval.keyopts import CenteredKeys, key_structure
from kvq_eval.niah import exact_match, make_sample
from kvq_ref import KIVI, QJL, QuaRot, TurboQuantMSE, TurboQuantSplit


# --- band ------------------------------------------------------------------------------------------
def test_parse_band():
    assert parse_band("none") == Band(0, 0) and parse_band("64,256") == Band(64, 256) and parse_band("own") is None
    assert Band(64, 256).label == "64,256" and Band(64, 256).tag == "64-256" and Band().label == "none"
    for bad in ("64", "a,b", "1,2,3", "-1,4"):
        with pytest.raises(ValueError, match="band must be"):
            parse_band(bad)
    with pytest.raises(ValueError, match="band window must be a non-negative integer"):
        Band(0, -1)


@given(st.integers(0, 40), st.integers(0, 80), st.integers(1, 120))
def test_band_mask_is_the_sliding_rule_for_token_methods(sink, window, t):
    """group 1: key t is exact for query i iff t < sink or i - t < window (the streaming rule)."""
    pos = np.arange(t)
    mask = band_mask(pos, pos, sink, window, 1)
    i, k = np.meshgrid(pos, pos, indexing="ij")
    assert np.array_equal(mask[k <= i], ((k < sink) | (i - k < window))[k <= i])


@given(st.integers(0, 40), st.integers(0, 80), st.sampled_from([1, 8, 32]), st.lists(st.integers(1, 50), max_size=12))
def test_n_encoded_matches_incremental_writes(sink, window, group, writes):
    """The closed form equals a cache that writes chunks and moves whole groups out of its window."""
    n, sink_n, win, mid = 0, 0, 0, 0
    for w in writes:
        n += w
        take = min(sink - sink_n, w)
        sink_n += take
        win += w - take
        out = n_encoded(win, 0, window, group)
        win -= out
        mid += out
        assert mid == n_encoded(n, sink, window, group)
        assert win < window + group  # the window never holds a whole group beyond W


def test_token_groups():
    assert token_group(KIVI(64, 2, "key", group=32, residual=32)) == 32
    assert token_group(KIVI(64, 2, "value", group=32, residual=32)) == 1
    assert token_group(QJL(64, "key", m=128, m_outlier=16)) == 32 and token_group(TurboQuantMSE(64, 2)) == 1


# --- accounting ------------------------------------------------------------------------------------
def test_pair_weighted_bits_by_enumeration():
    """Mean over causal (query, key) pairs of the key's cost: 16 in the band, the rate elsewhere."""
    T, sink, window, group, rate = 300, 4, 40, 32, 4.25
    costs = []
    for i in range(T):
        mid_end = sink + n_encoded(i + 1, sink, window, group)
        costs += [16.0 if (t < sink or t >= mid_end) else rate for t in range(i + 1)]
    acc = pair_weighted_bits(T, sink, window, group, rate, tables=8 * 1000, n_layers=2, n_heads=3, d=64)
    assert acc["bits"] == pytest.approx(np.mean(costs) + 8000 / (2 * T * 64 * 3 * 2), rel=1e-12)
    assert 0 < acc["band_pairs"] < 1
    none = pair_weighted_bits(T, 0, 0, 1, rate, 0, 2, 3, 64)
    assert none == {"bits": rate, "band_pairs": 0.0, "table_bits_per_element": 0.0}


def test_rates_and_tables():
    # TurboQuantMSE-4: 4 bits per coordinate and a float16 norm per 64-vector
    assert method_rate(TurboQuantMSE(64, 4), 64) == pytest.approx(4 + 16 / 64)
    mu = tuple(np.linspace(-1, 1, 64))
    assert table_bits(CenteredKeys(TurboQuantMSE(64, 4), mu)) == 32 * 64
    assert table_bits(TurboQuantSplit(64, tuple(range(16)), 3, 2)) == 8 * 16
    assert table_bits(TurboQuantMSE(64, 4)) == 0


# --- mean-centred keys -----------------------------------------------------------------------------
@pytest.mark.parametrize("inner", [TurboQuantMSE(64, 3, seed=4), TurboQuantSplit(64, tuple(range(0, 64, 4)), 4, 3),
                                   QuaRot(64, 2, group=64, seed=2)], ids=lambda m: m.name)
def test_centred_keys_softmax_invariance(inner):
    """Scoring every key as q . c_hat (mu dropped) gives the attention of q . k_hat exactly.

    Tolerance: the two score sets differ by the row constant q . mu, which softmax removes; what is
    left is float64 rounding of scores of size ~100 (1e-12 relative).
    """
    rng = np.random.default_rng(0)
    mu = 3.0 * rng.standard_normal(64)
    k = mu + rng.standard_normal((200, 64))
    v = rng.standard_normal((200, 64))
    q = rng.standard_normal((5, 64))
    m = CenteredKeys(inner, tuple(mu))
    enc = m.encode(k)
    k_hat = m.decode(enc).astype(np.float64)
    qp = m.prepare_query(q)
    full, centred = m.scores(qp, enc), m.centred_scores(qp, enc)
    # scores are <q, decode> (float32 decode: 1e-5 relative) ...
    assert np.allclose(full, q @ k_hat.T, rtol=1e-5, atol=1e-4)
    # ... and the centred form differs by the row constant q . mu only
    assert np.allclose(full - centred, (q @ mu)[:, None], rtol=1e-12, atol=1e-9)

    def attend(z):
        p = np.exp(z - z.max(1, keepdims=True))
        return (p / p.sum(1, keepdims=True)) @ v

    assert np.allclose(attend(full), attend(centred), rtol=1e-12, atol=1e-12)
    # centring helps: the quantizer sees k - mu, whose norm is far smaller than k's
    plain = inner.decode(inner.encode(k)).astype(np.float64)
    assert np.mean((k_hat - k) ** 2) < np.mean((plain - k) ** 2)
    with pytest.raises(ValueError, match="mu must be 64 finite numbers"):
        CenteredKeys(inner, (0.0,) * 63)


# --- key structure (where a rotation hurts) ----------------------------------------------------------
def _design_keys(mu, s):
    """Keys mu +- s e_j (j < d): mean exactly mu, covariance exactly s^2 / d * I, mean ||k - mu||^2 = s^2."""
    d = len(mu)
    eye = s * np.eye(d)
    return np.concatenate([mu + eye, mu - eye])


@pytest.mark.parametrize("mu_norm", [0.0, 0.5, 3.0])
def test_key_structure_closed_form(mu_norm):
    """On the design keys: share = |mu|^2 / (|mu|^2 + s^2) and logit SNR = 1 - share for any query
    (q^T Cov q = s^2 |q|^2 / d against |q|^2 (|mu|^2 + s^2) / d). Exact up to float64 rounding."""
    rng = np.random.default_rng(1)
    d, s = 16, 2.0
    mu = rng.standard_normal(d)
    mu *= mu_norm / max(np.linalg.norm(mu), 1e-300)
    q = rng.standard_normal((7, d))
    share, snr = key_structure(q, _design_keys(mu, s))
    expect = mu_norm**2 / (mu_norm**2 + s**2)
    assert share == pytest.approx(expect, rel=1e-12, abs=1e-15)
    assert snr == pytest.approx(1.0 - expect, rel=1e-12)


@given(st.integers(0, 2**31), st.floats(0.01, 100.0), st.floats(0.01, 100.0))
def test_key_structure_invariances(seed, cq, ck):
    """Both numbers are unchanged by one orthogonal map of queries and keys and by rescaling
    either (the rotation a quantizer applies cannot change them); share in [0, 1], SNR >= 0."""
    rng = np.random.default_rng(seed)
    d = 8
    q = rng.standard_normal((5, d))
    k = rng.standard_normal(d) * 2 + rng.standard_normal((40, d)) * rng.uniform(0.1, 2, d)
    rot, _ = np.linalg.qr(rng.standard_normal((d, d)))
    share, snr = key_structure(q, k)
    share2, snr2 = key_structure(cq * q @ rot, ck * k @ rot)
    assert 0.0 <= share <= 1.0 and snr >= 0.0
    assert share2 == pytest.approx(share, rel=1e-9) and snr2 == pytest.approx(snr, rel=1e-9)


def test_key_structure_predicts_rotation_logit_noise():
    """The Notes' premise: after TurboQuantMSE's random rotation the key error is isotropic, so the
    logit noise variance is D |q|^2 |k|^2 / d (D the measured relative MSE), mean or not; and the
    SNR is then logit_snr / D. Bound: 4 standard errors of the noise mean over independent keys."""
    rng = np.random.default_rng(7)
    d, n = 64, 4000
    mu = 4.0 * rng.standard_normal(d) / np.sqrt(d)
    k = mu + rng.standard_normal((n, d)) * np.linspace(0.3, 1.5, d) / np.sqrt(d)
    q = rng.standard_normal((32, d))
    m = TurboQuantMSE(d, 3, seed=5)
    err = m.decode(m.encode(k)).astype(np.float64) - k
    D = np.sum(err**2) / np.sum(k**2)
    per_key = np.mean((q @ err.T) ** 2, axis=0)            # (n,): noise over queries, one per key
    predicted = D * np.mean(np.sum(q**2, 1)) * np.mean(np.sum(k**2, 1)) / d
    se = per_key.std(ddof=1) / np.sqrt(n)
    assert abs(per_key.mean() - predicted) < 4 * se
    share, snr = key_structure(q, k)
    spread = np.mean(np.var(q @ k.T, axis=1))
    assert spread / per_key.mean() == pytest.approx(snr / D, rel=4 * se / per_key.mean())


def test_key_structure_edges_and_errors():
    k = np.zeros((4, 3))
    assert key_structure(np.ones((2, 3)), k) == (0.0, 0.0)           # no key energy: defined as 0, 0
    k[:, 0] = [1.0, 2.0, 3.0, 4.0]
    assert key_structure(np.zeros((2, 3)), k) == (6.25 / 7.5, 0.0)    # no query: no logit spread
    q = np.array([[0.0, 1.0, 0.0]])
    assert key_structure(q, k)[1] == 0.0                              # query orthogonal to key variation
    with pytest.raises(ValueError, match="q must have shape"):
        key_structure(np.ones(3), k)
    with pytest.raises(ValueError, match=r"k must have shape \(T, 3\)"):
        key_structure(q, np.ones((4, 2)))
    with pytest.raises(ValueError, match="T >= 2"):
        key_structure(q, np.ones((1, 3)))
    with pytest.raises(ValueError, match="finite"):
        key_structure(q, np.full((4, 3), np.nan))


# --- needle samples --------------------------------------------------------------------------------
class WordTok:
    """A whitespace tokenizer (no chat template): enough to test the sampler without a model."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True, **kw):
        return type("T", (), {"input_ids": text.split()})()


HAY = " ".join(f"Sentence number {i} of the haystack." for i in range(3000))


def test_samples_are_independent_and_reproducible():
    tok = WordTok()
    a = [make_sample(tok, "single", 1024, 0.5, s, haystack=HAY) for s in range(30)]
    assert len({x.keys + x.values for x in a}) == 30 and len({x.offset for x in a}) > 20
    assert make_sample(tok, "single", 1024, 0.5, 3, haystack=HAY) == a[3]
    other_ctx = make_sample(tok, "single", 4096, 0.5, 3, haystack=HAY)
    assert other_ctx.values != a[3].values and not other_ctx.document.startswith(a[3].document[:-50])
    s = a[0]
    assert s.document.count(f"special magic numbers for {s.keys[0]} is: {s.values[0]}.") == 1
    assert 1024 - 40 <= len((s.document + s.question).split()) <= 1024 and s.reference == f" {s.values[0]}."


def test_multiquery_asks_two_to_four_including_the_target():
    tok = WordTok()
    asked = set()
    for i in range(40):
        s = make_sample(tok, "multiquery", 1024, 0.3, i, haystack=HAY)
        asked.add(len(s.keys))
        assert 2 <= len(s.keys) <= 4 and len(set(s.keys)) == len(s.keys)
        assert s.document.count("One of the special magic numbers for") == 4
        for k, v in zip(s.keys, s.values):
            assert f"for {k} is: {v}." in s.document
        assert s.reference == " " + ", ".join(s.values) + "."
    assert asked == {2, 3, 4}
    with pytest.raises(ValueError, match="variant must be one of"):
        make_sample(tok, "multivalue", 1024, 0.5, 0, haystack=HAY)
    with pytest.raises(ValueError, match="depth must be"):
        make_sample(tok, "single", 1024, 1.5, 0, haystack=HAY)


def test_exact_match():
    s = make_sample(WordTok(), "multiquery", 1024, 0.5, 1, haystack=HAY)
    assert exact_match(s, ", ".join(s.values)) and exact_match(s, "\n- " + "\n- ".join(s.values))
    assert not exact_match(s, s.values[0]) and not exact_match(s, s.values[0][:-1] + "0")
    one = make_sample(WordTok(), "single", 1024, 0.5, 1, haystack=HAY)
    v = one.values[0]
    assert exact_match(one, f"{v[0]},{v[1:4]},{v[4:]}") and not exact_match(one, v + "1")


def test_window_stats_against_direct_formulas():
    """NLL sums, KL(fp32 || quant) and top-1 from logits, checked against scipy's log-softmax."""
    import torch
    from scipy.special import log_softmax

    from kvq_eval.scores import POSITION_BINS, window_stats

    rng = np.random.default_rng(0)
    ref, out = rng.standard_normal((40, 7)), rng.standard_normal((40, 7))
    target = rng.integers(0, 7, 40)
    s = window_stats(torch.from_numpy(ref), torch.from_numpy(out), torch.from_numpy(target))
    lp, lq = log_softmax(ref, -1), log_softmax(out, -1)
    nf, nq = -lp[np.arange(40), target], -lq[np.arange(40), target]
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    assert s["n"] == 40 and s["nll_f"] == pytest.approx(nf.sum(), rel=1e-12)
    assert s["nll_q"] == pytest.approx(nq.sum(), rel=1e-12) and s["kl"] == pytest.approx(kl.sum(), rel=1e-12)
    assert s["top1"] == int((ref.argmax(-1) == out.argmax(-1)).sum())
    assert len(s["dnll_bins"]) == POSITION_BINS
    assert np.mean(s["dnll_bins"][:8]) == pytest.approx((nq - nf)[:24].mean(), rel=1e-12)  # 8 bins of 3
    chunked = window_stats(torch.from_numpy(ref), torch.from_numpy(out), torch.from_numpy(target), chunk=7)
    assert chunked["top1"] == s["top1"] and chunked["kl"] == pytest.approx(s["kl"], rel=1e-12)
    assert chunked["dnll_bins"] == pytest.approx(s["dnll_bins"], rel=1e-12)
    same = window_stats(torch.from_numpy(ref), torch.from_numpy(ref), torch.from_numpy(target))
    assert same["kl"] == 0.0 and same["top1"] == 40 and same["nll_q"] == same["nll_f"]


@given(st.integers(16, 80), st.sampled_from([7, 64, 512]), st.sampled_from([3, 32]), st.sampled_from([5, 2053, 40009]),
       st.integers(0, 2**31), st.booleans())
@example(20, 7, 3, 40009, 1, False)  # 7-row chunks in pieces of 3, 3 and a lone row of 40009 logits
@example(20, 7, 3, 2053, 2, True)
@settings(max_examples=40, deadline=None)
def test_window_stats_buffered_rows_equal_whole_chunks_bit_for_bit(n, chunk, rows, vocab, seed, ties):
    """``window_stats`` runs its float64 work a few positions at a time in reused buffers (5.1x
    faster on Gemma's vocabulary, benchmarks/results/eval_stats.json); every operation is row-wise, so each sum is the whole chunk's
    bit for bit, for any row count, chunk, vocabulary size (odd, past the vector width, and past
    torch's 32768-element grain, where a lone row would be summed in per-thread parts: two threads
    here, as the evaluation runs) and float32 logits. ``ties`` rounds the logits to integers, so
    most rows have several maxima: the top-1 count (numpy's argmax here, torch's in the direct
    form) must pick the first of them in both."""
    import torch

    from kvq_eval import scores

    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    g = torch.Generator().manual_seed(seed)
    ref = 4 * torch.randn((n, vocab), generator=g)
    out = ref + 0.5 * torch.randn((n, vocab), generator=g)
    target = torch.randint(0, vocab, (n,), generator=g)
    if ties:
        ref, out = torch.round(ref), torch.round(out)
    old, scores._STATS_ROWS = scores._STATS_ROWS, rows
    try:
        s = scores.window_stats(ref, out, target, chunk=chunk)
        direct = scores.window_stats_direct(ref, out, target, chunk=chunk)
    finally:
        scores._STATS_ROWS = old
        torch.set_num_threads(threads)
    assert s == direct  # every float exactly: tolerance 0


def test_study_methods_in_the_registry():
    """``<base>-mc`` centres keys on the calibration mean of their (layer, head); values untouched."""
    from types import SimpleNamespace

    from kvq_eval.methods import METHODS, make_spec

    mean = np.arange(64) / 10.0
    stats = SimpleNamespace(head=lambda layer, head: SimpleNamespace(keys=SimpleNamespace(mean=mean + layer + head)))
    tables = type("Tables", (), {"stats": stats})()  # hashed by identity, as CalibrationTables
    spec = make_spec("tq_mse4-mc", tables=tables)
    key, value = spec.key(2, 1, 64), spec.value(2, 1, 64)
    assert isinstance(key, CenteredKeys) and np.array_equal(np.asarray(key.mu), mean + 3)
    assert key.inner == make_spec("tq_mse4").key(2, 1, 64) and value == make_spec("tq_mse4").value(2, 1, 64)
    with pytest.raises(ValueError, match="needs calibration tables"):
        make_spec("quarot2-mc")
    for name, (kb, vb) in {"tq_k4v2": (4, 2), "tq_k5v3": (5, 3), "tq_k8v4": (8, 4)}.items():
        s = make_spec(name)
        assert (s.key(0, 0, 64).bits, s.value(0, 0, 64).bits) == (kb, vb)
        assert METHODS[name]["nominal_bits"] == METHODS[f"{name}-mc"]["nominal_bits"] == (kb + vb) / 2
        # both options at once: the split's key quantizer on centred keys, its values untouched
        c = make_spec(f"{name}-mc", tables=tables)
        key = c.key(1, 0, 64)
        assert isinstance(key, CenteredKeys) and key.inner == s.key(1, 0, 64)
        assert np.array_equal(np.asarray(key.mu), mean + 1) and c.value(1, 0, 64) == s.value(1, 0, 64)
        with pytest.raises(ValueError, match="needs calibration tables"):
            make_spec(f"{name}-mc")
    assert {f"{b}-mc" for b in ("tq_mse2", "tq_mse3", "tq_mse4", "tq_split2.5", "tq_split3.5", "quarot2",
                                "quarot4")} <= set(METHODS)


def test_nova_table_bits_follow_the_value_path(small_tables):
    """NovaKV values by the release's INT2 path need only the d x d nova_value rotation; VQ values
    need their transform, groups and centroids (float arrays at 4 bytes, integer arrays at 1)."""
    from kvq_ref.nova import NovaKV

    head = small_tables.model.head(0, 0)
    assert table_bits(NovaKV(head, "value")) == 8 * 4 * 64 * 64
    vq = 8 * (4 * (64 + 64 * 64 + 16 * 256 * 4) + 16 * 4)  # value.mu, value.basis, value.centroids; value.groups
    assert table_bits(NovaKV(head, "value", values="vq")) == vq
    assert table_bits(NovaKV(head, "key")) == 8 * (4 * (64 + 2 * 64 * 64 + 16 * 256 * 4) + 16 * 4)


def test_every_registered_method_builds_and_round_trips(small_tables):
    """Every name the evaluation can run (make eval's grid included) builds its key and value
    quantizers at (layer 0, head 0) and encodes/decodes rows to finite values of the same shape.
    (oscar_official once failed here: a relative import left over from kvq_ref's eval package.)"""
    from kvq_eval.methods import METHODS, make_spec

    x = np.random.default_rng(1).standard_normal((40, 64))
    for name, info in METHODS.items():
        spec = make_spec(name, tables=small_tables if info.get("calibrated") or name.endswith("-mc") else None)
        for q in (spec.key(0, 0, 64), spec.value(0, 0, 64)):
            y = q.decode(q.encode(x))
            assert y.shape == x.shape and np.all(np.isfinite(y)), name


def test_calibration_tables_attach_a_cached_round_robin_calibration(tmp_path, monkeypatch):
    """The swap calibration (the committed results' key) carries the release's round_robin one,
    computed on first use into ``<folder>-round_robin`` and read back from there afterwards."""
    import kvq_eval.calib as calib

    rng = np.random.default_rng(3)
    seqs = [{0: (rng.standard_normal((3, 300, 64)), rng.standard_normal((1, 300, 64)),
                 rng.standard_normal((1, 300, 64)))} for _ in range(2)]
    captured = []
    monkeypatch.setattr(calib, "token_chunks", lambda tok, text, length, count: list(range(count)))
    monkeypatch.setattr(calib, "capture", lambda model, i: captured.append(i) or seqs[i])
    t = calib.calibration_tables(None, None, "toy", length=300, iterations=1, folder=tmp_path / "cal")
    assert t.model.meta["grouping"] == "swap" and len(captured) == 2
    rr = t.official_model()
    assert rr.meta["grouping"] == "round_robin" and t.official_model() is rr and len(captured) == 4
    assert (tmp_path / "cal-round_robin" / "nova_kv" / "manifest.json").is_file()
    again = calib.calibration_tables(None, None, "toy", length=300, iterations=1, folder=tmp_path / "cal")
    assert again.official_model().meta["grouping"] == "round_robin" and len(captured) == 4  # both from disk
    with pytest.raises(ValueError, match="grouping"):
        calib.calibration_tables(None, None, "toy", grouping="greedy", folder=tmp_path / "x")


@given(st.integers(1, 300), st.integers(1, 40))
def test_row_pieces_cover_the_rows_without_a_lone_row(n, size):
    """Consecutive pieces cover [0, n), none longer than size + 1, and none of one row unless
    there is one row (or pieces of one row are asked for)."""
    from kvq_eval.scores import row_pieces

    pieces = row_pieces(n, size)
    assert [a for a, _ in pieces] == [0] + [b for _, b in pieces[:-1]] and pieces[-1][1] == n
    assert all(1 <= b - a <= size + 1 for a, b in pieces)
    assert all(b - a > 1 for a, b in pieces) or n == 1 or size == 1
