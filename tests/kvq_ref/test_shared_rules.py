"""Rules every kvq_ref method shares (enforced once, in ``kvq_ref.common``).

Issue 16: finding 3 (``TurboQuantSplit.decode`` trusted ``Encoded.shape[-1]`` and returned
uninitialized memory; QJL values and KIVI returned a mis-shaped array), zero rows (handled three
ways: ZeroDivisionError in ``bits_per_element``, numpy reshape errors), ``from_bytes`` truncating
shape 2.9 and accepting True, NOVA-KV value gains near float32 max decoding to inf.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from codebooks.nova import calibrate
from kvq_ref import KIVI, QJL, Encoded, PolarQuant, QuaRot, TurboBlock, TurboQuantMSE, TurboQuantProd, TurboQuantSplit
from kvq_ref.nova import NovaKV, Oscar
from tests.nova_data import generator, sequence

D = 128


def _head():
    gen = generator(D, seed=2)
    _, model = calibrate([sequence(gen, 2, 1, 300, 0)], D, g=2, bits=1, iterations=2)
    return model.head(0, 0)


HEAD = _head()
METHODS = [
    TurboQuantMSE(D, 3), TurboQuantProd(D, 3), TurboQuantSplit(D, outliers=tuple(range(32))),
    QJL(D, role="key"), QJL(D, role="value"), PolarQuant(D), KIVI(D, role="key"), KIVI(D, role="value"),
    QuaRot(D), TurboBlock("turbo3", D), NovaKV(HEAD, "key"), NovaKV(HEAD, "value"), Oscar(HEAD, "key"),
]
IDS = [f"{type(m).__name__}-{getattr(m, 'role', '')}" for m in METHODS]


@pytest.mark.parametrize("q", METHODS, ids=IDS)
@pytest.mark.parametrize("shape", [(0, D), (3, 0, D), (0, 5, D)])
def test_zero_rows_have_a_defined_result(q, shape):
    enc = q.encode(np.zeros(shape))
    assert enc.shape == shape and enc.elements == 0
    assert enc.bits_per_element == 0.0  # nothing stored for nothing
    assert all(a.size == 0 for a in enc.arrays.values())
    out = q.decode(enc)
    assert out.shape == shape and out.dtype == np.float32
    assert q.inner_product(np.ones((2, D)), enc).shape == (2,) + shape[:-1]


@pytest.mark.parametrize("q", METHODS, ids=IDS)
@pytest.mark.parametrize("last", [64, 127, 129, 256])
def test_decode_refuses_a_shape_that_disagrees_with_the_arrays(q, last):
    x = np.random.default_rng(0).standard_normal((2, 160, D))
    enc = q.encode(x)
    bad = dataclasses.replace(enc, shape=enc.shape[:-1] + (last,))
    with pytest.raises(ValueError, match="does not end in"):
        q.decode(bad)
    with pytest.raises(ValueError, match="does not end in"):
        q.inner_product(np.ones(D), bad)


@pytest.mark.parametrize("shape", [(2.9, D), (True, D), (2, D, -1), (), "ab", (np.float64(2.0), D)])
def test_non_integer_shapes_are_refused(shape):
    tb = TurboBlock("turbo3", D)
    raw = tb.to_bytes(tb.encode(np.ones((2, D))))
    with pytest.raises(ValueError, match="shape must"):
        tb.from_bytes(raw, shape)
    with pytest.raises(ValueError, match="shape must"):
        Encoded("turbo_block", tb.config, shape, {})


def test_reconstruction_that_overflows_float32_is_refused():
    q = NovaKV(HEAD, "value", values="vq")  # the gain-shape VQ path (the default values path has no gains)
    enc = q.encode(np.random.default_rng(1).standard_normal((4, D)))
    enc.arrays["gains"][:] = np.float32(3.0e38)  # a valid float32 whose reconstruction is not
    with pytest.raises(ValueError, match="overflows float32"):
        q.decode(enc)


def test_config_is_computed_once_and_handed_out_as_a_copy():
    """``config`` is cached per instance (calibrated tables are hashed) but never shared: a caller
    mutating its dict changes nothing, equality and ``dataclasses.replace`` ignore the cache."""
    import dataclasses

    from kvq_ref import TurboQuantMSE

    q = TurboQuantMSE(64, 3, seed=1)
    c1 = q.config
    c1["bits"] = 99
    assert q.config["bits"] == 3 and q.config is not q.config
    assert q == TurboQuantMSE(64, 3, seed=1)  # the cache is not a field
    r = dataclasses.replace(q, bits=2)
    assert r.config["bits"] == 2 and q.config["bits"] == 3
    enc = q.encode(np.ones((2, 64)))
    assert enc.config == q.config and r.config != enc.config
