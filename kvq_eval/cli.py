"""``kvq-eval``: run the real-model evaluation grid, plot it, capture Q/K/V for calibration.

Examples
--------
kvq-eval run --model smollm2 --methods tq_mse4,nova --ctx 1024,4096,8192 --band none --band 64,256
kvq-eval run --model smollm2 --plan plan.json --tasks ppl,niah --ppl-windows 8192x7 --ctx 4096,8192
kvq-eval plot results/eval_v3 --model smollm2 -o results/eval_v3/smollm2
kvq-eval table results/eval_v3 --model smollm2
kvq-eval compare results/eval_v3 tq_mse4@none fp32
kvq-eval reproduce results/eval_v3 rerun --model smollm2 -o agreement.json
kvq-eval recommend results/eval_v3 --model gemma3
kvq-eval readme README.md docs/evaluation.md --check
kvq-eval capture --model smollm2 --tokens 1024 --sequences 2 --out qkv.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from codebooks.build import parse_float_list, parse_int_list

from .methods import DEFAULT_METHODS, method_info
from .niah import VARIANTS as NEEDLE_VARIANTS


MODEL_HELP = ("smollm2, gemma3, or your own model: a transformers folder (config.json, weights, tokenizer) or a "
              ".gguf file (default smollm2)")


def model_arg(text: str) -> str:
    """``--model``: ``kvq_eval.models.canonical_model`` (the argument error names what it takes)."""
    from .models import canonical_model

    try:
        return canonical_model(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _methods(text: str) -> list[str]:
    if text in ("all", "default"):
        return list(DEFAULT_METHODS)
    names = [m.strip() for m in text.split(",") if m.strip()]
    for m in names:
        if m != "fp32":
            try:
                method_info(m)
            except ValueError as exc:
                raise ValueError(f"--methods: {exc}") from None
    return names


def _entries(text: str | None):
    if text is None:
        return None
    from .grid import parse_entry

    names = [e.strip() for e in text.split(";") if e.strip()]
    for e in names:
        try:
            parse_entry(e)
        except ValueError as exc:
            raise ValueError(f"--entries: {exc}") from None
    return names


def _plans(paths, model: str) -> list[str]:
    """Load, check and register each ``--plan`` file (``kvq_eval.planfile``); their method names."""
    if not paths:
        return []
    import torch

    from .models import share_threads
    from .planfile import load_plan, register_plan

    share_threads(torch)  # checking a plan builds kvq_ref quantizers: Numba must not move torch's threads first
    return [register_plan(load_plan(p, model=model)) for p in paths]


def _windows(text: str) -> list[tuple[int, int]]:
    """``1024x8,8192x4`` -> [(1024, 8), (8192, 4)]."""
    out = []
    for item in text.split(","):
        t, sep, n = item.strip().partition("x")
        if not sep or not t.isdigit() or not n.isdigit() or int(t) < 16 or int(n) < 1:
            raise ValueError(f"--ppl-windows: expected TOKENSxCOUNT items (e.g. 1024x8,8192x4), got {item!r}")
        out.append((int(t), int(n)))
    return out


def _decode(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--decode: expected PREFIX,NEW,WINDOWS (positive integers), got {text!r}")
    return tuple(int(p) for p in parts)


def grid_kwargs(args) -> dict:
    """``kvq_eval.grid.plan``'s keyword arguments for a parsed ``kvq-eval run`` command line (the
    grid a ``run`` computes; also how a test reads ``make eval``'s grid)."""
    from .band import parse_band

    bands = args.band or ["none"]
    for b in bands:
        parse_band(b)
    plans = _plans(getattr(args, "plan", None), args.model)
    # an empty --methods is refused by checks.check_run (no method given), not read as the default
    methods = _methods(args.methods if args.methods is not None else ("fp32" if plans else "default")) + plans
    return dict(model=args.model, methods=methods, out=args.out,
                contexts=parse_int_list(args.ctx, "--ctx"), tasks=[t.strip() for t in args.tasks.split(",")],
                variants=[v.strip() for v in args.variants.split(",")],
                depths=parse_float_list(args.depths, "--depths"), samples=args.samples, bands=bands,
                prefill=[p.strip() for p in args.prefill.split(",")], ppl_windows=_windows(args.ppl_windows),
                decode=_decode(args.decode))


