"""Rate-distortion theory for KV-cache quantizers: bounds, exact curves, water-filling, plots.

Reads codebooks (``codebooks``); every bound names its source in its docstring.
"""

from .bounds import (ECSQ_CONSTANT, TQ_CONSTANT, bias_factor, cube_root_integral, entropy_coded_limit,
                     inner_product_lower_bound, panter_dite, qjl_prod_distortion, qjl_variance,
                     qjl_variance_bound, shannon_lower_bound, sphere_unit_distortion,
                     turboquant_mse_bound, turboquant_prod_bound, turboquant_prod_refined)
from .curves import (NormCorrection, entropy_coded_curve, entropy_coded_point, gap_curve, lloyd_max_curve,
                     norm_correction_effect, norm_correction_one_bit)
from .results import ResultsError, Series, load_series
from .waterfill import WaterFilling, group_log_volumes, grouping_gap, reverse_water_filling

__all__ = [
    "TQ_CONSTANT", "ECSQ_CONSTANT", "shannon_lower_bound", "turboquant_mse_bound", "entropy_coded_limit",
    "inner_product_lower_bound", "turboquant_prod_bound", "turboquant_prod_refined", "qjl_prod_distortion",
    "sphere_unit_distortion", "cube_root_integral", "panter_dite", "bias_factor", "qjl_variance",
    "qjl_variance_bound", "lloyd_max_curve", "gap_curve", "entropy_coded_point", "entropy_coded_curve",
    "NormCorrection", "norm_correction_effect", "norm_correction_one_bit", "WaterFilling",
    "reverse_water_filling", "grouping_gap", "group_log_volumes", "Series", "ResultsError", "load_series",
]
