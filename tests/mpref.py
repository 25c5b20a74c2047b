"""The package's densities written independently in mpmath, for reference integrals in tests."""

import mpmath as mp

from codebooks import Gaussian, SphereMarginal


def mp_pdf(density):
    """mpmath function x -> f(x) at the current mp precision."""
    if isinstance(density, SphereMarginal):
        d = density.d
        c = mp.gamma(mp.mpf(d) / 2) / (mp.sqrt(mp.pi) * mp.gamma(mp.mpf(d - 1) / 2))
        return lambda x: c * (1 - x * x) ** (mp.mpf(d - 3) / 2)
    if isinstance(density, Gaussian):
        s = mp.mpf(density.sigma)
        return lambda x: mp.exp(-x * x / (2 * s * s)) / (s * mp.sqrt(2 * mp.pi))
    if density.level == 1:
        return lambda x: 1 / (2 * mp.pi)
    m = 2 ** (density.level - 1)
    k = mp.gamma(m) / (mp.mpf(2) ** (m - 2) * mp.gamma(mp.mpf(m) / 2) ** 2)
    return lambda x: k * mp.sin(2 * x) ** (m - 1)


def mp_breakpoints(density, span=8):
    """Support ends plus centre +- k std (k <= span): smooth pieces for mp.quad."""
    lo, hi = density.support
    c, s = density.center, density.scale
    pts = {lo, hi} | {c + k * s for k in range(-span, span + 1) if lo < c + k * s < hi}
    return [mp.mpf(p) if abs(p) != float("inf") else (mp.inf if p > 0 else -mp.inf) for p in sorted(pts)]