def _dry_run(kw: dict, calib_tokens: int, calib_seed: int = 0) -> int:
    """Print what a run would compute: its cells, how many are stored, the missing (task, entry) pairs
    with their counts (a needle sample counts once per entry it lacks) and ``grid.estimate_seconds``.
    Computes nothing."""
    from .grid import RECENT, _check_calib_seed, _check_calib_tokens, _missing, estimate_seconds, plan

    _check_calib_tokens(calib_tokens)
    _check_calib_seed(calib_seed)
    units = plan(**kw)
    missing: dict[tuple[str, str], int] = {}
    todo = 0
    for u in units:
        need = _missing(u, calib_tokens, calib_seed)
        todo += bool(need)
        for e in need:
            key = (u["task"] + (f" {u['cell'][0]} {u['cell'][1]}" if u["task"] == "niah" else
                                f" {u['tokens']}x{u['windows']}" if u["task"] == "ppl" else ""), e)
            missing[key] = missing.get(key, 0) + 1
    print(f"{kw['model']}: {len(units)} cell(s) planned, {len(units) - todo} complete, {todo} missing an entry")
    for (task, entry), n in sorted(missing.items()):
        print(f"  missing  {task:<24} {entry:<36} {n}")
    seconds, unknown = estimate_seconds(units, calib_tokens, calib_seed) if todo else (0.0, 0)
    if todo and not seconds:
        print("  no time estimate: no cell of these kinds in this folder has a recorded time yet")
    elif todo:
        print(f"  about {seconds / 3600:.1f} hours at the speeds this folder's cells recorded last (median wall time "
              f"of the newest {RECENT} records per perplexity window, needle entry, needle prompt's shared prefill "
              f"and layers cell, of the same method where it has one), for one process: processes side by side "
              f"(--ray) share it" + (f"; {unknown} cell(s) of a kind with no record yet (or a needle prompt whose "
                                     f"context has no recorded prefill) not (fully) counted" if unknown else ""))
    return 0


def _portable_rerun(args) -> int:
    """``run --portable`` from a process on another numeric path: the same command in a fresh Python
    with ``provenance.PORTABLE`` set (MKL, ATen, oneDNN, Numba and OpenBLAS read them when they load).
    From the console the process becomes it (signals reach the run); called with ``argv`` (tests), it
    runs as a child and its exit status is returned."""
    from .provenance import portable_environ

    cmd = [sys.executable, "-m", "kvq_eval.cli", *args.argv]
    env = portable_environ()
    if args.console:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, cmd, env)
    import subprocess

    return subprocess.run(cmd, env=env).returncode


