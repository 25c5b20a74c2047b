"""``kvq-codebooks export --format llama.cpp --apply-to``: the rewrite of a fork checkout, on the fork's files.

Reads the fork's table files from ``$KVQ_LLAMA_CPP_DIR`` (``.ci/run`` sets it to the interop
folder's ``fork-69d8e4be``; a real checkout works too) and skips without it. Every test works on
a copy. Checks:

* the rewritten CPU reference, compiled (``fork_harness``), writes the bytes of kvq_ref's TurboBlock
  profile ``fork@69d8e4be+exact`` on every golden input and on Gaussian and tie rows; the same
  harness on the unmodified file writes the golden bytes (so the harness is the fork's build);
* every definition of every backend file holds the exact values: float32 tables the float32
  rounding of the exact levels and midpoints, half tables their float16 rounding (read here with an
  independent parser: comments dropped by regex, literals rounded once from their decimal value);
* nothing else changed: with every floating literal blanked the files are identical, and the files
  the profile lists without definitions are byte-identical;
* a second run changes nothing; an edited, missing or extra definition is refused with a message
  naming the file, and no byte of the checkout changes; the ``--patch`` diff gives the same files.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from codebooks.cli import main
from codebooks.llama_cpp import ForkMismatch, load_fork_profiles, plan_rewrite
from kvq_ref.turbo_block import TurboBlock

from . import fork_harness as fh
from .golden_format import DATA

FORK = fh.fork_dir()
if FORK is None:
    pytest.skip(f"${fh.ENV} is unset: no llama.cpp TurboQuant fork files to rewrite (.ci/run sets it)",
                allow_module_level=True)
if not (FORK / fh.SOURCES[0]).is_file():
    pytest.fail(f"${fh.ENV}={FORK} holds no {fh.SOURCES[0]}", pytrace=False)

PROFILE = load_fork_profiles()["fork@69d8e4be"]
EXACT = {fmt: TurboBlock(fmt, profile="fork@69d8e4be+exact") for fmt in ("turbo2", "turbo3", "turbo4")}
GOLDEN = sorted((DATA / "llama-cpp-turboquant").glob("golden*.json"))  # bundled with the tests
LIT = re.compile(r"(?<![\w.])(-?)(\d+\.\d*|\.\d+)([fFhH]?)(?![\w.])")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(original copy, rewritten copy, plan) of the fork files."""
    base = tmp_path_factory.mktemp("fork")
    orig, new = base / "orig", base / "new"
    shutil.copytree(FORK, orig)
    shutil.copytree(FORK, new)
    assert main(["export", "--format", "llama.cpp", "--apply-to", str(new)]) == 0
    return orig, new


@pytest.fixture(scope="module")
def exes(trees, tmp_path_factory):
    if fh.compiler() is None:
        pytest.skip("no C compiler (gcc/cc) to build the fork's CPU reference")
    base = tmp_path_factory.mktemp("build")
    return fh.build(trees[0], base / "orig"), fh.build(trees[1], base / "new")


def _golden_rows():
    assert GOLDEN, f"no llama-cpp-turboquant golden files in {DATA}"
    cases = [c for p in GOLDEN for c in json.loads(p.read_text())["cases"]]
    rows = [np.frombuffer(base64.b64decode(c["input_f32_le"]), "<f4").reshape(-1, 128) for c in cases]
    return cases, np.concatenate(rows)


