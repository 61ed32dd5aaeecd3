"""Parity with mlx-lm on small random checkpoints saved as Hugging Face folders: Llama 3 with rope scaling, Qwen3,
and Gemma 3 with a tiny sliding window; first-step logits and 64 greedy tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_engine.batch import Batch
from mlx_engine.mlx import MLXBackend
from mlx_engine.mlx.runtime import mx
from mlx_engine.models.registry import load_text_model

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 64, 4, 4, 2, 16, 128


def _random_weights(rng, qk_norm: bool, gemma: bool) -> dict[str, np.ndarray]:
    def w(*shape, std=0.08):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n):
        # Gemma stores w with the one added at run time; others store the scale itself.
        return (rng.standard_normal(n) * 0.1 + (0.0 if gemma else 1.0)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, std=0.5), "model.norm.weight": norm(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": norm(HIDDEN), p + "post_attention_layernorm.weight": norm(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN), p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        })
        if qk_norm:
            out[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
            out[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        if gemma:
            out[p + "pre_feedforward_layernorm.weight"] = norm(HIDDEN)
            out[p + "post_feedforward_layernorm.weight"] = norm(HIDDEN)
    return out


CONFIGS = {
    "llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=2048, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=2048, tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                   query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2, rope_scaling=None),
}


def _make_folder(tmp_path, kind: str):
    rng = np.random.default_rng({"llama3": 1, "qwen3": 2, "gemma3": 3}[kind])
    weights = _random_weights(rng, qk_norm=kind in ("qwen3", "gemma3"), gemma=kind == "gemma3")
    if kind == "llama3":
        weights["lm_head.weight"] = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    config = dict(CONFIGS[kind], vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=FFN)
    folder = tmp_path / kind
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder, config, weights


def _mlx_lm(kind: str, config: dict, weights: dict[str, np.ndarray]):
    if kind == "llama3":
        from mlx_lm.models import llama as mod
    elif kind == "qwen3":
        from mlx_lm.models import qwen3 as mod
    else:
        from mlx_lm.models import gemma3_text as mod
    args = mod.ModelArgs.from_dict(config)
    model = mod.Model(args)
    w = {k: mx.array(v) for k, v in weights.items()}
    model.load_weights(list(model.sanitize(w).items()) if hasattr(model, "sanitize") else list(w.items()))
    return model


def _reference(model, tokens: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    first = np.array(logits.astype(mx.float32))
    out, tok = [], int(mx.argmax(logits).item())
    for _ in range(n):
        out.append(tok)
        tok = int(mx.argmax(model(mx.array([[tok]]), cache=cache)[0, -1]).item())
    return first, out


def _ours(folder, tokens: list[int], n: int, chunk: int) -> tuple[np.ndarray, list[int], str]:
    backend = MLXBackend(folder, dtype="float32")
    model = load_text_model(backend)
    cache = model.make_cache()
    cache.init(backend, model.dtype, 1, 512, chunk)
    ctx = backend.new_context()
    logits = None
    for b in range(0, len(tokens), chunk):  # chunked prefill
        logits = model.forward(ctx, Batch.single(np.array(tokens[b:b + chunk]), b), cache)
    first = logits.numpy()[0]
    out, tok, pos = [], int(first.argmax()), len(tokens)
    for _ in range(n):
        out.append(tok)
        tok = int(model.forward(ctx, Batch.single(np.array([tok]), pos), cache).argmax(-1).item())
        pos += 1
    return first, out, model.config.architecture


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma3"])
def test_random_checkpoint_matches_mlx_lm(kind, tmp_path):
    folder, config, weights = _make_folder(tmp_path, kind)
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 40)]
    ref_first, ref_tokens = _reference(_mlx_lm(kind, config, weights), tokens, 64)
    first, got, arch = _ours(folder, tokens, 64, chunk=16)
    assert arch == {"llama3": "llama", "qwen3": "qwen3", "gemma3": "gemma3"}[kind]
    scale = np.abs(ref_first).max()
    assert np.abs(first - ref_first).max() <= 1e-3 * scale
    assert got == ref_tokens


def test_llama3_rope_scaling_changes_the_output(tmp_path):
    """The scaled frequencies are really used: without them the logits differ from mlx-lm's scaled model."""
    folder, config, weights = _make_folder(tmp_path, "llama3")
    tokens = list(range(1, 200))
    unscaled = dict(config, rope_scaling=None)
    ref_scaled, _ = _reference(_mlx_lm("llama3", config, weights), tokens, 0)
    ref_plain, _ = _reference(_mlx_lm("llama3", unscaled, weights), tokens, 0)
    ours, _, _ = _ours(folder, tokens, 0, chunk=64)
    assert np.abs(ref_scaled - ref_plain).max() > 1e-2  # the scaling matters at this length
    assert np.abs(ours - ref_scaled).max() <= 1e-3 * np.abs(ref_scaled).max()
