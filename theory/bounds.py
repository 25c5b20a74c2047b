"""Rate-distortion bounds and closed-form constants for TurboQuant-style quantizers.

All MSE quantities are *normalized*: distortion divided by the source's second moment. For a unit
vector in R^d quantized coordinate-wise after a random rotation this is ``E||x - x_hat||^2 =
d * mse`` (``Codebook.unit_distortion``); for N(0, sigma^2) it is ``mse / sigma^2``.
Inner-product quantities are ``E[(<y, x> - <y, x_hat>)^2]`` for a unit ``x``.

Notes
-----
Sources (:ref:`ref-bounds`; TurboQuant, arXiv 2504.19874, Theorems 1-3):

* Shannon lower bound for unit vectors at b bits per coordinate: ``D_mse >= 4^-b``.
* TurboQuant_mse upper bound: ``D_mse <= (sqrt(3) pi / 2) 4^-b``; the constant is the
  Panter-Dite constant of the Gaussian, ``(1/12) (int phi^(1/3))^3``.
* Inner product: ``D_prod >= (||y||^2 / d) 4^-b``; TurboQuant_prod (b-1 bit MSE stage plus a 1-bit
  QJL sketch of the residual) satisfies ``D_prod <= (pi / (2d)) ||y||^2 D_mse(b-1)
  <= (sqrt(3) pi^2 ||y||^2 / d) 4^-b`` (``D_mse(0) = 1``).
* Panter-Dite (1951) high-resolution approximation of fixed-rate scalar quantization:
  ``mse ~ (1/12) (int f^(1/3))^3 4^-b``.
* Entropy-coded uniform scalar quantization approaches ``(pi e / 6) 4^-b`` (1.53 dB above the
  Shannon bound; Gish and Pierce 1968) for Gaussian-like sources.
* QJL (arXiv 2406.03482): for ``S`` with i.i.d. N(0, 1) entries, the estimator
  ``sqrt(pi/2)/m ||k|| <S q, sign(S k)>`` is unbiased for ``<q, k>``. Each of its m terms has
  second moment ``(pi/2) ||q||^2 ||k||^2`` (sign^2 = 1, E[(s.q)^2] = ||q||^2), so its variance is
  exactly ``((pi/2) ||q||^2 ||k||^2 - <q, k>^2) / m <= (pi / (2m)) ||q||^2 ||k||^2``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

from codebooks import Codebook, Density, Empirical, Gaussian, PolarAngle, SphereMarginal, lloyd_max
from codebooks._validate import check_int, check_positive

__all__ = [
    "TQ_CONSTANT", "ECSQ_CONSTANT", "shannon_lower_bound", "turboquant_mse_bound",
    "inner_product_lower_bound", "turboquant_prod_bound", "turboquant_prod_refined",
    "qjl_prod_distortion", "sphere_unit_distortion", "cube_root_integral", "panter_dite",
    "entropy_coded_limit", "bias_factor", "qjl_variance", "qjl_variance_bound",
]

#: sqrt(3) pi / 2 = 2.7207: TurboQuant_mse's constant, Panter-Dite constant of the Gaussian.
TQ_CONSTANT = math.sqrt(3.0) * math.pi / 2.0
#: pi e / 6 = 1.4233: entropy-coded uniform scalar quantization over the Shannon bound.
ECSQ_CONSTANT = math.pi * math.e / 6.0


def _bits_array(bits, lo: float = 0.0):
    b = np.asarray(bits, dtype=np.float64)
    if not np.all(np.isfinite(b)) or np.any(b < lo):
        raise ValueError(f"bits must be finite and >= {lo:g}, got {bits!r}")
    return b


def _scalar_or_array(value, like):
    return float(value) if np.ndim(like) == 0 else value


def shannon_lower_bound(bits):
    """``4^-b``: no quantizer of unit vectors at b bits/coordinate does better (normalized MSE).

    Parameters
    ----------
    bits : float or array_like
        Bits per coordinate, >= 0.

    Returns
    -------
    float or ndarray
    """
    b = _bits_array(bits)
    return _scalar_or_array(4.0**-b, bits)


def turboquant_mse_bound(bits):
    """``(sqrt(3) pi / 2) 4^-b``: TurboQuant_mse's upper bound (Theorem 1)."""
    b = _bits_array(bits)
    return _scalar_or_array(TQ_CONSTANT * 4.0**-b, bits)


