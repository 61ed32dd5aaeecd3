"""Sampler tests: greedy, seeds, the sampled distribution against softmax, the filters' kept sets, penalties against
NumPy, option validation. Runs on the MLX backend through the ``mlx_engine.ml`` interfaces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlx_engine.errors import InvalidRequestError
from mlx_engine.ml import DType
from mlx_engine.models.generation.sampler import Sampler, SamplerOptions, apply_penalties


@pytest.fixture(scope="module")
def ctx():
    from mlx_engine.mlx import MLXContext

    return MLXContext()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# chi-square critical values at p = 0.001 by degrees of freedom (the draws are seeded, so the tests are exact)
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 9: 27.88}


def _draws(ctx, options: SamplerOptions, logits: np.ndarray, n: int) -> np.ndarray:
    """``n`` independent draws from one row of logits (one call on ``n`` copies of the row)."""
    batch = ctx.from_numpy(np.repeat(logits[None].astype(np.float32), n, axis=0))
    out = Sampler(options, ctx).sample(batch)
    assert out.dtype == DType.INT32 and out.shape == (n,)
    return out.numpy()


# ---- greedy and seeds ----------------------------------------------------------------------------------------------


def test_greedy_is_argmax(ctx):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 3000)).astype(np.float32) * 4
    tok = Sampler(SamplerOptions(), ctx).sample(ctx.from_numpy(logits))
    assert tok.dtype == DType.INT32 and tok.shape == (5,)
    np.testing.assert_array_equal(tok.numpy(), logits.argmax(-1))
    for dt in (DType.FLOAT16, DType.BFLOAT16):  # half-precision logits are sampled in float32
        half = ctx.from_numpy(logits, dt)
        np.testing.assert_array_equal(Sampler(SamplerOptions(), ctx).sample(half).numpy(),
                                      half.astype(DType.FLOAT32).numpy().argmax(-1))
    one = Sampler(SamplerOptions(), ctx).sample(ctx.from_numpy(logits[0]))  # [V] is taken as [1, V]
    assert one.shape == (1,) and int(one.numpy()[0]) == logits[0].argmax()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(ctx, temperature):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 500)).astype(np.float32)
    s = Sampler(SamplerOptions(temperature=temperature, top_k=1, seed=3), ctx)
    for _ in range(5):
        np.testing.assert_array_equal(s.sample(ctx.from_numpy(logits)).numpy(), logits.argmax(-1))


def test_same_seed_same_tokens_and_different_seed_differs(ctx):
    rng = np.random.default_rng(2)
    logits = ctx.from_numpy(rng.normal(size=(4, 200)).astype(np.float32) * 0.1)  # nearly uniform
    opts = dict(temperature=1.0, top_p=0.95, top_k=150)

    def run(seed):
        s = Sampler(SamplerOptions(seed=seed, **opts), ctx)
        return np.stack([s.sample(logits).numpy() for _ in range(30)])

    a, b, c = run(42), run(42), run(43)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.9  # 120 draws from ~150 tokens: a different seed agrees by chance only
    assert len({tuple(r) for r in a}) == 30  # the key advances at each call
    unseeded = [Sampler(SamplerOptions(**opts), ctx).sample(logits).numpy() for _ in range(2)]
    assert not np.array_equal(unseeded[0], unseeded[1])  # seed None draws a random seed


# ---- the sampled distribution --------------------------------------------------------------------------------------


def test_distribution_matches_softmax_with_temperature(ctx):
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
    n = 40000
    for temperature in (0.7, 1.0, 2.5):
        draws = _draws(ctx, SamplerOptions(temperature=temperature, seed=11), logits, n)
        counts = np.bincount(draws, minlength=8)
        probs = _softmax(logits.astype(np.float64) / temperature)
        assert _chi_square(counts, probs) < _CHI2_999[7], temperature
        assert np.abs(counts / n - probs).max() < 0.012


def _reference_filter(logits: np.ndarray, o: SamplerOptions) -> np.ndarray:
    """Hugging Face transformers' warpers in order (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    MinPLogitsWarper), written out in float64: the probabilities of the kept tokens."""
    x = logits.astype(np.float64) / o.temperature
    if o.top_k:
        kth = np.sort(x)[::-1][o.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if o.top_p < 1:
        order = np.argsort(x)  # ascending
        cum = np.cumsum(_softmax(x)[order])
        remove = cum <= 1 - o.top_p
        remove[-1] = False
        x[order[remove]] = -np.inf
    if o.min_p > 0:
        p = _softmax(x)
        x = np.where(p < o.min_p * p.max(), -np.inf, x)
    return _softmax(x)


@pytest.mark.parametrize("opts", [
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=2.0, top_k=6, top_p=0.9, min_p=0.1),
])
def test_filtered_distribution_matches_reference(ctx, opts):
    logits = np.array([1.2, 2.0, -0.4, 0.9, 0.0, 1.6, -1.5, 0.5, -0.2, 1.0], np.float32)
    o = SamplerOptions(seed=5, **opts)
    probs = _reference_filter(logits, o)
    kept = probs > 0
    n = 30000
    counts = np.bincount(_draws(ctx, o, logits, n), minlength=10)
    assert set(np.nonzero(counts)[0]) == set(np.nonzero(kept)[0])  # never an excluded token, every kept one seen
    assert _chi_square(counts, probs) < _CHI2_999[int(kept.sum()) - 1]
    processed = Sampler(o, ctx).process(ctx.from_numpy(logits[None])).numpy()[0]
    np.testing.assert_array_equal(np.isfinite(processed), kept)
    np.testing.assert_allclose(processed[kept], logits[kept] / o.temperature, rtol=1e-6)