def _cmd_run(args) -> int:
    from .checks import check_run, check_run_lengths
    from .models import load_tokenizer
    from .provenance import numerics
    from .runner import run_grid

    if args.portable and numerics() != "portable":
        return _portable_rerun(args)
    kw = grid_kwargs(args)
    check_run(kw, args.ray_gpus, args.dry_run)  # before the model loads (issue 53)
    if not args.dry_run:
        check_run_lengths(kw, load_tokenizer(args.model))
    if args.dry_run:
        return _dry_run(kw, args.calib_tokens, args.calib_seed)
    t0 = time.perf_counter()
    summary: dict = {}
    interrupted = None

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        run_grid(**kw, calib_tokens=args.calib_tokens, calib_seed=args.calib_seed, ray=args.ray, num_gpus=args.ray_gpus, summary=summary,
                 reuse=args.reuse, reuse_only=args.reuse_only)
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "SIGINT"
    finally:
        signal.signal(signal.SIGTERM, previous)
    wall = time.perf_counter() - t0
    if summary:  # the grid was planned: log the command, also when it was stopped part-way
        log = Path(args.out) / args.model / "runs.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        entry = {"command": shlex.join(["kvq-eval", *args.argv]), "wall_seconds": round(wall, 1), **summary}
        if interrupted:
            entry["interrupted"] = interrupted
        with log.open("a") as f:
            f.write(json.dumps(entry) + "\n")
    reused = summary.get("reused")
    print(f"{summary.get('ran', 0)} cell(s) run, {summary.get('done_before', 0)} already done, of "
          f"{summary.get('cells', 0)}; {wall:.0f} s" + (f" (interrupted: {interrupted})" if interrupted else "")
          + (f"; reused {', '.join(f'{n} {k}' for k, n in reused.items())}" if reused else "")
          + (f"; {summary['left']} cell(s) left to compute" if "left" in summary else ""))
    return 130 if interrupted else 0


def _cmd_plot(args) -> int:
    from .checks import writable_folder
    from .plot import plot_results

    writable_folder(Path(args.output).parent, "-o")
    paths = plot_results(args.results, args.model, args.output, _entries(args.entries), args.variant)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


# Needle variants of `table`/`compare`: exact match and log-probability are not comparable across
# variants (RULER's multi-query asks several values), so one variant is the default, not a pool.
VARIANTS = NEEDLE_VARIANTS + ("all",)


def _variant(name: str) -> str | None:
    """The ``variant`` argument of ``markdown_table``/the needle filter: None for ``all``."""
    return None if name == "all" else name


def _cmd_table(args) -> int:
    from .plot import decode_table, layers_table, load_results, markdown_table, position_table

    res = load_results(args.results, args.model, _entries(args.entries))
    if args.positions is not None:
        print(position_table(res, args.positions))
    elif args.decode:
        print(decode_table(res))
    elif args.layers:
        print(layers_table(res))
    else:
        print(markdown_table(res, _variant(args.variant)))
    return 0


def _cmd_compare(args) -> int:
    from .plot import (comparison_table, load_results, paired_comparison, paired_decode, paired_ppl,
                       ppl_comparison_table)

    res = load_results(args.results, args.model)
    # perplexity windows and long decodes paired over blocks ({} when one entry has no such cell:
    # fp32 never has a perplexity cell), then the needle samples
    tables = [ppl_comparison_table(c, args.a, args.b)
              for c in (paired_ppl(res, args.a, args.b), paired_decode(res, args.a, args.b)) if c]
    variant = _variant(args.variant)
    cells = [c for c in res["niah"] if variant is None or c["variant"] == variant]
    if not tables or (any(args.a in c["results"] for c in cells) and any(args.b in c["results"] for c in cells)):
        tables.append(comparison_table(paired_comparison(cells, args.a, args.b), args.a, args.b))
    print("\n\n".join(tables))
    return 0


def _cmd_reproduce(args) -> int:
    from .reproduce import compare_runs, format_comparison

    result = compare_runs(args.a, args.b, args.model)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(format_comparison(result), end="")
    return 0


def _cmd_readme(args) -> int:
    from .readme import refresh_file

    stale = []
    for f in args.files:
        if refresh_file(f, args.results, check=args.check):
            stale.append(f)
    if args.check:
        for f in stale:
            print(f"{f}: tables differ from {args.results} (run kvq-eval readme to refresh them)")
        if not stale:
            print(f"{', '.join(args.files)}: tables match {args.results}")
        return 1 if stale else 0
    for f in args.files:
        print(f"{f}: {'tables refreshed' if f in stale else 'tables already current'}")
    return 0


def _cmd_recommend(args) -> int:
    from .plot import load_results
    from .recommend import parse_targets, recommend_table

    targets = parse_targets(args.targets)
    if args.tokens < 16:
        raise ValueError(f"--tokens must be at least 16, got {args.tokens}")
    print(recommend_table(load_results(args.results, args.model), targets, args.tokens))
    return 0