def entropy_coded_limit(bits):
    """``(pi e / 6) 4^-b``: high-rate limit of entropy-coded uniform scalar quantization."""
    b = _bits_array(bits)
    return _scalar_or_array(ECSQ_CONSTANT * 4.0**-b, bits)


def inner_product_lower_bound(bits, d: int, y_norm: float = 1.0):
    """``(||y||^2 / d) 4^-b``: lower bound on ``E[(<y,x> - <y,x_hat>)^2]`` (Theorem 3)."""
    d = check_int("d", d, lo=2)
    y2 = check_positive("y_norm", y_norm) ** 2
    b = _bits_array(bits)
    return _scalar_or_array(y2 / d * 4.0**-b, bits)


def turboquant_prod_bound(bits, d: int, y_norm: float = 1.0):
    """``(sqrt(3) pi^2 ||y||^2 / d) 4^-b``: TurboQuant_prod's upper bound (Theorem 2)."""
    d = check_int("d", d, lo=2)
    y2 = check_positive("y_norm", y_norm) ** 2
    b = _bits_array(bits, lo=1.0)
    return _scalar_or_array(math.sqrt(3.0) * math.pi**2 * y2 / d * 4.0**-b, bits)


@lru_cache(maxsize=4096)
def _sphere_unit(d: int, bits: int) -> float:
    return 1.0 if bits == 0 else lloyd_max(SphereMarginal(d), bits).unit_distortion


def sphere_unit_distortion(d: int, bits):
    """Exact Lloyd-Max ``D_mse(b) = d * mse`` of SphereMarginal(d); ``D_mse(0) = 1``.

    Parameters
    ----------
    d : int
    bits : int or array_like of int, 0..12

    Returns
    -------
    float or ndarray
    """
    d = check_int("d", d, lo=2)
    b = np.asarray(bits)
    if not np.issubdtype(b.dtype, np.integer) or np.any(b < 0) or np.any(b > 12):
        raise ValueError(f"bits must be integers in 0..12, got {bits!r}")
    out = np.array([_sphere_unit(d, int(v)) for v in b.ravel()]).reshape(b.shape)
    return _scalar_or_array(out, bits)


def turboquant_prod_refined(bits, d: int, y_norm: float = 1.0):
    """``(pi / (2d)) ||y||^2 D_mse(b-1)``: the refined TurboQuant_prod bound, with exact D_mse."""
    y2 = check_positive("y_norm", y_norm) ** 2
    b = np.asarray(bits)
    if np.any(b < 1):
        raise ValueError(f"bits must be >= 1 (one bit goes to QJL), got {bits!r}")
    return _scalar_or_array(math.pi / (2 * d) * y2 * np.asarray(sphere_unit_distortion(d, b - 1)), bits)


def qjl_prod_distortion(bits, d: int, y_norm: float = 1.0):
    """Exact ``E[(<y,x> - <y,x_hat>)^2]`` of TurboQuant_prod with a Gaussian d x d QJL matrix.

    Notes
    -----
    The residual ``r`` of the (b-1)-bit MSE stage is isotropic under a Haar rotation
    (``E[r r^T] = D_mse(b-1) I / d``), so averaging the exact QJL variance over ``r`` gives
    ``(pi/2 - 1/d) ||y||^2 D_mse(b-1) / d``, just under the refined bound's ``pi/(2d)``.
    """
    d = check_int("d", d, lo=2)
    y2 = check_positive("y_norm", y_norm) ** 2
    b = np.asarray(bits)
    if np.any(b < 1):
        raise ValueError(f"bits must be >= 1 (one bit goes to QJL), got {bits!r}")
    dm = np.asarray(sphere_unit_distortion(d, b - 1))
    return _scalar_or_array((math.pi / 2 - 1.0 / d) * y2 * dm / d, bits)


