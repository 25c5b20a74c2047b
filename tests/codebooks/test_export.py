"""``kvq-codebooks export --format llama.cpp``: the C header parses, compiles and holds the codebook."""

from __future__ import annotations

import re
import shutil
import subprocess
from fractions import Fraction

import numpy as np
import pytest

from codebooks import SphereMarginal, lloyd_max
from codebooks.cli import main

ARRAY = re.compile(r"static const float (CENTROIDS|THRESHOLDS)_(\d)BIT\[(\d+)\] = \{([^}]*)\};")


def parse_header(text: str) -> dict[int, dict[str, list[str]]]:
    """{bits: {"CENTROIDS": [literal...], "THRESHOLDS": [...]}} of a header, literals without 'f'."""
    out: dict[int, dict[str, list[str]]] = {}
    for kind, bits, n, body in ARRAY.findall(text):
        lits = [v.strip().removesuffix("f") for v in body.split(",") if v.strip()]
        assert len(lits) == int(n), f"{kind}_{bits}BIT declares {n} values, holds {len(lits)}"
        out.setdefault(int(bits), {})[kind] = lits
    return out


def _is_nearest_float32(literal: str, want: np.float32) -> bool:
    """The decimal lies within half a float32 ulp of ``want``, so a C compiler reads ``want``."""
    half_ulp = Fraction(float(np.spacing(np.abs(want)))) / 2
    return abs(Fraction(literal) - Fraction(float(want))) < half_ulp


def _export(tmp_path, name="t.h", *extra):
    out = tmp_path / name
    assert main(["export", "--format", "llama.cpp", "--out", str(out), *extra]) == 0
    return out


def test_header_holds_the_codebooks_in_float32(tmp_path, capsys):
    out = _export(tmp_path)
    assert "CENTROIDS/THRESHOLDS_<b>BIT of SphereMarginal(128) at bits 2, 3, 4" in capsys.readouterr().out
    text = out.read_text()
    tables = parse_header(text)
    assert sorted(tables) == [2, 3, 4] and "#define KVQ_TURBO_DIM 128" in text
    for bits, tab in tables.items():
        cb = lloyd_max(SphereMarginal(128), bits)
        for kind, ref in (("CENTROIDS", cb.levels), ("THRESHOLDS", cb.thresholds)):
            want = ref.astype(np.float32)
            assert len(tab[kind]) == want.size
            assert all(_is_nearest_float32(lit, w) for lit, w in zip(tab[kind], want)), (bits, kind)
    assert _export(tmp_path, "again.h").read_bytes() == out.read_bytes()  # deterministic
    other = parse_header(_export(tmp_path, "d64.h", "--bits", "1-2,5", "--dim", "64").read_text())
    assert sorted(other) == [1, 2, 5]
    assert _is_nearest_float32(other[5]["CENTROIDS"][-1], np.float32(lloyd_max(SphereMarginal(64), 5).levels[-1]))


def test_header_compiles_and_the_index_rule_takes_the_higher_cell(tmp_path):
    """A C program includes the header and prints every value's float32 bits and the index of each
    threshold (the strict v < t rule: i + 1), of the float just below it (i), and of +-0."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) to compile the exported header; the parse test still ran")
    header = _export(tmp_path)
    src = tmp_path / "main.c"
    body = []
    for b in (2, 3, 4):
        n = 1 << b
        body.append(f"""
    for (int i = 0; i < {n}; i++) {{ memcpy(&u, &CENTROIDS_{b}BIT[i], 4); printf("L {b} %08x\\n", u); }}
    for (int i = 0; i < {n - 1}; i++) {{
        float t = THRESHOLDS_{b}BIT[i];
        memcpy(&u, &t, 4);
        printf("T {b} %08x %d %d\\n", u, kvq_turbo_nearest_index(THRESHOLDS_{b}BIT, {n - 1}, t),
               kvq_turbo_nearest_index(THRESHOLDS_{b}BIT, {n - 1}, nextafterf(t, -1.0f)));
    }}
    printf("Z {b} %d %d\\n", kvq_turbo_nearest_index(THRESHOLDS_{b}BIT, {n - 1}, 0.0f),
           kvq_turbo_nearest_index(THRESHOLDS_{b}BIT, {n - 1}, -0.0f));""")
    src.write_text(f'#include <math.h>\n#include <stdint.h>\n#include <stdio.h>\n#include <string.h>\n'
                   f'#include "{header.name}"\nint main(void) {{\n    uint32_t u;{"".join(body)}\n    return 0;\n}}\n')
    exe = tmp_path / "main"
    subprocess.run([cc, "-std=c99", "-O2", "-Wall", "-Werror", "-o", str(exe), str(src), "-lm"], check=True,
                   cwd=tmp_path, capture_output=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    for b in (2, 3, 4):
        cb = lloyd_max(SphereMarginal(128), b)
        lv = [int(ln.split()[2], 16) for ln in lines if ln.startswith(f"L {b} ")]
        assert lv == cb.levels.astype(np.float32).view(np.uint32).tolist()
        rows = [ln.split()[2:] for ln in lines if ln.startswith(f"T {b} ")]
        assert [int(r[0], 16) for r in rows] == cb.thresholds.astype(np.float32).view(np.uint32).tolist()
        assert [(int(r[1]), int(r[2])) for r in rows] == [(i + 1, i) for i in range(len(rows))]
        assert f"Z {b} {1 << (b - 1)} {1 << (b - 1)}" in lines


@pytest.mark.parametrize("args, msg", [
    (["--format", "gguf"], "--format must be one of llama.cpp, got 'gguf'"),
    (["--format", "llama.cpp", "--bits", "0"], r"bits must be one or more integers in 1..8"),
    (["--format", "llama.cpp", "--bits", "4,9"], r"bits must be one or more integers in 1..8"),
    (["--format", "llama.cpp", "--bits", "x"], r"--bits: cannot parse 'x'"),
    (["--format", "llama.cpp", "--dim", "1"], "dim must be an integer >= 2"),
])
def test_export_refuses_bad_arguments(tmp_path, capsys, args, msg):
    assert main(["export", *args, "--out", str(tmp_path / "x.h")]) == 2
    assert re.search(msg, capsys.readouterr().err)
    assert not (tmp_path / "x.h").exists()


def test_export_refuses_a_folder(tmp_path, capsys):
    assert main(["export", "--format", "llama.cpp", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
