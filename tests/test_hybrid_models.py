"""Hybrid models on the recurrent cache: LFM2 (short convolutions) and Qwen3-Next (Gated DeltaNet, gated attention,
experts) against transformers and mlx-lm on small random checkpoints (folders, and a GGUF for LFM2), chunked and
batched prefill, copy-on-write, checkpoint restore, roll-back refusals, bounded memory, and a 10-turn chat session
that prefills only each new message."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError
from mlx_engine.kvcache import RecurrentCache
from mlx_engine.mlx import MLXBackend
from mlx_engine.models.registry import load_text_model
from mlx_engine.models.generation.runner import GenerationStats, Request, Runner
from mlx_engine.models.generation.sampler import SamplerOptions
from tests.conftest import NoText, logits_for
from tests.hybrid_small import BUILDERS, greedy_reference, lfm2_gguf, qwen3_next_gguf, write_gguf

pytest.importorskip("torch")

INTERVAL = 48  # the test cache's checkpoint interval: prompts below are longer than it


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def hybrid(request, tmp_path_factory):
    """Each hybrid architecture's random checkpoint: ``(folder, transformers model)``."""
    folder = tmp_path_factory.mktemp("hybrid") / request.param
    return folder, BUILDERS[request.param](folder)


def _runner(path, *, chunk: int = 64, sequences: int = 4, count: int = 24, interval: int = INTERVAL,
            min_pos: int = 16) -> Runner:
    model = load_text_model(MLXBackend(path, dtype="float32"))
    model.cache_options = dict(checkpoint_count=count, checkpoint_interval=interval, checkpoint_min_pos=min_pos)
    return Runner(model, NoText(), context_length=1024, max_sequences=sequences, prefill_chunk=chunk)




def _greedy(runner: Runner, prompt: list[int], n: int, seq: int = 0) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    req = Request(prompt, SamplerOptions(temperature=0.0), max_tokens=n, sequence=seq)
    return list(runner.generate_tokens(req, stats)), stats


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 261, n)]


def test_matches_transformers(hybrid):
    folder, reference = hybrid
    prompt = _prompt(1, 150)  # 3 chunks of 64, longer than the checkpoint interval
    ref_first, ref_tokens = greedy_reference(reference, prompt, 64)
    runner = _runner(folder)
    first = logits_for(runner.model, runner, prompt)
    assert np.abs(first - ref_first).max() <= 1e-3 * np.abs(ref_first).max()
    tokens, _ = _greedy(runner, prompt, 64)
    assert tokens == ref_tokens
    assert runner.cache.checkpoints(0)  # checkpoints were taken on the way


def test_matches_mlx_lm(hybrid):
    from mlx_lm.utils import load_model

    from tests.reference import mlx_lm_greedy

    folder, _ = hybrid
    prompt = _prompt(2, 100)
    ref_first, ref_tokens = mlx_lm_greedy(load_model(folder)[0], prompt, 64)
    runner = _runner(folder)
    tokens, _ = _greedy(runner, prompt, 64)
    first = logits_for(runner.model, runner, prompt)
    assert np.abs(first - ref_first).max() <= 1e-3 * np.abs(ref_first).max()
    assert tokens == ref_tokens


