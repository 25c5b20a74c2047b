"""The package's Lloyd-Max tables against an independent 50-digit mpmath reference.

``data/mpmath_reference.json`` is written by ``make_mpmath_reference.py`` (mpmath only; it does not
import ``codebooks``). These tests check that

* the stored reference is reproduced exactly by its generator (a few cases, and the whole file
  byte for byte),
* the reference is self-consistent and meets closed forms and published values,
* ``codebooks.lloyd_max`` agrees with it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from decimal import Decimal
from pathlib import Path

import mpmath
import numpy as np
import pytest
from mpmath import mp, mpf

from codebooks import Gaussian, PolarAngle, SphereMarginal, lloyd_max

HERE = Path(__file__).resolve().parent
GENERATOR_PATH = HERE / "make_mpmath_reference.py"
DATA_PATH = HERE / "data" / "mpmath_reference.json"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_mpmath_reference", GENERATOR_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
REF_TEXT = DATA_PATH.read_text(encoding="utf-8")
REF = json.loads(REF_TEXT)
CASES = REF["cases"]


def _label(case) -> str:
    return gen.case_label(case["kind"], case["params"], case["bits"])


BY_LABEL = {_label(c): c for c in CASES}


# ------------------------------------------------------------------------------------------------
# a. the stored file is what the generator produces


@pytest.mark.parametrize("label", [
    "gaussian_b1", "gaussian_b2", "gaussian_b3", "sphere_d3_b2", "sphere_d128_b2", "polar_l2_b2",
])
def test_cheap_cases_regenerate_exactly(label):
    stored = BY_LABEL[label]
    fresh = gen.compute_case(stored["kind"], stored["params"], stored["bits"])
    assert fresh == stored  # string equality of every digit


def test_full_file_regenerates_byte_identically(tmp_path):
    # about 5 s on one core, so not marked slow
    out = tmp_path / "ref.json"
    assert gen.main(["--out", str(out)]) == 0
    assert out.read_bytes() == DATA_PATH.read_bytes()


def test_only_selects_cases(tmp_path):
    out = tmp_path / "some.json"
    assert gen.main(["--out", str(out), "--only", "sphere_d3", "gaussian_b2"]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    labels = [_label(c) for c in doc["cases"]]
    assert labels == ["gaussian_b2"] + [f"sphere_d3_b{b}" for b in range(1, 6)]
    assert doc["cases"] == [BY_LABEL[x] for x in labels]
    with pytest.raises(SystemExit):
        gen.main(["--out", str(out), "--only", "no_such_case"])


def test_file_layout():
    assert REF["dps"] == 50
    assert isinstance(REF["generator"], str) and REF["generator"]
    assert REF_TEXT == gen.render(CASES)  # fixed formatting
    expected = [gen.case_label(*c) for c in gen.select_cases()]
    assert [_label(c) for c in CASES] == expected
    for case in CASES:
        k = 2 ** case["bits"]
        levels = [mpf(x) for x in case["levels"]]
        assert len(levels) == k
        assert all(a < b for a, b in zip(levels, levels[1:]))
        for s in case["levels"] + [case["mse"]]:
            digits = s.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
            assert len(digits) == gen.DIGITS, s
        if case["kind"] != "polar":  # centre 0: mirrored strings
            assert case["levels"][: k // 2] == ["-" + x for x in reversed(case["levels"][k // 2:])]


# ------------------------------------------------------------------------------------------------
# the reference itself: ingredients, self-consistency, closed forms


def test_sphere_tail_matches_mpmath_betainc_and_quad():
    with mp.workdps(50):
        for d in (2, 4, 5, 16, 128, 1024):
            s = gen._Sphere(d)
            for u in ("0.001", "0.05", "0.3", "0.9"):
                u = mpf(u)
                want = mpmath.betainc(s.al, s.al, 0, (1 - u) / 2, regularized=True)
                assert abs(s.tail(u) - want) <= mpf("1e-45") * want, (d, u)
        # d = 65536: mpmath.betainc fails to converge here; compare to quadrature of the pdf
        s = gen._Sphere(65536)
        for u in ("0.0005", "0.003", "0.012"):
            u = mpf(u)
            pts = [u + j * s.std for j in range(41)] + [mpf(1)]
            want = mpmath.quad(s.pdf, pts)
            assert abs(s.tail(u) - want) <= mpf("1e-40") * want, u
        # polar tail against quadrature of its pdf
        for level in (2, 3):
            p = gen._Polar(level)
            for u in ("0.1", "0.5"):
                u = mpf(u)
                want = mpmath.quad(p.pdf, [u, p.hi])
                assert abs(p.tail(u) - want) <= mpf("1e-45") * want


@pytest.mark.parametrize("label", sorted(BY_LABEL))
def test_stored_levels_are_centroids(label):
    """The 30-digit levels satisfy c_i = E[X | cell i] and give the stored MSE (to ~1e-28)."""
    case = BY_LABEL[label]
    with mp.workdps(50):
        dens = gen._density(case["kind"], case["params"])
        k = 2 ** case["bits"]
        c = [mpf(x) - dens.center for x in case["levels"][k // 2:]]
        _, mom = gen._cells(dens, c)
        assert gen._residual(dens, c, mom) < mpf("1e-28")
        mse = 2 * mp.fsum(m2 - 2 * ci * m1 + ci * ci * P for ci, (P, m1, m2) in zip(c, mom))
        assert abs(mse - mpf(case["mse"])) <= mpf("1e-27") * mse


def test_closed_forms():
    with mp.workdps(50):
        tol = mpf("1e-29")

        def close(s, want):
            return abs(mpf(s) - want) <= tol * abs(want)

        g1 = BY_LABEL["gaussian_b1"]
        assert close(g1["mse"], 1 - 2 / mp.pi) and close(g1["levels"][1], mp.sqrt(2 / mp.pi))
        a1 = BY_LABEL["sphere_d2_b1"]  # arcsine: E|X| = 2/pi, E X^2 = 1/2
        assert close(a1["mse"], mpf(1) / 2 - 4 / mp.pi**2) and close(a1["levels"][1], 2 / mp.pi)
        for b in range(1, 6):  # d = 3 is uniform on [-1, 1]: the uniform quantizer is optimal
            k = 2**b
            u = BY_LABEL[f"sphere_d3_b{b}"]
            assert close(u["mse"], mpf(2 / k) ** 2 / 12)
            assert all(close(x, -1 + (2 * j + mpf(1)) / k) for j, x in enumerate(u["levels"]))
        p1 = BY_LABEL["polar_l2_b1"]  # f = sin(2 psi): levels pi/4 +- (pi/4 - 1/2), mse pi/4 - 3/4
        assert close(p1["mse"], mp.pi / 4 - mpf(3) / 4)
        assert close(p1["levels"][1], mp.pi / 2 - mpf(1) / 2)


# ------------------------------------------------------------------------------------------------
# c. published N(0,1) and sphere d=128 values are met by the mpmath reference


def _agree_to_given_digits(ref: str, given: str):
    """|ref - given| <= one unit in the last digit of ``given``."""
    unit = Decimal(1).scaleb(Decimal(given).as_tuple().exponent)
    assert abs(Decimal(ref) - Decimal(given)) <= unit, (ref, given)


@pytest.mark.parametrize(("bits", "mse", "positive_levels"), [
    (1, "0.36338022763241866", ["0.7978845608028654"]),
    (2, "0.11748184782932929", ["0.452780034636492", "1.510417608499095"]),
    (3, "0.03454776078850373",
     ["0.2450941789442217", "0.7560052812058773", "1.343909278505", "2.151945704536987"]),
    (4, "0.0095010080081918861", None),
])
def test_gaussian_known_values(bits, mse, positive_levels):
    case = BY_LABEL[f"gaussian_b{bits}"]
    _agree_to_given_digits(case["mse"], mse)
    if positive_levels is not None:
        k = 2**bits
        for ref, given in zip(case["levels"][k // 2:], positive_levels, strict=True):
            _agree_to_given_digits(ref, given)


@pytest.mark.parametrize(("bits", "d_mse"), [(1, "0.3609"), (2, "0.1160"), (3, "0.03397"), (4, "0.009315")])
def test_sphere_d128_known_values(bits, d_mse):
    value = 128 * float(BY_LABEL[f"sphere_d128_b{bits}"]["mse"])
    assert float(f"{value:.3e}") == float(d_mse)  # 4 significant digits


# ------------------------------------------------------------------------------------------------
# b. the package agrees with the reference

_DENSITY = {"gaussian": Gaussian, "sphere": SphereMarginal, "polar": PolarAngle}

@functools.cache
def _solve(label):
    case = BY_LABEL[label]
    return lloyd_max(_DENSITY[case["kind"]](**case["params"]), case["bits"])


def _std(case, cb) -> float:
    if case["kind"] == "gaussian":
        return float(case["params"]["sigma"])
    if case["kind"] == "sphere":
        return 1.0 / math.sqrt(case["params"]["d"])
    return cb.density.scale


@pytest.mark.parametrize("label", sorted(BY_LABEL))
def test_package_mse_matches_reference(label):
    # The package sums positive cell distortions computed relative to each level (no
    # cancellation), each with relative error of a few eps (Gauss-Legendre rounding, the
    # normaliser, log-weights): measured <= 1.8e-15 over all cases, so 1e-14 leaves 5x headroom.
    cb = _solve(label)
    ref = float(BY_LABEL[label]["mse"])
    assert cb.mse == pytest.approx(ref, rel=1e-14, abs=0.0)


@pytest.mark.parametrize("label", sorted(BY_LABEL))
def test_package_levels_match_reference(label):
    case = BY_LABEL[label]
    cb = _solve(label)
    ref = np.array([float(x) for x in case["levels"]])
    k = 2 ** case["bits"]
    # The package solves in float64 to a centroid residual ~1e-15 * std. A residual r moves the
    # levels by about r times the conditioning of the Lloyd map, which grows like K^2 (the Newton
    # Jacobian's smallest eigenvalue shrinks like 1/K^2 relative to the cell masses), so the level
    # error bound is 1e-14 * std * K^2 (10x headroom over the residual). Measured max errors are
    # <= 1.1e-14 std, at most 2% of this bound.
    atol = 1e-14 * _std(case, cb) * k**2
    assert cb.levels.dtype == np.float64 and cb.levels.shape == (k,)
    err = np.max(np.abs(cb.levels - ref))
    assert err <= atol, f"max level error {err:.3e} > atol {atol:.3e}"


# ------------------------------------------------------------------------------------------------
# d. exact=True: the package's tables are the reference optimum, correctly rounded


@pytest.mark.parametrize("label", sorted(BY_LABEL))
def test_exact_tables_are_the_reference_correctly_rounded(label):
    # The reference holds each level to 30 significant digits, so rounding it to float64 gives the
    # rounding of the true optimum unless that lies within 1e-30 relative of a midpoint between two
    # floats (chance ~1e-14 per level): equality is the expectation, not a tolerance. The mse of
    # the stored table (rounded levels, float64 midpoints) differs from the optimum's by
    # O(ulp^2) relative, so it too rounds to the reference mse.
    case = BY_LABEL[label]
    cb = lloyd_max(_DENSITY[case["kind"]](**case["params"]), case["bits"], exact=True)
    with mp.workdps(50):
        ref = np.array([float(mpf(x)) for x in case["levels"]])
        ref_mse = float(mpf(case["mse"]))
    k = 2 ** case["bits"]
    assert cb.solver == "newton-tridiagonal+mp50"
    np.testing.assert_array_equal(cb.levels, ref)
    assert cb.mse == ref_mse
    mid = 0.5 * (cb.levels[:-1] + cb.levels[1:])
    mid[k // 2 - 1] = cb.density.center  # the centre threshold is the float64 centre itself
    np.testing.assert_array_equal(cb.thresholds, mid)
    # the rounded levels' own centroid residual: half an ulp of the largest level, over the std
    assert cb.residual <= 2 * np.spacing(np.max(np.abs(cb.levels))) / _std(case, cb)
