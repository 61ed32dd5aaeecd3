"""Speculative decoding with prompt lookup: the output is the model's own (token for token when greedy, in
distribution when sampled), with a grammar, a stop string inside an accepted run, and past Gemma 3's sliding window."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

import mlx_engine
from mlx_engine.errors import InvalidOptionError, InvalidRequestError
from mlx_engine.kvcache import CausalCache, RecurrentCache
from mlx_engine.models.generation.options import GenerationOptions
from mlx_engine.models.generation.runner import GenerationStats, Request, Runner
from mlx_engine.models.generation.sampler import SamplerOptions
from mlx_engine.models.generation.speculative import DraftLength, PromptLookup, verify_token

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
             "climbed the narrow spiral stairs, trimmed the wick, polished the great lens and watched the beam sweep "
             "across the dark water. Ships passing in the storm relied on that light to find the harbour safely.")


def _tokens(model, tokens, n, speculative, **kw):
    model.runner.reset(0)
    stats = GenerationStats()
    out = list(model.runner.generate_tokens(Request(tokens, SamplerOptions(**kw), n, (), 0, speculative=speculative),
                                            stats))
    return out, stats


# ---- the drafter and the acceptance rule --------------------------------------------------------------------------
def test_prompt_lookup_takes_the_longest_latest_match():
    lookup = PromptLookup()
    assert lookup.draft([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 3) == [7, 8, 5]  # the latest 3-gram match
    assert lookup.draft([4, 5, 6, 7, 9, 5], 2) == [6, 7]  # no 3- or 2-gram match: the 1-gram
    assert lookup.draft([1, 2, 3], 4) == []  # nothing repeats
    length = DraftLength(4)
    length.update(4, 0)
    assert length.k == 2
    length.update(2, 2)
    assert length.k == 3


def test_rejected_one_token_drafts_pause_drafting_longer_each_time():
    length = DraftLength(2)
    length.update(2, 0)
    assert (length.k, length.next) == (1, 1)  # halved: no pause yet
    paused = []
    for _ in range(3):
        length.update(1, 0)  # a one-token draft rejected
        n = 0
        while length.next == 0:
            n += 1
            length.update(0, 0)  # a plain pass
        paused.append(n)
    assert paused == [2, 4, 8]
    for _ in range(3):
        length.update(1, 0)
        while length.next == 0:
            length.update(0, 0)
    length.update(1, 0)
    assert length.rest == 16  # at most 16
    while length.next == 0:
        length.update(0, 0)
    length.update(1, 1)  # accepted: the run of misses ends, and the next miss pauses 2 again
    length.update(2, 0)
    length.update(1, 0)
    assert length.rest == 2


def _chi_square_p_value(counts: np.ndarray, p: np.ndarray) -> float:
    """Upper tail of the chi-square statistic with 4 degrees of freedom (5 categories): exp(-x/2) (1 + x/2)."""
    assert len(p) == 5
    expected = p * counts.sum()
    x = float(((counts - expected) ** 2 / expected).sum())
    return math.exp(-x / 2) * (1 + x / 2)


def _first_tokens(rule, p: np.ndarray, draft: int, seeds: int = 8000) -> np.ndarray:
    counts = np.zeros(len(p))
    for seed in range(seeds):
        token, _ = rule(p, draft, np.random.default_rng(seed))
        counts[token] += 1
    return counts


def test_sampled_speculation_keeps_the_target_distribution():
    """Over many seeds the first token after a draft follows the target's p (chi-square, p-value > 0.001); a rule
    that accepts every draft, or one that redraws from p itself on rejection, fails the same test."""
    p = np.array([0.1, 0.3, 0.25, 0.05, 0.3])
    for draft in (1, 3):
        assert _chi_square_p_value(_first_tokens(verify_token, p, draft), p) > 1e-3

    def accept_always(p, draft, rng):
        return draft, True

    def redraw_from_p(p, draft, rng):
        return (draft, True) if rng.random() < p[draft] else (int(rng.choice(len(p), p=p)), False)

    for broken in (accept_always, redraw_from_p):
        assert _chi_square_p_value(_first_tokens(broken, p, 1), p) < 1e-3


# ---- real models ---------------------------------------------------------------------------------------------------
def test_greedy_lookup_is_plain_greedy_on_smollm2(smollm2_model):
    m = smollm2_model
    tokens = m.chat_tokens([{"role": "user", "content": "Repeat this paragraph exactly:\n\n" + PARAGRAPH}])
    plain, _ = _tokens(m, tokens, 60, "off")
    fast, stats = _tokens(m, tokens, 60, "lookup")
    assert fast == plain
    assert stats.verify_steps < 59 and stats.draft_accepted > 0  # drafts were accepted: several tokens a pass
    with pytest.raises(InvalidOptionError, match="speculative"):
        GenerationOptions.parse({"speculative": "medusa"})
    with pytest.raises(InvalidOptionError, match="draft_tokens"):
        GenerationOptions.parse({"draft_tokens": 0})


def test_lookup_with_a_json_schema_and_a_stop_string(smollm2_model):
    m = smollm2_model
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    prompt = "Put this paragraph in the text field of a JSON object:\n\n" + PARAGRAPH
    runs = {s: list(m.stream(prompt, json_schema=schema, max_tokens=80, temperature=0, speculative=s))
            for s in ("off", "lookup")}
    assert runs["lookup"][:-1] == runs["off"][:-1]
    assert runs["lookup"][-1].format_complete == runs["off"][-1].format_complete
    assert runs["lookup"][-1].draft_accepted > 0

    prompt = "Repeat this paragraph exactly:\n\n" + PARAGRAPH
    whole = "".join(p for p in m.stream(prompt, max_tokens=60, temperature=0) if isinstance(p, str))
    assert "spiral" in whole  # the stop string falls in the copied run, which lookup drafts and accepts
    cut = {s: list(m.stream(prompt, max_tokens=60, temperature=0, stop=["spiral"], speculative=s))
           for s in ("off", "lookup")}
    assert cut["lookup"][:-1] == cut["off"][:-1]
    assert "".join(cut["lookup"][:-1]) == whole[:whole.index("spiral")]
    stats = cut["lookup"][-1]
    assert stats.stop_reason == "stop" and stats.verify_steps < stats.generated_tokens - 1
    # the cache holds what was read: the rejected draft and the tokens past the stop were rolled back
    cached = m.runner.cached_tokens(0)
    assert len(cached) < len(m.chat_tokens([{"role": "user", "content": prompt}])) + stats.generated_tokens


def test_sampled_lookup_runs_reproducibly(smollm2_model):
    m = smollm2_model
    prompt = "Repeat this paragraph exactly:\n\n" + PARAGRAPH
    a = list(m.stream(prompt, max_tokens=30, temperature=0.7, seed=3, speculative="lookup", draft_tokens=4))
    b = list(m.stream(prompt, max_tokens=30, temperature=0.7, seed=3, speculative="lookup", draft_tokens=4))
    assert a[:-1] == b[:-1] and a[-1].generated_tokens == 30 and a[-1].verify_steps > 0


def test_greedy_lookup_past_gemma3s_sliding_window(gemma3_gguf):
    """A prompt past the 512-token window: the ring of the sliding layers is written by multi-token verification
    passes and rolled back by ``remove``; the tokens stay plain greedy's."""
    m = mlx_engine.load(str(gemma3_gguf), progress=False, context_length=1024)
    try:
        text = " ".join([PARAGRAPH] * 9)
        tokens = m.runner.tokenizer.encode("Text: " + text + "\nThe same text again: " + PARAGRAPH[:60])
        assert len(tokens) > 512
        plain, _ = _tokens(m, tokens, 40, "off")
        fast, stats = _tokens(m, tokens, 40, "lookup")
        assert fast == plain
        assert stats.draft_accepted > 0
    finally:
        m.close()


def test_speculation_is_refused_where_a_draft_cannot_be_taken_back():
    """A recurrent state cannot forget a rejected draft: the request is refused with what to do."""
    runner = SimpleNamespace(cache=RecurrentCache(shift_fn=None), model=SimpleNamespace(architecture="lfm2"),
                             draft=None, mtp=None, mtp_head=None)
    with pytest.raises(InvalidRequestError, match="lfm2: its recurrent layers .* use --speculative off"):
        Runner.drafter(runner, Request([1], speculative="lookup"))
    assert Runner.drafter(runner, Request([1])) is None  # without speculation it runs as before
    runner.cache = CausalCache(shift_fn=None)
    with pytest.raises(InvalidRequestError, match="draft_tokens must be an integer >= 1"):
        Runner.drafter(runner, Request([1], speculative="lookup", draft_tokens=0))
    with pytest.raises(InvalidRequestError, match="needs a draft model: load the model with --draft-model"):
        Runner.drafter(runner, Request([1], speculative="draft"))
