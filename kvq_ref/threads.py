"""Thread count of the row-parallel Numba kernels.

A ``parallel=True`` kernel wakes its worker threads on every call. On an idle machine that costs
microseconds; on a busy one (torch's own threads spinning beside it, another process) each wake-up
waits for a scheduler slice: one row through ``fwht`` took 16 ms instead of 3 us, which made a
decode loop that quantizes one token per layer and head 5,000x slower than its arithmetic. Calls
over fewer than ``PARALLEL_MIN_ROWS`` rows therefore run on the calling thread. The rows are
independent, so the result does not depend on the thread count (tests check it bit for bit).
"""

from __future__ import annotations

import functools

import numba

__all__ = ["PARALLEL_MIN_ROWS", "rows_parallel"]

PARALLEL_MIN_ROWS = 256  # rows below which a call is not worth waking threads for


def rows_parallel(kernel):
    """Wrap a row-parallel Numba kernel (rows along axis 0 of its first argument) so that calls
    over fewer than ``PARALLEL_MIN_ROWS`` rows run with one Numba thread (``numba.set_num_threads``
    is thread-local and restored afterwards). The compiled kernel stays reachable as
    ``.kernel``."""

    @functools.wraps(kernel)
    def call(*args):
        if args[0].shape[0] >= PARALLEL_MIN_ROWS:
            return kernel(*args)
        before = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            return kernel(*args)
        finally:
            numba.set_num_threads(before)

    call.kernel = kernel
    return call
