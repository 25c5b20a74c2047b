"""TurboBlock profile records: the shipped file, validation of bad data, a new revision as data."""

from __future__ import annotations

import copy
import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvq_ref.turbo_block import TurboBlock
from kvq_ref.turbo_profiles import (DEFAULT_PROFILE, PROFILES_FILE, BlockLayout, TurboProfile, get_profile,
                                    load_profiles, parse_f32, profile_names)

FORK = "fork@69d8e4be"


def _fork_record() -> dict:
    return copy.deepcopy(next(r for r in json.loads(PROFILES_FILE.read_text())["profiles"] if r["name"] == FORK))


def test_shipped_profiles():
    names = profile_names()
    assert names == (FORK, "fork@69d8e4be+exact", "kvq") and DEFAULT_PROFILE == FORK
    fork, exact, kvq = (get_profile(n) for n in names)
    assert fork.revision == "69d8e4be47243e83b3d0d71e932bc7aa61c644dc" and fork.date == "2026-05-04"
    # the exact profile is the fork's record with Lloyd-Max tables (its "base")
    assert exact.tables is None and fork.tables is not None
    for key in ("revision", "layouts", "signs", "arithmetic", "tie", "tiny_norm", "rotation_scale"):
        assert getattr(exact, key) == getattr(fork, key)
    assert fork.blocks == exact.blocks == (128,) and kvq.blocks == (32, 128)
    assert kvq.signs is None and kvq.arithmetic == "float64" and kvq.tie == "low"
    assert fork.tiny_norm == 1e-10 and fork.rotation_scale == float(np.float32(0.08838834764831845))
    assert fork.layout("turbo4", 128).fields == (("norm",), ("zero", 2), ("codes", 0, 4))
    assert [fork.layout(f, 128).nbytes for f in ("turbo2", "turbo3", "turbo4")] == [34, 50, 68]
    assert [kvq.layout(f, 32).nbytes for f in ("turbo2", "turbo3", "turbo4")] == [10, 14, 18]
    lv, th = fork.table(3)
    assert lv.dtype == np.float32 and lv[0] == np.float32(-0.190685) and th[3] == 0


@pytest.mark.parametrize("name", profile_names())
def test_records_round_trip(name):
    p = get_profile(name)
    again = TurboProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p and again.digest == p.digest and hash(again) == hash(p)


def test_parse_f32_rounds_once():
    """A decimal just above the midpoint of 1 and the next float32: one rounding gives the upper
    float32; rounding to float64 first lands on the midpoint and ties to even (1.0)."""
    mid = Fraction(1) + Fraction(1, 2**24)
    text = f"{float(mid):.30f}" + "1"
    assert Fraction(text) > mid and np.float32(float(text)) == np.float32(1)
    assert parse_f32(text) == np.nextafter(np.float32(1), np.float32(2))
    assert parse_f32(f"{float(mid):.30f}") == np.float32(1)  # the tie itself: to even


@given(st.floats(-1e3, 1e3, allow_nan=False).map(lambda v: f"{v:.12g}"))
def test_parse_f32_is_the_nearest_float32(text):
    f = parse_f32(text)
    exact = Fraction(text)
    for other in (np.nextafter(f, np.float32(-np.inf)), np.nextafter(f, np.float32(np.inf))):
        assert abs(Fraction(float(f)) - exact) <= abs(Fraction(float(other)) - exact)


BAD = [  # (change to the fork's record, message)
    (lambda r: r["signs"]["signs1"].pop(), r"signs1 and signs2 must be 128 values"),
    (lambda r: r["signs"]["signs2"].__setitem__(3, 0), r"signs2 must be a list of \+1/-1"),
    (lambda r: r.__setitem__("signs", "random"), "signs must be 'seeded' or"),
    (lambda r: r["tables"]["3"]["levels"].reverse(), "3-bit table must have increasing levels"),
    (lambda r: r["tables"]["2"]["thresholds"].__setitem__(0, "-0.2"), "2-bit table must have increasing levels"),
    (lambda r: r["tables"]["4"]["levels"].pop(), "4-bit table needs 16 levels and 15 thresholds, got 15"),
    (lambda r: r["tables"]["2"]["levels"].__setitem__(0, -0.133462), r"must be a decimal string .* got -0.133462"),
    (lambda r: r["tables"]["2"]["levels"].__setitem__(0, "abc"), "'abc' is not a decimal number"),
    (lambda r: r["tables"]["2"]["levels"].__setitem__(0, "-1e60"), "is not finite in float32"),
    (lambda r: r["tables"].pop("4"), r"tables must give bit widths \[2, 3, 4\], got \[2, 3\]"),
    (lambda r: r.pop("tie"), r"missing fields \['tie'\]"),
    (lambda r: r.__setitem__("rounding", "x"), r"unknown fields \['rounding'\]"),
    (lambda r: r.__setitem__("arithmetic", "float16"), "arithmetic must be 'float32' or 'float64'"),
    (lambda r: r.__setitem__("tie", "middle"), "tie must be 'high' or 'low'"),
    (lambda r: r.__setitem__("tiny_norm", "-1"), "tiny_norm must be a finite float >= 0"),
    (lambda r: r.__setitem__("arithmetic", "float64"), "float64 arithmetic is quantize_rotated's rule"),
    (lambda r: r.__setitem__("rotation_scale", "0.0884"), r"rotation_scale .* is not 1/sqrt\(128\)"),
    (lambda r: r.__setitem__("rotation_scale", None), "float32 arithmetic needs rotation_scale"),
    (lambda r: r["layouts"]["128"]["turbo2"].append(["norm"]), r"turbo2 layout of 128 values: needs exactly one \['norm'\]"),
    (lambda r: r["layouts"]["128"]["turbo3"].pop(), r"must cover index bits 0..2 exactly once, they cover \[0, 1\]"),
    (lambda r: r["layouts"]["128"]["turbo4"].append(["codes", 3, 1]), r"exactly once, they cover \[0, 1, 2, 3, 3\]"),
    (lambda r: r["layouts"]["128"]["turbo2"].__setitem__(1, ["codes", 0, 3]), r"bad field \['codes', 0, 3\]"),
    (lambda r: r["layouts"]["128"]["turbo4"].__setitem__(1, ["zero", 0]), r"bad field \['zero', 0\]"),
    (lambda r: r["layouts"]["128"].__setitem__("turbo5", [["norm"]]), "layout format must be one of"),
    (lambda r: r["layouts"].__setitem__("96", r["layouts"]["128"]), "layout block must be a power of two"),
    (lambda r: r["layouts"].__setitem__("64", r["layouts"]["128"]), "explicit signs fit one block size"),
    (lambda r: r.__setitem__("layouts", {}), "layouts must be a non-empty object"),
    (lambda r: r.__setitem__("name", ""), "turbo profile name must be a non-empty string"),
    (lambda r: r.__setitem__("base", "nope"), "base 'nope' is not an earlier record"),
]


