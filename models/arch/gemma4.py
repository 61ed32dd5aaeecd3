"""Gemma 4 text model (the dense ones: E2B, E4B, 31B; the 26B-A4B mixture of experts is refused).

What is new against Gemma 3 (``gemma3.py``), each from transformers' ``models/gemma4/modeling_gemma4.py`` and
llama.cpp's ``src/models/gemma4.cpp``:

- plain RMSNorm weights ``x * w`` everywhere (not Gemma 3's ``1 + w``; llama.cpp's converter adds nothing either),
  and an RMSNorm without weight on the values;
- attention scale 1 (the query/key norms carry it); no attention soft-cap; the output logits soft-capped;
- full-attention layers with a head size and a key/value head count of their own (``global_head_dim``,
  ``num_global_key_value_heads``), and with ``attention_k_eq_v`` no value projection: the values are the key
  projection's output (before the key norm and RoPE, after the value norm);
- RoPE base 10,000 over the whole head on sliding layers; "proportional" RoPE on full layers: pairs ``(i, i + D/2)``
  rotated with period ``theta ** (2i / D)`` for ``i < partial_rotary_factor * D / 2``, the others not at all
  (llama.cpp's converter writes this as ``rope_freqs`` factors of 1 and 1e30);
- the last ``num_kv_shared_layers`` layers compute no keys and values: each attends to those of the last earlier
  layer of its kind (``Gemma4TextConfig.kv_sharing_modes``); with ``use_double_wide_mlp`` their MLP is twice as wide;
- per-layer embeddings (PLE, ``hidden_size_per_layer_input = P``): a second token table ``[vocab, L * P]`` times
  ``sqrt(P)``, plus a projection of the scaled embeddings ``(h @ W) / sqrt(D)`` normed per layer, the sum times
  ``2 ** -0.5``; after each layer's MLP, ``h += norm(W_proj (gelu(W_gate h) * ple[layer]))``;
- every layer's output times its ``layer_scalar``.

Hugging Face names are the model's (``model.language_model.`` of ``Gemma4ForConditionalGeneration`` folded to
``model.``; its vision and audio towers are left out); GGUF names are mapped to them in :meth:`Gemma4.sanitize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, hf_names_from_gguf
from mlx_engine.models.layers.config import DecoderConfig, check_layer_count, metadata_getter, vocab_size_of
from mlx_engine.models.arch.gemma2 import capped, soft_cap
from mlx_engine.models.arch.gemma3 import bf16_embed_scale
from mlx_engine.models.layers.layer import apply_rope, rope_positions
from mlx_engine.models.layers.step import NotWholeStep

if TYPE_CHECKING:
    from mlx_engine.kvcache import Cache

#: llama.cpp's period factor for the features proportional RoPE leaves unrotated (angle ``p / 1e30``: none).
_UNROTATED = 1e30

# GGUF names (gguf-py's MODEL_ARCH.GEMMA4 map) that hf_names_from_gguf does not know.
_GGUF_EXTRA = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_GGUF_LAYER_EXTRA = {"inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
                     "post_norm.weight": "post_per_layer_input_norm.weight",
                     "layer_output_scale.weight": "layer_scalar"}
# The parts of Gemma4ForConditionalGeneration that are not its text model.
_TOWERS = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")


@dataclass
class Gemma4Config(DecoderConfig):
    """:class:`DecoderConfig` (its ``head_dim``, ``num_kv_heads`` and ``intermediate_size`` those of the sliding,
    unshared layers) and what differs per layer in Gemma 4.

    Attributes:
        global_head_dim, global_kv_heads: the head size and key/value head count of full-attention layers.
        k_eq_v: full-attention layers have no value projection; values are the key projection's output.
        kv_source: per layer, the layer whose keys and values it attends to (itself, or for a shared layer the last
            unshared layer of its kind).
        ffn_sizes: per layer, the MLP's width (doubled on shared layers with ``use_double_wide_mlp``).
        ple_dim: the width ``P`` of the per-layer embeddings (0: none).
        global_periods: the RoPE periods ``[global_head_dim / 2]`` of full-attention layers (proportional RoPE).
    """

    global_head_dim: int = 0
    global_kv_heads: int = 0
    k_eq_v: bool = False
    kv_source: list[int] = field(default_factory=list)
    ffn_sizes: list[int] = field(default_factory=list)
    ple_dim: int = 0
    global_periods: np.ndarray | None = None

    def __post_init__(self) -> None:
        """Raises ``WeightsError``: a head size or count that does not fit, a shared layer without a source of its
        kind, per-layer lists of the wrong length, periods that are not finite and positive."""
        super().__post_init__()
        n = self.num_layers
        for name in ("global_head_dim", "global_kv_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 < v < 1 << 20:
                raise WeightsError(f"model config has {name} = {v!r}; it must be a positive integer")
        if self.global_head_dim % 2 or self.num_heads % self.global_kv_heads:
            raise WeightsError(f"model config's full-attention layers have {self.global_kv_heads} key/value heads "
                               f"of {self.global_head_dim} for {self.num_heads} heads; the heads must be a multiple "
                               "and the head size even")
        if len(self.kv_source) != n or any(not 0 <= s <= i or self.layer_types[s] != self.layer_types[i]
                                           or self.kv_source[s] != s for i, s in enumerate(self.kv_source)):
            raise WeightsError(f"model config's key/value sharing {self.kv_source!r} does not give every shared layer "
                               "an earlier unshared layer of its kind")
        if len(self.ffn_sizes) != n or any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f <= 0
                                           for f in self.ffn_sizes):
            raise WeightsError(f"model config has feed-forward sizes {self.ffn_sizes!r} for {n} layers; each must "
                               "be a positive integer")
        if isinstance(self.ple_dim, bool) or not isinstance(self.ple_dim, (int, np.integer)) or self.ple_dim < 0:
            raise WeightsError(f"model config has hidden_size_per_layer_input = {self.ple_dim!r}; it must be an "
                               "integer of at least 0")
        p = np.asarray(self.global_periods)
        if p.shape != (self.global_head_dim // 2,) or not np.all(np.isfinite(p)) or not np.all(p > 0):
            raise WeightsError(f"the full-attention layers' RoPE periods have shape {p.shape} (want "
                               f"({self.global_head_dim // 2},)) or values that are not finite and positive")

    def head(self, layer: int) -> tuple[int, int]:
        """``(key/value heads, head size)`` of ``layer``."""
        if self.layer_types[layer] == "sliding_attention":
            return self.num_kv_heads, self.head_dim
        return self.global_kv_heads, self.global_head_dim


def _kv_sources(types: list[str], shared: int) -> list[int]:
    """Per layer, the layer whose keys and values it reads (transformers' ``kv_sharing_modes``).

    Raises:
        WeightsError: more shared layers than layers, or a shared layer with no unshared layer of its kind before.
    """
    n = len(types)
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n:
        raise WeightsError(f"model config shares keys and values over {shared!r} of {n} layers; it must be an "
                           "integer from 0 to the layer count less one")
    first = n - shared
    out = list(range(n))
    for i in range(first, n):
        same = [j for j in range(first) if types[j] == types[i]]
        if not same:
            raise WeightsError(f"shared layer {i} ({types[i]}) has no unshared {types[i]} layer to read keys and "
                               "values from")
        out[i] = same[-1]
    return out


def _proportional_periods(theta: float, dims: int, rotated_pairs: int) -> np.ndarray:
    """RoPE periods ``[dims / 2]``: ``theta ** (2i / dims)`` for the first ``rotated_pairs``, none for the rest
    (transformers' ``_compute_proportional_rope_parameters``, whose zero inverse frequencies are these periods)."""
    periods = theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    periods[rotated_pairs:] = _UNROTATED
    return periods.astype(np.float32)


class Gemma4(DecoderModel):
    architecture = "gemma4"
    # Google ships and Hugging Face runs Gemma 4 in bfloat16; its residual stream outgrows float16, as Gemma 3's.
    half_dtype = DType.BFLOAT16
    own_layers = "per-layer embeddings and key/value layers shared across layers"

    def __init__(self, config: Gemma4Config, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        if self.part.reduce is not None or any(config.kv_source[i] not in self.layers for i in self.layers):
            raise UnsupportedError("a Gemma 4 model is not split over ranks: its shared layers read earlier layers' "
                                   "keys and values")
        self._global_periods = self.backend.new_context().from_numpy(np.asarray(config.global_periods, np.float32))

    # ---- configuration -----------------------------------------------------------------------------------------
    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> Gemma4Config:
        get = metadata_getter(metadata, "gemma4")
        layers = check_layer_count(get("block_count"))
        pattern = list(get("attention.sliding_window_pattern"))
        if len(pattern) != layers:
            raise WeightsError(f"GGUF key gemma4.attention.sliding_window_pattern has {len(pattern)} entries for "
                               f"{layers} layers")
        types = ["sliding_attention" if s else "full_attention" for s in pattern]
        if any(n.startswith("blk.") and ".ffn_gate_inp." in n for n in weights):
            raise UnsupportedError("Gemma 4's mixture-of-experts model (26B-A4B) is not supported yet; its dense "
                                   "models (E2B, E4B, 31B) are")
        heads = get("attention.head_count", positive=True)
        kv = get("attention.head_count_kv", heads)
        kv = [int(kv)] * layers if isinstance(kv, int) else [int(x) for x in kv]
        ff = get("feed_forward_length")
        ff = [int(ff)] * layers if isinstance(ff, int) else [int(x) for x in ff]
        if len(kv) != layers:
            raise WeightsError(f"GGUF key gemma4.attention.head_count_kv has {len(kv)} entries for {layers} layers")
        sources = _kv_sources(types, int(get("attention.shared_kv_layers", 0)))
        sliding, full = types.index("sliding_attention"), types.index("full_attention")
        global_dim = int(get("attention.key_length"))
        theta = float(get("rope.freq_base", 1e6))
        factors = weights.get("rope_freqs.weight")
        factors = (np.ones(global_dim // 2, np.float64) if factors is None
                   else factors.astype(DType.FLOAT32).numpy().astype(np.float64).reshape(-1))
        if factors.shape != (global_dim // 2,):
            raise WeightsError(f"tensor rope_freqs.weight has {factors.size} factors for a head size of {global_dim}")
        hidden = get("embedding_length", positive=True)
        return Gemma4Config(
            architecture="gemma4", vocab_size=vocab_size_of(weights, metadata, "gemma4"), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=kv[sliding], head_dim=int(get("attention.key_length_swa")),
            intermediate_size=ff[0], rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 131072)), rope_theta=theta,
            rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
            # Hugging Face's sliding_window counts the token itself; the cache's window does not.
            sliding_window=int(get("attention.sliding_window")) - 1, layer_types=types, query_scale=1.0,
            embed_scale=bf16_embed_scale(hidden), qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
            final_softcap=soft_cap(get("final_logit_softcapping", None)),
            global_head_dim=global_dim, global_kv_heads=kv[full],
            k_eq_v=f"blk.{full}.attn_v.weight" not in weights, kv_source=sources, ffn_sizes=ff,
            ple_dim=int(get("embedding_length_per_layer_input", 0)),
            global_periods=(theta ** (np.arange(0, global_dim, 2) / global_dim) * factors).astype(np.float32),
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> Gemma4Config:
        config = config.get("text_config", config)
        if config.get("enable_moe_block"):
            raise UnsupportedError("Gemma 4's mixture-of-experts model (26B-A4B) is not supported yet; its dense "
                                   "models (E2B, E4B, 31B) are")
        if config.get("use_bidirectional_attention") == "all":
            raise UnsupportedError("a Gemma 4 model with bidirectional attention everywhere is an encoder, not a chat "
                                   "model")
        layers = check_layer_count(config["num_hidden_layers"])
        types = list(config.get("layer_types") or
                     ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
        if types:
            types[-1] = "full_attention"  # as Gemma4TextConfig forces it
        heads = int(config.get("num_attention_heads", 8))
        kv, head_dim = int(config.get("num_key_value_heads", 4)), int(config.get("head_dim", 256))
        k_eq_v = bool(config.get("attention_k_eq_v", False))
        overrides = [v for k, v in (config.get("per_layer_config") or {}).items()
                     if int(k) < layers and types[int(k)] == "full_attention"]
        full = overrides[0] if overrides else {}
        global_dim = int(full.get("head_dim", config.get("global_head_dim", 512)))
        global_kv = int(full.get("num_key_value_heads",
                                 (config.get("num_global_key_value_heads") if k_eq_v else None) or kv))
        rope = config.get("rope_parameters") or {}
        local, glob = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
        for kind, params in (("sliding", local), ("full", glob)):
            if params.get("rope_type", "default") not in ("default", "proportional") or params.get("factor", 1.0) != 1:
                raise UnsupportedError(f"gemma4: RoPE {params.get('rope_type')!r} with factor "
                                       f"{params.get('factor', 1.0)} on {kind} layers is not supported (default and "
                                       "proportional are)")
        theta = float(glob.get("rope_theta", 1e6))
        factor = float(glob.get("partial_rotary_factor", 1.0)) if glob.get("rope_type") == "proportional" else 1.0
        shared = int(config.get("num_kv_shared_layers", 0))
        sources = _kv_sources(types, shared)
        ff = int(config["intermediate_size"])
        double = bool(config.get("use_double_wide_mlp", False))
        hidden = int(config["hidden_size"])
        return Gemma4Config(
            architecture="gemma4", vocab_size=int(config.get("vocab_size", 262144)), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate_size=ff,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 131072)), rope_theta=theta,
            rope_local_theta=float(local.get("rope_theta", 10000.0)),
            sliding_window=int(config.get("sliding_window", 512)) - 1, layer_types=types, query_scale=1.0,
            embed_scale=bf16_embed_scale(hidden), qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
            final_softcap=soft_cap(config.get("final_logit_softcapping")),
            global_head_dim=global_dim, global_kv_heads=global_kv, k_eq_v=k_eq_v, kv_source=sources,
            ffn_sizes=[ff * 2 if double and i >= layers - shared else ff for i in range(layers)],
            ple_dim=int(config.get("hidden_size_per_layer_input") or 0),
            global_periods=_proportional_periods(theta, global_dim, int(factor * global_dim // 2)),
        )

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        if source == "gguf":
            out = {}
            for name, t in hf_names_from_gguf(weights, "pre_feedforward_layernorm").items():
                parts = name.split(".")
                if name in _GGUF_EXTRA:
                    name = _GGUF_EXTRA[name]
                elif parts[0] == "blk" and ".".join(parts[2:]) in _GGUF_LAYER_EXTRA:
                    name = f"model.layers.{parts[1]}.{_GGUF_LAYER_EXTRA['.'.join(parts[2:])]}"
                out[name] = t
            return out
        return {name.replace("model.language_model.", "model."): t for name, t in weights.items()
                if not any(tower in name for tower in _TOWERS)}

    # ---- weights -----------------------------------------------------------------------------------------------
    def _check_weights(self) -> None:
        """Every tensor of Gemma 4's layout is there, with the shape the config implies.

        Raises:
            WeightsError: a missing tensor, or one whose shape disagrees with the config (both named).
        """
        c: Gemma4Config = self.config
        d, p, n = c.hidden_size, c.ple_dim, c.num_layers
        want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
        if p:
            want.update({"model.embed_tokens_per_layer.weight": (c.vocab_size, n * p),
                         "model.per_layer_model_projection.weight": (n * p, d),
                         "model.per_layer_projection_norm.weight": (p,)})
        for i in self.part.layers:
            pre = f"model.layers.{i}."
            kv, hd = c.head(i)
            ff = c.ffn_sizes[i]
            want.update({pre + n: (d,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                                 "pre_feedforward_layernorm.weight",
                                                 "post_feedforward_layernorm.weight")})
            want.update({pre + "self_attn.q_proj.weight": (c.num_heads * hd, d),
                         pre + "self_attn.o_proj.weight": (d, c.num_heads * hd), pre + "self_attn.q_norm.weight": (hd,),
                         pre + "mlp.gate_proj.weight": (ff, d), pre + "mlp.up_proj.weight": (ff, d),
                         pre + "mlp.down_proj.weight": (d, ff)})
            if c.kv_source[i] == i:
                want.update({pre + "self_attn.k_proj.weight": (kv * hd, d), pre + "self_attn.k_norm.weight": (hd,)})
                if not (c.k_eq_v and c.layer_types[i] == "full_attention"):
                    want[pre + "self_attn.v_proj.weight"] = (kv * hd, d)
            if p:
                want.update({pre + "per_layer_input_gate.weight": (p, d), pre + "per_layer_projection.weight": (d, p),
                             pre + "post_per_layer_input_norm.weight": (d,)})
        missing = [name for name in want if name not in self.w]
        if missing:
            raise WeightsError(f"the gemma4 checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}; "
                               "is it a complete Gemma 4 text model?")
        for name, shape in {**want, "lm_head.weight": (c.vocab_size, d)}.items():
            t = self.w.get(name)
            if t is not None and tuple(t.shape) != shape:
                raise WeightsError(f"tensor {name} has shape {tuple(t.shape)} but the model config implies {shape} "
                                   f"(hidden {d}, {c.num_heads} heads of {c.head_dim} / {c.global_head_dim} on full "
                                   f"layers, feed-forward {c.ffn_sizes[0]}, per-layer width {p}); the file is "
                                   "inconsistent")

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        w = super()._layer_weights(i)
        pre = f"model.layers.{i}."
        w.update({"ple_gate": self.w.get(pre + "per_layer_input_gate.weight"),
                  "ple_proj": self.w.get(pre + "per_layer_projection.weight"),
                  "ple_norm": self.w.get(pre + "post_per_layer_input_norm.weight")})
        scalar = self.w.get(pre + "layer_scalar")
        w["scalar"] = None if scalar is None else scalar.astype(self.dtype).reshape(1, 1, 1)
        return w

    # ---- caches ------------------------------------------------------------------------------------------------
    def layer_kv_shapes(self) -> list[tuple[int, int, int]]:
        c: Gemma4Config = self.config
        return [(c.head(i)[0], c.head(i)[1], c.head(i)[1]) if i in self.part.layers and c.kv_source[i] == i else None
                for i in range(c.num_layers)]

    def _layer_rope(self, layer: int) -> tuple[int, float | None, Tensor | None]:
        """``(dims, base, periods)`` of the layer's RoPE."""
        if self.is_sliding(layer):
            return self.config.head_dim, self.config.rope_local_theta, None
        return self.config.global_head_dim, None, self._global_periods

    def shift(self, ctx: Context, layer: int, keys: Tensor, shift: Tensor) -> Tensor:
        """Re-rotate cached keys ``[1, H_kv, n, Dh]`` by per-cell position deltas (INT32 ``[n]``) with the layer's
        own RoPE (see :meth:`DecoderModel.shift`)."""
        dims, base, periods = self._layer_rope(layer)
        return apply_rope(keys, shift, dims, base, 1.0, False, periods)

    # ---- forward -----------------------------------------------------------------------------------------------
    def _per_layer_inputs(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor | None:
        """The per-layer embeddings ``[1, N, L, P]`` of the batch's tokens, from their scaled embeddings
        ``h [1, N, D]`` (transformers' ``get_per_layer_inputs`` and ``project_per_layer_inputs``), or None.

        Raises:
            UnsupportedError: the batch gives embeddings, not token ids (the token table needs the ids).
        """
        c: Gemma4Config = self.config
        if not c.ple_dim:
            return None
        if batch.embeddings is not None:
            raise UnsupportedError("Gemma 4's per-layer embeddings need the token ids; this batch gives embeddings")
        n, layers, p = h.shape[1], c.num_layers, c.ple_dim
        ids = batch.inputs if isinstance(batch.inputs, Tensor) else ctx.from_numpy(batch.inputs, DType.INT32)
        tokens = self.w["model.embed_tokens_per_layer.weight"].take(ids, axis=0).astype(self.dtype) * (p ** 0.5)
        proj = h.linear(self.w["model.per_layer_model_projection.weight"]) * (c.hidden_size ** -0.5)
        proj = proj.reshape(1, n, layers, p).rms_norm(self.w["model.per_layer_projection_norm.weight"],
                                                      c.rms_norm_eps)
        return (proj + tokens.reshape(1, n, layers, p)) * (2.0 ** -0.5)

    def run_layers(self, ctx: Context, batch: Batch, h: Tensor, cache: "Cache", output_layer: int | None = None,
                   angles: Any = None, whole: bool = False, pos_tensor: Tensor | None = None) -> Tensor:
        """Gemma 4's layers on ``h [1, N, D]`` (see :meth:`DecoderModel.run_layers`; op by op, ``angles`` and
        ``pos_tensor`` unused). Raises :class:`NotWholeStep` when traced whole."""
        if whole:
            raise NotWholeStep("Gemma 4's layers run op by op")
        c: Gemma4Config = self.config
        eps, n = c.rms_norm_eps, h.shape[1]
        positions = rope_positions(ctx, batch)
        ple = self._per_layer_inputs(ctx, batch, h)
        kept: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}  # a source layer's keys, values and mask

        def heads(x: Tensor, count: int, dim: int) -> Tensor:
            return x.reshape(1, n, count, dim).transpose(0, 2, 1, 3)

        for i, w in self.layers.items():
            if output_layer is not None and i > output_layer:
                break
            kv, hd = c.head(i)
            dims, base, periods = self._layer_rope(i)
            x = h.rms_norm(w["attn_norm"], eps)
            q = heads(x.linear(w["q"]), c.num_heads, hd).rms_norm(w["q_norm"], eps)
            q = apply_rope(q, positions, dims, base, 1.0, False, periods)
            if c.kv_source[i] == i:
                cache.set_layer(i)
                k = x.linear(w["k"])
                v = k if w["v"] is None else x.linear(w["v"])  # attention_k_eq_v: the key projection's output
                k = apply_rope(heads(k, kv, hd).rms_norm(w["k_norm"], eps), positions, dims, base, 1.0, False,
                               periods)
                cache.put(ctx, k, heads(v, kv, hd).rms_norm(None, eps))
                kept[i] = cache.get(ctx)
            keys, values, mask = kept[c.kv_source[i]]
            o = ctx.scaled_dot_product_attention(q, keys, values, c.query_scale, mask)
            o = o.transpose(0, 2, 1, 3).reshape(1, n, c.num_heads * hd).linear(w["o"])
            h = h + o.rms_norm(w["post_attn_norm"], eps)
            x = h.rms_norm(w["pre_ffn_norm"], eps)
            h = h + x.linear(w["gate"]).gated_linear(x.linear(w["up"]), c.activation, w["down"], w["post_ffn_norm"],
                                                      eps)
            if ple is not None:
                g = h.linear(w["ple_gate"]).gelu(approximate=True) * ple[:, :, i, :]
                h = h + g.linear(w["ple_proj"]).rms_norm(w["ple_norm"], eps)
            if w["scalar"] is not None:
                h = h * w["scalar"]
        return h

    def logits(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor:
        """The output logits ``[K, vocab]``, soft-capped where the config caps them (as Gemma 2's)."""
        return capped(super().logits(ctx, batch, h), self.config.final_softcap)
