"""Llama 4 text (``llama4`` folders and GGUF: Llama 4 Scout and Maverick; the text model of
``Llama4ForConditionalGeneration``): Llama's layer with four changes.

- **Layers without RoPE** (NoPE): every ``no_rope_layer_interval``-th layer (the 4th, 8th, ...) attends without
  positions, over the whole context; the others rotate queries and keys (interleaved pairs: transformers' complex
  product, llama.cpp's NORM RoPE; the converter does not permute) and attend within chunks of
  ``attention_chunk_size`` positions (:class:`~mlx_engine.kvcache.ChunkedAttentionCache`).
- **Query/key L2 norm** on the RoPE layers, after RoPE: ``x / sqrt(mean(x^2) + eps)``, no weight
  (``use_qk_norm``; Maverick has none).
- **Attention temperature tuning** on the NoPE layers: the queries at position ``p`` times ``1 + attn_scale *
  log(1 + floor((p + 1) / floor_scale))`` (``attn_temperature_tuning``).
- **Experts** on the MoE layers (``interleave_moe_layer_step``, or ``moe_layers``): the top-``k`` (1) router logits,
  their sigmoid weighing each expert's *input*, plus an always-on shared expert; the dense layers' MLP has its own
  width (``intermediate_size_mlp``).

llama.cpp's ``llama4`` reads no chunk size, temperature or NoPE interval from a GGUF: it fixes chunks of 8192,
``floor_scale`` 8192, ``attn_scale`` 0.1 and every 4th layer without RoPE (``src/models/llama4.cpp``); a GGUF runs
here as there (one that sets ``sliding_window`` 0, MobileLLM's, is refused).

References: transformers' ``models/llama4/modeling_llama4.py`` (``Llama4TextAttention``, ``Llama4TextMoe``,
``Llama4Router``); llama.cpp's ``src/models/llama4.cpp`` and its converter (``conversion/llama.py``,
``Llama4Model``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, ModelPart, hf_names_from_gguf
from mlx_engine.models.layers.config import (DecoderConfig, check_layer_count, check_rope_scaling, hf_rope_parameters,
                                      llama3_rope_freqs, metadata_getter, vocab_size_of)
from mlx_engine.models.layers.layer import apply_rope, rope_positions
from mlx_engine.models.layers.moe import MoEWeights, experts_mlp, moe_names_from_gguf
from mlx_engine.models.layers.step import NotWholeStep

if TYPE_CHECKING:
    from mlx_engine.kvcache import Cache


@dataclass
class Llama4Config(DecoderConfig):
    """:class:`DecoderConfig` plus Llama 4's per-layer attention.

    Attributes:
        rope_layers: per layer, whether it rotates (else NoPE). chunk: the RoPE layers' attention chunk (None: none).
        temperature: ``(attn_scale, floor_scale)`` of the NoPE layers' query temperature (None: off).
        l2_norm: the RoPE layers' query/key L2 norm (``use_qk_norm``; no weights, unlike ``qk_norm``).
    """

    rope_layers: list[bool] = field(default_factory=list)
    l2_norm: bool = False
    chunk: int | None = None
    temperature: tuple[float, int] | None = None

    def __post_init__(self) -> None:
        """Raises ``WeightsError`` for a per-layer list of the wrong length, a chunk or floor that is not positive."""
        super().__post_init__()
        if len(self.rope_layers) != self.num_layers:
            raise WeightsError(f"model config's no_rope_layers has {len(self.rope_layers)} entries for "
                               f"{self.num_layers} layers")
        if self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 1):
            raise WeightsError(f"model config has attention_chunk_size = {self.chunk!r}; it must be positive")
        if self.temperature is not None and (not math.isfinite(self.temperature[0]) or self.temperature[1] < 1):
            raise WeightsError(f"model config has attention temperature (attn_scale, floor_scale) = "
                               f"{self.temperature!r}; the floor must be positive")


def _moe_layers(layers: int, step: int) -> list[int]:
    """transformers' and llama.cpp's default MoE layers: every ``step``-th (``step - 1, 2 step - 1, ...``)."""
    return list(range(step - 1, layers, step)) if step > 0 else []


class Llama4(MoEWeights, DecoderModel):
    """Llama 4 text (module docstring). Runs its own layer loop, op by op (NoPE and chunked layers, the temperature
    and the input-weighed experts are not the shared block's)."""

    architecture = "llama4"
    shared_expert_gated = False
    config: Llama4Config
    own_layers = "chunked attention, layers without RoPE and the attention temperature"

    def __init__(self, config: Llama4Config, weights: dict[str, Tensor], backend: Backend,
                 part: ModelPart | None = None):
        super().__init__(config, weights, backend, part)
        if self.part.reduce is not None:
            raise UnsupportedError("a Llama 4 model is not split over ranks by heads yet; use --parallel pipeline")

    # ---- configuration -----------------------------------------------------------------------------------------
    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> Llama4Config:
        """From llama.cpp's ``llama4.*`` keys, with the chunk, temperature and NoPE layers llama.cpp fixes (module
        docstring). Raises ``UnsupportedError`` for a RoPE scaling other than linear and llama3, and for a file
        without chunked attention (``sliding_window`` 0)."""
        get = metadata_getter(metadata, "llama4")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        layers = check_layer_count(int(get("block_count", positive=True)))
        head_dim = int(get("attention.key_length", hidden // heads))
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, "llama4")
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        freqs = weights.get("rope_freqs.weight")
        if int(get("attention.sliding_window", 8192)) == 0:
            # llama.cpp then drops the chunks and RoPE's absence from every layer but the last (MobileLLM)
            raise UnsupportedError("a llama4 GGUF without chunked attention (sliding_window 0: MobileLLM) is not "
                                   "supported")
        experts = int(get("expert_count", positive=True))
        moe_ff = int(get("expert_feed_forward_length", positive=True))
        theta = float(get("rope.freq_base", 500000.0))
        return Llama4Config(
            architecture=cls.architecture, vocab_size=vocab_size_of(weights, metadata, "llama4"), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim, intermediate_size=int(get("feed_forward_length", positive=True)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(get("context_length", 131072)), rope_theta=theta, rope_scale=1.0 / factor,
            rope_freqs=None if freqs is None else (  # llama.cpp's per-pair factors (Llama 3 scaling)
                theta ** (np.arange(0, head_dim, 2) / head_dim) * freqs.numpy().astype(np.float64)).astype(np.float32),
            rope_traditional=True, l2_norm=experts != 128, num_experts=experts,
            experts_per_token=int(get("expert_used_count", positive=True)), moe_intermediate_size=moe_ff,
            shared_expert_size=moe_ff, norm_topk_prob=False,
            rope_layers=[(i + 1) % 4 != 0 for i in range(layers)], chunk=8192, temperature=(0.1, 8192))

    @classmethod
    def config_from_hf(cls, config: Any) -> Llama4Config:
        """From a ``Llama4ForCausalLM`` ``config.json`` or the ``text_config`` of a
        ``Llama4ForConditionalGeneration`` one. Raises ``UnsupportedError`` for a RoPE scaling other than linear
        and llama3."""
        config = config.get("text_config") or config
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        layers = check_layer_count(config["num_hidden_layers"])
        theta, scaling = hf_rope_parameters(config)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, "llama4")
        freqs = None
        if kind == "llama3":
            freqs = llama3_rope_freqs(theta, head_dim, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                      float(scaling["high_freq_factor"]),
                                      int(scaling["original_max_position_embeddings"]))
        interval = int(config.get("no_rope_layer_interval") or 4)
        rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        moe = config.get("moe_layers")
        moe = moe if moe is not None else _moe_layers(layers, int(config.get("interleave_moe_layer_step") or 1))
        chunk = config.get("attention_chunk_size")
        return Llama4Config(
            architecture=cls.architecture, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(config.get("intermediate_size_mlp") or config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            context_length=int(config.get("max_position_embeddings", 131072)), rope_theta=theta, rope_freqs=freqs,
            rope_scale=1.0 / float(scaling["factor"]) if kind == "linear" else 1.0, rope_traditional=True,
            l2_norm=bool(config.get("use_qk_norm", True)), num_experts=int(config["num_local_experts"]) if moe else 0,
            experts_per_token=int(config.get("num_experts_per_tok") or 1) if moe else 0,
            moe_intermediate_size=int(config["intermediate_size"]),
            shared_expert_size=int(config["intermediate_size"]), norm_topk_prob=False,
            rope_layers=[bool(r) for r in rope], chunk=int(chunk) if chunk else None,
            temperature=(float(config.get("attn_scale", 0.1)), int(config.get("floor_scale", 8192)))
            if config.get("attn_temperature_tuning", True) else None)

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: Llama4Config, source: str) -> dict[str, Tensor]:
        """llama.cpp's names to the hub's (``ffn_norm`` is the MLP's input norm); the hub's ``feed_forward`` to
        ``mlp``, its ``router`` to ``gate``, its experts ``gate_up_proj [E, D, 2I]`` and ``down_proj [E, I, D]`` to
        the stacked ``[E, out, in]`` products; the multimodal checkpoint's ``language_model.`` prefix dropped and its
        vision tensors with it."""
        if source == "gguf":
            return hf_names_from_gguf(moe_names_from_gguf(weights), "post_attention_layernorm")
        out: dict[str, Tensor] = {}
        for name, t in weights.items():
            if name.startswith(("vision_model.", "multi_modal_projector.")):
                continue
            name = name.removeprefix("language_model.")
            name = name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")
            if name.endswith(".mlp.experts.gate_up_proj"):
                t = t.dequantize().transpose(0, 2, 1)  # [E, 2I, D]: the gate's rows, then the up projection's
                half = t.shape[1] // 2
                out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = \
                    t[:, :half], t[:, half:]
                continue
            if name.endswith(".mlp.experts.down_proj"):
                t = t.dequantize().transpose(0, 2, 1)
            out[name] = t
        return out

    def make_cache(self, kv_bits: int | None = None) -> "Cache":
        """Chunked caches for the RoPE layers (where the config has chunks), causal ones for the NoPE layers."""
        from mlx_engine.kvcache import CausalCache, ChunkedAttentionCache, WrapperCache

        c = self.config
        if c.chunk is None:
            return CausalCache(shift_fn=self.shift, kv_bits=kv_bits)
        return WrapperCache([CausalCache(shift_fn=self.shift, kv_bits=kv_bits),
                             ChunkedAttentionCache(c.chunk, shift_fn=self.shift, kv_bits=kv_bits)],
                            [1 if r else 0 for r in c.rope_layers])

    def shift(self, ctx: Context, layer: int, keys: Tensor, shift: Tensor) -> Tensor:
        """Re-rotate a RoPE layer's cached keys by ``shift`` (:meth:`DecoderModel.shift`); a NoPE layer's keys
        hold no position."""
        return super().shift(ctx, layer, keys, shift) if self.config.rope_layers[layer] else keys

    # ---- forward -----------------------------------------------------------------------------------------------
    def run_layers(self, ctx: Context, batch: Batch, h: Tensor, cache: "Cache", output_layer: int | None = None,
                   angles: Any = None, whole: bool = False, pos_tensor: Tensor | None = None) -> Tensor:
        """The layers on ``h [1, N, D]`` (see :meth:`DecoderModel.run_layers`; op by op, ``angles`` unused).
        Raises :class:`NotWholeStep` when traced whole."""
        if whole:
            raise NotWholeStep("Llama 4's layers run op by op")
        c = self.config
        eps, n = c.rms_norm_eps, h.shape[1]
        positions = rope_positions(ctx, batch)
        temperature = None
        if c.temperature is not None:
            scale, floor = c.temperature
            t = 1 + scale * np.log1p(np.floor((np.asarray(batch.positions, np.float64) + 1) / floor))
            temperature = ctx.from_numpy(t.astype(np.float32).reshape(1, 1, n, 1)).astype(self.dtype)
        for i, lw in self.layers.items():
            if output_layer is not None and i > output_layer:
                break
            cache.set_layer(i)
            x = h.rms_norm(lw["attn_norm"], eps)
            q, k, v = (x.linear(lw[p]).reshape(1, n, heads, c.head_dim).transpose(0, 2, 1, 3)
                       for p, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)))
            if c.rope_layers[i]:
                base, scale, freqs = self._rope(i)
                q, k = (apply_rope(y, positions, c.head_dim, base, scale, True, freqs) for y in (q, k))
                if c.l2_norm:
                    q, k = q.rms_norm(None, eps), k.rms_norm(None, eps)
            elif temperature is not None:
                q = q * temperature
            cache.put(ctx, k, v)
            keys, values, mask = cache.get(ctx)
            o = ctx.scaled_dot_product_attention(q, keys, values, c.query_scale, mask)
            h = h + o.transpose(0, 2, 1, 3).reshape(1, n, c.num_heads * c.head_dim).linear(lw["o"])
            x = h.rms_norm(lw["post_attn_norm"], eps)
            if lw.get("router") is not None:
                x2 = x.reshape(n, c.hidden_size)
                logits = x2.linear(lw["router"]).astype(DType.FLOAT32)
                kk = c.experts_per_token
                idx = (-logits).argpartition(kk - 1, axis=-1)[:, :kk] if kk < c.num_experts else \
                    (-logits).argsort(axis=-1)
                top = logits.take_along_axis(idx, axis=-1).sigmoid()
                m = experts_mlp(x2, idx, top, lw, weigh_input=True).reshape(1, n, c.hidden_size)
            else:
                m = (x.linear(lw["gate"]).silu() * x.linear(lw["up"])).linear(lw["down"])
            h = h + m
        return h