@pytest.mark.parametrize("change, msg", BAD, ids=[m for _, m in BAD])
def test_bad_records_are_refused_with_the_field_named(change, msg):
    record = _fork_record()
    change(record)
    with pytest.raises(ValueError, match=msg):
        TurboProfile.from_dict(record)


def test_bad_files_are_refused(tmp_path):
    f = tmp_path / "p.json"
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_profiles(f)
    f.write_text(json.dumps({"schema": 2, "profiles": []}))
    with pytest.raises(ValueError, match=r"expected \{'schema': 1"):
        load_profiles(f)
    f.write_text(json.dumps({"schema": 1, "profiles": [_fork_record(), _fork_record()]}))
    with pytest.raises(ValueError, match="'fork@69d8e4be' is defined twice"):
        load_profiles(f)
    with pytest.raises(ValueError, match="not readable JSON"):
        load_profiles(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="BlockLayout"):
        TurboProfile(**{**get_profile(FORK).__dict__, "layouts": (("turbo2", 128),)})
    with pytest.raises(ValueError, match="format must be one of"):
        BlockLayout("turbo9", 128, (("norm",),))


def test_a_new_revision_is_data(tmp_path):
    """The fork's PR #197 dropped turbo4's zero field (66 B, 4.125 bits per value): a record on top
    of 69d8e4be with that layout (keeping the old table here) writes the same indices and norm, two
    bytes shorter, with no code change."""
    later = {"name": "fork@pr197-layout", "base": FORK, "revision": "pr197 (layout only, for this test)",
             "layouts": {"128": {**_fork_record()["layouts"]["128"], "turbo4": [["norm"], ["codes", 0, 4]]}}}
    f = tmp_path / "profiles.json"
    f.write_text(json.dumps({"schema": 1, "profiles": [_fork_record(), later]}))
    prof = load_profiles(f)["fork@pr197-layout"]
    new, old = TurboBlock("turbo4", profile=prof), TurboBlock("turbo4")
    x = np.random.default_rng(0).standard_normal((5, 128))
    enc = new.encode(x)
    assert new.bytes_per_block == 66 and enc.bits_per_element == 4.125
    ob = old.encode(x).arrays["blocks"]
    assert np.array_equal(enc.arrays["blocks"], np.concatenate([ob[:, :2], ob[:, 4:]], axis=1))
    assert np.array_equal(new.decode(enc), old.decode(old.encode(x)))
    assert enc.config["profile"] == f"sha256:{prof.digest}"
    with pytest.raises(ValueError, match="config"):
        old.decode(enc)
    assert TurboBlock("turbo3", profile=prof).encode(x) != TurboBlock("turbo3").encode(x)  # configs differ
    assert np.array_equal(TurboBlock("turbo3", profile=prof).encode(x).arrays["blocks"],
                          TurboBlock("turbo3").encode(x).arrays["blocks"])


def test_the_exported_header_is_the_exact_profile(tmp_path):
    """`kvq-codebooks export --format llama.cpp` writes the tables profile fork@69d8e4be+exact uses:
    a fork build with that header writes this profile's bytes."""
    from codebooks.cli import main
    from tests.codebooks.test_export import parse_header

    out = tmp_path / "turbo_tables.h"
    assert main(["export", "--format", "llama.cpp", "--bits", "2,3,4", "--out", str(out)]) == 0
    tables = parse_header(out.read_text())
    for fmt, bits in (("turbo2", 2), ("turbo3", 3), ("turbo4", 4)):
        tb = TurboBlock(fmt, profile="fork@69d8e4be+exact")
        assert np.array_equal([parse_f32(v) for v in tables[bits]["CENTROIDS"]], tb.levels)
        assert np.array_equal([parse_f32(v) for v in tables[bits]["THRESHOLDS"]], tb.thresholds)
