"""LFM2 (Liquid AI): a hybrid of gated short-convolution blocks and grouped-query attention layers.

A convolution layer (``layer_types[i] == "conv"``): ``B, C, x = in_proj(norm(h))`` split in three along the
features, ``y = C * conv(B * x)`` with a depthwise causal convolution of kernel ``K`` (``conv_L_cache``, 3) over the
sequence, then ``out_proj``; its state is the last ``K - 1`` values of ``B * x`` (``[K - 1, D]`` per sequence, in
the :class:`~mlx_engine.kvcache.RecurrentCache`). Attention layers are Llama's with per-head RMSNorm on queries and
keys (Qwen3's). Every layer ends with a SwiGLU MLP; the final norm is ``embedding_norm``; the head is tied to the
embeddings.

References: transformers' ``models/lfm2/modeling_lfm2.py`` (``Lfm2ShortConv.slow_forward``, ``Lfm2MLP``); mlx-lm's
``models/arch/lfm2.py``; llama.cpp's ``convert_hf_to_gguf.py`` (``LFM2Model``: ``head_count_kv`` 0 marks a convolution
layer, the convolution weight squeezed to ``[D, K]``, ``feed_forward_length`` the adjusted size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_engine.errors import WeightsError
from mlx_engine.ml import Context, Tensor
from mlx_engine.models.layers.base import DecoderModel, hf_names_from_gguf
from mlx_engine.models.layers.layer import feed_forward
from mlx_engine.models.layers.config import DecoderConfig, check_rope_scaling, hf_rope_parameters, metadata_getter, \
    vocab_size_of

if TYPE_CHECKING:
    from mlx_engine.batch import Batch
    from mlx_engine.kvcache import Cache

# Hugging Face LFM2 names -> the shared names of models/layers/base.py (attention and MLP layers are Llama's).
_HF_RENAMES = [
    (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."), (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
    (".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
]


def lfm2_ff_dim(config: Any) -> int:
    """The MLP width transformers' ``Lfm2MLP`` builds from the config (``block_auto_adjust_ff_dim``: two thirds,
    times the multiplier, rounded up to ``block_multiple_of`` when a multiplier is given)."""
    ff = int(config.get("block_ff_dim") or config["intermediate_size"])
    if config.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        mult = config.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            ff = int(mult * ff)
            k = int(config.get("block_multiple_of", 256))
            ff = k * ((ff + k - 1) // k)
    return ff


class LFM2(DecoderModel):
    architecture = "lfm2"

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, "lfm2")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        layers = int(get("block_count", positive=True))
        kv = get("attention.head_count_kv")
        kv = [int(k) for k in (kv.tolist() if isinstance(kv, np.ndarray) else kv)] if not isinstance(kv, int) \
            else [kv] * layers
        if len(kv) != layers or not any(kv):
            raise WeightsError(f"GGUF key 'lfm2.attention.head_count_kv' has {len(kv)} entries for {layers} layers "
                               "(or no attention layer); the file is not a complete lfm2 model")
        return DecoderConfig(
            architecture="lfm2", vocab_size=vocab_size_of(weights, metadata, "lfm2"), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=max(kv), head_dim=hidden // heads,
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(get("context_length", 128000)), rope_theta=float(get("rope.freq_base", 1000000.0)),
            layer_types=["full_attention" if k else "conv" for k in kv], qk_norm=True,
            conv_kernel=int(get("shortconv.l_cache", 3)),
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        theta, scaling = hf_rope_parameters(config)
        check_rope_scaling((scaling or {}).get("rope_type", (scaling or {}).get("type")), "lfm2")
        types = config.get("layer_types")
        if types is None:
            full = config.get("full_attn_idxs")
            full = range(layers) if full is None else full
            types = ["full_attention" if i in full else "conv" for i in range(layers)]
        return DecoderConfig(
            architecture="lfm2", vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_layers=layers, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=lfm2_ff_dim(config), rms_norm_eps=float(config.get("norm_eps", 1e-5)),
            context_length=int(config.get("max_position_embeddings", 128000)), rope_theta=theta,
            layer_types=list(types), qk_norm=True, conv_kernel=int(config.get("conv_L_cache", 3)),
            conv_bias=bool(config.get("conv_bias", False)),
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """GGUF and Hugging Face names to the shared ones; the convolution weight ``[D, 1, K]`` (mlx-lm's folders:
        ``[D, K, 1]``) to ``[D, K]``."""
        if source == "gguf":
            out = {}
            for name, t in weights.items():
                name = (name.replace(".shortconv.conv.", ".conv.conv.").replace(".shortconv.in_proj.", ".conv.in_proj.")
                        .replace(".shortconv.out_proj.", ".conv.out_proj."))
                if name == "token_embd_norm.weight":
                    name = "output_norm.weight"
                out[name] = t
            out = hf_names_from_gguf(out, "post_attention_layernorm")
            return {(n.replace("blk.", "model.layers.", 1) if n.startswith("blk.") else n): t for n, t in out.items()}
        out = {}
        for name, t in weights.items():
            for a, b in _HF_RENAMES:
                name = name.replace(a, b)
            if name == "model.embedding_norm.weight":
                name = "model.norm.weight"
            if name.endswith(".conv.conv.weight") and t.ndim == 3:  # [D, 1, K], or mlx-lm's [D, K, 1]
                t = t.reshape(t.shape[0], t.shape[1] * t.shape[2])
            out[name] = t
        return out

    def mixer_shapes(self, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        if self.config.layer_types[layer] != "conv":
            return super().mixer_shapes(layer)
        d, k, p = self.config.hidden_size, self.config.conv_kernel, f"model.layers.{layer}.conv."
        req = {p + "in_proj.weight": (3 * d, d), p + "out_proj.weight": (d, d), p + "conv.weight": (d, k)}
        opt = {p + "in_proj.bias": (3 * d,), p + "out_proj.bias": (d,), p + "conv.bias": (d,)}
        return req, opt

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        w = super()._layer_weights(i)
        if self.config.layer_types[i] == "conv":
            p = f"model.layers.{i}.conv."
            w.update({"conv_in": self.w.get(p + "in_proj.weight"), "conv_in_bias": self.w.get(p + "in_proj.bias"),
                      "conv_out": self.w.get(p + "out_proj.weight"), "conv_out_bias": self.w.get(p + "out_proj.bias"),
                      "conv_bias": self.w.get(p + "conv.bias")})
            # the kernel's taps, one [D] row each, in the compute dtype
            taps = self.w[p + "conv.weight"].dequantize().astype(self.dtype).transpose(1, 0)
            w.update({f"conv_tap{k}": taps[k] for k in range(self.config.conv_kernel)})
        return w

    def make_cache(self, kv_bits: int | None = None) -> "Cache":
        """A :class:`~mlx_engine.kvcache.RecurrentCache`: causal KV for the attention layers, convolution state for
        the others."""
        from mlx_engine.kvcache import RecurrentCache

        return RecurrentCache(shift_fn=self.shift, kv_bits=kv_bits, **self.cache_options)

    def state_bytes(self) -> int:
        from mlx_engine.kvcache.recurrent import CHECKPOINT_COUNT

        c = self.config
        conv = sum(t == "conv" for t in c.layer_types) * (c.conv_kernel - 1) * c.hidden_size * 4  # float32 states
        return conv * (2 + self.cache_options.get("checkpoint_count", CHECKPOINT_COUNT))  # now, one step back

    _CONV_WEIGHTS = ("attn_norm", "conv_in", "conv_in_bias", "conv_out", "conv_out_bias", "conv_bias",
                     "post_attn_norm", "gate", "up", "down")

    def mixer_layer(self, ctx: Context, layer: int, w: dict[str, Tensor | None], h: Tensor, cache: "Cache",
                    batch: "Batch") -> Tensor:
        """A convolution layer (transformers' ``Lfm2ShortConv.slow_forward``): the state holds the last ``K - 1``
        values of ``B * x`` before the batch. A decode step (one token per sequence) runs as one compiled graph."""
        c = self.config
        state = cache.get_state(ctx, layer, "conv", (c.conv_kernel - 1, c.hidden_size))
        taps = [w[f"conv_tap{j}"] for j in range(c.conv_kernel)]
        names = tuple(k for k in self._CONV_WEIGHTS if w.get(k) is not None)
        if cache.layout[1] == 1 and self.compile_decode:
            fn = self._compiled.get(("conv", names))
            if fn is None:
                joiner = self.backend.new_context()  # concatenation only: holds nothing between calls

                def block(h: Tensor, state: Tensor, *ws: Tensor) -> tuple[Tensor, Tensor]:
                    named = dict(zip(names, ws[:len(names)]))
                    return conv_layer(c, joiner, h, state, named, list(ws[len(names):]))
                fn = self._compiled[("conv", names)] = self.backend.compile(block)
            h, state = fn(h, state, *[w[k] for k in names], *taps)
        else:
            h, state = conv_layer(c, ctx, h, state, w, taps)
        cache.set_state(ctx, layer, "conv", state)
        return h


def conv_layer(c: DecoderConfig, ctx: Context, h: Tensor, state: Tensor, w: dict[str, Tensor | None],
               taps: list[Tensor]) -> tuple[Tensor, Tensor]:
    """One LFM2 convolution layer on ``h [1, S * L, D]`` (``S`` sequences of ``L`` tokens) from ``state
    [S, K - 1, D]``: returns the new ``h`` and the new state (the last ``K - 1`` values of ``B * x``)."""
    d, k = c.hidden_size, c.conv_kernel
    s = state.shape[0]
    n = h.shape[1] // s
    x = h.rms_norm(w["attn_norm"], c.rms_norm_eps).linear(w["conv_in"], w.get("conv_in_bias"))
    bx = (x[..., :d] * x[..., 2 * d:]).reshape(s, n, d)
    full = ctx.concatenate([state.astype(bx.dtype), bx], axis=1)  # [S, K - 1 + L, D]
    conv = full[:, 0:n] * taps[0]
    for j in range(1, k):
        conv = conv + full[:, j:j + n] * taps[j]
    if w.get("conv_bias") is not None:
        conv = conv + w["conv_bias"]
    y = (x[..., d:2 * d] * conv.reshape(1, s * n, d)).linear(w["conv_out"], w.get("conv_out_bias"))
    return feed_forward(c, h, y, w), full[:, n:]
