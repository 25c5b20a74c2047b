"""Row-parallel kernels give the same bytes on one thread and on many (kvq_ref.threads)."""

import numba
import numpy as np
import pytest

from kvq_ref import TurboQuantMSE
from kvq_ref.common import row_norms
from kvq_ref.fast import decode_fast, encode_fast
from kvq_ref.packing import pack_codes, unpack_codes
from kvq_ref.rotations import fwht
from kvq_ref import threads
from kvq_ref.nova import nearest_centroids
from kvq_ref.official import bf16_matmul
from kvq_ref.threads import PARALLEL_MIN_ROWS, rows_parallel

# both sides of the threshold: one row (a decode step), just below it, at it, and well above
ROWS = (1, PARALLEL_MIN_ROWS - 1, PARALLEL_MIN_ROWS, 3 * PARALLEL_MIN_ROWS + 5)


def test_small_calls_run_on_one_thread_and_restore_the_count():
    seen = []
    probe = rows_parallel(lambda x: seen.append(numba.get_num_threads()))
    before = numba.get_num_threads()
    probe(np.zeros((PARALLEL_MIN_ROWS - 1, 2)))
    probe(np.zeros((PARALLEL_MIN_ROWS, 2)))
    assert seen == [1, before]
    assert numba.get_num_threads() == before


def test_count_restored_when_the_kernel_raises():
    def boom(x):
        raise RuntimeError("kernel failed")

    before = numba.get_num_threads()
    with pytest.raises(RuntimeError):
        rows_parallel(boom)(np.zeros((1, 2)))
    assert numba.get_num_threads() == before


def _outputs(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 64))
    codes = rng.integers(0, 8, (n, 64), dtype=np.uint8)
    q = TurboQuantMSE(64, 3, rotation="hadamard", seed=1)
    enc = encode_fast(q, x)
    shapes = rng.standard_normal((n, 8))
    groups = np.arange(8, dtype=np.int64).reshape(2, 4)
    centroids = rng.standard_normal((2, 16, 4))
    nearest = np.empty((n, 2), dtype=np.uint8)
    nearest_centroids(shapes, groups, centroids, nearest)
    return [fwht(x), row_norms(x), pack_codes(codes, 3), unpack_codes(pack_codes(codes, 3), 3, 64),
            *enc.arrays.values(), decode_fast(q, enc), nearest, bf16_matmul(x, rng.standard_normal((64, 32)))]


@pytest.mark.parametrize("n", ROWS)
def test_kernels_identical_on_one_and_all_threads(n, monkeypatch):
    """Each row is computed alone, so the thread count cannot change a bit: every wrapped kernel
    (fwht, row norms, packing, the fused TurboQuant encode/decode, NOVA's nearest centroids, OSCAR's
    bf16 GEMM) run with the threshold forcing one thread and forcing all of them."""
    if numba.get_num_threads() < 2:
        pytest.skip("one Numba thread: nothing to compare")
    monkeypatch.setattr(threads, "PARALLEL_MIN_ROWS", 10**9)
    one = _outputs(n)
    monkeypatch.setattr(threads, "PARALLEL_MIN_ROWS", 0)
    many = _outputs(n)
    assert len(one) == len(many) == 9
    for a, b in zip(one, many):
        assert a.dtype == b.dtype and np.array_equal(a, b)
