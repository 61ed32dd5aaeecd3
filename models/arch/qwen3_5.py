"""Qwen3.5, dense (Qwen3.5-0.8B ... 27B) and mixture of experts (Qwen3.5-35B-A3B ... 397B-A17B): Qwen3-Next's hybrid
(:mod:`mlx_engine.models.arch.qwen3_next`, whose layers this runs) with these differences, read from transformers'
``models/qwen3_5`` and ``models/qwen3_5_moe`` and llama.cpp's ``src/models/qwen35.cpp`` / ``qwen35moe.cpp``:

- the Gated DeltaNet input projections unfused: ``in_proj_qkv`` (all query rows, all key rows, all value rows: the
  order the convolution reads), ``in_proj_z``, and ``in_proj_b`` / ``in_proj_a`` with one row per value head (where
  Qwen3-Next groups ``[q, k, v, z]`` and ``[b, a]`` per key head);
- RoPE is interleaved multimodal RoPE (``mrope_section``) on the first ``partial_rotary_factor`` of each head; for
  text the three position axes are equal, which makes it Qwen3-Next's rotate-half RoPE on those features;
- the dense variant has a SwiGLU MLP on every layer; the MoE variant routes every layer (top-k probabilities always
  renormalised) and adds the shared expert behind its sigmoid gate; its folders hold the experts fused,
  ``mlp.experts.gate_up_proj [E, 2I, D]`` (split at load by :func:`~mlx_engine.models.layers.moe.stack_experts`);
- the released checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): the text model is read from
  ``text_config`` and ``model.language_model.*``; the vision tower and the multi-token-prediction block are not loaded;
- llama.cpp's converter writes the linear layers' value heads in tiled order when there are more value heads than
  key heads (``_LinearAttentionVReorderBase``): ``DecoderConfig.linear_tiled``.
"""

from __future__ import annotations

from mlx_engine.models.arch.qwen3_next import Qwen3Next


class Qwen35(Qwen3Next):
    architecture = "qwen3_5"
    gguf_arch = "qwen35"
    gguf_tiled_values = True


class Qwen35MoE(Qwen35):
    architecture = "qwen3_5_moe"
    gguf_arch = "qwen35moe"
