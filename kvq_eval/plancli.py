"""``kvq-plan``: the cheapest per-layer KV-cache plan that meets a quality target, and its study.

Examples
--------
kvq-plan search --model smollm2 --target 1 --band 0,64 --candidates tq_mse2-8 --out plan.json
kvq-plan show plan.json
kvq-eval run --model smollm2 --plan plan.json --tasks ppl --ppl-windows 8192x7
kvq-plan study --model smollm2 --targets 0.5,1,3 --baseline results/eval_v3 --out results/plan
kvq-plan plot results/plan/smollm2/study.json -o results/plan/smollm2/study
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from codebooks.build import parse_float_list

from .band import parse_band
from .cli import MODEL_HELP, model_arg, run_main


def _band(text: str) -> tuple[int, int]:
    b = parse_band(text)
    if b is None:
        raise ValueError("--band: a plan's band is one global setting: 'none' or 'S,W', not 'own'")
    return (b.sink, b.window)


def _config(args, target: float):
    from .planner import SearchConfig, parse_candidates

    return SearchConfig(model=args.model, target=target / 100.0, candidates=parse_candidates(args.candidates),
                        band=_band(args.band), context=args.context, calib_windows=args.calib_windows,
                        valid_windows=args.valid_windows, stride=args.stride, rounds=args.rounds,
                        extrapolate_above=args.extrapolate_above, check_model=not args.no_model_check, metric=args.metric,
                        name=getattr(args, "name", None))


def _work(args) -> Path:
    return Path(args.work) if args.work else Path(args.out).parent / "plan-cells"


def _dry_run(cfg, work) -> int:
    from .grid import RECENT, recent_median
    from .sensitivity import layer_units, read_cell

    units = layer_units(cfg.model, work, cfg.band, cfg.measured, cfg.context, cfg.calib_windows, cfg.stride)
    cells = [(u, read_cell(u)) for u in units]
    missing = [u for u, c in cells if c is None]
    print(f"{cfg.model}: {len(units)} sensitivity cells ({len(missing)} missing), then at most {cfg.rounds} validation "
          f"round(s) of {cfg.valid_windows} windows" + (f" and {cfg.calib_windows} model-check windows"
                                                          if cfg.check_model else "")
          + f" of {cfg.context} tokens")
    # a layer cell runs the layers from its own on, so its time falls with the layer: the median of the
    # newest stored cells of that layer, else of all stored cells (grid.recent_median)
    done: dict = {}
    for u, c in cells:
        if c is not None and "seconds" in c:
            done.setdefault(u["layer"], []).append((c.get("finished"), c["seconds"]))
    if missing and done:
        every = recent_median([r for v in done.values() for r in v])
        hours = sum(recent_median(done[u["layer"]]) if u["layer"] in done else every for u in missing) / 3600
        print(f"  the missing sensitivity cells: about {hours:.1f} hours at the speeds the stored ones recorded last "
              f"(median wall time of the newest {RECENT} per layer)")
    return 0


def _cmd_search(args) -> int:
    from codebooks._atomic import check_output_file

    from .planfile import save_plan
    from .planner import search

    if args.target is None:
        raise ValueError("--target is required (perplexity increase in %, e.g. 1)")
    cfg = _config(args, args.target)
    if args.dry_run:
        return _dry_run(cfg, _work(args))
    out = check_output_file(args.out, "--out", (".json",))
    plan = search(cfg, _work(args), ray=args.ray, progress=args.progress)
    save_plan(plan, out)
    q = plan.record["quality"]
    print(f"wrote {out}: {plan.entry}, {plan.record['validation']['rounds'][plan.record['validation']['chosen']]['bits_per_element']:.3f} "
          f"stored bits, validated {q['dppl']:+.3f} % [{q['ci'][0]:+.3f}, {q['ci'][1]:+.3f}] on {q['windows']} windows"
          + ("" if q["meets_target"] else f" (MISSES the {q['target_dppl']:g} % target)"))
    return 0 if q["meets_target"] else 3


def _cmd_show(args) -> int:
    from .planfile import load_plan, stored_bits

    plan = load_plan(args.plan)
    bits = stored_bits(plan)
    q = plan.record.get("quality", {})
    print(f"{args.plan}: {plan.entry} for {plan.model}, target {100 * plan.target:g} % at {plan.context} tokens")
    print(f"stored bits {bits['bits_per_element']:.4f} per element (keys {bits['key_rate']:.3f}, values "
          f"{bits['value_rate']:.3f}, band pairs {bits['band_pairs']:.4f})")
    if q:
        print(f"validated {q['dppl']:+.3f} % [{q['ci'][0]:+.3f}, {q['ci'][1]:+.3f}] on {q['windows']} {q['text']} windows")
    print("layer  key       value")
    for i, (k, v) in enumerate(plan.layers):
        print(f"{i:>5}  {k:<9} {v}")
    return 0


def _cmd_study(args) -> int:
    from .planstudy import run_study

    targets = parse_float_list(args.targets, "--targets")
    if args.dry_run:
        return _dry_run(_config(args, targets[0]), Path(args.out))  # every target shares the sensitivity cells
    path = run_study([_config(args, t) for t in targets], Path(args.out), Path(args.baseline), ray=args.ray,
                     needles=args.needles, needle_contexts=tuple(int(c) for c in args.needle_contexts.split(",") if c),
                     eval_windows=args.eval_windows, progress=args.progress)
    print(f"wrote {path}")
    return 0


def _cmd_plot(args) -> int:
    from .planstudy import plot_study

    print("wrote " + ", ".join(str(p) for p in plot_study(args.study, args.output)))
    return 0


def _search_options(p, study: bool) -> None:
    p.add_argument("--model", default="smollm2", type=model_arg, help=MODEL_HELP)
    p.add_argument("--band", default="0,64", help="the global float16 band: none or S,W (default 0,64)")
    p.add_argument("--candidates", default="tq_mse2-8",
                   help="per-(layer, role) choices: tq_mseA-B ranges and/or method names (default tq_mse2-8)")
    p.add_argument("--context", type=int, default=8192, help="window length of calibration and validation")
    p.add_argument("--calib-windows", type=int, default=3, help="consecutive windows of the calibration text")
    p.add_argument("--valid-windows", type=int, default=4, help="windows spread over the long_haystack text (>= 2)")
    p.add_argument("--stride", type=int, default=1, help="score every STRIDE-th position (1: all)")
    p.add_argument("--rounds", type=int, default=4, help="most validation rounds of the correction")
    p.add_argument("--extrapolate-above", type=int, default=None, metavar="BITS",
                   help="predict TurboQuantMSE widths above BITS by the distortion ratio instead of measuring them")
    p.add_argument("--metric", default="kl", choices=["kl", "dnll"],
                   help="the additive model's items: KL(fp32 || quant) per token (default) or the NLL change")
    p.add_argument("--no-model-check", action="store_true",
                   help="skip simulating the chosen plan on the calibration windows")
    p.add_argument("--work", default=None, help="folder of the resumable cells (default: beside --out)")
    p.add_argument("--ray", default=None, help="run cells as Ray tasks: local, auto or a cluster ADDRESS")
    p.add_argument("--progress", action="store_true", default=None, help="show progress bars (default: on a terminal)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq-plan", description="Per-layer KV-cache plans that meet a quality target.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("search", help="find, validate and write the cheapest plan meeting a target")
    _search_options(s, study=False)
    s.add_argument("--target", type=float, default=None, help="perplexity increase in % at --context (e.g. 1)")
    s.add_argument("--name", default=None, help="plan name (default <model>-<band>-t<target>)")
    s.add_argument("--out", required=True, help="plan file to write (.json)")
    s.add_argument("--dry-run", action="store_true", help="only count the cells a search needs")
    s.set_defaults(func=_cmd_search)
    w = sub.add_parser("show", help="check a plan file and print it")
    w.add_argument("plan")
    w.set_defaults(func=_cmd_show)
    t = sub.add_parser("study", help="plans at several targets against the cheapest uniform settings (JSON)")
    _search_options(t, study=True)
    t.add_argument("--targets", default="0.5,1,3", help="perplexity increases in %% (comma list)")
    t.add_argument("--baseline", default="results/eval_v3", help="kvq-eval results with the uniform settings' cells")
    t.add_argument("--eval-windows", type=int, default=7, help="held-out perplexity windows of --context tokens")
    t.add_argument("--needles", type=int, default=30, help="needle samples per context (multiple of 5; 0: none)")
    t.add_argument("--needle-contexts", default="4096,8192")
    t.add_argument("--out", required=True, help="study folder (plans, cells, eval/ and <model>/study.json)")
    t.add_argument("--dry-run", action="store_true", help="only count the cells the searches need")
    t.set_defaults(func=_cmd_study)
    q = sub.add_parser("plot", help="the study's chart from its JSON")
    q.add_argument("study", help="a study.json")
    q.add_argument("-o", "--output", required=True, help="output prefix of the PNG")
    q.set_defaults(func=_cmd_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    return run_main("kvq-plan", _parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
