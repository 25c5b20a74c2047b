"""Evaluation text (protocol v3): disjoint parts, the fixtures rebuilt from Debian's bible-kjv,
short perplexity windows on their own text, the long needle haystack and its filler overlap."""

from __future__ import annotations

import shutil

import pytest

from kvq_eval.text import FIXTURES, PARTS, fixture_text, kjv_chapters, part, ppl_text


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv (the bible command) is not installed")
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixtures_are_the_kjv_as_bible_prints_it(name):
    path, verses = FIXTURES[name]
    assert fixture_text(name) == kjv_chapters(verses), f"{path.name} is not what kjv_chapters({verses!r}) makes"


def test_parts_are_disjoint_and_cover_what_they_claim():
    words = {n: fixture_text(n).split() for n in FIXTURES}
    spans = {}
    for name, (fixture, lo, hi) in PARTS.items():
        n = len(words[fixture])
        spans[name] = (fixture, int(lo * n), int(hi * n))
        assert part(name) == " ".join(words[fixture][spans[name][1]:spans[name][2]])

    def overlap(a, b):
        fa, la, ha = spans[a]
        fb, lb, hb = spans[b]
        return fa == fb and max(la, lb) < min(ha, hb)

    # calibration never meets any evaluation text; short and long perplexity windows never meet
    for other in ("evaluation", "haystack", "heldout", "short", "long_haystack"):
        assert not overlap("calibration", other)
    assert not overlap("short", "heldout") and not overlap("long_haystack", "heldout")
    assert ppl_text(1024) == ppl_text(4096) == "short" and ppl_text(4097) == ppl_text(8192) == "heldout"
    with pytest.raises(ValueError, match="part must be one of"):
        part("nope")
    with pytest.raises(ValueError, match="fixture must be one of"):
        fixture_text("nope")


class _WordTokenizer:
    """Counts a word as a token: enough for the generator's budget arithmetic."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False, **kw):
        class Out:
            input_ids = text.split()

        return Out()


def test_long_haystack_beyond_4k_and_refusal():
    from kvq_eval.niah import haystack_part, make_sample

    tok = _WordTokenizer()
    assert haystack_part(4096) == "haystack" and haystack_part(8192) == "long_haystack"
    short = make_sample(tok, "single", 4096, 0.5, 0)
    long = make_sample(tok, "single", 8192, 0.5, 0)
    assert short.sentences > 0 and long.sentences > 0
    # each sample's filler starts at its offset in its own haystack part
    from kvq_eval.niah import _haystack_sentences

    assert _haystack_sentences("long_haystack")[long.offset] in long.document
    assert _haystack_sentences("haystack")[short.offset] in short.document
    with pytest.raises(ValueError, match="needs more filler than the 'long_haystack' haystack holds"):
        make_sample(tok, "single", 2_000_000, 0.5, 0)
    with pytest.raises(ValueError, match="haystack holds"):
        make_sample(tok, "single", 40_000, 0.5, 0, haystack=part("haystack"))


def test_filler_overlap_is_low_on_the_long_haystack():
    """The statement the README makes: 30 samples of 8K share little filler on the long haystack
    (word tokens here: 8K words is ~10K SmolLM2 tokens, so this is a conservative check)."""
    from kvq_eval.niah import filler_overlap

    tok = _WordTokenizer()
    depths = (0.1, 0.3, 0.5, 0.7, 0.9)
    long = filler_overlap(tok, "single", 8192, depths, 6)
    short = filler_overlap(tok, "single", 4096, depths, 6)
    assert long["prompts"] == short["prompts"] == 30 and long["haystack"] == "long_haystack"
    assert long["pair_overlap"] < 0.03 and long["mean_uses"] < 1.5
    assert short["pair_overlap"] > 0.05  # the short haystack's samples share filler (stated in the docs)
