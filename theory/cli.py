"""``kvq-theory``: write bound and curve JSON files, and plot them.

Examples
--------
::

    kvq-theory curves --dim 128 --bits 1-12 --out results/theory
    kvq-theory curves --dim 128 --bits 1-8 --out results/theory --audit mytable=levels.npy
    kvq-theory plot results/theory/*.json -o results/theory/rd.png
"""

from __future__ import annotations

import argparse
import sys
import time

from codebooks import SphereMarginal
from codebooks._atomic import check_output_file, check_output_folder
from codebooks._validate import check_int
from codebooks.build import parse_int_list, read_levels

from .figures import audit_series, default_series
from .plot import PLOT_SUFFIXES, plot_files
from .results import ResultsError


def _cmd_curves(args) -> int:
    out = check_output_folder(args.out, "--out", lambda f: True)  # series files are added, nothing removed
    bits = parse_int_list(args.bits, "--bits", 1, 12)
    check_int("--dim", args.dim, 2, 2**20)
    check_int("--mc-samples", args.mc_samples, 100)
    audits = []
    for spec in args.audit or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--audit expects NAME=FILE, got {spec!r}")
        audits.append((name, path, read_levels(path, "--audit")))
    t0 = time.perf_counter()
    series = default_series(args.dim, bits, mc_samples=args.mc_samples, seed=args.seed)
    for name, path, levels in audits:
        series.append(audit_series(name, SphereMarginal(args.dim), levels, f"external table {path}, audited exactly"))
    for s in series:
        s.save(out)
    print(f"wrote {len(series)} series to {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_plot(args) -> int:
    out = check_output_file(args.output, "-o", PLOT_SUFFIXES)
    path = plot_files(args.files, out)
    print(f"wrote {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq-theory", description="Rate-distortion bounds, curves and plots.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("curves", help="write bound and curve JSON files")
    c.add_argument("--dim", type=int, default=128, help="dimension of the rotated unit vectors (default 128)")
    c.add_argument("--bits", default="1-12", help="bit widths, e.g. 1-12 (default)")
    c.add_argument("--out", required=True, help="output folder")
    c.add_argument("--audit", action="append", metavar="NAME=FILE",
                   help="add an external table (.npy/.json/.txt levels for SphereMarginal(dim)) as a point")
    c.add_argument("--mc-samples", type=int, default=20000, help="Monte Carlo vectors per bit width")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=_cmd_curves)
    q = sub.add_parser("plot", help="draw the figure from JSON files only")
    q.add_argument("files", nargs="+", help="series JSON files")
    q.add_argument("-o", "--output", required=True, help="PNG path (ending in .png)")
    q.set_defaults(func=_cmd_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, ResultsError, OSError) as exc:
        print(f"kvq-theory {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
