"""``kvq-codebooks``: build table sets, audit external tables, show a set.

Examples
--------
kvq-codebooks build --default --out out/tables
kvq-codebooks build --dist sphere --dim 64,128 --bits 1-8 --out DIR
kvq-codebooks build --dist polar --level 1-4 --bits 1-4 --out DIR
kvq-codebooks audit --dist sphere --dim 128 --levels=-0.133,-0.04,0.04,0.133
kvq-codebooks show DIR
kvq-codebooks calibrate --qkv captured.safetensors --out calib/
kvq-codebooks export --format llama.cpp --bits 2,3,4 --out turbo_tables.h
kvq-codebooks export --format llama.cpp --apply-to ~/llama-cpp-turboquant [--patch exact.patch]
kvq-codebooks golden --method kivi --out DIR      (added by kvq_ref, see PLUGIN_GROUP)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ._atomic import check_output_file, check_output_folder, read_file, write_file
from ._validate import MAX_BITS, check_int
from ._version import __version__
from .artifacts import MANIFEST, TENSORS, holds_only
from .audit import audit
from .build import build, default_densities, parse_float_list, parse_int_list, read_levels
from .densities import MAX_POLAR_LEVEL, Density, Gaussian, PolarAngle, SphereMarginal
from .tables import HEADER, TableFileError, load_tables, save_tables

#: Entry-point group through which installed packages add subcommands: ``name = "module:function"`` with
#: ``function(argv: list[str]) -> int`` (kvq_ref registers ``golden`` in pyproject.toml). codebooks only
#: reads the group's names and loads an entry when its command runs, so it never names kvq_ref, theory or
#: gpu: the data flow stays one way (density -> ... -> kvq_ref), as the layering test checks.
PLUGIN_GROUP = "kvq_codebooks.commands"


def _densities(args, allow_many: bool = True) -> list[Density]:
    if not args.dist:
        raise ValueError("--dist is required (sphere, gaussian or polar)")
    out: list[Density] = []
    for dist in [s.strip() for s in args.dist.split(",")]:
        if dist == "sphere":
            if args.dim is None:
                raise ValueError("--dist sphere needs --dim (e.g. --dim 64,128)")
            out += [SphereMarginal(d) for d in parse_int_list(args.dim, "--dim", 2, 2**20)]
        elif dist == "gaussian":
            out += [Gaussian(s) for s in parse_float_list(args.sigma, "--sigma")]
        elif dist == "polar":
            if args.level is None:
                raise ValueError("--dist polar needs --level (e.g. --level 1-4)")
            out += [PolarAngle(level) for level in parse_int_list(args.level, "--level", 1, MAX_POLAR_LEVEL)]
        else:
            raise ValueError(f"--dist must be sphere, gaussian or polar, got {dist!r}")
    if not allow_many and len(out) != 1:
        raise ValueError(f"audit needs exactly one density, got {len(out)}")
    return out


def _cmd_build(args) -> int:
    check_output_folder(args.out, "--out", lambda f: holds_only(f, (MANIFEST, TENSORS, HEADER)))
    if args.default:
        jobs = default_densities()
    else:
        bits = parse_int_list(args.bits, "--bits", 1, MAX_BITS)
        jobs = [(d, bits) for d in _densities(args)]
    t0 = time.perf_counter()
    cbs = build(jobs, progress=None if not args.quiet else False, exact=not args.fast)
    elapsed = time.perf_counter() - t0
    folder = save_tables(cbs, args.out)
    print(f"wrote {len(cbs)} codebooks to {folder} in {elapsed:.2f} s "
          f"(max residual {max(cb.residual for cb in cbs):.1e})")
    return 0


def _cmd_audit(args) -> int:
    (density,) = _densities(args, allow_many=False)
    levels = read_levels(args.levels)
    thresholds = read_levels(args.thresholds) if args.thresholds else None
    report = audit(density, levels, thresholds)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.summary())
    return 0


def _cmd_show(args) -> int:
    tables = load_tables(args.folder)
    print(f"{tables.folder}: {len(tables)} codebooks, schema {tables.schema_version}, {tables.generator}")
    if args.brief:
        by_density: dict[str, list] = {}
        for cb in tables.values():
            by_density.setdefault(repr(cb.density), []).append(cb)
        for name, cbs in by_density.items():
            bits = [cb.bits for cb in cbs]
            unit = [cb.unit_distortion for cb in cbs if cb.unit_distortion is not None]
            tail = f"  d*mse at {bits[-1]} bits: {unit[-1]:.4g}" if unit else ""
            print(f"  {name:32s} bits {min(bits)}-{max(bits)}{tail}")
        return 0
    print(f"  {'name':24s} {'bits':>4s} {'mse':>14s} {'d*mse':>12s} {'iters':>5s} {'residual':>9s}")
    for cb in tables.values():
        ud = f"{cb.unit_distortion:12.6g}" if cb.unit_distortion is not None else f"{'':12s}"
        print(f"  {cb.name:24s} {cb.bits:4d} {cb.mse:14.8g} {ud} {cb.iterations:5d} {cb.residual:9.1e}")
    return 0


def _cmd_export(args) -> int:
    from .export import FORMATS, llama_cpp_codebooks, render_llama_cpp_header

    if args.format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {args.format!r}")
    bits = parse_int_list(args.bits, "--bits")
    if (args.out is None) == (args.apply_to is None):
        raise ValueError("give exactly one of --out FILE (write a header) and --apply-to FORK_DIR (rewrite a checkout)")
    if args.apply_to is not None:
        return _apply_to_fork(args, bits)
    if args.patch is not None or args.fork_profile is not None:
        raise ValueError("--patch and --fork-profile go with --apply-to FORK_DIR")
    cbs = llama_cpp_codebooks(bits, args.dim)
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give the header's file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(render_llama_cpp_header(cbs, args.dim))
    print(f"wrote {out}: CENTROIDS/THRESHOLDS_<b>BIT of SphereMarginal({args.dim}) at bits "
          f"{', '.join(map(str, bits))} (float32, llama.cpp TurboQuant form)")
    return 0


def _apply_to_fork(args, bits: list[int]) -> int:
    """``export --format llama.cpp --apply-to FORK_DIR [--patch FILE]``: codebooks.llama_cpp."""
    from .llama_cpp import plan_rewrite

    if args.dim != 128:
        raise ValueError(f"--dim: a fork rewrite uses the profile's dimension (128), got {args.dim}")
    patch = None if args.patch is None else check_output_file(args.patch, "--patch")
    plan = plan_rewrite(args.apply_to, bits, args.fork_profile)  # ForkMismatch (a ValueError): nothing written
    prof = plan.profile
    what = f"{len(plan.changed)} definition(s) in {len(plan.files_changed)} file(s)"
    if not plan.files_changed:
        print(f"{args.apply_to} ({prof.name}): nothing to change, its {len(plan.already)} turbo table definition(s) "
              "already hold the exact values")
        return 0
    if patch is not None:
        write_file(patch, plan.patch().encode("utf-8"))
        print(f"wrote {patch}: the rewrite of {what} of {args.apply_to} ({prof.name}) as a unified diff "
              "(apply with `git apply` or `patch -p1` in the checkout)")
    else:
        plan.apply()
        print(f"rewrote {what} of {args.apply_to} ({prof.name}): turbo tables at bits {', '.join(map(str, bits))} "
              f"now hold the exact Lloyd-Max levels of SphereMarginal({prof.dim}) and their midpoints")
    for where in plan.changed:
        print(f"  {where}")
    if plan.already:
        print(f"  already exact, left as they are: {len(plan.already)} definition(s)")
    return 0


def read_qkv(path) -> tuple[list[dict], int]:
    """Captured attention inputs from a safetensors file.

    Tensors ``layer{L}.q`` (Hq, T, d) and ``layer{L}.k``, ``layer{L}.v`` (Hkv, T, d), or with a
    leading sequence axis (S, ..., T, d) for several calibration sequences.

    Returns
    -------
    (sequences, d) : list of {layer: (q, k, v)}, head dimension
    """
    import re

    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        read_file(path, 0)  # a regular file? (FIFOs, directories, missing files named as such)
    except ValueError as exc:
        if "more than the 0 allowed" not in str(exc):
            raise ValueError(f"--qkv {exc}") from None
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--qkv {path}: not a readable safetensors file of float arrays ({exc!r})") from None
    layers = sorted({int(m.group(1)) for k in tensors if (m := re.fullmatch(r"layer(\d+)\.[qkv]", k))})
    if not layers:
        raise ValueError(f"--qkv {path}: no tensors named layer<L>.q/.k/.v")
    seqs: list[dict] = []
    d = None
    for layer in layers:
        try:
            q, k, v = (tensors[f"layer{layer}.{x}"] for x in "qkv")
        except KeyError as exc:
            raise ValueError(f"--qkv {path}: layer {layer} lacks tensor {exc}") from None
        if q.ndim == 3:
            q, k, v = q[None], k[None], v[None]
        if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[0] != k.shape[0] \
                or q.shape[2:] != k.shape[2:]:
            raise ValueError(f"--qkv {path}: layer {layer} has shapes q {q.shape}, k {k.shape}, v {v.shape}; "
                             "expected ([S,] Hq, T, d) and ([S,] Hkv, T, d)")
        d = q.shape[-1] if d is None else d
        if q.shape[-1] != d:
            raise ValueError(f"--qkv {path}: layer {layer} has head dimension {q.shape[-1]}, others {d}")
        while len(seqs) < q.shape[0]:
            seqs.append({})
        for i in range(q.shape[0]):
            seqs[i][layer] = (q[i], k[i], v[i])
    return seqs, d


def _cmd_calibrate(args) -> int:
    from .nova import calibrate

    out = check_output_folder(args.out, "--out", lambda f: True)  # only its two subfolders are replaced
    for sub in ("nova_kv", "calibration"):
        check_output_folder(out / sub, "--out", lambda f: holds_only(f, (MANIFEST, TENSORS)))
    check_int("--group", args.group, 1, 8)
    check_int("--bits", args.bits, 1, 8)
    check_int("--iterations", args.iterations, 0, 10**6)
    check_int("--max-train-tokens", args.max_train_tokens, 1)
    check_int("--seed", args.seed, 0, 2**63 - 1)
    seqs, d = read_qkv(args.qkv)
    t0 = time.perf_counter()
    stats, model = calibrate(seqs, d, g=args.group, bits=args.bits, iterations=args.iterations, seed=args.seed,
                             grouping=args.grouping, max_train_tokens=args.max_train_tokens)
    model.save(out / "nova_kv")
    stats.save(out / "calibration")
    floored = sum(hd.key.n_floored for hd in model.heads.values())
    print(f"calibrated {len(model.heads)} heads (d={d}, g={args.group}, {args.bits} bits) from {len(seqs)} "
          f"sequence(s) in {time.perf_counter() - t0:.1f} s; {floored} query eigenvalues floored; "
          f"wrote {out / 'nova_kv'} and {out / 'calibration'}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq-codebooks", description="Exact Lloyd-Max codebooks and table files.")
    p.add_argument("--version", action="version", version=f"kvq-codebooks {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def density_args(sp):
        sp.add_argument("--dist", help="sphere, gaussian or polar (comma-separated for several)")
        sp.add_argument("--dim", help="sphere dimensions, e.g. 64,128 or 16-32")
        sp.add_argument("--sigma", default="1.0", help="gaussian standard deviations (default 1.0)")
        sp.add_argument("--level", help="polar angle levels, e.g. 1-4")

    b = sub.add_parser("build", help="solve tables and write a table set")
    density_args(b)
    b.add_argument("--bits", default="1-8", help="bit widths, e.g. 1-8 (default) or 2,3,4")
    b.add_argument("--default", action="store_true", help="the default set (sphere dims, gaussian, polar)")
    b.add_argument("--out", required=True, help="output folder")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--fast", action="store_true",
                   help="skip the 50-digit refinement: float64 levels whose last bits depend on the platform "
                        "(default: the exact optimum correctly rounded, the same bytes everywhere)")
    b.set_defaults(func=_cmd_build)

    a = sub.add_parser("audit", help="exact excess distortion of a table from elsewhere")
    density_args(a)
    a.add_argument("--levels", required=True, help="file (.npy/.json/.txt) or a list; write --levels=-1.5,-0.5,0.5,1.5 when it starts with '-'")
    a.add_argument("--thresholds", help="the table's own thresholds (default: midpoints)")
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    a.set_defaults(func=_cmd_audit)

    c = sub.add_parser("calibrate", help="NOVA-KV/OSCAR transforms, groupings and VQ tables from captured Q/K/V")
    c.add_argument("--qkv", required=True, help="safetensors with layer<L>.q/.k/.v tensors")
    c.add_argument("--out", required=True, help="output folder (gets nova_kv/ and calibration/)")
    c.add_argument("--group", type=int, default=4, help="coefficients per VQ group (default 4)")
    c.add_argument("--bits", type=int, default=2, help="bits per coefficient (default 2)")
    c.add_argument("--iterations", type=int, default=25, help="k-means iterations (default 25)")
    c.add_argument("--grouping", default="round_robin",
                   help="round_robin (default, NOVA-KV's release) | consecutive | greedy | swap")
    c.add_argument("--max-train-tokens", type=int, default=32768, help="tokens per head for k-means")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=_cmd_calibrate)

    e = sub.add_parser("export", help="write exact tables in another project's source form (a C header)")
    e.add_argument("--format", required=True, help="llama.cpp: the TurboQuant fork's CENTROIDS_<b>BIT tables")
    e.add_argument("--bits", default="2,3,4", help="bit widths in 1..8 (default 2,3,4: turbo2/3/4)")
    e.add_argument("--dim", type=int, default=128, help="SphereMarginal dimension (default 128, the fork's group)")
    e.add_argument("--out", help="output file (.h): a header with the tables (not drop-in for the fork)")
    e.add_argument("--apply-to", metavar="FORK_DIR",
                   help="rewrite every turbo table and threshold of this llama.cpp TurboQuant fork checkout in "
                        "place (refused, nothing changed, unless its files match a known revision: "
                        "codebooks/data/llama_cpp/forks.json)")
    e.add_argument("--patch", metavar="FILE", help="with --apply-to: write the rewrite as a unified diff instead")
    e.add_argument("--fork-profile", help="with --apply-to: the fork revision's profile (default: the one that matches)")
    e.set_defaults(func=_cmd_export)

    s = sub.add_parser("show", help="list the codebooks of a table set")
    s.add_argument("folder")
    s.add_argument("--brief", action="store_true", help="one line per density")
    s.set_defaults(func=_cmd_show)
    for name, ep in sorted(plugin_commands().items()):
        if name not in sub.choices:  # listed for --help; main() hands its arguments to the entry point
            sub.add_parser(name, help=f"from {ep.value.split(':')[0]} (kvq-codebooks {name} --help)")
    return p


def plugin_commands() -> dict:
    """Subcommands other installed packages register in ``PLUGIN_GROUP``: name -> EntryPoint (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    argv = sys.argv[1:] if argv is None else list(argv)
    plugins = plugin_commands()
    if argv and argv[0] in plugins and argv[0] not in ("build", "audit", "calibrate", "show"):
        return int(plugins[argv[0]].load()(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, TableFileError, OSError) as exc:
        print(f"kvq-codebooks {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