def cube_root_integral(density: Density) -> float:
    """``int f^(1/3) dx`` in closed form.

    Notes
    -----
    * SphereMarginal(d): ``C_d^(1/3) B(1/2, k/3 + 1)`` with ``k = (d-3)/2``
      (``int_{-1}^{1} (1-x^2)^a dx = B(1/2, a+1)``).
    * Gaussian(sigma): ``sqrt(6 pi) sigma (sigma sqrt(2 pi))^(-1/3)``.
    * PolarAngle(l >= 2): ``K_m^(1/3) B(1/2, (n/3 + 1)/2) / 2`` with ``n = m - 1``
      (``int_0^{pi/2} sin^a(2 psi) dpsi = B(1/2, (a+1)/2) / 2``); level 1: ``(2 pi)^(2/3)``.
    """
    if isinstance(density, SphereMarginal):
        k = (density.d - 3) / 2
        return math.exp(density._logc / 3 + special.betaln(0.5, k / 3 + 1))
    if isinstance(density, Gaussian):
        s = density.sigma
        return math.sqrt(6 * math.pi) * s * (s * math.sqrt(2 * math.pi)) ** (-1 / 3)
    if isinstance(density, PolarAngle):
        if density.level == 1:
            return (2 * math.pi) ** (2 / 3)
        n = density._n
        return math.exp(density._logk / 3 + special.betaln(0.5, (n / 3 + 1) / 2)) / 2
    raise TypeError(f"no closed form of int f^(1/3) for {type(density).__name__}")


def panter_dite(density: Density, bits):
    """Panter-Dite approximation ``(1/12) (int f^(1/3))^3 4^-b / E[X^2]`` (normalized MSE)."""
    if isinstance(density, Empirical):
        raise TypeError("Panter-Dite needs a continuous density")
    b = _bits_array(bits)
    const = cube_root_integral(density) ** 3 / 12.0 / density.second_moment
    return _scalar_or_array(const * 4.0**-b, bits)


def bias_factor(codebook: Codebook) -> float:
    """``E[X Q(X)] / E[X^2]``: the inner-product shrinkage of an MSE codebook.

    For a Lloyd-Max table (levels at centroids) it equals ``1 - mse / E[X^2]``; after a random
    rotation ``E[<y, x_hat>] = bias_factor * <y, x>`` (2/pi at 1 bit for the Gaussian).
    Computed exactly from the closed-form first moments of the table's cells.
    """
    if not isinstance(codebook, Codebook):
        raise TypeError(f"codebook must be a Codebook, got {type(codebook).__name__}")
    dens = codebook.density
    lo, hi = dens.support
    edges = np.concatenate([[lo], codebook.thresholds, [hi]])
    _, m1, _ = dens.cell_moments(edges[:-1], edges[1:])
    return float(np.dot(codebook.levels, m1) / dens.second_moment)


def qjl_variance(m: int, q_norm: float, k_norm: float, inner: float) -> float:
    """Exact variance of the QJL inner-product estimator with m Gaussian rows.

    Parameters
    ----------
    m : int
        Sketch rows.
    q_norm, k_norm : float
        ``||q||``, ``||k||``.
    inner : float
        ``<q, k>``; ``|inner| <= q_norm * k_norm``.
    """
    m = check_int("m", m, lo=1)
    q2 = float(q_norm) ** 2
    k2 = float(k_norm) ** 2
    if not (math.isfinite(q2) and math.isfinite(k2)) or q_norm < 0 or k_norm < 0:
        raise ValueError("q_norm and k_norm must be finite and >= 0")
    if not math.isfinite(inner) or abs(inner) > math.sqrt(q2 * k2) * (1 + 1e-12):
        raise ValueError(f"inner must satisfy |inner| <= q_norm * k_norm, got {inner!r}")
    return (math.pi / 2 * q2 * k2 - inner**2) / m


def qjl_variance_bound(m: int, q_norm: float, k_norm: float) -> float:
    """``(pi / (2m)) ||q||^2 ||k||^2``: QJL's published variance bound."""
    m = check_int("m", m, lo=1)
    return math.pi / (2 * m) * float(q_norm) ** 2 * float(k_norm) ** 2