def test_an_mlx_lm_quantized_folder_matches_mlx_lm(hybrid, tmp_path):
    """A folder that ``mlx_lm.convert`` quantized (mlx-community's layout: 4-bit, experts stacked as
    ``switch_mlp``, norms holding ``1 + w``, the convolution ``[C, K, 1]``) loads with its experts quantized and
    gives mlx-lm's greedy tokens from the same file."""
    from mlx_lm import convert
    from mlx_lm.utils import load_model

    from tests.reference import mlx_lm_greedy

    folder, _ = hybrid
    out = tmp_path / "mlx-4bit"
    convert(str(folder), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    prompt = _prompt(6, 80)
    ref_first, ref_tokens = mlx_lm_greedy(load_model(out)[0], prompt, 32)
    runner = _runner(out)
    moe = [w for w in runner.model.layers.values() if w.get("experts_gate") is not None]
    assert all(w[k].is_quantized for w in moe for k in ("experts_gate", "experts_up", "experts_down"))
    assert len(moe) == (3 if folder.name == "qwen3_next" else 0)
    first = logits_for(runner.model, runner, prompt)
    assert np.abs(first - ref_first).max() <= 1e-3 * np.abs(ref_first).max()
    assert _greedy(runner, prompt, 32)[0] == ref_tokens


def test_gguf_equals_the_folder(hybrid, tmp_path):
    """The same weights written as llama.cpp's converter writes them give the folder's logits and tokens."""
    folder, reference = hybrid
    write = {"lfm2": lfm2_gguf, "qwen3_next": qwen3_next_gguf}[folder.name]
    path = write(reference, tmp_path / f"{folder.name}.gguf")
    prompt = _prompt(3, 70)
    gguf_runner, folder_runner = _runner(path), _runner(folder)
    assert gguf_runner.model.config.layer_types == folder_runner.model.config.layer_types
    a = logits_for(gguf_runner.model, gguf_runner, prompt)
    b = logits_for(folder_runner.model, folder_runner, prompt)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    assert _greedy(gguf_runner, prompt, 32)[0] == _greedy(folder_runner, prompt, 32)[0]


def test_chunked_prefill_and_batching_give_the_same_tokens(hybrid):
    folder, _ = hybrid
    a, b = _prompt(4, 90), _prompt(5, 90)
    whole = _runner(folder, chunk=512)
    alone = [_greedy(whole, p, 24, seq=0)[0] for p in (a, b)]
    assert _greedy(_runner(folder, chunk=7), a, 24)[0] == alone[0]
    batched = _runner(folder, chunk=32).generate_batch([Request(a, max_tokens=24, sequence=0),
                                                        Request(b, max_tokens=24, sequence=1)])
    assert batched == alone


def test_copy_on_write_sequences_diverge_like_fresh_runs(hybrid):
    folder, _ = hybrid
    shared, tail0, tail1 = _prompt(6, 60), _prompt(7, 20), _prompt(8, 20)
    runner = _runner(folder)
    _greedy(runner, shared + tail0[:1], 1, seq=0)  # the state of seq 0 is after the shared prefix + 1 token
    cache = runner.cache
    # seq 1 shares seq 0's slot (copy-on-write): same state, one slot
    runner.cache.copy_prefix(0, 1, len(shared) + 1)
    runner._cached[1] = list(runner._cached[0])
    assert cache.slots_in_use() == 1
    got0, _ = _greedy(runner, shared + tail0, 16, seq=0)
    got1, _ = _greedy(runner, shared + tail0[:1] + tail1, 16, seq=1)
    assert cache.slots_in_use() == 2  # the first write gave a sequence a slot of its own
    fresh = _runner(folder)
    assert got0 == _greedy(fresh, shared + tail0, 16, seq=0)[0]
    assert got1 == _greedy(fresh, shared + tail0[:1] + tail1, 16, seq=1)[0]


def test_a_shared_prefix_restores_the_nearest_checkpoint(hybrid):
    folder, _ = hybrid
    prompt = _prompt(9, 200)
    runner = _runner(folder, chunk=16)
    # prefill chunks end on the checkpoint grid (16, then every 48) and before the prompt's last token
    assert runner.chunk_bounds(0, 200)[:3] == [(0, 16), (16, 17), (17, 33)]
    assert runner.chunk_bounds(0, 200)[-2:] == [(193, 199), (199, 200)]
    _greedy(runner, prompt, 4, seq=0)
    cps = runner.cache.checkpoints(0)
    assert cps == [16, 64, 112, 160, 198]
    assert len(prompt) - 2 in cps  # the one the runner asks for before the prompt's last token
    other = prompt[:150] + _prompt(10, 30)
    shared = runner.share_prefix(0, 1, other)
    restore = max(p for p in cps if p < 150) + 1
    assert shared == restore  # the nearest checkpoint at or before the common prefix
    tokens, stats = _greedy(runner, other, 16, seq=1)
    assert stats.prefilled_tokens == len(other) - restore
    assert tokens == _greedy(_runner(folder), other, 16, seq=0)[0]
    # the same prompt again (a regenerated answer) runs one token: the checkpoint before the prompt's last token
    again, stats = _greedy(runner, prompt, 4, seq=0)
    assert stats.prefilled_tokens == 1
    assert again == _greedy(_runner(folder), prompt, 4)[0]


def test_remove_to_a_position_without_a_checkpoint_is_refused_and_changes_nothing(hybrid):
    folder, _ = hybrid
    prompt = _prompt(11, 120)
    runner = _runner(folder)
    _greedy(runner, prompt, 8, seq=0)
    cache: RecurrentCache = runner.cache
    before = (cache.length(0), cache.checkpoints(0), cache.kv.positions(0).tolist(), cache.nbytes())
    bad = next(p for p in range(1, cache.length(0)) if p - 1 not in cache.checkpoints(0))
    with pytest.raises(CacheError, match="cannot be rolled back to position"):
        cache.remove(0, bad, None)
    with pytest.raises(CacheError, match="middle"):
        cache.remove(0, 10, 20)
    assert (cache.length(0), cache.checkpoints(0), cache.kv.positions(0).tolist(), cache.nbytes()) == before
    assert cache.restore_point(0, bad) == max([p + 1 for p in cache.checkpoints(0) if p + 1 <= bad], default=0)
    # and the sequence goes on as if nothing was asked
    held = runner.cached_tokens(0)
    assert _greedy(runner, held, 8)[0] == _greedy(_runner(folder), held, 8)[0]


def test_batches_the_recurrent_layers_cannot_run_are_refused(hybrid):
    folder, _ = hybrid
    runner = _runner(folder)
    cache = runner.cache
    mixed = Batch(np.array([5, 6, 7]), [0, 1, 0], [0, 0, 1], [2])  # unequal runs
    assert not cache.is_supported_for_batch(mixed)
    with runner.backend.new_context() as ctx:
        with pytest.raises(CacheError, match="same number"):
            runner.model.forward(ctx, mixed, cache)
        with pytest.raises(CacheError, match="cannot skip"):
            runner.model.forward(ctx, Batch.single(np.array([5, 6]), 4, 0), cache)
    assert cache.cells_in_use() == 0 and cache.slots_in_use() == 0


def test_recurrent_memory_is_bounded_by_slots_and_checkpoints(hybrid):
    folder, _ = hybrid
    runner = _runner(folder, chunk=32, count=3, interval=32)
    cache: RecurrentCache = runner.cache
    one = _runner(folder, count=0)
    one.prefill(one.backend.new_context(), 0, _prompt(19, 5))  # one forward from the start: one state, no other
    per_state = one.cache.nbytes() - one.cache.kv.nbytes()
    assert per_state > 0
    seen = []
    tokens: list[int] = []
    for i in range(6):
        tokens += _prompt(20 + i, 100)
        runner.prefill(runner.backend.new_context(), 0, tokens)
        seen.append(cache.nbytes() - cache.kv.nbytes())
        assert len(cache.checkpoints(0)) <= 3
    assert max(seen) <= (2 + 3) * per_state  # one slot: its state, one step back and at most 3 checkpoints
    assert seen[-1] == seen[2]  # however long the sequence runs
    assert runner.model.state_bytes() == (2 + 3) * per_state


def test_a_ten_turn_chat_prefills_only_the_new_message(hybrid):
    import mlx_engine

    folder, _ = hybrid
    model = mlx_engine.load(str(folder), context_length=2048, dtype="float32")
    letters = {"response_format": {"type": "regex", "pattern": "[a-z ]{4,12}"}, "max_tokens": 12}
    session = model.chat_session(**letters)
    history: list[dict] = []
    rng = np.random.default_rng(12)
    for turn in range(10):
        message = f"turn {turn}: " + "".join(chr(c) for c in rng.integers(97, 123, 8 + turn))
        history.append({"role": "user", "content": message})
        ids = model._chat_ids(history)
        held = model.runner.common_prefix(session.sequence, ids)  # all but a stop token the template rewrites
        assert held >= model.runner.cached_length(session.sequence) - 1
        answer = "".join(p for p in session.send(message) if isinstance(p, str))
        assert session.last_stats.prefilled_tokens == len(ids) - held, turn
        assert answer == model.chat(history, **letters), turn
        history.append({"role": "assistant", "content": answer})
    assert len({m["content"] for m in history if m["role"] == "assistant"}) > 3  # the answers differ turn to turn
    model.close()



def test_the_server_shares_a_prefix_through_a_checkpoint(hybrid, tmp_path, monkeypatch):
    """Two requests with the same long system prompt: the second restores the first's checkpoint before the
    prompt's end (the server's prefix cache, through the recurrent cache) and answers as a fresh model does."""
    import openai

    import mlx_engine
    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    folder, _ = hybrid
    monkeypatch.setenv("MLX_ENGINE_HOME", str(tmp_path / "home"))
    system = "you answer in letters only. " * 6
    asks = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("first one", "second")]
    fresh = mlx_engine.load(str(folder), context_length=2048, dtype="float32")
    want = [fresh.chat(m, max_tokens=16, temperature=0) for m in asks]
    fresh.close()
    srv = RunningServer(ServerConfig(port=free_port(), models=[str(folder)], max_sequences=4, context_length=2048,
                                     store_root=str(tmp_path / "home")))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        name = str(folder)  # the model is named as the server was given it
        got = [client.chat.completions.create(model=name, messages=m, max_tokens=16, temperature=0) for m in asks]
    finally:
        srv.stop()
    assert [g.choices[0].message.content for g in got] == want
    assert got[0].usage.prompt_tokens_details.cached_tokens == 0
    assert 16 <= got[1].usage.prompt_tokens_details.cached_tokens < got[1].usage.prompt_tokens