def test_harness_fp16_is_ieee(exes):
    """The harness's fp32 -> fp16 against numpy on normals, subnormals, ties, overflow, Inf and NaN."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    edge = np.array([0, 0x80000000, 0x477FEFFF, 0x477FF000, 0x7F800000, 0xFF800000, 0x33000000, 0x33000001,
                     0x387FE000, 0x38800000, 0x3F801000, 0x3F803000, 0x7FC00000, 0xFFC00000], np.uint32)
    x = np.concatenate([bits, edge]).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    want = np.where(nan, (want & 0x8000) | 0x7E00, want)  # ggml writes a NaN as the quiet NaN 0x7E00, sign kept
    np.testing.assert_array_equal(fh.to_fp16_bits(exes[0], x), want)


def test_harness_builds_the_golden_bytes_from_the_original(exes):
    cases, rows = _golden_rows()
    for bits in (2, 3, 4):
        want = b"".join(bytes.fromhex(c[f"turbo{bits}"]) for c in cases)
        assert fh.quantize(exes[0], bits, rows) == want, f"turbo{bits}: the harness is not the fork's golden build"


def _extra_rows():
    rng = np.random.default_rng(53)
    gauss = rng.standard_normal((1500, 128)).astype(np.float32)
    keys = (rng.standard_normal((500, 128)) * np.exp(rng.uniform(-1, 1, 128)) + rng.uniform(-2, 2, 128))
    return np.concatenate([gauss, keys.astype(np.float32)])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rewritten_cpu_reference_writes_profile_exact(exes, bits):
    """The rewritten fork's bytes are TurboBlock('fork@69d8e4be+exact')'s, on the golden inputs, 2,000
    Gaussian and key-like rows, and rows whose rotated coordinates sit exactly on the new thresholds."""
    _, golden = _golden_rows()
    tb = EXACT[f"turbo{bits}"]
    from kvq_ref.testing import tie_rows
    ties = tie_rows(tb, 200, seed=bits).astype(np.float32)
    rows = np.concatenate([golden, _extra_rows(), ties])
    got = fh.quantize(exes[1], bits, rows)
    want = tb.to_bytes(tb.encode(rows))
    if got != want:
        nb = tb.bytes_per_block
        bad = [i for i in range(rows.shape[0]) if got[i * nb:(i + 1) * nb] != want[i * nb:(i + 1) * nb]]
        pytest.fail(f"turbo{bits}: {len(bad)} of {rows.shape[0]} blocks differ from fork@69d8e4be+exact, first row {bad[0]}")
    # the rewritten dequantize is TurboBlock's decode_rotated (levels[idx] * norm, float32)
    deq = fh.dequantize(exes[1], bits, want)
    np.testing.assert_array_equal(deq, tb.decode_rotated(tb.from_bytes(want, rows.shape)))


def _nonfinite_rows():
    """Rows where the fork writes +Inf or NaN norms: overflow of the scale, of n^2, Inf and NaN inputs."""
    rng = np.random.default_rng(9)
    base = rng.standard_normal((6, 128)).astype(np.float32)
    rows = [base[0] * np.float32(8e4 / np.linalg.norm(base[0])), base[1] * np.float32(1e20),
            np.full(128, np.float32(3e38))]
    for v in np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFF800001],
                      np.uint32).view(np.float32):
        r = base[2].copy()
        r[int(rng.integers(128))] = v
        rows.append(r)
    r = base[3].copy()
    r[[3, 9]] = np.array([0xFFC00000, 0x7FC00000], np.uint32).view(np.float32)  # the first NaN's sign wins
    return np.stack(rows + [r, base[4]])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_nonfinite_blocks_match_the_fork(exes, bits):
    """overflow='fork' writes the fork's bytes (original and rewritten tables), and those blocks, read
    back, decode as the fork's dequantize_row_* bit for bit (+-Inf, NaN with its sign)."""
    rows = _nonfinite_rows()
    for exe, profile in zip(exes, ("fork@69d8e4be", "fork@69d8e4be+exact")):
        tb = TurboBlock(f"turbo{bits}", profile=profile, overflow="fork")
        got = fh.quantize(exe, bits, rows)
        assert tb.to_bytes(tb.encode(rows)) == got
        enc = TurboBlock(f"turbo{bits}", profile=profile).from_bytes(got, rows.shape)
        ours = TurboBlock(f"turbo{bits}", profile=profile).decode_rotated(enc)
        np.testing.assert_array_equal(ours.view(np.uint32), fh.dequantize(exe, bits, got).view(np.uint32))


def _f32(text: str) -> np.float32:
    from kvq_ref.turbo_profiles import parse_f32
    return parse_f32(text.rstrip("fFhH"))


def _f16(text: str) -> np.float16:
    x = Fraction(text.rstrip("fFhH"))
    f = np.float16(float(x))
    cands = [np.nextafter(f, np.float16(-1)), f, np.nextafter(f, np.float16(1))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint16)) & 1))


def test_every_definition_holds_the_exact_values(trees):
    """Parsed independently of codebooks.llama_cpp: each definition's literals, in order, are the exact
    float32 (or float16) values; half tables are the float16 rounding of the float64 levels."""
    _, new = trees
    f64 = {bits: EXACT[f"turbo{bits}"].codebook for bits in (2, 3, 4)}
    checked = 0
    for rel, (_, defs) in PROFILE.files.items():
        text = COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), (new / rel).read_text(encoding="utf-8"))
        for d in defs:
            starts = [m.start() for m in re.finditer(re.escape(d.anchor), text)]
            assert len(starts) == d.count, f"{rel}: {d.name}"
            for s in starts:
                body = text[s + len(d.anchor):text.index(d.end, s + len(d.anchor))]
                found = [m.group(0) for m in LIT.finditer(body)]
                cb = f64[d.bits]
                want64 = (cb.levels if d.values == "levels" else cb.thresholds)[d.select[0]:d.select[1]]
                if d.type == "float":
                    tb = EXACT[f"turbo{d.bits}"]
                    want = (tb.levels if d.values == "levels" else tb.thresholds)[d.select[0]:d.select[1]]
                    got = np.array([_f32(t) for t in found], np.float32)
                    assert np.array_equal(want, want64.astype(np.float32))
                else:
                    want = want64.astype(np.float16)
                    got = np.array([_f16(t) for t in found], np.float16)
                assert got.shape == want.shape and np.array_equal(got, want), f"{rel}: {d.name} holds {found}"
                checked += 1
    assert checked == sum(d.count for _, defs in PROFILE.files.values() for d in defs) == 35


