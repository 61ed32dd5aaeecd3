"""The decode plan (``models/layers/plan.py``): which form each layer of a one-token step takes, decided once per loaded
model, and the reason where a layer does not fuse: smollm2 and gemma3 as pulled (every layer fused, the step
compiled whole), a soft-capped Gemma 2 and gpt-oss with attention sinks (made small by transformers: their
attention apart, the step layer by layer), and the plan the steps then take (the cache's fused attention called for
the fused layers only)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine.batch import Batch
from mlx_engine.mlx import MLXBackend, cpu_kernels
from mlx_engine.models.layers import plan as plans
from mlx_engine.models.registry import load_text_model

# our CPU kernels make the step's RoPE angles (the cache's attention rotates) and run the MLP in one node
FUSED = plans.FUSED if cpu_kernels.rope_apply is not None else plans.FUSED_ROTATED
TAIL = cpu_kernels.output_mlp is not None


def _model(path):
    return load_text_model(MLXBackend(path, device="cpu", dtype="float32"))


@pytest.mark.parametrize("which, layers", [("smollm2_gguf", 30), ("gemma3_gguf", 18)])
def test_pulled_models_fuse_every_layer_and_compile_the_step_whole(request, which, layers):
    model = _model(request.getfixturevalue(which))
    plan = model.plan
    assert plan.whole and plan.whole_reason == ""
    assert list(plan.layers) == list(range(layers))
    assert {lp for lp in plan.layers.values()} == {plans.LayerPlan(FUSED, "", TAIL)}
    assert model.plan is plan  # decided once
    model.fuse_attention = False  # a switch makes it again
    assert model.plan is not plan
    assert {lp.form for lp in model.plan.layers.values()} == {plans.COMPILED}
    assert model.plan.whole_reason == "layer 0 does not fuse: fused attention is switched off"


def _hf_folder(tmp_path, config, model_class):
    import torch

    torch.manual_seed(0)
    folder = tmp_path / config.model_type
    model_class(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    return _hf_folder(tmp_path_factory.mktemp("plan"), config, Gemma2ForCausalLM)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False)
    return _hf_folder(tmp_path_factory.mktemp("plan"), config, GptOssForCausalLM)


def test_a_soft_capped_layer_and_a_layer_with_sinks_take_attention_apart(gemma2, gpt_oss):
    capped, sinks = _model(gemma2).plan, _model(gpt_oss).plan
    # (float weights, and gpt-oss's mixture of experts: no MLP node, which takes quantized weights of a dense MLP)
    assert {lp for lp in capped.layers.values()} == {
        plans.LayerPlan(plans.COMPILED, "attention soft-capping: the fused attention has no score cap")}
    assert {lp for lp in sinks.layers.values()} == {
        plans.LayerPlan(plans.COMPILED, "attention sinks: the fused attention has no sinks")}
    assert not capped.whole and capped.whole_reason == ("layer 0 does not fuse: attention soft-capping: the fused "
                                                        "attention has no score cap")
    assert sinks.describe().splitlines() == [
        "decode step: layer by layer (layer 0 does not fuse: attention sinks: the fused attention has no sinks)",
        "  layers 0-1: compiled (attention sinks: the fused attention has no sinks)"]


@pytest.mark.parametrize("which", ["gemma2", "gemma3_gguf"])
def test_the_steps_take_the_plan(request, which, monkeypatch):
    """Decode steps call the cache's fused attention exactly for the layers the plan fuses (gemma3 steps layer by
    layer here, so that each layer's call is seen), and never for a soft-capped Gemma 2."""
    from mlx_engine.kvcache import CausalCache

    model = _model(request.getfixturevalue(which))
    model.compile_step = False
    calls = []
    real = CausalCache.attend
    monkeypatch.setattr(CausalCache, "attend", lambda self, *a: calls.append(1) or real(self, *a))
    backend, cache = model.backend, model.make_cache()
    cache.init(backend, model.dtype, 1, 64, 16)
    ctx = backend.new_context()
    model.forward(ctx, Batch.single(np.arange(3, 8), 0), cache)
    assert not calls  # a prompt runs op by op
    for pos in range(5, 9):
        ctx.evaluate(model.forward(ctx, Batch.single(np.array([7]), pos), cache))
    fused = sum(lp.fused for lp in model.plan.layers.values())
    assert len(calls) == 4 * fused and fused == (0 if which == "gemma2" else len(model.layers))
