"""Reference quantizers for KV caches: the readable, exact specification kernels follow.

Every method implements ``encode(x) -> Encoded``, ``decode(enc)``, ``inner_product(q, enc)`` and
``Encoded.bits_per_element`` (from the stored bytes); see ``kvq_ref.common`` for the conventions
and each module's Notes for the rules kernels must match (rounding, tie rule, bit order).
"""

from .attention import (QuantizedKV, attention_decode, attention_prefill, exact_attention, logit_mse,
                        relative_error, topk_agreement)
from .common import Encoded, Quantizer
from .kivi import KIVI
from .polarquant import PolarQuant
from .qjl import QJL
from .quarot import QuaRot
from .rotations import HaarRotation, HadamardRotation, make_rotation
from .turbo_block import TurboBlock
from .turboquant import TurboQuantMSE, TurboQuantProd, TurboQuantSplit

__all__ = [
    "Encoded", "Quantizer", "TurboQuantMSE", "TurboQuantProd", "TurboQuantSplit", "QJL", "PolarQuant",
    "KIVI", "QuaRot", "TurboBlock", "HaarRotation", "HadamardRotation", "make_rotation", "QuantizedKV",
    "attention_decode", "attention_prefill", "exact_attention", "relative_error", "logit_mse",
    "topk_agreement",
]
