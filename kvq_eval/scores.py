"""Per-window scores of a quantized model against the fp32 one: summed NLLs, KL(fp32 || quant),
top-1 agreement and the changes per position bin, from two sets of logits (or final hidden states
and the vocabulary head), formed in float64.

``window_stats`` is what every perplexity window, decode window and planner cell records
(``kvq_eval.runner``, ``kvq_eval.sensitivity``); ``window_stats_direct`` is the same written
straight from the definitions, the form it must equal bit for bit
(``tests/kvq_eval/test_protocol.py``, timed beside it by ``benchmarks/eval_stats.py``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["POSITION_BINS", "window_stats", "window_stats_direct", "row_pieces"]

#: Equal parts of a window's positions whose mean NLL and KL changes a window records.
POSITION_BINS = 16
_STATS_ROWS = 32  # positions of float64 statistics at a time (window_stats)


def window_stats(ref, out, target, chunk: int = 512, head=None, ref_logits: bool = False) -> dict:
    """Summed NLL of the quantized and the fp32 logits, KL(fp32 || quant), top-1 agreement and the
    NLL/KL change per position bin, for logits (T, vocab) predicting ``target`` (T,).

    Formed in float64: per position ``lp = log_softmax(ref)``, ``lq = log_softmax(out)``, the NLLs
    ``-lp[target]`` and ``-lq[target]``, ``KL = sum(exp(lp) * (lp - lq))`` and whether the argmaxes
    agree. With ``head`` (``Evaluator._head``), ``ref`` and ``out`` are final hidden states
    (T, hidden) and the float32 logits are formed here ``chunk`` positions at a time: an 8K window
    of Gemma's 262K-token vocabulary never holds its 8.6 GB of logits. ``ref_logits``: ``ref``
    already holds the reference's logits (the planner's cells share one window's reference across
    many cells, ``kvq_eval.sensitivity``).

    The float64 work runs ``_STATS_ROWS`` positions at a time in buffers allocated once: every
    operation is row-wise, so the numbers are bit for bit those of whole chunks, which allocated
    (and page-faulted) seven 1 GB arrays per 512 Gemma positions (``window_stats_direct``, which
    ``tests/kvq_eval/test_protocol.py`` checks the equality against and ``benchmarks/eval_stats.py``
    times beside this: 5.1x on Gemma's vocabulary with the argmax below, 3.3x without). One
    exception to "row-wise", handled by ``row_pieces``: torch sums a lone row of more than 32768
    elements in per-thread parts, in another order than the same row among others.
    """
    import torch

    if target.numel() < POSITION_BINS:  # an empty position bin would be written as NaN
        raise ValueError(f"a window scores {target.numel()} positions, fewer than the {POSITION_BINS} position bins")
    nf, nq, kl, top1 = [], [], [], 0
    bufs = None
    for lo in range(0, target.numel(), chunk):
        r, o, tg = ref[lo:lo + chunk], out[lo:lo + chunk], target[lo:lo + chunk]
        if head is not None:
            r, o = (r if ref_logits else head(r)), head(o)
        for at, stop in row_pieces(r.shape[0], _STATS_ROWS):
            rows, vocab = stop - at, r.shape[1]
            if bufs is None or bufs.shape[2] != vocab:
                bufs = torch.empty((5, _STATS_ROWS + 1, vocab), dtype=torch.float64)
            rd, od, lp, lq, w = (b[:rows] for b in bufs)
            rd.copy_(r[at:at + rows])
            od.copy_(o[at:at + rows])
            torch.ops.aten._log_softmax.out(rd, -1, False, out=lp)  # torch.log_softmax's kernel, into lp
            torch.ops.aten._log_softmax.out(od, -1, False, out=lq)
            t = tg[at:at + rows, None]
            nf.append(-lp.gather(1, t)[:, 0])
            nq.append(-lq.gather(1, t)[:, 0])
            # numpy's argmax (vectorized; torch's took 17 ms per 32 Gemma rows): first maximum, as torch's
            top1 += int((np.argmax(od.numpy(), 1) == np.argmax(rd.numpy(), 1)).sum())
            torch.exp(lp, out=w)
            torch.mul(w, torch.sub(lp, lq, out=lq), out=w)
            kl.append(w.sum(-1))
    return _summary(nf, nq, kl, top1)


def window_stats_direct(ref, out, target, chunk: int = 512) -> dict:
    """What ``window_stats`` computes from logits, written straight from the definitions in whole
    ``chunk``-position float64 arrays: the form it must equal bit for bit (tested, and benchmarked
    against in ``benchmarks/eval_stats.py``)."""
    import torch

    nf, nq, kl, top1 = [], [], [], 0
    for lo in range(0, target.numel(), chunk):
        r, o, tg = ref[lo:lo + chunk].double(), out[lo:lo + chunk].double(), target[lo:lo + chunk]
        lp, lq = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
        nf.append(-lp.gather(1, tg[:, None])[:, 0])
        nq.append(-lq.gather(1, tg[:, None])[:, 0])
        kl.append((lp.exp() * (lp - lq)).sum(-1))
        top1 += int((o.argmax(-1) == r.argmax(-1)).sum())
    return _summary(nf, nq, kl, top1)


def _summary(nf: list, nq: list, kl: list, top1: int) -> dict:
    """The window record from per-position float64 NLLs and KLs (lists of chunks) and the top-1 count."""
    import torch

    nf, nq, kl = (torch.cat(x) for x in (nf, nq, kl))
    d, k = (nq - nf).numpy(), kl.numpy()
    bins = np.array_split(np.arange(d.size), POSITION_BINS)
    return {"n": int(d.size), "nll_q": float(nq.sum()), "nll_f": float(nf.sum()), "kl": float(kl.sum()),
            "top1": top1, "dnll_bins": [float(d[b].mean()) for b in bins],
            "kl_bins": [float(k[b].mean()) for b in bins]}


def row_pieces(n: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) pieces of ``n`` rows, ``size`` at a time, the last taking a lone remainder
    row (``size + 1``): a piece has one row only when ``n`` is 1 (``window_stats``)."""
    pieces = [(at, min(at + size, n)) for at in range(0, n, size)]
    if len(pieces) > 1 and pieces[-1][1] - pieces[-1][0] == 1:
        pieces[-2:] = [(pieces[-2][0], n)]
    return pieces