def test_top_p_and_min_p_keep_exactly_the_right_tokens(ctx):
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    cases = [  # (options, the tokens that must survive)
        (dict(top_p=0.75), {0, 1}),  # 0.5 < 0.75 <= 0.8: the first two reach 0.75
        (dict(top_p=0.4), {0}),
        (dict(top_p=0.9), {0, 1, 2}),
        (dict(min_p=0.35), {0, 1}),  # keep p >= 0.175
        (dict(min_p=0.25), {0, 1, 2}),  # keep p >= 0.125
        (dict(min_p=1.0), {0}),
        (dict(top_p=0.9, min_p=0.35), {0, 1}),
        (dict(top_k=2, top_p=0.99), {0, 1}),
    ]
    for opts, keep in cases:
        o = SamplerOptions(temperature=1.0, seed=9, **opts)
        draws = _draws(ctx, o, logits, 4000)
        assert set(np.unique(draws)) == keep, opts
        assert set(np.flatnonzero(np.isfinite(Sampler(o, ctx).process(ctx.from_numpy(logits[None])).numpy()[0]))) \
            == keep, opts
    # the filters see the tempered distribution: at T = 3 the probabilities flatten and top_p 0.75 keeps three
    flat = _softmax(np.log(probs) / 3)
    assert flat[0] + flat[1] < 0.75 < flat[0] + flat[1] + flat[2]
    draws = _draws(ctx, SamplerOptions(temperature=3.0, top_p=0.75, seed=1), logits, 4000)
    assert set(np.unique(draws)) == {0, 1, 2}


# ---- penalties -----------------------------------------------------------------------------------------------------


def _reference_penalties(logits: np.ndarray, history: np.ndarray, o: SamplerOptions) -> np.ndarray:
    """llama.cpp's repeat penalty (llama_sampler_penalties) and OpenAI's frequency/presence penalties, by loops."""
    out = logits.astype(np.float64).copy()
    v = logits.shape[1]
    for r in range(logits.shape[0]):
        seq = [int(t) for t in history[r] if 0 <= t < v]
        if o.repeat_penalty != 1 and o.repeat_last_n != 0:
            window = seq if o.repeat_last_n == -1 else seq[-o.repeat_last_n:]
            for t in set(window):
                out[r, t] = out[r, t] / o.repeat_penalty if out[r, t] > 0 else out[r, t] * o.repeat_penalty
        for t in set(seq):
            c = seq.count(t)
            out[r, t] -= c * o.frequency_penalty + (1.0 if c > 0 else 0.0) * o.presence_penalty
    return out


