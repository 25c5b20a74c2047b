"""Build and run the llama.cpp TurboQuant fork's CPU reference (``ggml-turbo-quant.c``) from a checkout.

The fork's file needs three headers: its own ``ggml-common.h`` (block structs) and two that this
harness writes in place of ggml's (``ggml-quants.h``: the C declarations and macros;
``ggml-impl.h``: fp16 conversion). The fp32 -> fp16 conversion is written here from the facts
(IEEE binary16, round to nearest even, +-Inf past the range; a NaN becomes the quiet NaN 0x7E00 with
its sign, as ggml's CPU conversion writes it); ``test_harness_fp16_is_ieee`` checks it against numpy
on every kind of float32. The driver reads rows of k float32 from stdin and writes the bytes of
``quantize_row_turbo{2,3,4}_0_ref`` for each row (or, with ``dq``, the floats of
``dequantize_row_turbo{b}_0`` of block bytes). The fork's code is read from the checkout, never
copied into this repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

ENV = "KVQ_LLAMA_CPP_DIR"
SOURCES = ("ggml/src/ggml-turbo-quant.c", "ggml/src/ggml-common.h")
BYTES = {2: 34, 3: 50, 4: 68}

QUANTS_H = r"""#pragma once
#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include <stddef.h>
#include <stdint.h>
#define GGML_RESTRICT __restrict
#define GGML_API
#define GGML_UNUSED(x) (void)(x)
"""

IMPL_H = r"""#pragma once
#include <stdint.h>
#include <string.h>
static inline uint16_t harness_fp32_to_fp16(float f) {
    uint32_t w; memcpy(&w, &f, 4);
    uint16_t sign = (uint16_t)((w >> 16) & 0x8000u);
    uint32_t a = w & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u;          /* NaN: quiet, sign kept */
    if (a >= 0x477FF000u) return sign | 0x7C00u;         /* >= 65520: rounds past 65504, Inf */
    if (a < 0x38800000u) {                               /* below 2^-14: subnormal or zero */
        if (a < 0x33000000u) return sign;                /* below 2^-25: rounds to zero */
        uint32_t shift = 126u - (a >> 23), m = (a & 0x7FFFFFu) | 0x800000u;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return sign | (uint16_t)r;
    }
    uint32_t r = (a - 0x38000000u) >> 13, rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return sign | (uint16_t)r;
}
static inline float harness_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, w;
    if (e == 0x1Fu) w = sign | 0x7F800000u | (m << 13);
    else if (e == 0) { float v = (float)m * 0x1p-24f; memcpy(&w, &v, 4); w |= sign; }
    else w = sign | ((e + 112u) << 23) | (m << 13);
    float f; memcpy(&f, &w, 4); return f;
}
#define GGML_FP32_TO_FP16(x) harness_fp32_to_fp16(x)
#define GGML_FP16_TO_FP32(x) harness_fp16_to_fp32(x)
"""

DRIVER = r"""#include "ggml-quants.h"
#include "ggml-impl.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
void quantize_row_turbo2_0_ref(const float *, block_turbo2_0 *, int64_t);
void quantize_row_turbo3_0_ref(const float *, block_turbo3_0 *, int64_t);
void quantize_row_turbo4_0_ref(const float *, block_turbo4_0 *, int64_t);
void dequantize_row_turbo2_0(const block_turbo2_0 *, float *, int64_t);
void dequantize_row_turbo3_0(const block_turbo3_0 *, float *, int64_t);
void dequantize_row_turbo4_0(const block_turbo4_0 *, float *, int64_t);
int main(int argc, char ** argv) {
    if (argc < 3) return 2;
    int bits = atoi(argv[1]);
    const char * mode = argv[2];
    if (!strcmp(mode, "h")) {  /* fp32 -> fp16 of every input float */
        float f; uint16_t h;
        while (fread(&f, 4, 1, stdin) == 1) { h = harness_fp32_to_fp16(f); fwrite(&h, 2, 1, stdout); }
        return 0;
    }
    size_t bs = bits == 2 ? sizeof(block_turbo2_0) : bits == 3 ? sizeof(block_turbo3_0) : sizeof(block_turbo4_0);
    float x[128]; unsigned char y[128];
    if (!strcmp(mode, "dq")) {
        while (fread(y, 1, bs, stdin) == bs) {
            if (bits == 2) dequantize_row_turbo2_0((const block_turbo2_0 *)y, x, 128);
            else if (bits == 3) dequantize_row_turbo3_0((const block_turbo3_0 *)y, x, 128);
            else dequantize_row_turbo4_0((const block_turbo4_0 *)y, x, 128);
            fwrite(x, 4, 128, stdout);
        }
        return 0;
    }
    while (fread(x, 4, 128, stdin) == 128) {
        if (bits == 2) quantize_row_turbo2_0_ref(x, (block_turbo2_0 *)y, 128);
        else if (bits == 3) quantize_row_turbo3_0_ref(x, (block_turbo3_0 *)y, 128);
        else quantize_row_turbo4_0_ref(x, (block_turbo4_0 *)y, 128);
        fwrite(y, 1, bs, stdout);
    }
    return 0;
}
"""


def fork_dir() -> Path | None:
    """``$KVQ_LLAMA_CPP_DIR`` (a fork checkout, or the folder of its table files), or None when unset."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def build(checkout: Path, out: Path) -> Path:
    """Compile the checkout's CPU reference with the harness into ``out``; returns the executable.

    ``-O2 -ffp-contract=off``: float32 without fused multiply-add, as the facts' golden build.
    """
    out.mkdir(parents=True, exist_ok=True)
    for rel in SOURCES:
        shutil.copyfile(checkout / rel, out / Path(rel).name)
    (out / "ggml-quants.h").write_text(QUANTS_H)
    (out / "ggml-impl.h").write_text(IMPL_H)
    (out / "driver.c").write_text(DRIVER)
    exe = out / "turbo_ref"
    subprocess.run([compiler(), "-O2", "-ffp-contract=off", "-std=gnu11", "-w", "-o", str(exe), "driver.c",
                    "ggml-turbo-quant.c", "-lm"], cwd=out, check=True, capture_output=True, timeout=300)
    return exe


def quantize(exe: Path, bits: int, rows: np.ndarray) -> bytes:
    """The fork's bytes of rows (N, 128) float32 (each row one call of quantize_row_turbo<bits>_0_ref)."""
    data = np.ascontiguousarray(rows, dtype="<f4").tobytes()
    return subprocess.run([str(exe), str(bits), "q"], input=data, capture_output=True, check=True, timeout=300).stdout


def dequantize(exe: Path, bits: int, blocks: bytes) -> np.ndarray:
    """The fork's ``dequantize_row_turbo<bits>_0`` of whole blocks, (N, 128) float32."""
    out = subprocess.run([str(exe), str(bits), "dq"], input=blocks, capture_output=True, check=True, timeout=300).stdout
    return np.frombuffer(out, "<f4").reshape(-1, 128)


def to_fp16_bits(exe: Path, values: np.ndarray) -> np.ndarray:
    """The harness's fp32 -> fp16 conversion of ``values`` as uint16 bit patterns."""
    data = np.ascontiguousarray(values, dtype="<f4").tobytes()
    out = subprocess.run([str(exe), "0", "h"], input=data, capture_output=True, check=True, timeout=300).stdout
    return np.frombuffer(out, "<u2")