BAD_CONFIGS = {
    "lfm2": [({"conv_L_cache": 1}, "kernel size 1"), ({"layer_types": ["conv"] * 5}, "layer_types has 5 entries")],
    "qwen3_next": [({"linear_num_value_heads": 3}, "value heads must be a positive multiple of key heads"),
                   ({"num_experts_per_tok": 9}, "routes each token to 9 of 4 experts"),
                   ({"partial_rotary_factor": 0.1}, "rotates 1 features per head")],
}
BAD_GGUF_KEYS = {"lfm2": ("lfm2.attention.head_count_kv", [2, 0, 2], "head_count_kv' has 3 entries for 6 layers"),
                 "qwen3_next": ("qwen3next.ssm.time_step_rank", 3, "value heads must be a positive multiple")}


def test_a_bad_hybrid_config_is_refused_at_load(hybrid, tmp_path):
    import json
    import shutil

    from mlx_engine.errors import WeightsError

    folder, _ = hybrid
    config = json.loads((folder / "config.json").read_text())
    for i, (change, message) in enumerate(BAD_CONFIGS[folder.name]):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(folder, bad)
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(WeightsError, match=message):
            load_text_model(MLXBackend(bad, dtype="float32"))


def test_a_gguf_with_inconsistent_hybrid_keys_is_refused(hybrid, tmp_path):
    import gguf

    from mlx_engine.errors import WeightsError

    folder, reference = hybrid
    write = {"lfm2": lfm2_gguf, "qwen3_next": qwen3_next_gguf}[folder.name]
    reader = gguf.GGUFReader(str(write(reference, tmp_path / "ok.gguf")))
    key, value, message = BAD_GGUF_KEYS[folder.name]
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", key):
            continue
        writer.add_key_value(name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    if isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_uint32(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
    write_gguf(writer)
    with pytest.raises(WeightsError, match=message):
        load_text_model(MLXBackend(tmp_path / "bad.gguf", dtype="float32"))


def test_a_hybrid_model_is_not_split_over_ranks(hybrid):
    from mlx_engine.errors import UnsupportedError
    from mlx_engine.models.layers.sharding import plan
    from mlx_engine.models.registry import file_config
    from mlx_engine.weights import open_weights

    folder, _ = hybrid
    with open_weights(folder) as wf:
        for mode in ("pipeline", "tensor"):
            with pytest.raises(UnsupportedError, match="hybrid model .* one machine only"):
                plan(wf, file_config(wf), mode, 0, 2)


def test_the_chunked_delta_rule_equals_the_token_by_token_one():
    from mlx_engine.models.arch.qwen3_next import delta_rule, delta_rule_chunked

    rng = np.random.default_rng(3)
    s, n, h, dk, dv = 2, 150, 3, 8, 5  # 150 tokens: two chunks of 64 and a padded third
    backend = MLXBackend()
    with backend.new_context() as ctx:
        def t(*shape, scale=1.0):
            return ctx.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))

        k = rng.standard_normal((s, n, h, dk)).astype(np.float32)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        q, v, state = t(s, n, h, dk, scale=dk ** -0.5), t(s, n, h, dv), t(s, h, dk, dv)
        log_decay = ctx.from_numpy(-rng.uniform(0.0, 0.5, (s, n, h)).astype(np.float32))
        beta = ctx.from_numpy(rng.uniform(0.0, 1.0, (s, n, h)).astype(np.float32))
        a = delta_rule(ctx, q, ctx.from_numpy(k), v, log_decay, beta, state)
        b = delta_rule_chunked(ctx, q, ctx.from_numpy(k), v, log_decay, beta, state)
        for x, y in zip(a, b):
            x, y = x.numpy(), y.numpy()
            assert x.shape == y.shape and np.abs(x - y).max() <= 1e-4 * np.abs(x).max()