def _cmd_capture(args) -> int:
    for name in ("tokens", "sequences"):
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"--{name} must be a positive integer, got {v}")
    from .calib import capture, save_qkv, token_chunks
    from .checks import check_text_tokens, writable_file
    from .models import load_model, load_tokenizer
    from .text import part

    writable_file(args.out)  # before the model loads (issue 53)
    check_text_tokens(load_tokenizer(args.model), args.part, args.tokens * args.sequences,
                      f"--tokens {args.tokens} x --sequences {args.sequences}")
    model, tok, _ = load_model(args.model)
    seqs = [capture(model, ids) for ids in token_chunks(tok, part(args.part), args.tokens, args.sequences)]
    print(f"wrote {save_qkv(seqs, args.out)}")
    return 0


def _cmd_sink(args) -> int:
    for name in ("tokens", "calib_tokens"):
        if getattr(args, name) < 2:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 2, got {getattr(args, name)}")
    if not 1 <= args.bits <= 8:
        raise ValueError(f"--bits must be in 1..8, got {args.bits}")
    if args.window < 0 or args.window >= args.tokens:
        raise ValueError(f"--window must be in 0..{args.tokens - 1}, got {args.window}")
    from .calib import calibration_tables, capture
    from .checks import check_text_tokens, writable_file
    from .models import load_model, load_tokenizer
    from .sink import attention_geometry, sink_report
    from .text import part

    writable_file(args.out)  # before the model loads (issue 53)
    check_text_tokens(load_tokenizer(args.model), "heldout", args.tokens, f"--tokens {args.tokens}")
    model, tok, _ = load_model(args.model)
    tables = calibration_tables(model, tok, args.model, length=args.calib_tokens)
    ids = tok(part("heldout"), return_tensors="pt").input_ids[:, :args.tokens]
    report = sink_report(capture(model, ids), tables.stats, args.bits, args.window, *attention_geometry(model))
    report = {"model": args.model, "command": "kvq-eval " + shlex.join(args.argv), "calib_tokens": args.calib_tokens,
              **report}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)
    t = report["totals"]
    print(f"TurboQuantMSE-{args.bits}, keys >= {args.window} tokens old, {args.tokens} tokens: attention-weighted "
          f"logit MSE {t['err_plain']:.4f} plain, {t['err_centred']:.4f} centred; centring worse in "
          f"{t['heads_centring_worse']} of {t['heads']} heads; wrote {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq-eval", description="Evaluate KV-cache quantizers on real models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run (or resume) the evaluation grid")
    r.add_argument("--model", default="smollm2", type=model_arg, help=MODEL_HELP)
    r.add_argument("--methods", default=None,
                   help="comma list, or 'default' for every method (the default unless --plan is given); "
                   "<method>:keys (or :values) applies a method to the keys only (values only), the other "
                   "half stored exactly")
    r.add_argument("--plan", action="append", default=None, metavar="PLAN.json",
                   help="a per-layer plan made by kvq-plan, evaluated as the entry plan:<name>@<its band> "
                   "(its own band only, whatever --band says); repeat for several")
    r.add_argument("--ctx", default="1024", help="needle contexts in tokens, e.g. 1024,4096,8192")
    r.add_argument("--tasks", default="ppl,niah", help="comma list of ppl, niah, decode, layers")
    r.add_argument("--variants", default="single,multiquery")
    r.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    r.add_argument("--samples", type=int, default=6, help="needle samples per (variant, context, depth)")
    r.add_argument("--band", action="append", default=None,
                   help="16-bit band applied to every method: none, S,W (sink S, recent window W) or own "
                   "(each method's built-in band); repeat for several (default: none)")
    r.add_argument("--prefill", default="exact", help="needle/decode prefill modes: exact, quantized (comma list)")
    r.add_argument("--ppl-windows", default="1024x8", help="perplexity windows TOKENSxCOUNT, e.g. 1024x8,8192x4")
    r.add_argument("--decode", default="1024,512,1", help="long decode: PREFIX,NEW,WINDOWS tokens")
    r.add_argument("--calib-tokens", type=int, default=1024,
                   help="length of each of the 2 calibration sequences (calibrated methods)")
    r.add_argument("--calib-seed", type=int, default=0,
                   help="the calibration's k-means seed (default 0): another seed is another draw of the same "
                   "calibration; entries record it when not 0")
    r.add_argument("--out", default="results/eval_v3")
    r.add_argument("--ray", default=None,
                   help="run cells as Ray tasks: 'local' starts a Ray instance on this machine (no cluster needed); "
                   "'auto' joins the running cluster (ray start --head first); or a cluster ADDRESS")
    r.add_argument("--ray-gpus", type=float, default=0.0, help="GPUs per Ray task")
    r.add_argument("--reuse", default=None, metavar="OLD",
                   help="an older results folder: copy what it holds of the missing cells on the same inputs "
                   "(same needle samples, the same long perplexity windows, same calibration digests) before "
                   "computing the rest; reused entries record reused_from")
    r.add_argument("--reuse-only", action="store_true",
                   help="with --reuse: copy what the older folder holds and compute nothing")
    r.add_argument("--portable", action="store_true",
                   help="the portable numeric path: the same instructions on every x86-64 processor with AVX2 and "
                   "FMA, so that cells reproduce bit for bit across processor models and vendors (about 1.5x "
                   "slower); entries record it as provenance numerics")
    r.add_argument("--dry-run", action="store_true",
                   help="compute nothing: list the grid's missing (task, entry) pairs, how many cells lack each, and "
                   "the hours they need at the speeds the folder's cells recorded")
    r.set_defaults(func=_cmd_run)
    q = sub.add_parser("plot", help="quality-vs-stored-bits chart from the JSON")
    q.add_argument("results", help="results folder (the --out of run)")
    q.add_argument("--model", default="smollm2")
    q.add_argument("-o", "--output", required=True, help="output prefix for the PNG files")
    q.add_argument("--entries", default=None, help="only these entries (';' list, e.g. 'fp32;tq_mse4@none')")
    q.add_argument("--variant", default="single", choices=NEEDLE_VARIANTS,
                   help="needle variant of the exact-match and log-probability panels (default single)")
    q.set_defaults(func=_cmd_plot)
    t = sub.add_parser("table", help="the summary table (Markdown, with intervals) from the JSON")
    t.add_argument("results", help="results folder (the --out of run)")
    t.add_argument("--model", default="smollm2")
    t.add_argument("--entries", default=None, help="only these entries (';' list, e.g. 'fp32;tq_mse4@none')")
    t.add_argument("--variant", default="single", choices=VARIANTS,
                   help="needle variant of the needle columns (default single; 'all' pools every variant)")
    t.add_argument("--positions", type=int, default=None, metavar="TOKENS",
                   help="instead: the NLL change per position bin of the TOKENS-token perplexity windows")
    t.add_argument("--layers", action="store_true", help="instead: per-layer attention error (layers cells)")
    t.add_argument("--decode", action="store_true",
                   help="instead: the long decodes (perplexity change over the generated tokens, KL, top-1)")
    t.set_defaults(func=_cmd_table)
    k = sub.add_parser("compare", help="two entries on their shared perplexity windows and long decodes and needle "
                       "samples: paired t interval, paired t and exact sign-flip p over windows (samples); McNemar's "
                       "exact test on needle exact match (Markdown)")
    k.add_argument("results", help="results folder (the --out of run)")
    k.add_argument("a", help="entry, e.g. tq_mse4@none")
    k.add_argument("b", help="entry to compare against, e.g. fp32")
    k.add_argument("--model", default="smollm2")
    k.add_argument("--variant", default="single", choices=VARIANTS,
                   help="needle variant of the paired needle samples (default single; 'all' pools them)")
    k.set_defaults(func=_cmd_compare)
    x = sub.add_parser("reproduce", help="two runs of one grid (e.g. the committed cells and a rerun on another "
                       "machine): per entry, bit-identical samples and windows, exact match (McNemar) and the paired "
                       "t interval of the log-probability (NLL) change (Markdown)")
    x.add_argument("a", help="results folder, e.g. results/eval_v3")
    x.add_argument("b", help="results folder of the rerun")
    x.add_argument("--model", default="smollm2")
    x.add_argument("-o", "--out", default=None, help="also write the comparison as JSON here")
    x.set_defaults(func=_cmd_reproduce)
    m = sub.add_parser("readme", help="recompute the marked tables of Markdown files (README, docs) from the JSON")
    m.add_argument("files", nargs="*", default=["README.md", "docs/evaluation.md", "docs/plan.md"],
                   help="Markdown files with '<!-- kvq-eval ... -->' markers (default: README.md docs/evaluation.md "
                        "docs/plan.md)")
    m.add_argument("--results", default="results/eval_v3", help="results folder (the --out of run)")
    m.add_argument("--check", action="store_true", help="only compare: exit 1 when a table is stale")
    m.set_defaults(func=_cmd_readme)
    w = sub.add_parser("recommend", help="the cheapest stored-bits setting within perplexity targets (upper end of "
                       "the 95%% interval), with and without a 16-bit band, its needle recall, and the joint pick whose "
                       "bound holds through the search (Bonferroni over the entries) (Markdown)")
    w.add_argument("results", nargs="?", default="results/eval_v3", help="results folder (the --out of run)")
    w.add_argument("--model", default="smollm2")
    w.add_argument("--targets", default="0.5,1,3", help="perplexity increases over fp32, in %% (comma list)")
    w.add_argument("--tokens", type=int, default=8192, help="window length the targets apply to")
    w.set_defaults(func=_cmd_recommend)
    c = sub.add_parser("capture", help="exact post-RoPE Q/K/V for kvq-codebooks calibrate")
    c.add_argument("--model", default="smollm2", type=model_arg, help=MODEL_HELP)
    c.add_argument("--tokens", type=int, default=1024)
    c.add_argument("--sequences", type=int, default=2)
    c.add_argument("--part", default="calibration", choices=["calibration", "evaluation", "haystack"])
    c.add_argument("--out", required=True)
    c.set_defaults(func=_cmd_capture)
    s = sub.add_parser("sink", help="why mean-centred keys hurt: the first token's share of the attention outside a "
                       "recent window and TurboQuantMSE's logit error there, plain and centred, per layer and head (JSON)")
    s.add_argument("--model", default="smollm2", type=model_arg, help=MODEL_HELP)
    s.add_argument("--tokens", type=int, default=2048, help="the first TOKENS tokens of the held-out text")
    s.add_argument("--window", type=int, default=64, help="recent tokens left exact")
    s.add_argument("--bits", type=int, default=3, help="TurboQuantMSE bits")
    s.add_argument("--calib-tokens", type=int, default=8192, help="calibration length (the key means' source)")
    s.add_argument("--out", required=True, help="JSON file to write")
    s.set_defaults(func=_cmd_sink)
    return p


def run_main(prog: str, parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse ``argv`` and run its subcommand; bad input ends as one ``prog CMD: error: ...`` line
    and exit status 2 (the console entry points of ``kvq-eval`` and ``kvq-plan``)."""
    # OpenMP threads that sleep at once when idle: a decode step alternates torch's and Numba's
    # thread pools with numpy on 2 cores, and spinning pools made a SmolLM2 step at 8K tokens
    # about 2x slower. Read when the runtime loads, so only before torch is first imported here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # what runs.jsonl records
    args.console = argv is None
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"{prog} {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    return run_main("kvq-eval", _parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
