"""The sink probe (``kvq_eval.sink``): outside-window attention, the sink's statistics, the logit error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_eval.sink import logit_error, outside_weights, sink_report, sink_stats


def _loop_weights(q, k, window, scale, sliding):
    """The definition, one query at a time with math.exp: softmax over the attended keys, kept where
    i - j >= window."""
    G, T, _ = q.shape
    out = np.zeros((G, T, T))
    for g in range(G):
        for i in range(T):
            keys = [j for j in range(i + 1) if sliding is None or i - j < sliding]
            z = {j: scale * float(np.dot(q[g, i], k[j])) for j in keys}
            top = max(z.values())
            tot = sum(math.exp(v - top) for v in z.values())
            for j in keys:
                if i - j >= window:
                    out[g, i, j] = math.exp(z[j] - top) / tot
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.integers(2, 12), st.integers(0, 12),
       st.one_of(st.none(), st.integers(1, 12)))
def test_outside_weights_is_the_masked_causal_softmax(seed, G, T, window, sliding):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((G, T, 4)) * 2, rng.standard_normal((T, 4))
    w = outside_weights(q, k, window, 0.5, sliding)
    np.testing.assert_allclose(w, _loop_weights(q, k, window, 0.5, sliding), rtol=1e-12, atol=1e-15)


def test_sink_stats_closed_form():
    """Zero queries attend uniformly: p_ij = 1/(i+1), so the sink's share of the outside weight is
    sum_{i>=W} 1/(i+1) / sum_{i>=W} (i-W+1)/(i+1); the norms are set by construction."""
    T, W, d = 20, 5, 4
    k = np.zeros((T, d))
    k[0] = [0.0, 1.0, 0.0, 0.0]           # short sink
    k[1:] = [3.0, 0.0, 0.0, 0.0]           # every other key
    mu = np.array([3.0, 0.0, 0.0, 0.0])
    out = sink_stats(np.zeros((2, T, d)), k, mu, W, 0.125)
    share = sum(1 / (i + 1) for i in range(W, T)) / sum((i - W + 1) / (i + 1) for i in range(W, T))
    assert out["sink_share"] == pytest.approx(share, rel=1e-12)
    assert out["sink_norm"] == pytest.approx(1.0) and out["sink_offset"] == pytest.approx(math.sqrt(10.0))
    assert out["key_rms"] == pytest.approx(math.sqrt((1 + 9 * (T - 1)) / T))
    assert out["centred_rms"] == pytest.approx(math.sqrt(10.0 / T))
    # a window as long as the sequence leaves nothing outside: a defined 0, not NaN
    assert sink_stats(np.zeros((1, T, d)), k, mu, T, 0.125)["sink_share"] == 0.0


def test_logit_error_counts_only_outside_weight_on_the_moved_key():
    """Moving one key j0 by delta gives sum_{g,i: i-j0>=W} p_gij0 (scale q_gi . delta)^2 / sum w,
    written out with the loop weights."""
    rng = np.random.default_rng(3)
    G, T, d, W, scale = 2, 9, 4, 3, 0.7
    q, k = rng.standard_normal((G, T, d)), rng.standard_normal((T, d))
    delta, j0 = rng.standard_normal(d), 2
    k_hat = k.copy()
    k_hat[j0] += delta
    p = _loop_weights(q, k, W, scale, None)
    expect = sum(p[g, i, j0] * (scale * float(q[g, i] @ delta)) ** 2 for g in range(G) for i in range(T)) / p.sum()
    assert logit_error(q, k, k_hat, W, scale) == pytest.approx(expect, rel=1e-12)
    assert logit_error(q, k, k, W, scale) == 0.0
    assert logit_error(q, k, k_hat, T, scale) == 0.0   # nothing outside the band


class _Stats:
    """The one attribute sink_report reads: stats.head(layer, head).keys.mean."""

    def __init__(self, means):
        self.means = means

    def head(self, layer, head):
        mean = self.means[(layer, head)]
        return type("H", (), {"keys": type("K", (), {"mean": mean})()})()


def test_sink_report_centring_hurts_when_the_sink_is_far_from_the_mean():
    """A head whose queries attend only to a short first key 10x closer to 0 than to the mean:
    TurboQuantMSE's error scales with the coded norm, so centring multiplies the weighted logit
    error by ~100 (offset/norm squared); a head whose keys all sit near the mean gains from it.
    Both outcomes are far from the boundary (factors > 10), so the fixed seeds do not decide them."""
    rng = np.random.default_rng(5)
    T, d = 48, 64
    mu = np.zeros(d)
    mu[0] = 20.0
    sink = rng.standard_normal(d)
    sink *= 2.0 / np.linalg.norm(sink)
    keys_far = mu + rng.standard_normal((T, d)) * 0.5
    keys_far[0] = sink                        # head 0: the sink, ||k0|| = 2, ||k0 - mu|| ~ 20
    q_far = np.tile(sink * 40.0, (1, T, 1)) + rng.standard_normal((1, T, d)) * 0.01
    keys_near = mu + rng.standard_normal((T, d)) * 0.5   # head 1: every key near the mean
    q_near = rng.standard_normal((1, T, d))
    captured = {0: (np.concatenate([q_far, q_near]), np.stack([keys_far, keys_near]))}
    rep = sink_report(captured, _Stats({(0, 0): mu, (0, 1): mu}), 3, 4, {0: d ** -0.5})
    far, near = rep["heads"]
    assert far["sink_share"] > 0.99 and far["sink_offset"] / far["sink_norm"] > 9
    assert far["err_centred"] > 10 * far["err_plain"]
    assert near["err_centred"] < near["err_plain"] / 10
    assert rep["totals"]["heads"] == 2 and rep["totals"]["heads_centring_worse"] == 1
    assert rep["tokens"] == T and rep["bits"] == 3 and rep["window"] == 4


def test_bad_input_names_the_argument():
    q, k = np.zeros((1, 5, 4)), np.zeros((5, 4))
    for call, match in [
        (lambda: outside_weights(q, np.zeros((5,)), 0, 1.0), "k must have shape"),
        (lambda: outside_weights(np.zeros((1, 4, 4)), k, 0, 1.0), "q must have shape"),
        (lambda: outside_weights(q, k, -1, 1.0), "window must be"),
        (lambda: outside_weights(q, k, 0, 0.0), "scale must be"),
        (lambda: outside_weights(q, k, 0, 1.0, sliding=0), "sliding must be"),
        (lambda: outside_weights(q, np.full((5, 4), np.nan), 0, 1.0), "must be finite"),
        (lambda: sink_stats(q, k, np.zeros(3), 0, 1.0), "mu must be"),
        (lambda: logit_error(q, k, np.zeros((4, 4)), 0, 1.0), "k_hat must be"),
        (lambda: sink_report({}, None, 3, 0, {}), "no layer"),
        (lambda: sink_report({0: (np.zeros((3, 5, 4)), np.zeros((2, 5, 4)))}, None, 3, 0, {0: 1.0}), "Hkv | Hq"),
        (lambda: sink_report({0: (np.zeros((3, 5, 4)), np.zeros((0, 5, 4)))}, None, 3, 0, {0: 1.0}), "Hkv | Hq"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_cli_rejects_bad_arguments_before_loading_a_model(tmp_path, capsys):
    from kvq_eval.cli import main

    out = str(tmp_path / "s.json")
    assert main(["sink", "--tokens", "1", "--out", out]) == 2
    assert main(["sink", "--bits", "9", "--out", out]) == 2
    assert main(["sink", "--window", "2048", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--tokens must be" in err and "--bits must be" in err and "--window must be" in err
    assert not (tmp_path / "s.json").exists()