@pytest.mark.parametrize("opts", [
    dict(repeat_penalty=1.3),
    dict(repeat_penalty=1.3, repeat_last_n=5),
    dict(repeat_penalty=0.7, repeat_last_n=-1),
    dict(repeat_penalty=1.5, repeat_last_n=0, presence_penalty=0.4),
    dict(frequency_penalty=0.25),
    dict(presence_penalty=-0.6, frequency_penalty=0.3),
    dict(repeat_penalty=1.1, repeat_last_n=12, presence_penalty=0.5, frequency_penalty=0.2),
])
def test_penalties_match_numpy(ctx, opts):
    rng = np.random.default_rng(7)
    n, v, t = 4, 64, 30
    logits = (rng.normal(size=(n, v)) * 3).astype(np.float32)
    logits[:, :5] = 0.0  # zero logits are left as they are by the repeat penalty
    history = rng.integers(0, 12, size=(n, t)).astype(np.int32)  # many repeats among few tokens
    history[0, :10] = -1  # left padding
    history[1, -7:] = -1  # right padding
    history[2, ::3] = -1  # holes
    history[3, 4] = v + 3  # out of range: ignored
    o = SamplerOptions(**opts)
    got = apply_penalties(ctx, ctx.from_numpy(logits), ctx.from_numpy(history), o).numpy()
    want = _reference_penalties(logits, history, o)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(got, logits)
    np.testing.assert_allclose(Sampler(o, ctx).process(ctx.from_numpy(logits), ctx.from_numpy(history)).numpy(),
                               want, rtol=1e-6, atol=1e-6)


def test_penalties_change_the_greedy_choice(ctx):
    logits = ctx.from_numpy(np.array([[3.0, 2.9, -1.0, 0.5]], np.float32))
    history = ctx.from_numpy(np.array([[-1, -1, 0, 3]], np.int32))
    assert Sampler(SamplerOptions(), ctx).sample(logits, history).numpy()[0] == 0
    assert Sampler(SamplerOptions(repeat_penalty=1.1), ctx).sample(logits, history).numpy()[0] == 1
    assert Sampler(SamplerOptions(presence_penalty=0.2), ctx).sample(logits, history).numpy()[0] == 1
    assert Sampler(SamplerOptions(repeat_penalty=1.1), ctx).sample(logits, None).numpy()[0] == 0  # no history
    long = ctx.from_numpy(np.array([[0, 1, 2, 3, 3]], np.int32))  # token 0 is out of the last 2
    assert Sampler(SamplerOptions(repeat_penalty=1.1, repeat_last_n=2), ctx).sample(logits, long).numpy()[0] == 0


def test_uses_history():
    assert not SamplerOptions().uses_history
    assert not SamplerOptions(repeat_penalty=1.2, repeat_last_n=0).uses_history
    assert SamplerOptions(repeat_penalty=1.2).uses_history
    assert SamplerOptions(presence_penalty=0.1).uses_history
    assert SamplerOptions(frequency_penalty=-0.1).uses_history


# ---- validation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "hot"),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_penalty", float("inf")),
    ("repeat_last_n", -2), ("repeat_last_n", 3.0),
    ("presence_penalty", float("nan")), ("frequency_penalty", float("-inf")), ("frequency_penalty", None),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5),
])
def test_invalid_options_raise(ctx, field, value):
    o = SamplerOptions(**{field: value})
    with pytest.raises(InvalidRequestError, match=field):
        o.validate()
    with pytest.raises(InvalidRequestError, match=field):
        Sampler(o, ctx)
    assert isinstance(InvalidRequestError("x"), ValueError)


def test_valid_edge_options(ctx):
    for o in (SamplerOptions(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0), SamplerOptions(top_p=1e-9, min_p=1.0),
              SamplerOptions(repeat_last_n=-1, repeat_penalty=1e-3, seed=0), SamplerOptions(seed=2**64 - 1),
              SamplerOptions(temperature=1e-4, top_k=10**9)):
        assert o.validate() is o
        tok = Sampler(o, ctx).sample(ctx.from_numpy(np.array([[0.0, 1.0, 0.5]], np.float32)))
        assert tok.numpy()[0] == 1
    assert math.isclose(SamplerOptions().top_p, 1.0) and SamplerOptions().repeat_last_n == 64


def test_argpartition_selects_the_top_k(ctx):
    """``Tensor.argpartition`` (added for the sampler's top-k) partitions as ``numpy.argpartition``."""
    x = np.random.default_rng(3).normal(size=(3, 1000)).astype(np.float32)
    got = ctx.from_numpy(-x).argpartition(39, axis=-1).numpy()[:, :40]
    for r in range(3):
        assert set(got[r]) == set(np.argsort(-x[r])[:40])
    from mlx_engine.ml import Tensor

    default = Tensor.argpartition(ctx.from_numpy(-x), 39)  # the interface's default: a full sort
    for r in range(3):
        assert set(default.numpy()[r, :40]) == set(np.argsort(-x[r])[:40])