def test_nothing_else_changed(trees):
    orig, new = trees
    a, b = _snapshot(orig), _snapshot(new)
    assert a.keys() == b.keys()
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {rel for rel, (_, defs) in PROFILE.files.items() if defs}  # 8 files; ggml-common.h stays
    for k in changed:
        blank = [LIT.sub("#", v.decode("utf-8")) for v in (a[k], b[k])]
        assert blank[0] == blank[1], f"{k}: something other than a floating literal changed"
        # and only literals inside the profile's definitions (the old values are gone, comments keep theirs)
    text = b["ggml/src/ggml-turbo-quant.c"].decode()
    assert "midpoint(-0.133, -0.040)" in text and "0.086728f" not in text


def test_second_run_changes_nothing(trees, capsys):
    _, new = trees
    before = _snapshot(new)
    plan = plan_rewrite(new)
    assert plan.files_changed == [] and len(plan.already) == 35
    assert main(["export", "--format", "llama.cpp", "--apply-to", str(new)]) == 0
    assert "nothing to change" in capsys.readouterr().out
    assert _snapshot(new) == before


def _copy(tmp_path) -> Path:
    dst = tmp_path / "fork"
    shutil.copytree(FORK, dst)
    return dst


@pytest.mark.parametrize("edit,message", [
    (("ggml/src/ggml-vulkan/vulkan-shaders/copy_to_quant.comp", "-0.145561,", "-0.145560,"),
     r"copy_to_quant.comp:\d+ TM4 \(turbo4 thresholds\) holds"),
    (("ggml/src/ggml-cuda/turbo-quant.cuh", "static __constant__ float TURBO_MID_2BIT[3]", "static __constant__ float MID2[3]"),
     r"turbo-quant.cuh: TURBO_MID_2BIT: .* occurs 0 time"),
    (("ggml/src/ggml-common.h", "#define QK_TURBO3 128", "#define QK_TURBO3 32"), r"ggml-common.h: lacks '#define QK_TURBO3 128'"),
    (("ggml/src/ggml-metal/ggml-metal.metal", "// Half-precision 4-bit centroid LUT for vec path",
      "constant float extra_mid[1] = { 0.086728f };"), r"ggml-metal.metal:\d+: 0.086728f .* outside the definitions"),
])
def test_a_file_that_does_not_match_is_refused_and_nothing_changes(tmp_path, capsys, edit, message):
    fork = _copy(tmp_path)
    rel, old, new = edit
    path = fork / rel
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1
    path.write_text(text.replace(old, new), encoding="utf-8")
    before = _snapshot(fork)
    assert main(["export", "--format", "llama.cpp", "--apply-to", str(fork)]) == 2
    err = capsys.readouterr().err
    assert "nothing was changed" in err and re.search(message, err), err
    assert _snapshot(fork) == before


def test_missing_file_and_unknown_table_elsewhere_are_refused(tmp_path):
    fork = _copy(tmp_path)
    (fork / "ggml/src/ggml-vulkan/vulkan-shaders/flash_attn_base.glsl").unlink()
    with pytest.raises(ForkMismatch, match="flash_attn_base.glsl: missing"):
        plan_rewrite(fork)
    fork = _copy(tmp_path / "b")
    extra = fork / "ggml/src/ggml-sycl/turbo.hpp"
    extra.parent.mkdir(parents=True)
    extra.write_text("// 0.190685 in a comment is fine\nstatic const float T3[2] = { -0.190685f, 0.190685f };\n")
    with pytest.raises(ForkMismatch, match=r"ggml-sycl/turbo.hpp:2: -0.190685f .* a file fork@69d8e4be does not list"):
        plan_rewrite(fork)
    extra.write_text("// only a comment: -0.190685f\n")
    assert len(plan_rewrite(fork).changed) == 35


def test_patch_gives_the_same_files(trees, tmp_path):
    _, new = trees
    fork = _copy(tmp_path)
    patch = tmp_path / "exact.patch"
    assert main(["export", "--format", "llama.cpp", "--apply-to", str(fork), "--patch", str(patch)]) == 0
    assert _snapshot(fork) == _snapshot(FORK)  # --patch writes only the diff
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot apply the patch")
    subprocess.run(["git", "apply", "-p1", str(patch)], cwd=fork, check=True, capture_output=True)
    assert _snapshot(fork) == _snapshot(new)


def test_only_some_widths(tmp_path):
    """--bits 4 rewrites the 4-bit definitions only; the others still have to match the revision."""
    fork = _copy(tmp_path)
    plan = plan_rewrite(fork, bits=(4,))
    assert plan.changed and all("4" in w.split(" ", 1)[1] for w in plan.changed)
    plan.apply()
    text = (fork / "ggml/src/ggml-turbo-quant.c").read_text()
    assert "-0.133462f" in text and "-0.173926f" not in text
