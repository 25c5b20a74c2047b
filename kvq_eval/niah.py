"""Needle-in-a-haystack prompts (RULER style) and their scoring.

Notes
-----
REFERENCE.md section 10. A needle is "One of the special magic numbers for {key} is: {value}."
with an adjective-noun key and a 7-digit value, inserted at a chosen depth (fraction of the filler)
between sentences of the KJV haystack. Variants: ``single`` (one needle), ``multikey`` (the target
plus three needles with other keys), ``multivalue`` (one key with three values). The prompt ends
with the question and an answer prefix; the model continues greedily. Scoring: the fraction of the
asked values that appear (as digit strings) in the answer, so 0/1 for single and multi-key.

The document (haystack with needles) is prefilled once in full precision; the question and the
answer are then processed token by token over the method's quantized cache, so retrieval reads the
quantized keys and values (``run_sample``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

from .text import part

__all__ = ["Sample", "make_sample", "score", "VARIANTS", "ADJECTIVES", "NOUNS"]

VARIANTS = ("single", "multikey", "multivalue")
ADJECTIVES = ("ancient", "bright", "calm", "daring", "eager", "faint", "gentle", "hollow", "icy", "jolly",
              "keen", "lively", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tender")
NOUNS = ("anchor", "bridge", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jungle",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tower")
QUESTION = "\n\nWhat is the special magic number for {key} mentioned in the provided text?"
ANSWER = "\nThe special magic number for {key} mentioned in the provided text is"
ANSWER_MULTI = "\nThe special magic numbers for {key} mentioned in the provided text are"
INTRO = ("A special magic number is hidden within the following text. Make sure to memorize it. "
         "I will quiz you about it afterwards.\n\n")


@dataclass(frozen=True)
class Sample:
    """One prompt: ``document`` (intro + haystack with needles) and ``question`` (question + answer
    prefix), the ``key`` asked for and the ``values`` expected."""

    variant: str
    context: int
    depth: float
    seed: int
    document: str
    question: str
    key: str
    values: tuple[str, ...]


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.;:?!])\s+", text) if s.strip()]


def make_sample(tok, variant: str, context: int, depth: float, seed: int, haystack: str | None = None) -> Sample:
    """A prompt whose document and question together take about ``context`` tokens.

    Parameters
    ----------
    tok : tokenizer
    variant : {"single", "multikey", "multivalue"}
    context : int
        Target prompt length in tokens.
    depth : float in [0, 1]
        Position of the (target) needle in the filler.
    seed : int
        Keys, values, distractor positions and the haystack offset derive from it.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    rng = random.Random(seed)
    keys = rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], 4)
    key = keys[0]
    n_values = 3 if variant == "multivalue" else 1
    values = tuple(str(rng.randint(1_000_000, 9_999_999)) for _ in range(n_values))
    needles = [(depth, f"One of the special magic numbers for {key} is: {v}.") for v in values]
    if variant == "multikey":
        needles += [(rng.random(), f"One of the special magic numbers for {k} is: {rng.randint(1_000_000, 9_999_999)}.")
                    for k in keys[1:]]
    elif variant == "multivalue":
        needles = [(min(1.0, max(0.0, depth + 0.1 * i)), t) for i, (_, t) in enumerate(needles)]
    question = QUESTION.format(key=key) + (ANSWER_MULTI if n_values > 1 else ANSWER).format(key=key)
    sents = _sentences(haystack if haystack is not None else part("haystack"))
    start = rng.randrange(0, max(1, len(sents) // 2))
    budget = context - len(tok(INTRO + question).input_ids) - sum(len(tok(t).input_ids) + 1 for _, t in needles)
    filler, used = [], 0
    i = start
    while used < budget:
        s = sents[i % len(sents)]
        n = len(tok(" " + s).input_ids)
        if used + n > budget:
            break
        filler.append(s)
        used += n
        i += 1
    for d, text in sorted(needles, key=lambda x: -x[0]):  # insert from the back so positions hold
        filler.insert(int(round(d * len(filler))), text)
    return Sample(variant, context, depth, seed, INTRO + " ".join(filler), question, key, values)


def score(sample: Sample, answer: str) -> float:
    """Fraction of the expected values found in ``answer`` (digits only, so 1,234,567 counts)."""
    digits = re.sub(r"[^0-9 ]", "", answer.replace(",", ""))
    return float(np.mean([v in digits for v in sample.values]))
