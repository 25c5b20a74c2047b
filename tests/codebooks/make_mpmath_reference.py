#!/usr/bin/env python
"""Independent high-precision reference for exact Lloyd-Max codebooks (mpmath only).

Usage::

    python tests/codebooks/make_mpmath_reference.py [--out PATH] [--only NAME ...]

writes ``tests/codebooks/data/mpmath_reference.json`` (or PATH). ``NAME`` selects cases by kind
(``gaussian``, ``sphere``, ``polar``), by density label (``gaussian``, ``sphere_d128``,
``polar_l2``) or by case label (``sphere_d128_b3``).

This script deliberately does NOT import the ``codebooks`` package: every number here comes from
closed forms / quadrature evaluated in mpmath at ``DPS = 50`` digits and a Newton solver written
from scratch below, so the package can be tested against it.

Math
----
Levels ``c_1 < ... < c_K`` (``K = 2**bits``), thresholds ``t_i = (c_i + c_{i+1}) / 2``, optimality
``F_i = c_i P_i - M_i = 0`` with ``P_i``, ``M_i`` the mass and first moment of cell i. All densities
here are symmetric, so the upper half (``K/2`` levels, first threshold fixed at the centre) is
solved in the centred variable ``u = x - centre`` and mirrored. The Jacobian of F is symmetric
tridiagonal::

    J_ii     = P_i - f(t_i) (c_{i+1} - c_i) / 4 - f(t_{i-1}) (c_i - c_{i-1}) / 4
    J_i,i+1  = -f(t_i) (c_{i+1} - c_i) / 4

(terms only for interior thresholds). Densities, in the centred variable on the upper half:

* Gaussian N(0, 1): tail ``P(U > u) = erfc(u / sqrt 2) / 2``, ``int u phi = phi(a) - phi(b)``,
  ``int u^2 phi = P + a phi(a) - b phi(b)``.
* SphereMarginal(d): ``f = C_d (1 - u^2)^k``, ``k = (d-3)/2``, ``C_d = G(d/2) / (sqrt(pi) G((d-1)/2))``;
  ``(U+1)/2 ~ Beta(al, al)``, ``al = (d-1)/2``, so ``P(U > u) = I_y(al, al)`` with
  ``y = (1-u)/2 <= 1/2``, evaluated as ``y^al (1-y)^al / (al B(al, al)) 2F1(2 al, 1; al+1; y)``
  (DLMF 8.17.8: a positive-term series, which stays accurate for d = 65536 where the
  ``2F1(al, 1-al; al+1; y)`` form inside ``mpmath.betainc`` cancels catastrophically);
  ``int u f = C_d [(1-a^2)^al - (1-b^2)^al] / (2 al)`` and ``int u^2 f = P_d - (d-1)/d P_{d+2}``.
* PolarAngle(level >= 2), ``m = 2^(level-1)``: ``f(psi) = G(m) / (2^(m-2) G(m/2)^2) sin^(m-1)(2 psi)``
  on ``[0, pi/2]``, centre ``pi/4``; in ``u = psi - pi/4``, ``f = K_m cos^(m-1)(2u)``;
  ``sin^2 psi ~ Beta(m/2, m/2)`` gives ``P(U > u) = I_y(m/2, m/2)`` with ``y = (1 - sin 2u)/2``;
  first and second cell moments by ``mpmath.quad``.

Solver: Newton on F (step halving until the levels stay ordered inside the support and the
centroid residual ``max_i |c_i - M_i/P_i| / std`` decreases; a Lloyd step if no halving is
accepted), first at 20 digits to 1e-15 and then at 50 digits to 1e-40. The result is verified by
recomputing the residual independently at 60 digits. Levels and MSE are written as 30-significant
-digit strings; output is deterministic (byte-identical across runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mpmath
from mpmath import mp, mpf

DPS = 50
DIGITS = 30  # significant digits written to the JSON
TOL = mpf("1e-40")  # final centroid residual, relative to std (all std <= 1 here)
GENERATOR = "tests/codebooks/make_mpmath_reference.py (mpmath, independent of the codebooks package)"
DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "mpmath_reference.json"

#: (kind, params, bits) of every stored case.
CASES: list[tuple[str, dict, int]] = (
    [("gaussian", {"sigma": 1.0}, b) for b in range(1, 7)]
    + [("sphere", {"d": d}, b) for d in (2, 3, 4, 5, 16, 128, 1024, 65536) for b in range(1, 6)]
    + [("polar", {"level": lv}, b) for lv in (2, 3) for b in range(1, 5)]
)


# ------------------------------------------------------------------------------------------------
# densities on the upper half, centred variable u in [0, hi]


def _beta_tail(al, y):
    """Regularized I_y(al, al) for 0 <= y <= 1/2 (DLMF 8.17.8, positive-term 2F1)."""
    if y == 0:
        return mpf(0)
    if y * 2 == 1:
        return mpf(1) / 2
    logpre = al * mp.log(y) + al * mp.log1p(-y) - mp.log(al) - mp.log(mp.beta(al, al))
    return mp.exp(logpre) * mp.hyp2f1(2 * al, 1, al + 1, y, maxterms=10**7)


class _Gaussian:
    """Standard normal N(0, 1)."""

    def __init__(self):
        self.hi = mp.inf
        self.center = mpf(0)
        self.std = mpf(1)

    def tail(self, u):
        return mp.erfc(u / mp.sqrt(2)) / 2

    def pdf(self, u):
        return mp.npdf(u) if u != mp.inf else mpf(0)

    def _ua_phi(self, u):
        return u * self.pdf(u) if u != mp.inf else mpf(0)

    def moments(self, a, b):
        """(P, int u f, int u^2 f) over [a, b]."""
        P = self.tail(a) - self.tail(b)
        m1 = self.pdf(a) - self.pdf(b)
        m2 = P + self._ua_phi(a) - self._ua_phi(b)
        return P, m1, m2

    def guess(self, half):
        k = 2 * half
        return [mp.sqrt(3) * _ndtri((half + j + mpf(1) / 2) / k) for j in range(half)]


def _ndtri(p):
    """Standard normal quantile (only used for the starting guess)."""
    return mp.sqrt(2) * mp.erfinv(2 * p - 1)


class _Sphere:
    """One coordinate of a uniform point on S^{d-1}."""

    def __init__(self, d: int):
        self.d = d
        self.hi = mpf(1)
        self.center = mpf(0)
        self.std = 1 / mp.sqrt(d)
        self.al = mpf(d - 1) / 2
        self.k = mpf(d - 3) / 2
        self.logc = mp.loggamma(mpf(d) / 2) - mp.log(mp.pi) / 2 - mp.loggamma(mpf(d - 1) / 2)

    def tail(self, u, al=None):
        if u >= 1:
            return mpf(0)
        return _beta_tail(self.al if al is None else al, (1 - u) / 2)

    def pdf(self, u):
        if u >= 1:
            return mpf(0) if self.d > 3 else (mp.exp(self.logc) if self.d == 3 else mp.inf)
        return mp.exp(self.logc + self.k * mp.log1p(-u * u))

    def moments(self, a, b):
        d, al = self.d, self.al
        P = self.tail(a) - self.tail(b)
        Pw = self.tail(a, al + 1) - self.tail(b, al + 1)  # mass under SphereMarginal(d + 2)
        m1 = mp.exp(self.logc) * ((1 - a * a) ** al - (1 - b * b) ** al) / (2 * al)
        m2 = P - mpf(d - 1) / d * Pw
        return P, m1, m2

    def guess(self, half):
        k = 2 * half
        if self.d <= 5:  # uniform grid on [-1, 1] (exact for d = 3)
            return [(j + mpf(1) / 2) / half for j in range(half)]
        g = [mp.sqrt(3) * _ndtri((half + j + mpf(1) / 2) / k) / mp.sqrt(self.d) for j in range(half)]
        if g[-1] < mpf("0.95"):
            return g
        return [(j + mpf(1) / 2) / half for j in range(half)]


class _Polar:
    """PolarQuant angle at recursion level >= 2, centred at pi/4."""

    def __init__(self, level: int):
        if level < 2:
            raise ValueError("polar level must be >= 2 (level 1 is uniform)")
        m = 2 ** (level - 1)
        self.m = m
        self.n = m - 1
        self.hi = mp.pi / 4
        self.center = mp.pi / 4
        self.coef = mp.gamma(m) / (mpf(2) ** (m - 2) * mp.gamma(mpf(m) / 2) ** 2)
        self.al = mpf(m) / 2
        self.std = mp.sqrt(2 * self._quad(2, 0, self.hi))

    def _quad(self, power, a, b):
        n, coef = self.n, self.coef
        return mp.quad(lambda u: u**power * coef * mp.cos(2 * u) ** n, [a, b])

    def tail(self, u):
        if u >= self.hi:
            return mpf(0)
        return _beta_tail(self.al, (1 - mp.sin(2 * u)) / 2)

    def pdf(self, u):
        return self.coef * mp.cos(2 * u) ** self.n

    def moments(self, a, b):
        P = self.tail(a) - self.tail(b)
        return P, self._quad(1, a, b), self._quad(2, a, b)

    def guess(self, half):
        k = 2 * half
        g = [self.std * mp.sqrt(3) * _ndtri((half + j + mpf(1) / 2) / k) for j in range(half)]
        if g[-1] < self.hi * mpf("0.95"):
            return g
        return [self.hi * (j + mpf(1) / 2) / half for j in range(half)]


def _density(kind: str, params: dict):
    if kind == "gaussian":
        return _Gaussian()
    if kind == "sphere":
        return _Sphere(int(params["d"]))
    if kind == "polar":
        return _Polar(int(params["level"]))
    raise ValueError(f"unknown kind {kind!r}")


# ------------------------------------------------------------------------------------------------
# Newton solver on the upper half


def _cells(dens, c):
    """Thresholds and per-cell (P, M1, M2) for upper-half levels c (first threshold at 0)."""
    t = [mpf(0)] + [(c[i] + c[i + 1]) / 2 for i in range(len(c) - 1)] + [dens.hi]
    mom = [dens.moments(t[i], t[i + 1]) for i in range(len(c))]
    return t, mom


def _residual(dens, c, mom):
    return max(abs(ci - m1 / P) for ci, (P, m1, _) in zip(c, mom)) / dens.std


def _valid(dens, c):
    return c[0] > 0 and all(c[i] < c[i + 1] for i in range(len(c) - 1)) and c[-1] < dens.hi


def _tridiag_solve(diag, off, rhs):
    """Solve the symmetric tridiagonal system (Thomas algorithm); None if a pivot is <= 0."""
    n = len(diag)
    d = list(diag)
    r = list(rhs)
    for i in range(1, n):
        if d[i - 1] <= 0:
            return None
        w = off[i - 1] / d[i - 1]
        d[i] -= w * off[i - 1]
        r[i] -= w * r[i - 1]
    if d[-1] <= 0:
        return None
    x = [mpf(0)] * n
    x[-1] = r[-1] / d[-1]
    for i in range(n - 2, -1, -1):
        x[i] = (r[i] - off[i] * x[i + 1]) / d[i]
    return x


def _newton(dens, c, tol, max_iter=200):
    t, mom = _cells(dens, c)
    res = _residual(dens, c, mom)
    for _ in range(max_iter):
        if res < tol:
            return c, res
        h = len(c)
        P = [m[0] for m in mom]
        F = [c[i] * P[i] - mom[i][1] for i in range(h)]
        f = [dens.pdf(t[i]) for i in range(1, h)]  # interior thresholds t_1 .. t_{h-1}
        gap = [c[i + 1] - c[i] for i in range(h - 1)]
        diag = list(P)
        for i in range(h - 1):
            diag[i] -= f[i] * gap[i] / 4
            diag[i + 1] -= f[i] * gap[i] / 4
        off = [-f[i] * gap[i] / 4 for i in range(h - 1)]
        delta = _tridiag_solve(diag, off, [-x for x in F])
        accepted = False
        if delta is not None:
            lam = mpf(1)
            for _halving in range(40):
                trial = [ci + lam * di for ci, di in zip(c, delta)]
                if _valid(dens, trial):
                    tt, tmom = _cells(dens, trial)
                    tres = _residual(dens, trial, tmom)
                    if all(m[0] > 0 for m in tmom) and tres < res:
                        c, t, mom, res = trial, tt, tmom, tres
                        accepted = True
                        break
                lam /= 2
        if not accepted:  # Lloyd step: every level to its centroid (stays ordered and inside)
            c = [m1 / P for P, m1, _ in mom]
            t, mom = _cells(dens, c)
            res = _residual(dens, c, mom)
    if res < tol:
        return c, res
    raise RuntimeError(f"Newton did not converge: residual {mpmath.nstr(res, 5)}")


def _fmt(x) -> str:
    return mpmath.nstr(x, DIGITS, strip_zeros=False)


def compute_case(kind: str, params: dict, bits: int) -> dict:
    """Solve one case at DPS digits and return its JSON record (30-digit strings)."""
    if not (isinstance(bits, int) and bits >= 1):
        raise ValueError(f"bits must be an integer >= 1, got {bits!r}")
    half = 2 ** (bits - 1)
    with mp.workdps(DPS):
        dens = _density(kind, params)
        with mp.workdps(20):
            dens20 = _density(kind, params)
            c20, _ = _newton(dens20, dens20.guess(half), mpf("1e-15"))
        c, _ = _newton(dens, [mpf(x) for x in c20], TOL)
        _, mom = _cells(dens, c)
        # MSE = 2 * sum over the upper half of int (u - c)^2 f
        mse = 2 * mp.fsum(m2 - 2 * ci * m1 + ci * ci * P for ci, (P, m1, m2) in zip(c, mom))
        # independent verification at higher precision with the 50-digit levels
        with mp.workdps(DPS + 10):
            dens60 = _density(kind, params)
            _, mom60 = _cells(dens60, c)
            res60 = _residual(dens60, c, mom60)
            if not res60 < TOL:
                raise RuntimeError(f"{kind} {params} bits={bits}: verification residual "
                                   f"{mpmath.nstr(res60, 5)} >= {mpmath.nstr(TOL, 3)}")
        scale = mpf(1)
        if kind == "gaussian":
            scale = mpf(repr(float(params.get("sigma", 1.0))))
        levels = [dens.center - x for x in reversed(c)] + [dens.center + x for x in c]
        levels = [scale * x for x in levels]
        mse = scale * scale * mse
        return {
            "kind": kind,
            "params": dict(params),
            "bits": bits,
            "levels": [_fmt(x) for x in levels],
            "mse": _fmt(mse),
        }


# ------------------------------------------------------------------------------------------------
# command line


def density_label(kind: str, params: dict) -> str:
    if kind == "gaussian":
        s = float(params.get("sigma", 1.0))
        return "gaussian" if s == 1.0 else f"gaussian_s{s!r}"
    if kind == "sphere":
        return f"sphere_d{params['d']}"
    return f"polar_l{params['level']}"


def case_label(kind: str, params: dict, bits: int) -> str:
    return f"{density_label(kind, params)}_b{bits}"


def _sort_key(case):
    kind, params, bits = case
    return (kind, sorted((k, float(v)) for k, v in params.items()), bits)


def select_cases(only=None) -> list[tuple[str, dict, int]]:
    cases = sorted(CASES, key=_sort_key)
    if not only:
        return cases
    names = set(only)
    out = [c for c in cases
           if c[0] in names or density_label(*c[:2]) in names or case_label(*c) in names]
    unknown = names - {c[0] for c in cases} - {density_label(*c[:2]) for c in cases} \
        - {case_label(*c) for c in cases}
    if unknown:
        raise SystemExit(f"unknown case name(s): {', '.join(sorted(unknown))}")
    return out


def render(records: list[dict]) -> str:
    doc = {"generator": GENERATOR, "dps": DPS, "cases": records}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSON path")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="kind, density label (sphere_d128) or case label (sphere_d128_b3)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    records = []
    for kind, params, bits in select_cases(args.only):
        t1 = time.perf_counter()
        records.append(compute_case(kind, params, bits))
        print(f"{case_label(kind, params, bits):22s} {time.perf_counter() - t1:7.3f} s", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(records), encoding="utf-8")
    print(f"wrote {len(records)} cases to {args.out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
