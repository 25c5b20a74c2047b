"""Needle-in-a-haystack prompts that sample: every (variant, context, depth, sample) its own needles.

Notes
-----
:ref:`ref-niah` (RULER). A needle is "One of the special magic numbers for {key} is:
{value}." with an adjective-noun key and a 7-digit value, inserted at a depth (fraction of the
filler) between sentences of a KJV haystack (``haystack_part``): prompts of up to
``text.SHORT_HAYSTACK_MAX`` tokens take their filler from the ``haystack`` part (Genesis 30 %
to the end of Exodus, ~35K tokens: protocol v2's samples), longer ones from ``long_haystack``
(Joshua to Revelation, ~0.9M tokens), so that the 30 samples of an 8K context share little filler
(``filler_overlap`` measures it: each filler sentence of the short haystack is in 3.5 of 30 4K
samples on average, 7.5-8.6 at 8K, which is why 8K moved to the long one). Variants:

* ``single``: one needle, asked for;
* ``multiquery`` (RULER's multi-query): four needles with distinct keys, the target at ``depth``
  and the others at random depths; the question asks for 2-4 of them (the number drawn per sample,
  the target always included).

Every random choice of a sample (keys, values, asked count, other depths, haystack offset) comes
from one generator keyed on (variant, context, depth, sample): ``numpy.random.default_rng`` of
``(version, variant index, context, round(depth * 10**6), sample)`` with ``version`` =
``VERSION`` (2) on the short haystack and ``VERSION_LONG`` (3) on the long one. Two samples never share a
needle by construction of the seed (up to chance collisions of the draws), and the haystack window
starts at a random sentence of the whole haystack part, so a 1K prompt is not a prefix of a 4K one.
A prompt needs fewer filler tokens than its haystack holds: a longer context is refused.

The prompt is wrapped in the model's chat template when it has one (the user turn holds document
and question, the assistant turn starts with the answer prefix). ``Sample.document`` ends where the
question starts: the document is prefilled once and shared by every method.

Scores (``runner.Evaluator.niah``): exact match (the greedy answer contains every asked value as
a digit string) and the teacher-forced log-probability of the reference answer ``Sample.reference``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .text import SHORT_HAYSTACK_MAX, part

__all__ = ["Sample", "make_sample", "exact_match", "VARIANTS", "ADJECTIVES", "NOUNS", "haystack_part",
           "filler_overlap"]

VERSION = 2  # part of every sample's seed: bump when the generator changes
VERSION_LONG = 3  # the seed's version on the long haystack (contexts above text.SHORT_HAYSTACK_MAX)
VARIANTS = ("single", "multiquery")
ADJECTIVES = ("ancient", "bright", "calm", "daring", "eager", "faint", "gentle", "hollow", "icy", "jolly",
              "keen", "lively", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tender",
              "amber", "bold", "crisp", "dusty", "early", "fierce", "golden", "humble", "idle", "jagged")
NOUNS = ("anchor", "bridge", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jungle",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tower",
         "arrow", "barrel", "canyon", "desert", "ember", "forest", "glacier", "hammer", "iris", "jewel")
INTRO = ("A special magic number is hidden within the following text. Make sure to memorize it. "
         "I will quiz you about it afterwards.\n\n")
INTRO_MULTI = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
               "I will quiz you about them afterwards.\n\n")
QUESTION = "\n\nWhat is the special magic number for {keys} mentioned in the provided text?"
QUESTION_MULTI = "\n\nWhat are all the special magic numbers for {keys} mentioned in the provided text?"
ANSWER = "The special magic number for {keys} mentioned in the provided text is"
ANSWER_MULTI = "The special magic numbers for {keys} mentioned in the provided text are"
N_MULTI = 4  # needles in a multi-query sample


@dataclass(frozen=True)
class Sample:
    """One prompt. ``document`` (template start, intro, haystack with needles) is prefilled once;
    ``question`` (question, template turn change, answer prefix) follows it; ``reference`` is the
    answer continuation scored by teacher forcing; ``keys``/``values`` are the asked needles."""

    variant: str
    context: int
    depth: float
    sample: int
    document: str
    question: str
    reference: str
    keys: tuple[str, ...]
    values: tuple[str, ...]
    offset: int  # first haystack sentence used
    chat: bool
    sentences: int = 0  # filler sentences used (offset, offset + 1, ... modulo the haystack's count)


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.;:?!])\s+", text) if s.strip()]


def haystack_part(context: int) -> str:
    """The text part a ``context``-token prompt takes its filler from (module docstring)."""
    return "haystack" if context <= SHORT_HAYSTACK_MAX else "long_haystack"


@lru_cache(maxsize=4)
def _haystack_sentences(name: str) -> tuple[str, ...]:
    return tuple(_sentences(part(name)))


def sample_rng(variant: str, context: int, depth: float, sample: int) -> np.random.Generator:
    """The one generator of a sample (module docstring)."""
    version = VERSION if haystack_part(int(context)) == "haystack" else VERSION_LONG
    return np.random.default_rng([version, VARIANTS.index(variant), int(context), int(round(depth * 10**6)),
                                  int(sample)])


def _check(variant, context, depth, sample):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 256:
        raise ValueError(f"context must be an integer >= 256 tokens, got {context!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
        raise ValueError(f"sample must be a non-negative integer, got {sample!r}")


def _wrap(tok, user: str, answer_prefix: str) -> tuple[str, str]:
    """(text before the user content, text after it up to the answer prefix) of the chat template,
    or ("", "\\n") without one."""
    if getattr(tok, "chat_template", None):
        marker = "\x00USER\x00"
        text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                       add_generation_prompt=True)
        head, tail = text.split(marker)
        return head, tail + answer_prefix
    return "", "\n" + answer_prefix


def make_sample(tok, variant: str, context: int, depth: float, sample: int, haystack: str | None = None,
                chat: bool = True) -> Sample:
    """A prompt of about ``context`` tokens (document + question), drawn from its own generator.

    Parameters
    ----------
    tok : tokenizer
    variant : {"single", "multiquery"}
    context : int >= 256
    depth : float in [0, 1]
        Position of the target needle in the filler.
    sample : int >= 0
        Index of the sample at this (variant, context, depth).
    haystack : str, optional
        Filler text (default: ``haystack_part(context)``).
    chat : bool
        Use the tokenizer's chat template when it has one.

    Raises
    ------
    ValueError
        Bad arguments, or a context that needs more filler than the haystack holds (the message
        names the maximum context; a prompt is never cut short of its label).
    """
    _check(variant, context, depth, sample)
    rng = sample_rng(variant, context, depth, sample)
    pool = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
    n_needles = 1 if variant == "single" else N_MULTI
    keys = [pool[i] for i in rng.choice(len(pool), size=n_needles, replace=False)]
    values = [str(v) for v in rng.integers(1_000_000, 10_000_000, size=n_needles)]
    depths = [float(depth)] + [float(x) for x in rng.random(n_needles - 1)]
    asked = 1 if variant == "single" else int(rng.integers(2, N_MULTI + 1))
    ask_idx = [0] + sorted(int(i) + 1 for i in rng.choice(n_needles - 1, size=asked - 1, replace=False))
    ask_keys = tuple(keys[i] for i in ask_idx)
    ask_values = tuple(values[i] for i in ask_idx)
    key_text = ", ".join(ask_keys)
    if variant == "single":
        intro, q, a = INTRO, QUESTION.format(keys=key_text), ANSWER.format(keys=key_text)
    else:
        intro, q, a = INTRO_MULTI, QUESTION_MULTI.format(keys=key_text), ANSWER_MULTI.format(keys=key_text)
    head, tail = _wrap(tok, "", a) if chat else ("", "\n" + a)
    reference = " " + ", ".join(ask_values) + "."
    needles = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(depths, keys, values)]
    sents = _sentences(haystack) if haystack is not None else _haystack_sentences(haystack_part(context))
    offset = int(rng.integers(0, len(sents)))
    fixed = head + intro + q + tail
    budget = context - len(tok(fixed, add_special_tokens=False).input_ids) - sum(
        len(tok(" " + t, add_special_tokens=False).input_ids) for _, t in needles)
    filler, used, i = [], 0, offset
    while used < budget and len(filler) < len(sents):
        s = sents[i % len(sents)]
        n = len(tok(" " + s, add_special_tokens=False).input_ids)
        if used + n > budget:
            break
        filler.append(s)
        used += n
        i += 1
    if len(filler) == len(sents) and used < budget:
        raise ValueError(f"context {context} needs more filler than the {haystack_part(context)!r} haystack holds "
                         f"({used} tokens of {len(sents)} sentences, {budget} needed): this {variant} prompt "
                         f"reaches at most {context - (budget - used)} tokens (maximum context)")
    for d, text in sorted(needles, key=lambda x: -x[0]):  # insert from the back so positions hold
        filler.insert(int(round(d * len(filler))), text)
    return Sample(variant, context, float(depth), sample, head + intro + " ".join(filler), q + tail, reference,
                  ask_keys, ask_values, offset, bool(head), len(filler) - len(needles))


def exact_match(sample: Sample, answer: str) -> bool:
    """Whether every asked value appears (as a digit string) in ``answer`` (1,234,567 counts)."""
    found = set(re.sub(r"[^0-9]+", " ", answer.replace(",", "")).split())
    return all(v in found for v in sample.values)


def filler_overlap(tok, variant: str, context: int, depths, samples: int) -> dict:
    """How much filler the needle samples of one (variant, context) share.

    Parameters
    ----------
    tok : tokenizer
    variant, context : as in ``make_sample``
    depths : sequence of float
    samples : int
        Samples per depth (the grid's cells: ``len(depths) * samples`` prompts).

    Returns
    -------
    dict
        ``prompts``; ``haystack`` (its part name) and ``haystack_sentences``; ``mean_uses`` (over the
        filler sentences used at all, how many prompts hold each), ``max_uses``; ``pair_overlap``
        (mean over prompt pairs of the shared sentences as a fraction of a prompt's filler) and
        ``max_pair_overlap``.
    """
    name = haystack_part(context)
    n = len(_haystack_sentences(name))
    sets = []
    for d in depths:
        for s in range(samples):
            smp = make_sample(tok, variant, context, float(d), s)
            sets.append({(smp.offset + i) % n for i in range(smp.sentences)})
    uses: dict[int, int] = {}
    for st in sets:
        for i in st:
            uses[i] = uses.get(i, 0) + 1
    pairs = [len(a & b) / max(1, min(len(a), len(b))) for i, a in enumerate(sets) for b in sets[i + 1:]]
    return {"variant": variant, "context": context, "prompts": len(sets), "haystack": name,
            "haystack_sentences": n, "mean_uses": float(np.mean(list(uses.values()))),
            "max_uses": int(max(uses.values())), "pair_overlap": float(np.mean(pairs)) if pairs else 0.0,
            "max_pair_overlap": float(max(pairs)) if pairs else 0.0}
