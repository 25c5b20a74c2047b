"""Argument and output checks that ``kvq-eval`` runs before it loads a model.

Loading a model takes seconds to minutes and a run takes hours; an output path that cannot be
written or an argument that cannot work must fail first, with one line naming it (issue 53:
``--out`` a file or unwritable, ``--band 99999999999999999999,0``, ``--methods ''``, windows too
short for the position bins or longer than the text, needle contexts beyond the haystack). The
length checks need only the tokenizer (``models.load_tokenizer``).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

__all__ = ["writable_folder", "writable_file", "check_run", "check_run_lengths", "check_text_tokens",
           "MIN_PPL_TOKENS"]

#: POSITION_BINS (scores) + 1: a window of T tokens scores T - 1 positions, split into 16 bins
MIN_PPL_TOKENS = 17


def _probe(folder: Path, name: str, shown: Path) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kvq-eval-write-check-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ValueError(f"{name} {shown}: cannot be written ({exc.strerror})") from None


def writable_folder(path, name: str = "--out", create: bool = True) -> Path:
    """A folder results can be written into: not an existing file; created (``create``) and probed
    with a temporary file, else its nearest existing ancestor must be a directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{name} {p}: exists and is not a directory")
    if not create:
        anc = p
        while not anc.exists():
            anc = anc.parent
        if not anc.is_dir():
            raise ValueError(f"{name} {p}: {anc} is not a directory")
        return p
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{name} {p}: cannot be created ({exc.strerror})") from None
    _probe(p, name, p)
    return p


def writable_file(path, name: str = "--out") -> Path:
    """A file path that can be written: not a directory or a FIFO/device; its folder created and probed."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{name} {p}: is a directory; give a file path")
    if p.exists() and not p.is_file():
        raise ValueError(f"{name} {p}: exists and is not a regular file")
    writable_folder(p.parent if str(p.parent) else Path("."), name)
    return p


def check_run(kw: dict, ray_gpus: float = 0.0, dry_run: bool = False) -> None:
    """The cheap checks of ``kvq-eval run`` (``cli.grid_kwargs``' dict), before any model or tokenizer."""
    if not kw["methods"]:
        raise ValueError("--methods: no method given (e.g. --methods tq_mse4,nova, or default)")
    writable_folder(kw["out"], "--out", create=not dry_run)
    if "niah" in kw["tasks"]:
        for c in kw["contexts"]:
            if c < 256:
                raise ValueError(f"--ctx: needle contexts must be >= 256 tokens, got {c}")
        for d in kw["depths"]:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"--depths: depths are fractions in [0, 1], got {d}")
    if "ppl" in kw["tasks"]:
        for tokens, _ in kw["ppl_windows"]:
            if tokens < MIN_PPL_TOKENS:
                raise ValueError(f"--ppl-windows: a window needs at least {MIN_PPL_TOKENS} tokens (16 position bins "
                                 f"of the {tokens - 1} scored positions would be empty: NaN), got {tokens}")
    if isinstance(ray_gpus, bool) or not math.isfinite(ray_gpus) or ray_gpus < 0:
        raise ValueError(f"--ray-gpus must be a finite number >= 0, got {ray_gpus}")


def check_text_tokens(tok, part_name: str, need: int, what: str) -> None:
    """``need`` tokens of the fixture part ``part_name`` must exist (``calib.token_chunks`` takes them)."""
    from .text import part

    have = len(tok(part(part_name)).input_ids)
    if need > have:
        raise ValueError(f"{what} needs {need} tokens of the {part_name!r} text, which holds {have}")


def check_run_lengths(kw: dict, tok) -> None:
    """Lengths against the text, with the model's tokenizer: perplexity and decode windows fit the
    held-out text; every planned needle sample at the largest context of each variant fits the
    haystack (``niah.make_sample`` raises naming the maximum context)."""
    from .grid import plan
    from .niah import make_sample

    tasks = kw["tasks"]
    if "ppl" in tasks:
        for tokens, count in kw["ppl_windows"]:
            check_text_tokens(tok, "heldout", tokens * count, f"--ppl-windows {tokens}x{count}")
    if "decode" in tasks:
        prefix, new, count = kw["decode"]
        check_text_tokens(tok, "heldout", (prefix + new) * count, f"--decode {prefix},{new},{count}")
    if "niah" in tasks and kw["contexts"]:
        cells = [u["cell"] for u in plan(**{**kw, "tasks": ["niah"]}) if u["task"] == "niah"]
        top = {v: max(c for vv, c, _, _ in cells if vv == v) for v, _, _, _ in cells}
        for variant, context, depth, sample in cells:
            if context == top[variant]:
                try:
                    make_sample(tok, variant, context, depth, sample)
                except ValueError as exc:
                    raise ValueError(f"--ctx: {exc}") from None
