"""Golden tests: TurboBlock against the llama.cpp TurboQuant fork's CPU reference.

Reads ``tests/interop/data/llama-cpp-turboquant/facts.json``, the ``golden*.json`` beside it and
those of ``$KVQ_INTEROP_DIR/llama-cpp-turboquant/`` (same revision, same facts), made by running the
fork's compiled ``quantize_row_turbo{2,3,4}_0_ref``. Checks:

* the shipped profile of the golden file's commit is exactly what facts.json states (signs,
  float32 tables, layout sizes, the 1e-10 limit, the float32 1/sqrt(128));
* every row of every golden file, every format: our bytes are the fork's bytes;
* the fork's bytes decode (rotated domain: bit-exact with the facts' dequantize rule computed here
  from the facts alone; original domain: bit-exact with the facts' inverse rule, written here as
  plain loops);
* what the rules imply on the golden inputs: zero and tiny rows, the norm identity, overflow.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from kvq_ref.turbo_block import TurboBlock
from kvq_ref.turbo_profiles import get_profile, parse_f32, profile_names

from .golden_format import DATA, file_label, golden_files

FOLDER = DATA / "llama-cpp-turboquant"  # the bundled set: the fork at 69d8e4be
FMTS = {"turbo2": 2, "turbo3": 3, "turbo4": 4}


# --- loading golden data: this set's inputs are bare base64 strings of little-endian float32 (not
# the {dtype, shape, b64} arrays of golden_format), blocks are hex strings ------------------------
def f32_le(b64: str) -> np.ndarray:
    """A base64 string of little-endian float32 values as a float32 array."""
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").astype(np.float32)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


FACTS = _json(FOLDER / "facts.json")
GOLDEN_FILES = golden_files("llama-cpp-turboquant")


def _commit(source: str) -> str:
    """The commit of a ``owner/repo@commit ...`` source string."""
    return source.split("@", 1)[1].split()[0]


def _profile_for(commit: str):
    """The shipped fork profile that reproduces ``commit`` (the default profile's layout and rules)."""
    for name in profile_names():
        prof = get_profile(name)
        if prof.tables is not None and (prof.revision.startswith(commit) or commit.startswith(prof.revision)):
            return prof
    pytest.fail(f"no TurboBlock profile reproduces fork revision {commit}: add a record to "
                "kvq_ref/data/turbo_profiles.json")


@pytest.fixture(scope="module", params=GOLDEN_FILES, ids=[file_label(p) for p in GOLDEN_FILES])
def golden(request):
    beside = request.param.parent / "facts.json"
    if beside.is_file() and _json(beside) != FACTS:
        pytest.fail(f"{beside} differs from the bundled facts: these tests decode with the 69d8e4be facts only")
    doc = _json(request.param)
    assert doc["cases"], f"{request.param} has no cases"
    prof = _profile_for(_commit(doc["source"]))
    rows = [f32_le(c["input_f32_le"]).reshape(-1, 128) for c in doc["cases"]]
    for c, x in zip(doc["cases"], rows):
        assert x.size == c["k"], f"{request.param}: a case's input has {x.size} values, k = {c['k']}"
    return doc, prof, rows


def test_golden_files_exist():
    assert GOLDEN_FILES, f"{FOLDER} has facts.json but no golden*.json"


def test_profile_is_the_facts():
    """The default profile holds exactly the facts: commit, signs, float32 tables, block sizes."""
    prof = _profile_for(_commit(FACTS["source"]))
    assert prof.name == "fork@69d8e4be" and _commit(FACTS["source"]) == prof.revision
    assert prof.signs == (tuple(FACTS["signs1"]), tuple(FACTS["signs2"]))
    for bits in (2, 3, 4):
        levels, thresholds = prof.table(bits)
        assert np.array_equal(levels, [parse_f32(v) for v in FACTS["levels_f32"][str(bits)]])
        assert np.array_equal(thresholds, [parse_f32(v) for v in FACTS["thresholds_f32"][str(bits)]])
    assert FACTS["block"]["values"] == 128 and prof.blocks == (128,)
    for fmt in FMTS:
        assert prof.layout(fmt, 128).nbytes == FACTS["block"][fmt]["bytes"]
    assert prof.tie == "high" and prof.arithmetic == "float32"
    assert np.float32(prof.tiny_norm) == np.float32(1e-10)
    assert np.float32(prof.rotation_scale) == np.float32(0.08838834764831845)


@pytest.mark.parametrize("fmt", FMTS)
def test_every_golden_row_is_byte_identical(golden, fmt):
    doc, prof, rows = golden
    tb = TurboBlock(fmt, profile=prof)
    ours = tb.encode(np.concatenate(rows)).arrays["blocks"]  # one call; rows are independent
    nb = tb.bytes_per_block
    bad, start = [], 0
    for i, (case, x) in enumerate(zip(doc["cases"], rows)):
        got = ours[start:start + x.shape[0]].tobytes()
        start += x.shape[0]
        if got != bytes.fromhex(case[fmt]):
            want = bytes.fromhex(case[fmt])
            first = next((j for j in range(min(len(got), len(want))) if got[j] != want[j]), None)
            bad.append(f"case {i} ({case['family']}, k={case['k']}): first differing byte {first} of block "
                       f"{None if first is None else first // nb}")
    assert not bad, f"{len(bad)} of {len(rows)} {fmt} rows differ from the fork: " + "; ".join(bad[:5])


def _hand_unpack(raw: bytes, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Indices and fp16 norms of the fork's blocks from the facts' field descriptions (bit by bit)."""
    nb = FACTS["block"][fmt]["bytes"]
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, nb)
    norms = blocks[:, :2].copy().view("<f2")[:, 0]
    j = np.arange(128)
    if fmt == "turbo4":
        idx = (blocks[:, 4 + j // 2] >> (4 * (j % 2))) & 15
    else:
        idx = (blocks[:, 2 + j // 4] >> (2 * (j % 4))) & 3
        if fmt == "turbo3":
            idx = idx | (((blocks[:, 34 + j // 8] >> (j % 8)) & 1) << 2)
    return idx.astype(np.int64), norms


def _inverse_rule_loops(y: np.ndarray) -> np.ndarray:
    """The facts' original-domain rule, as written there, in float32: y_j *= signs2[j]; butterflies
    h = 1..64 over pairs (j, j + h); y_j *= (0.08838834764831845f * signs1[j])."""
    y = y.astype(np.float32) * np.array(FACTS["signs2"], np.float32)
    h = 1
    while h < 128:
        for i in range(0, 128, 2 * h):
            for j in range(i, i + h):
                a, b = y[:, j].copy(), y[:, j + h].copy()
                y[:, j], y[:, j + h] = a + b, a - b
        h *= 2
    return y * (np.float32(0.08838834764831845) * np.array(FACTS["signs1"], np.float32))


@pytest.mark.parametrize("fmt", FMTS)
def test_fork_bytes_decode_in_both_domains(golden, fmt):
    doc, prof, rows = golden
    tb = TurboBlock(fmt, profile=prof)
    raw = b"".join(bytes.fromhex(c[fmt]) for c in doc["cases"])
    n = sum(x.shape[0] for x in rows)
    enc = tb.from_bytes(raw, (n, 128))
    idx, norms = _hand_unpack(raw, fmt)
    levels = np.array([parse_f32(v) for v in FACTS["levels_f32"][str(FMTS[fmt])]], np.float32)
    rotated = levels[idx] * norms.astype(np.float32)[:, None]  # the fork's dequantize_row_*: float32 product
    assert np.array_equal(tb.decode_rotated(enc), rotated)
    assert np.array_equal(tb.decode(enc), _inverse_rule_loops(rotated))
    # norm correction: ||x_hat|| = ||x|| to fp16 rounding (2^-11) plus float32 sums (< 2e-5), where
    # the norm is normal in fp16 and the input is not below the 1e-10 limit
    x = np.concatenate(rows).astype(np.float64)
    nx, nh = np.linalg.norm(x, axis=1), np.linalg.norm(tb.decode(enc).astype(np.float64), axis=1)
    ok = (nx > 1e-10) & (norms >= 2**-14)
    assert ok.sum() > n // 2  # 546 of the 733 blocks here; the rest are zero, tiny or one-hot zero blocks
    assert np.all(np.abs(nh[ok] - nx[ok]) <= nx[ok] * (2**-11 + 2e-5))


def test_zero_and_tiny_rows(golden):
    """Rows with norm <= 1e-10 (zeros, tiny): every index is 2^(b-1) (u = 0, and 0 < 0 is false)
    and the stored norm is +0 (n / ||c|| underflows fp16)."""
    doc, prof, rows = golden
    seen = 0
    for case, x in zip(doc["cases"], rows):
        small = np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=1)) <= 1e-10
        for fmt, bits in FMTS.items():
            idx, norms = _hand_unpack(bytes.fromhex(case[fmt]), fmt)
            assert np.all(idx[small] == 2 ** (bits - 1)) and np.all(norms[small].view(np.uint16) == 0)
        seen += int(small.sum())
    assert seen > 0, "the golden set has no zero or tiny rows"


def test_overflow_where_the_fork_writes_inf(golden):
    """Scaling the largest golden row until n / ||c|| passes 65504: the fork's rule stores 0x7C00
    (+Inf) with the row's codes. encode raises by default and writes it with overflow="fork"; a
    block holding 0x7C00 is read and decodes as the fork's dequantize does (+-Inf)."""
    doc, prof, rows = golden
    x = max(rows, key=lambda r: float(np.max(np.linalg.norm(r.astype(np.float64), axis=1))))
    big = x * np.float32(8e4 / np.max(np.linalg.norm(x.astype(np.float64), axis=1)))
    for fmt in FMTS:
        tb = TurboBlock(fmt, profile=prof)
        with pytest.raises(ValueError, match="overflows float16"):
            tb.encode(big)
        enc = TurboBlock(fmt, profile=prof, overflow="fork").encode(big)
        idx, norms = tb.unpack(enc.arrays["blocks"].reshape(-1, tb.bytes_per_block))
        over = np.isinf(norms)
        assert over.any() and np.all(norms[over].view(np.uint16) == 0x7C00)
        raw = bytearray(tb.to_bytes(tb.encode(x)))
        raw[0:2] = b"\x00\x7c"
        enc = tb.from_bytes(bytes(raw), x.shape)
        want = tb.levels[tb.unpack(enc.arrays["blocks"].reshape(-1, tb.bytes_per_block))[0][0]] * np.float32(np.inf)
        assert np.array_equal(tb.decode_rotated(enc).reshape(-1, 128)[0], want)
