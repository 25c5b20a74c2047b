"""Rotations: orthogonality, the documented Hadamard sequence, determinism."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from scipy.linalg import hadamard

from kvq_ref.rotations import HaarRotation, HadamardRotation, fwht, hadamard_block_size, make_rotation, rng


@pytest.mark.parametrize("d", [2, 16, 64, 80, 96, 128, 256, 576])
@pytest.mark.parametrize("kind", ["hadamard", "haar"])
def test_orthogonal_and_inverse(kind, d):
    R = make_rotation(kind, d, seed=7)
    M = R.matrix()
    assert np.allclose(M @ M.T, np.eye(d), atol=1e-13)
    x = np.random.default_rng(0).standard_normal((5, 3, d))
    assert np.allclose(R.inverse(R.apply(x)), x, atol=1e-13)
    assert np.allclose(R.apply(x), x @ M.T, atol=1e-12)


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_fwht_is_the_sylvester_hadamard_matrix(d):
    x = np.random.default_rng(1).standard_normal((4, d))
    assert np.allclose(fwht(x), x @ hadamard(d).T / math.sqrt(d), atol=1e-13)


def test_block_hadamard_for_non_powers_of_two():
    assert [hadamard_block_size(d) for d in (80, 96, 576, 128, 54)] == [16, 32, 64, 128, 2]
    R = HadamardRotation(80, seed=3)
    # independent construction: D2 . blockdiag(H16)/4 . P . D1
    H = np.kron(np.eye(5), hadamard(16)) / 4.0
    P = np.eye(80)[R.perm]
    M = np.diag(R.signs2) @ H @ P @ np.diag(R.signs1)
    assert np.allclose(R.matrix(), M, atol=1e-14)
    assert not np.array_equal(R.perm, np.arange(80))
    assert np.array_equal(HadamardRotation(128, 3).perm, np.arange(128))


def test_same_seed_same_rotation_across_processes():
    code = ("import numpy as np; from kvq_ref.rotations import make_rotation;"
            "print(make_rotation('haar', 16, 5).matrix().tobytes().hex());"
            "print(make_rotation('hadamard', 96, 5).matrix().tobytes().hex())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1]
    here = make_rotation("haar", 16, 5).matrix().tobytes().hex()
    assert runs[0].split()[0] == here
    assert not np.array_equal(make_rotation("haar", 16, 5).matrix(), make_rotation("haar", 16, 6).matrix())


def test_haar_is_uniform_enough():
    """E[R_ij^2] = 1/d for a Haar matrix; average over seeds within 4.5 standard errors."""
    d, n = 8, 400
    sq = np.stack([HaarRotation(d, s).matrix() ** 2 for s in range(n)])
    m = sq.mean(axis=0)
    se = sq.std(axis=0, ddof=1) / math.sqrt(n)
    assert np.all(np.abs(m - 1 / d) <= 4.5 * se)


def test_errors():
    with pytest.raises(ValueError, match="rotation must be 'hadamard' or 'haar'"):
        make_rotation("dct", 8, 0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        rng(-1, 1)
    with pytest.raises(ValueError, match="rotation of dimension 8 applied to shape"):
        make_rotation("hadamard", 8, 0).apply(np.zeros(4))
    with pytest.raises(ValueError, match="block must be a power of two dividing"):
        fwht(np.zeros(12), 8)
