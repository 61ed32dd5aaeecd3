"""What every text architecture shares: the decoder-only transformer forward pass on the ``ml`` interfaces.

An architecture file (``llama.py``, ``gemma3.py``, ``qwen3.py``, ``lfm2.py``) supplies a :class:`DecoderConfig`
(``config.py``) read from GGUF metadata or a Hugging Face ``config.json``, a name map for its checkpoint tensors, and the per-layer cache choice;
:class:`DecoderModel` runs the layers. Shapes: hidden states ``[1, N, D]`` for a batch of ``N`` tokens (sequences are
kept apart by the cache's mask), attention ``[1, H, N, Dh]``.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import WeightsError
from mlx_engine.kvcache import Cache, FusedSteps
from mlx_engine.ml import Backend, Context, DType, LayerFusion, RopeAngles, Tensor
from mlx_engine.models.layers.config import ATTENTION_TYPES, DecoderConfig
from mlx_engine.models.layers.layer import (SectionPositions, apply_rope, attention_in, attention_out, rope_positions,
                                            section_positions, takes_output_mlp)
from mlx_engine.models.layers.plan import COMPILED, FUSED, FUSED_ROTATED, DecodePlan, PlanInputs, decode_plan
from mlx_engine.models.layers.step import NotWholeStep, WholeStep

# GGUF tensor names (llama.cpp's) to the Hugging Face names every architecture file uses.
_GGUF_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"rope_freqs\.weight", "rope_freqs"),
    (r"blk\.(\d+)\.attn_norm\.(weight|bias)", r"model.layers.\1.input_layernorm.\2"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]
_GGUF_RE = [(re.compile(p + "$"), r) for p, r in _GGUF_NAMES]


def hf_names_from_gguf(weights: dict[str, Tensor], ffn_norm: str) -> dict[str, Tensor]:
    """Rename llama.cpp tensor names to Hugging Face ones. ``ffn_norm`` is what ``blk.N.ffn_norm`` is in this
    architecture (``post_attention_layernorm`` for Llama and Qwen3, ``pre_feedforward_layernorm`` for Gemma 3)."""
    out = {}
    for name, t in weights.items():
        m = re.match(r"blk\.(\d+)\.ffn_norm\.weight$", name)
        if m:
            out[f"model.layers.{m.group(1)}.{ffn_norm}.weight"] = t
            continue
        for rx, repl in _GGUF_RE:
            if rx.match(name):
                out[rx.sub(repl, name)] = t
                break
        else:
            out[name] = t
    return out


class DecoderModel(abc.ABC):
    """A decoder-only transformer (Llama, Qwen3, Gemma 3) running on the ``ml`` interfaces.

    Subclasses set ``architecture`` and implement ``config_from_gguf``, ``config_from_hf``, ``sanitize`` and
    optionally ``make_cache``.
    """

    architecture = ""
    #: The tokens of one image attend to each other both ways (Gemma 3); else causally, as text.
    images_both_ways = False
    #: An image's rows take the places of its placeholder tokens (Gemma 3); False: the placeholder stays a token
    #: and the rows are read through cross-attention (Llama 3.2 Vision).
    images_in_stream = True
    #: Rows of the token embedding beyond the output vocabulary (Llama 3.2 Vision's 8, its image token among them).
    extra_token_rows = 0
    #: The 16-bit dtype a GPU computes in unless the load names one: float16, or bfloat16 for an architecture whose
    #: activations outgrow float16's range (65504), for which float16 is then refused.
    half_dtype = DType.FLOAT16
    #: The architecture runs its own layer code (its ``run_layers``), not the fused forms: the reason, for the
    #: decode plan; "" for the shared layer.
    own_layers = ""

    def __init__(self, config: DecoderConfig, weights: dict[str, Tensor], backend: Backend,
                 part: "ModelPart | None" = None):
        self.config = config
        self.backend = backend
        self.dtype = backend.compute_dtype
        self.w = weights
        self.part = part if part is not None else ModelPart(range(config.num_layers))
        self._check_weights()
        ctx = backend.new_context()
        freqs = config.rope_freqs
        self._rope_freqs = ctx.from_numpy(np.asarray(freqs, np.float32)) if freqs is not None else None
        self.head = (weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
                     if self.part.head else None)
        self.layers = {i: self._layer_weights(i) for i in self.part.layers}
        self.cache_options: dict[str, Any] = {}  # keyword arguments of the cache a hybrid model makes (checkpoints)
        self.vision: Any = None  # the image encoder of a multimodal checkpoint (models/vision/vision.py), or None
        self._plan: DecodePlan | None = None
        self._switches = (True, True, True)  # see compile_decode, fuse_attention, compile_step
        self._whole_step: WholeStep | None = None
        self._compiled: dict[tuple, Any] = {}
        self._block_of: dict[tuple, tuple[Any, tuple[str, ...]]] = {}  # (kind, layer, rope_args) -> _compiled_block

    # ---- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_backend(cls, backend: Backend, source: str, part: "Callable[[DecoderConfig], tuple[DecoderConfig, "
                     "ModelPart]] | None" = None) -> "DecoderModel":
        """Build from a loaded backend. ``source`` is ``"gguf"`` or ``"hf"`` (the naming of the tensors). ``part``
        (one rank of a distributed run) maps the file's config to this rank's (its share of the heads) and the
        :class:`ModelPart` it runs."""
        try:
            if source == "gguf":
                config = cls.config_from_gguf(backend.metadata, backend.weights)
            else:
                config = cls.config_from_hf(backend.metadata)
        except (ArithmeticError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            if isinstance(e, WeightsError):
                raise
            # the metadata is the file's: a value of the wrong type or a zero size is the file's fault
            raise WeightsError(f"the {cls.architecture} model's {'GGUF metadata' if source == 'gguf' else 'config'} "
                               f"is invalid: {type(e).__name__}: {e}") from e
        weights = cls.sanitize(dict(backend.weights), config, source)
        if part is None:
            return cls(config, weights, backend)
        config, model_part = part(config)
        return cls(config, weights, backend, model_part)

    @classmethod
    @abc.abstractmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        """Hyper-parameters from GGUF metadata (``<arch>.block_count`` ...). Raises ``WeightsError``."""

    @classmethod
    @abc.abstractmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        """Hyper-parameters from a Hugging Face ``config.json`` mapping. Raises ``WeightsError``."""

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """Map checkpoint names to Hugging Face names (and fix conventions). The default handles GGUF names."""
        return hf_names_from_gguf(weights, "post_attention_layernorm") if source == "gguf" else weights

    def _check_weights(self) -> None:
        """Every tensor the architecture needs is there, with the shape the config implies.

        Raises:
            WeightsError: a missing tensor, or one whose shape disagrees with the config (both named).
        """
        c = self.config
        if 8 * len(self.part.layers) > len(self.w):
            raise WeightsError(f"the model config says {c.num_layers} layers but the checkpoint holds only "
                               f"{len(self.w)} tensors; is it a complete {self.architecture} model?")
        d, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        part = self.part
        want: dict[str, tuple[int, ...] | None] = {}
        optional: dict[str, tuple[int, ...]] = {"lm_head.weight": (c.vocab_size, d)}
        if part.embed:
            want["model.embed_tokens.weight"] = (c.vocab_size + self.extra_token_rows, d)
        if part.head:
            want["model.norm.weight"] = (d,)
            if "lm_head.weight" not in self.w:
                want["model.embed_tokens.weight"] = (c.vocab_size, d)
        for i in part.layers:
            p = f"model.layers.{i}."
            want.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
            want.update(self.mlp_shapes(i))
            if not self.is_attention(i):
                req, opt = self.mixer_shapes(i)
                want.update(req)
                optional.update(opt)
                continue
            want.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                         p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q)})
            norms = {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
            (want if c.qk_norm else optional).update(norms)
            norms = {p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)}
            (want if c.sandwich_norm else optional).update(norms)
            optional.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                             p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (d,),
                             p + "self_attn.sinks": (c.num_heads,)})
        missing = [n for n in want if n not in self.w]
        if missing:
            raise WeightsError(f"the {self.architecture} checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(missing[:3])}; is it a complete {self.architecture} model?")
        for name, shape in {**want, **optional}.items():
            t = self.w.get(name)
            if t is not None and tuple(t.shape) != shape:
                raise WeightsError(f"tensor {name} has shape {tuple(t.shape)} but the model config implies {shape} "
                                   f"(hidden {d}, {c.num_heads} heads of {c.head_dim}, {c.num_kv_heads} key/value "
                                   f"heads, feed-forward {ff}, vocabulary {c.vocab_size}); the file is inconsistent")

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The shapes of a layer's MLP tensors (dense SwiGLU/GeGLU here; mixture-of-experts architectures
        override it)."""
        d, ff, p = self.config.hidden_size, self.config.intermediate_size, f"model.layers.{layer}.mlp."
        return {p + "gate_proj.weight": (ff, d), p + "up_proj.weight": (ff, d), p + "down_proj.weight": (d, ff)}

    def mixer_shapes(self, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """``(required, optional)`` tensor shapes of a recurrent layer's token mixer (hybrid architectures)."""
        raise WeightsError(f"layer {layer} of this {self.architecture} model is a {self.config.layer_types[layer]!r} "
                           "layer, which the architecture does not have")

    def mixer_layer(self, ctx: Context, layer: int, w: dict[str, Tensor | None], h: Tensor, cache: "Cache",
                    batch: Batch) -> Tensor:
        """One layer whose token mixer is not self-attention through the KV cache, on ``h [1, N, D]`` of ``batch``;
        returns the new ``h``: a recurrent layer, its state in the cache (a ``RecurrentCache``; hybrid
        architectures), or a cross-attention layer over the encoder cache (Llama 3.2 Vision)."""
        raise WeightsError(f"layer {layer} of this {self.architecture} model is a {self.config.layer_types[layer]!r} "
                           "layer, which the architecture does not have")

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        p = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias",
            "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight", "o_bias": "self_attn.o_proj.bias", "sinks": "self_attn.sinks",
            "post_attn_norm": "post_attention_layernorm.weight",
            "pre_ffn_norm": "pre_feedforward_layernorm.weight", "post_ffn_norm": "post_feedforward_layernorm.weight",
            "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
        }
        return {k: self.w.get(p + v) for k, v in names.items()}

    def use_context(self, tokens: int) -> None:
        """Called once, before the first forward pass, with the most tokens a sequence will hold here: a LongRoPE
        model (``config.rope_long_freqs``) takes its long factors when ``tokens`` exceeds the original context, as
        llama.cpp does by its context size (transformers decides per call by the sequence's length, which a KV
        cache cannot follow)."""
        c = self.config
        if c.rope_long_freqs is not None and tokens > c.rope_original_context:
            self._rope_freqs = self.backend.new_context().from_numpy(np.asarray(c.rope_long_freqs, np.float32))
            self._compiled.clear()  # traces hold the RoPE they were made with
            self._block_of.clear()
            self._whole_step = None

    # ---- the decode plan -----------------------------------------------------------------------------------------
    @property
    def compile_decode(self) -> bool:
        """Single-token steps through ``Backend.compile`` (False: op by op, for comparison). Setting a switch
        makes the decode plan again."""
        return self._switches[0]

    @compile_decode.setter
    def compile_decode(self, on: bool) -> None:
        self._switch(0, on)

    @property
    def fuse_attention(self) -> bool:
        """Compiled steps take the cache's fused attention (False: RoPE, put, get and attention apart)."""
        return self._switches[1]

    @fuse_attention.setter
    def fuse_attention(self, on: bool) -> None:
        self._switch(1, on)

    @property
    def compile_step(self) -> bool:
        """Fused decode steps are traced whole (``models/layers/step.py``; False: block by block)."""
        return self._switches[2]

    @compile_step.setter
    def compile_step(self, on: bool) -> None:
        self._switch(2, on)

    def _switch(self, at: int, on: bool) -> None:
        s = list(self._switches)
        s[at] = bool(on)
        self._switches = (s[0], s[1], s[2])
        self._plan = None

    @property
    def plan(self) -> DecodePlan:
        """How each layer of a one-token step runs (:mod:`mlx_engine.models.layers.plan`), decided on first use."""
        if self._plan is None:
            c = self.config
            base, scale, freqs = self._rope(next(iter(self.layers))) if self.layers else (c.rope_theta, 1.0, None)
            with self.backend.new_context() as ctx:
                angles = ctx.rope_angles(0, 1, c.rope_dims or c.head_dim, base, scale, freqs, self.dtype) is not None
            fusion = self.backend if isinstance(self.backend, LayerFusion) else None
            attention = {i: self.is_attention(i) for i in self.layers}
            self._plan = decode_plan(PlanInputs(
                {i: c.layer_types[i] for i in self.layers}, attention, self._switches, self.own_layers,
                c.attn_softcap, frozenset(i for i, w in self.layers.items() if w.get("sinks") is not None),
                c.query_temperature is not None, angles,
                frozenset(i for i, w in self.layers.items()
                          if attention[i] and takes_output_mlp(c, w, fusion, self.dtype, self.part.reduce)),
                self.part.reduce, self.part.embed, self.part.head))
        return self._plan

    # ---- caches ------------------------------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.config.layer_types[layer] == "sliding_attention"

    def is_attention(self, layer: int) -> bool:
        """Whether the layer attends through the KV cache (else it keeps a recurrent state)."""
        return self.config.layer_types[layer] in ATTENTION_TYPES

    def make_cache(self, kv_bits: int | None = None) -> "Cache":
        """The cache for this model: causal, or a wrapper of sliding-window and causal caches per layer type."""
        from mlx_engine.kvcache import CausalCache, SlidingWindowMemoryCache, WrapperCache

        if not any(self.is_sliding(i) for i in range(self.config.num_layers)):
            return CausalCache(shift_fn=self.shift, kv_bits=kv_bits)
        # Extra memory beyond the window lets a chat session rewind a little (re-tokenised history) and resume.
        w = self.config.sliding_window
        sliding = SlidingWindowMemoryCache(w, w + 256, shift_fn=self.shift, kv_bits=kv_bits)
        full = CausalCache(shift_fn=self.shift, kv_bits=kv_bits)
        return WrapperCache([full, sliding], [1 if self.is_sliding(i) else 0 for i in range(self.config.num_layers)])

    def state_bytes(self) -> int:
        """The most bytes of recurrent state one sequence holds in the cache (its state and its checkpoints): 0 for
        a model without recurrent layers."""
        return 0

    def kv_width(self, layer: int) -> int:
        """Numbers the KV cache keeps per token for ``layer``: every key/value head's key and value."""
        return 2 * self.config.num_kv_heads * self.config.head_dim

    def layer_kv_shapes(self) -> list[tuple[int, int, int]]:
        c = self.config
        return [(c.num_kv_heads, c.head_dim, c.head_dim) if i in self.part.layers and self.is_attention(i) else None
                for i in range(c.num_layers)]

    def _rope_args(self, layer: int) -> tuple[float | None, "Tensor | None"]:
        c = self.config
        if self.is_sliding(layer) and c.rope_local_theta is not None:
            return c.rope_local_theta, None
        if self._rope_freqs is not None:
            return None, self._rope_freqs
        return c.rope_theta, None

    def _rope_scale(self, layer: int) -> float:
        return 1.0 if self.is_sliding(layer) and self.config.rope_local_theta is not None else self.config.rope_scale

    def shift(self, ctx: Context, layer: int, keys: Tensor, shift: Tensor) -> Tensor:
        """Re-rotate cached keys ``[1, H_kv, n, Dh]`` by per-cell position deltas ``shift`` (INT32 ``[n]``): RoPE
        rotations compose additively, so rotating by the delta renumbers the key."""
        base, freqs = self._rope_args(layer)
        return apply_rope(keys, shift, self.config.rope_dims or self.config.head_dim, base, self._rope_scale(layer),
                          self.config.rope_traditional, freqs)

    # ---- forward -----------------------------------------------------------------------------------------------
    def _rope(self, layer: int) -> tuple[float | None, float, "Tensor | None"]:
        """``(base, scale, freqs)`` of the layer's RoPE."""
        base, freqs = self._rope_args(layer)
        return base, self._rope_scale(layer), freqs

    _BLOCK_WEIGHTS = {
        "in": ("attn_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm"),
        "out": ("o", "o_bias", "attn_gate", "attn_gate_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm",
                "gate", "up", "down", "router", "experts_gate", "experts_up", "experts_down", "shared_gate",
                "shared_up", "shared_down", "shared_expert_gate", "router_bias", "score_bias", "experts_gate_bias",
                "experts_up_bias", "experts_down_bias"),
    }

    def _compiled_block(self, kind: str, layer: int, rope_args: int = 1,
                        residual: bool = False) -> tuple[Any, tuple[str, ...]]:
        """``(fn, names)``: :func:`attention_in` (``kind="in"``, called ``fn(h, *rope, *weights)``, ``rope`` the
        positions or, with ``rope_args=2``, the cosines and sines of :class:`RopeAngles`, none with 0; with
        ``residual``, ``fn(h, m, *rope, *weights)`` adds the last layer's deferred ``m`` to ``h`` in its input norm
        and returns the sum after ``q, k, v``) or :func:`attention_out` (``"out"``, ``fn(h, o, *weights)``, its
        last residual add deferred: ``(h, m)``; as the backend's one operation where the plan says so)
        through ``Backend.compile``, the layer's weights ``names`` passed as
        arguments, so that alike layers share one trace. The traced functions hold the config and the RoPE arguments,
        not the model (no reference cycle keeps a closed model's weights alive)."""
        at = (kind, layer, rope_args, residual)
        known = self._block_of.get(at)
        if known is not None:  # one dict lookup per call: this runs twice per layer and decode step
            return known
        lw = self.layers[layer]
        names = tuple(k for k in self._BLOCK_WEIGHTS[kind] if lw.get(k) is not None)
        rope = self._rope(layer) if kind == "in" else None
        tail = kind == "out" and self.plan.layers[layer].tail
        key = (kind, names, rope[:2] if rope else None, rope_args, residual, tail)
        fn = self._compiled.get(key)
        if fn is None:
            c = self.config
            if kind == "in" and residual:
                def block(h: Tensor, m: Tensor, *args: Tensor) -> tuple[Tensor, ...]:
                    at = RopeAngles(*args[:2]) if rope_args == 2 else args[0] if rope_args else None
                    w = dict(zip(names, args[rope_args:]))
                    return attention_in(c, rope, h, at, w, m)
            elif kind == "in":
                def block(h: Tensor, *args: Tensor) -> tuple[Tensor, Tensor, Tensor]:
                    at = RopeAngles(*args[:2]) if rope_args == 2 else args[0] if rope_args else None
                    return attention_in(c, rope, h, at, dict(zip(names, args[rope_args:])))[:3]
            else:
                reduce = self.part.reduce
                fusion = self.backend if tail else None

                def block(h: Tensor, o: Tensor, *ws: Tensor) -> tuple[Tensor, Tensor]:
                    return attention_out(c, h, o, dict(zip(names, ws)), reduce, defer=True, fusion=fusion)
            fn = self._compiled[key] = self.backend.compile(block)
        self._block_of[at] = fn, names
        return fn, names

    def embed(self, ctx: Context, batch: Batch) -> Tensor:
        """Hidden states ``[1, N, D]`` for the batch's tokens (or its given embeddings)."""
        if batch.embeddings is not None:
            h = batch.embeddings
        else:
            ids = batch.inputs if isinstance(batch.inputs, Tensor) else ctx.from_numpy(batch.inputs, DType.INT32)
            h = self.w["model.embed_tokens.weight"].take(ids, axis=0)
        if h.dtype != self.dtype:
            h = h.astype(self.dtype)
        if self.config.embed_scale is not None:
            h = h * self.config.embed_scale
        if batch.images and self.images_in_stream:  # image rows replace their placeholders, unscaled (masked_scatter)
            parts, at = [], 0
            for start, rows in sorted(batch.images, key=lambda im: im[0]):
                parts += [h[at:start], rows.astype(self.dtype)]
                at = start + rows.shape[0]
            parts.append(h[at:])
            h = ctx.concatenate([p for p in parts if p.shape[0]], axis=0)
        return h.reshape(1, h.shape[-2], h.shape[-1])

    def forward(self, ctx: Context, batch: Batch, cache: "Cache", hidden_only: bool = False,
                output_layer: int | None = None, hidden_too: bool = False) -> "Tensor | tuple[Tensor, Tensor]":
        """Run the batch through the model, storing its keys and values in ``cache``.

        Returns logits ``[K, vocab]`` (float, the compute dtype) for the batch's ``outputs``, or with
        ``hidden_only`` the final-normed hidden states ``[1, N, D]`` of every token; with ``hidden_too`` both, as
        ``(logits, hidden [N, D])`` (what a multi-token-prediction head reads: models/generation/mtp.py). With
        ``output_layer = k``: the hidden states ``[1, N, D]`` of every token after layer ``k`` (0-based; ``-1``: the
        embeddings), not normed, and the layers after ``k`` do not run (transformers' ``hidden_states[k + 1]``; Z-Image's text encoder).
        A model whose config attends ``both_ways`` (an embedder) lets each input's run of the batch see itself both
        ways (``cache.set_causal``). Raises ``CacheFullError`` when the cache has no room (nothing is stored then).
        """
        cache.start_forward(ctx, batch)
        if self.config.both_ways:  # an embedder trained both ways: each input's run of the packed batch
            seqs = np.asarray(batch.sequences)
            cuts = [0, *(np.flatnonzero(np.diff(seqs)) + 1).tolist(), len(seqs)]
            cache.set_causal(ctx, list(zip(cuts[:-1], cuts[1:])), window_both_ways=True)
        elif batch.images and self.images_both_ways:
            cache.set_causal(ctx, [(s, s + rows.shape[0]) for s, rows in batch.images])
        if (len(batch) == 1 and output_layer is None and not hidden_only and not hidden_too and batch.embeddings is None
                and not batch.images and self.plan.whole):
            if self._whole_step is None:
                self._whole_step = WholeStep(self, self.backend.compile)
            logits = self._whole_step.run(ctx, batch, cache) if self._whole_step.usable else None
            if logits is not None:
                return logits
        h = self.run_layers(ctx, batch, self.embed(ctx, batch), cache, output_layer)
        if output_layer is not None:
            return h
        if hidden_only:
            return h.rms_norm(self.w["model.norm.weight"], self.config.rms_norm_eps)
        if hidden_too:
            return self.logits(ctx, batch, h), h[0].rms_norm(self.w["model.norm.weight"], self.config.rms_norm_eps)
        return self.logits(ctx, batch, h)

    def run_layers(self, ctx: Context, batch: Batch, h: Tensor, cache: "Cache", output_layer: int | None = None,
                   angles: "dict[tuple, RopeAngles] | None" = None, whole: bool = False,
                   pos_tensor: Tensor | None = None) -> Tensor:
        """The layers this model holds (``part.layers``) on hidden states ``h [1, N, D]`` of ``batch``, after
        ``cache.start_forward``; returns the new ``h``. ``output_layer``: stop after that layer. ``angles``: the
        RoPE angles per ``(base, scale, id(freqs))``, or ``pos_tensor`` (INT32 ``[1]``) the position of a one-token
        step where the backend makes none, made by the caller; ``whole``: tracing a step compiled whole (raises
        :class:`NotWholeStep` where the cache's fused attention does not run for this step). A one-token step runs
        each layer in the form of the decode plan (:attr:`plan`); other batches op by op."""
        c = self.config
        n = h.shape[1]
        positions = rope_positions(ctx, batch)
        sections: dict[tuple, SectionPositions] = {}  # M-RoPE's, per distinct RoPE
        mrope = batch.mrope_positions if c.mrope_section else None
        if mrope is not None:
            positions = None  # no single offset: op by op, M-RoPE in each layer
        step = n == 1 and isinstance(positions, int)  # a one-token step: the plan's forms; else op by op
        plan = self.plan.layers
        if step and angles is None and pos_tensor is None:
            pos_tensor = ctx.from_numpy(np.array([positions], np.int32))
        angles = dict(angles or {})  # per distinct RoPE: made once for all its layers
        temperature = self._query_temperature(ctx, batch)
        fused_cache = cache if isinstance(cache, FusedSteps) else None
        dims = c.rope_dims or c.head_dim
        # compiled steps: the last layer's final residual term, added to h by the next layer's input norm (one node)
        pending: Tensor | None = None

        def rope_at(layer: int) -> "int | Tensor | RopeAngles":
            base, scale, freqs = self._rope(layer)
            key = (base, scale, None if freqs is None else id(freqs))
            if mrope is not None:
                if key not in sections:
                    sections[key] = section_positions(ctx, mrope, c.mrope_section, dims, base, freqs)
                return sections[key]
            if key not in angles:
                angles[key] = ctx.rope_angles(positions, n, dims, base, scale, freqs, self.dtype)
            return angles[key] or (pos_tensor if step else positions)

        for i, lw in self.layers.items():
            if output_layer is not None and i > output_layer:
                break
            if not self.is_attention(i):
                if pending is not None:
                    h, pending = h + pending, None
                h = self.mixer_layer(ctx, i, lw, h, cache, batch)
                continue
            cache.set_layer(i)
            at = rope_at(i)
            form = plan[i].form if step else None
            o = None
            res = () if pending is None else (pending,)
            if form == FUSED:  # RoPE, the cache write and attention as the cache's one node (7 nodes otherwise)
                fn, names = self._compiled_block("in", i, 0, bool(res))
                q, k, v, *hs = fn(h, *res, *[lw[name] for name in names])
                if temperature is not None:
                    q = q * temperature
                if fused_cache is not None:
                    o = fused_cache.attend(ctx, q, k, v, c.query_scale, at, dims, c.rope_traditional)
                if o is None:
                    q, k = (x.rope(at, dims, traditional=c.rope_traditional) for x in (q, k))
            elif form in (FUSED_ROTATED, COMPILED):
                rope_args = (at.cos, at.sin) if isinstance(at, RopeAngles) else (at,)
                fn, names = self._compiled_block("in", i, len(rope_args), bool(res))
                q, k, v, *hs = fn(h, *res, *rope_args, *[lw[name] for name in names])
                if temperature is not None:
                    q = q * temperature
                if form == FUSED_ROTATED and fused_cache is not None:  # rotated: the cache write and attention
                    o = fused_cache.attend(ctx, q, k, v, c.query_scale, None, dims, c.rope_traditional)
            else:
                q, k, v, _ = attention_in(c, self._rope(i), h, at, lw)
                if temperature is not None:
                    q = q * temperature
            if o is None and whole:
                raise NotWholeStep(f"layer {i}'s attention has no fused path here")
            if res:  # (a compiled step's): h with the last layer's residual term added
                h, = hs
            if o is None:
                cache.put(ctx, k, v)
                keys, values, mask = cache.get(ctx)
                sinks = lw.get("sinks")
                o = (ctx.scaled_dot_product_attention(q, keys, values, c.query_scale, mask)
                     if c.attn_softcap is None and sinks is None
                     else ctx.scaled_dot_product_attention(q, keys, values, c.query_scale, mask, c.attn_softcap, sinks))
            if form in (FUSED, FUSED_ROTATED, COMPILED):
                fn, names = self._compiled_block("out", i)
                h, pending = fn(h, o, *[lw[name] for name in names])
            else:
                h = attention_out(c, h, o, lw, self.part.reduce)
        return h if pending is None else h + pending

    def _query_temperature(self, ctx: Context, batch: Batch) -> Tensor | None:
        """Llama 4's attention temperature tuning (Ministral 3's ``llama_4_scaling_beta``): queries at position ``p``
        times ``1 + beta * log(1 + floor(p / n))``, ``[1, 1, N, 1]``; None when the model has none (transformers'
        ``get_llama_4_attn_scale``)."""
        t = self.config.query_temperature
        if t is None:
            return None
        beta, n = t
        scale = 1 + beta * np.log1p(np.floor(np.asarray(batch.positions, np.float64) / n))
        return ctx.from_numpy(scale.astype(np.float32).reshape(1, 1, -1, 1)).astype(self.dtype)

    def logits(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor:
        """Logits ``[K, vocab]`` of the batch's ``outputs`` from the last layer's ``h [1, N, D]`` (final norm, then
        the output head)."""
        out, n = batch.outputs, h.shape[1]
        if len(out) == n and np.array_equal(out, np.arange(n)):
            rows = h[0]
        elif len(out) == 1:
            rows = h[0, int(out[0]):int(out[0]) + 1]
        else:
            rows = h[0].take(ctx.from_numpy(out, DType.INT32), axis=0)
        logits = rows.rms_norm(self.w["model.norm.weight"], self.config.rms_norm_eps).linear(self.head)
        return logits if self.config.logit_scale == 1.0 else logits * (1.0 / self.config.logit_scale)


@dataclass
class ModelPart:
    """What one rank of a distributed run holds and runs of a model (all of it when not distributed).

    Attributes:
        layers: the 0-based layers it holds, consecutive.
        embed: it holds the token embeddings (runs the first layers). head: it holds the final norm and the output
            head (computes logits).
        reduce: tensor parallelism: sums a row-sharded projection's partial output ``[1, N, D]`` over the ranks.
    """

    layers: range
    embed: bool = True
    head: bool = True
    reduce: "Callable[[Tensor], Tensor] | None" = None