def test_quantized_experts_stay_quantized(tmp_path):
    """A Qwen3-Next GGUF whose stacked experts are quantized (Q4_1, Q8_0 and Q5_0, as llama.cpp writes them) keeps
    them quantized in the file's own bytes, and the fused projections split at load (the linear layers' qkv, the
    attention's query and gate) keep their parts quantized; the logits and greedy tokens are those of the same values
    written as float32: a prompt's products (tokens grouped by expert) and decode's (one row each)."""
    from mlx_engine.mlx import cpu_kernels
    from mlx_engine.weights import open_weights
    from tests.hybrid_small import build_qwen3_next

    reference = build_qwen3_next(tmp_path / "qwen3_next", seed=4)
    experts = {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q5_0"}
    fused = {"attn_qkv": "Q8_0", "attn_gate": "Q4_0", "attn_q": "Q5_1"}  # split into parts at load
    types = {**experts, **fused}
    quantized = qwen3_next_gguf(reference, tmp_path / "q.gguf", types=types)
    floats = qwen3_next_gguf(reference, tmp_path / "f.gguf", types=types, dequantized=True)
    backend = MLXBackend(quantized, dtype="float32")
    with open_weights(quantized) as wf:
        for kind, type_name in experts.items():
            name = f"blk.0.{kind}.weight"
            assert wf.type_name(name) == type_name
            t = backend.weights[name]
            assert t.is_quantized and t.shape == tuple(wf.shape(name))
            if cpu_kernels.qmatmul is not None:  # symmetric ones without biases: exactly the file's bytes
                assert t.nbytes == wf.nbytes(name)
    prompt = _prompt(5, 70)
    q_runner, f_runner = _runner(quantized), _runner(floats)
    assert all(q_runner.model.layers[0][k].is_quantized for k in ("experts_gate", "experts_up", "experts_down"))
    lw = q_runner.model.layers  # the fused projections' parts stay quantized too
    assert all(lw[0][k].is_quantized for k in ("lin_q", "lin_k", "lin_v", "lin_z"))
    assert lw[3]["q"].is_quantized and lw[3]["attn_gate"].is_quantized
    a = logits_for(q_runner.model, q_runner, prompt)
    b = logits_for(f_runner.model, f_runner, prompt)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    assert _greedy(q_runner, prompt, 24)[0] == _greedy(f_runner, prompt, 24)[0]
