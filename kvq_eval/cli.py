"""``kvq-eval``: run the real-model evaluation grid, plot it, capture Q/K/V for calibration.

Examples
--------
kvq-eval run --model smollm2 --methods tq_mse4,nova --ctx 1024,4096,8192 --out results/eval
kvq-eval plot results/eval --model smollm2 -o results/eval/smollm2
kvq-eval table results/eval --model smollm2
kvq-eval capture --model smollm2 --tokens 1024 --sequences 2 --out qkv.safetensors
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from codebooks.build import parse_float_list, parse_int_list

from .methods import DEFAULT_METHODS, method_info


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


def _only(text: str | None):
    return None if text is None else _methods(text)


def _cmd_run(args) -> int:
    from .runner import run_grid

    t0 = time.perf_counter()
    summary = run_grid(args.model, _methods(args.methods), args.out,
                       contexts=parse_int_list(args.ctx, "--ctx"),
                       tasks=[t.strip() for t in args.tasks.split(",")],
                       variants=[v.strip() for v in args.variants.split(",")],
                       depths=parse_float_list(args.depths, "--depths"),
                       seeds=parse_int_list(args.seeds, "--seeds"),
                       lm_tokens=args.lm_tokens, lm_chunks=args.lm_chunks, calib_tokens=args.calib_tokens)
    wall = time.perf_counter() - t0
    log = Path(args.out) / args.model / "runs.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(json.dumps({"command": shlex.join(["kvq-eval", *sys.argv[1:]]), "wall_seconds": round(wall, 1),
                            **summary}) + "\n")
    print(f"{summary['ran']} cell(s) run, {summary['done_before']} already done, of {summary['cells']}; "
          f"{wall:.0f} s")
    return 0


def _cmd_plot(args) -> int:
    from .plot import plot_results

    paths = plot_results(args.results, args.model, args.output, _only(args.methods))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _cmd_table(args) -> int:
    from .plot import load_results, markdown_table

    print(markdown_table(load_results(args.results, args.model, _only(args.methods))))
    return 0


def _cmd_compare(args) -> int:
    from .plot import comparison_table, load_results, paired_comparison

    cells = load_results(args.results, args.model)["niah"]
    print(comparison_table(paired_comparison(cells, args.a, args.b), args.a, args.b))
    return 0


def _cmd_capture(args) -> int:
    from .calib import capture, save_qkv, token_chunks
    from .models import load_model
    from .text import part

    model, tok, _ = load_model(args.model)
    seqs = [capture(model, ids) for ids in token_chunks(tok, part(args.part), args.tokens, args.sequences)]
    print(f"wrote {save_qkv(seqs, args.out)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq-eval", description="Evaluate KV-cache quantizers on real models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run (or resume) the evaluation grid")
    r.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    r.add_argument("--methods", default="default",
                   help="comma list, or 'default' for every method; <method>:keys (or :values) applies "
                   "a method to the keys only (values only), the other half stored exactly")
    r.add_argument("--ctx", default="1024", help="needle contexts in tokens, e.g. 1024,4096,8192")
    r.add_argument("--tasks", default="lm,layers,niah")
    r.add_argument("--variants", default="single,multikey,multivalue")
    r.add_argument("--depths", default="0.25,0.5,0.75")
    r.add_argument("--seeds", default="0")
    r.add_argument("--lm-tokens", type=int, default=1024, help="tokens per perplexity window")
    r.add_argument("--lm-chunks", type=int, default=2, help="perplexity windows")
    r.add_argument("--calib-tokens", type=int, default=1024,
                   help="length of each of the 2 calibration sequences (NOVA-KV, OSCAR, fractional TurboQuant)")
    r.add_argument("--out", default="results/eval")
    r.set_defaults(func=_cmd_run)
    q = sub.add_parser("plot", help="accuracy-vs-bits and NIAH-vs-context charts from the JSON")
    q.add_argument("results", help="results folder (the --out of run)")
    q.add_argument("--model", default="smollm2")
    q.add_argument("-o", "--output", required=True, help="output prefix for the PNG files")
    q.add_argument("--methods", default=None, help="only these methods (comma list, fp32 if listed); "
                   "needle cells are paired over them alone")
    q.set_defaults(func=_cmd_plot)
    t = sub.add_parser("table", help="the summary table (Markdown) from the JSON")
    t.add_argument("results", help="results folder (the --out of run)")
    t.add_argument("--model", default="smollm2")
    t.add_argument("--methods", default=None, help="only these methods (comma list, fp32 if listed); "
                   "needle cells are paired over them alone")
    t.set_defaults(func=_cmd_table)
    k = sub.add_parser("compare", help="two methods on their shared needle cells: wins, losses, "
                       "sign test (Markdown)")
    k.add_argument("results", help="results folder (the --out of run)")
    k.add_argument("a", help="method, e.g. nova")
    k.add_argument("b", help="method to compare against, e.g. quarot2")
    k.add_argument("--model", default="smollm2")
    k.set_defaults(func=_cmd_compare)
    c = sub.add_parser("capture", help="exact post-RoPE Q/K/V for kvq-codebooks calibrate")
    c.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    c.add_argument("--tokens", type=int, default=1024)
    c.add_argument("--sequences", type=int, default=2)
    c.add_argument("--part", default="calibration", choices=["calibration", "evaluation", "haystack"])
    c.add_argument("--out", required=True)
    c.set_defaults(func=_cmd_capture)
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"kvq-eval {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
