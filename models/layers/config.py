"""The hyper-parameters of a text architecture (:class:`DecoderConfig`) and the helpers that read them from GGUF
metadata or a Hugging Face ``config.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.ml import Tensor


@dataclass
class DecoderConfig:
    """Hyper-parameters of a decoder-only transformer.

    Attributes:
        architecture: ``llama``, ``gemma3`` or ``qwen3``.
        rope_theta: RoPE base of the global (full-attention) layers; ``rope_local_theta`` of the sliding layers.
        rope_freqs: explicit RoPE periods ``[head_dim/2]`` after frequency scaling (Llama 3), or None.
        rope_scale: positions are multiplied by it (linear RoPE scaling: ``1 / factor``).
        rope_long_freqs, rope_original_context: LongRoPE (Phi-3): the periods ``[rope_dims/2]`` with the long
            factors, taken instead of ``rope_freqs`` (the short factors') when the context a model is run with
            exceeds ``rope_original_context`` (:meth:`DecoderModel.use_context`; llama.cpp's rule).
        rope_attention_factor: LongRoPE's attention factor, multiplying the rotated features of queries and keys
            (transformers scales the cosines and sines by it); the architecture folds it into ``query_scale``
            (every feature rotated) or its query weights (``Phi3.__init__``).
        rope_traditional: rotate interleaved pairs, for GGUF Llama checkpoints whose Q/K rows llama.cpp's converter
            permuted (attention scores are unchanged: queries and keys are permuted alike).
        mrope_section: M-RoPE (Qwen2-VL, Qwen2.5-VL): the rotary pairs split into consecutive sections (time, height,
            width; summing to ``rope_dims / 2``), each rotated by its own position axis when a batch carries
            ``mrope_positions``; None: one position per token.
        sliding_window: the window ``W`` in the cache's convention (a token sees ``W + 1`` keys), or None. With
            ``both_ways``, two-way: a token sees ``p - W .. p + W`` of its input.
        both_ways: every input attends to its own tokens both ways, each sliding layer within its two-way window
            (an embedder trained bidirectionally: EmbeddingGemma, transformers' ``use_bidirectional_attention``).
        layer_types: per layer, ``"sliding_attention"`` or ``"full_attention"`` (self-attention through the KV
            cache), ``"conv"``, ``"linear_attention"`` or ``"mamba"`` (recurrent, hybrid models),
            ``"cross_attention"`` (over an image's encoder output, Llama 3.2 Vision).
        query_scale: the attention scale (``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5`` for Gemma).
        embed_scale: embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)``; Granite's multiplier).
        residual_scale: each layer's attention and MLP outputs are multiplied by it before their residual adds
            (Granite's ``residual_multiplier``; 1: off, and the fused one-token paths are taken).
        logit_scale: the logits are divided by it (Granite's ``logits_scaling``; 1: off).
        query_temperature: ``(beta, n)``: queries at position ``p`` times ``1 + beta * log(1 + floor(p / n))``
            (Llama 4's attention temperature tuning, Ministral 3's ``llama_4_scaling_beta``); None: off.
        qk_norm: per-head RMSNorm on queries and keys (Qwen3, Gemma 3).
        sandwich_norm: RMSNorm after attention and after the MLP too (Gemma 2/3).
        activation: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU).
        conv_kernel: the kernel size of the short convolutions of ``"conv"`` layers (LFM2's ``conv_L_cache``).
        conv_bias: those convolutions and their projections have biases.
        rope_dims: RoPE rotates the first ``rope_dims`` features of each head (partial rotary; None: all).
        attention_gate: attention output times ``sigmoid(x @ W_gate)`` before the output projection (Qwen3-Next).
        linear_heads: Gated DeltaNet layers: ``(key heads, value heads, key head size, value head size)``.
        linear_tiled: those layers' value heads in tiled order, head ``j`` reading key head ``j % key heads`` (the
            order llama.cpp's converter writes Qwen3.5 in); else grouped, ``j // (value heads / key heads)``
            (Hugging Face's).
        num_experts, experts_per_token, moe_intermediate_size: mixture-of-experts MLPs (0: dense).
        shared_expert_size: the width of the always-on shared expert of an MoE layer (0: none).
        norm_topk_prob: the top-k router probabilities are renormalised to sum to 1.
        sigmoid_router: DeepSeek V3's router (:func:`mlx_engine.models.layers.moe.grouped_route`: sigmoid scores, the
            correction bias for the choice, groups, ``routed_scale``); else softmax top-k (Qwen, gpt-oss).
        expert_groups, groups_used: that router's ``n_group`` and ``topk_group`` (1, 1: no groups).
        routed_scale: that router's ``routed_scaling_factor``, on the routed experts' weights.
        clamped_swiglu: ``(alpha, limit)``: the experts' activation is gpt-oss's clamped SwiGLU,
            ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``
            (transformers' ``GptOssExperts._apply_gate``); None: SiLU-gated.
        attn_softcap: attention scores ``s`` (scaled) become ``attn_softcap * tanh(s / attn_softcap)`` (Gemma 2).
        final_softcap: the same cap on the output logits (Gemma 2).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    context_length: int
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None
    rope_freqs: np.ndarray | None = None
    rope_scale: float = 1.0
    rope_long_freqs: np.ndarray | None = None
    rope_original_context: int = 0
    rope_attention_factor: float = 1.0
    rope_traditional: bool = False
    mrope_section: tuple[int, ...] | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    query_scale: float | None = None
    embed_scale: float | None = None
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    query_temperature: tuple[float, int] | None = None
    qk_norm: bool = False
    sandwich_norm: bool = False
    activation: str = "silu"
    attention_bias: bool = False
    conv_kernel: int = 0
    conv_bias: bool = False
    rope_dims: int | None = None
    attention_gate: bool = False
    linear_heads: tuple[int, int, int, int] | None = None
    linear_tiled: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_size: int = 0
    norm_topk_prob: bool = True
    sigmoid_router: bool = False
    expert_groups: int = 1
    groups_used: int = 1
    routed_scale: float = 1.0
    clamped_swiglu: tuple[float, float] | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    both_ways: bool = False

    def __post_init__(self) -> None:
        """Validate every field, so that a bad model fails at load, never at the first forward pass.

        Raises:
            WeightsError: a size that is not a positive integer, a RoPE base, scale or epsilon that is not a finite
                positive number, heads that do not divide, a ``layer_types`` of the wrong length or kind.
        """
        check_layer_count(self.num_layers)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "context_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0 or v >= 1 << 31:
                raise WeightsError(f"model config has {name} = {v!r}; it must be a positive integer below 2**31")
        for name in ("rms_norm_eps", "rope_theta", "rope_local_theta", "rope_scale", "rope_attention_factor",
                     "query_scale", "embed_scale", "residual_scale", "logit_scale", "routed_scale"):
            v = getattr(self, name)
            if v is None and name in ("rope_local_theta", "query_scale", "embed_scale"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not math.isfinite(v) or v <= 0:
                raise WeightsError(f"model config has {name} = {v!r}; it must be a finite positive number")
        if self.num_heads % self.num_kv_heads:
            raise WeightsError(f"model config has {self.num_heads} heads, not a multiple of "
                               f"{self.num_kv_heads} key/value heads")
        if self.head_dim % 2:
            raise WeightsError(f"model config has head_dim = {self.head_dim}; RoPE needs an even head size")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise WeightsError(f"model config has sliding_window = {self.sliding_window!r}; it must be at least 2")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= _LAYER_TYPES:
            raise WeightsError(f"model config's layer_types has {len(self.layer_types)} entries for "
                               f"{self.num_layers} layers, or kinds other than {sorted(_LAYER_TYPES)}")
        if "conv" in self.layer_types and (not isinstance(self.conv_kernel, int) or not 2 <= self.conv_kernel <= 64):
            raise WeightsError(f"model config has convolution layers of kernel size {self.conv_kernel!r}; it must be "
                               "an integer from 2 to 64")
        if self.rope_dims is not None and (not isinstance(self.rope_dims, int) or self.rope_dims % 2
                                           or not 0 < self.rope_dims <= self.head_dim):
            raise WeightsError(f"model config rotates {self.rope_dims!r} features per head with RoPE; it must be "
                               f"an even number from 2 to head_dim {self.head_dim}")
        if self.mrope_section is not None and (
                not all(isinstance(v, int) and v > 0 for v in self.mrope_section)
                or sum(self.mrope_section) != (self.rope_dims or self.head_dim) // 2):
            raise WeightsError(f"model config has mrope_section {self.mrope_section!r}; its sections must be positive "
                               f"and sum to the {(self.rope_dims or self.head_dim) // 2} rotary pairs of a head")
        if self.query_temperature is not None:
            beta, n = self.query_temperature
            if not math.isfinite(beta) or isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise WeightsError(f"model config has attention temperature {self.query_temperature!r}; it needs a "
                                   "finite beta and a positive integer length")
        for freqs in (self.rope_freqs, self.rope_long_freqs):
            if freqs is None:
                continue
            f, half = np.asarray(freqs), (self.rope_dims or self.head_dim) // 2
            if f.shape != (half,) or not np.all(np.isfinite(f)) or not np.all(f > 0):
                raise WeightsError(f"the model's RoPE frequencies have shape {f.shape} (want ({half},)) "
                                   "or values that are not finite and positive")
        if "linear_attention" in self.layer_types:
            hk, hv, dk, dv = self.linear_heads or (0, 0, 0, 0)
            if min(hk, hv, dk, dv) <= 0 or hv % hk or self.conv_kernel < 2:
                raise WeightsError(f"model config's linear-attention layers have heads {self.linear_heads!r} and "
                                   f"convolution kernel {self.conv_kernel}: value heads must be a positive multiple "
                                   "of key heads, sizes positive, the kernel at least 2")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise WeightsError(f"model config routes each token to {self.experts_per_token} of {self.num_experts} "
                               "experts; it must be at least 1 and at most the number of experts")
        g, used = self.expert_groups, self.groups_used
        if self.num_experts and (g < 1 or self.num_experts % g or not 1 <= used <= g
                                 or self.num_experts // g * used < self.experts_per_token):
            raise WeightsError(f"model config puts {self.num_experts} experts in {g!r} groups and keeps {used!r} of "
                               f"them for {self.experts_per_token} experts per token: the groups must divide the "
                               "experts and the kept groups hold at least that many")
        if self.clamped_swiglu is not None and not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in self.clamped_swiglu):
            raise WeightsError(f"model config has swiglu (alpha, limit) = {self.clamped_swiglu!r}; both must be "
                               "finite positive numbers")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise WeightsError("model config has sliding-window layers but no sliding_window")
        if self.query_scale is None:
            self.query_scale = self.head_dim ** -0.5


_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "conv", "linear_attention", "mamba",
                          "cross_attention"})
#: Layer types whose tokens attend through the KV cache; the others keep a recurrent state (hybrid models).
ATTENTION_TYPES = frozenset({"full_attention", "sliding_attention"})
#: More layers than any released model has by far; a bigger count in a file is a lie, refused before lists are made.
MAX_LAYERS = 4096


def check_layer_count(n: Any) -> int:
    """``n`` as a layer count, checked before anything per layer is made.

    Raises:
        WeightsError: not an integer in ``1..MAX_LAYERS``.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 < n <= MAX_LAYERS:
        raise WeightsError(f"model config has {n!r} layers; it must be an integer from 1 to {MAX_LAYERS}")
    return int(n)



def metadata_getter(metadata: Any, prefix: str) -> Callable[..., Any]:
    """``get("block_count")`` reads ``<prefix>.block_count`` from GGUF metadata, with a default or a clear error
    (``positive=True``: it must be a positive integer, checked before anything divides by it)."""

    def get(key: str, default: Any = ..., positive: bool = False) -> Any:
        full = f"{prefix}.{key}"
        if full in metadata:
            v = metadata[full]
            v = v.item() if isinstance(v, np.generic) else v
            if positive and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise WeightsError(f"GGUF metadata key {full!r} is {v!r}; it must be a positive integer")
            return v
        if default is ...:
            raise WeightsError(f"GGUF metadata key {full!r} is missing; the file is not a complete {prefix} model")
        return default

    return get


def vocab_size_of(weights: dict[str, Tensor], metadata: Any, arch: str) -> int:
    tokens = metadata.get("tokenizer.ggml.tokens")
    emb = weights.get("token_embd.weight")
    if emb is not None:
        return emb.shape[0]
    if tokens is not None:
        return len(tokens)
    raise WeightsError(f"cannot tell the vocabulary size of this {arch} GGUF (no token_embd.weight)")


def check_rope_scaling(kind: str | None, arch: str) -> None:
    if kind not in (None, "none", "linear", "llama3", "default"):
        raise UnsupportedError(f"{arch}: RoPE scaling {kind!r} is not supported (linear and llama3 are)")


def llama3_rope_freqs(base: float, dims: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                      original_context: int) -> np.ndarray:
    """RoPE periods ``[dims/2]`` with Llama 3.1's frequency scaling (transformers' ``_compute_llama3_parameters``):
    long wavelengths divided by ``factor``, short ones kept, and a smooth blend between."""
    freqs = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelens = 2 * math.pi * freqs
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = np.where(wavelens > low_wavelen, freqs * factor, freqs)
    medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (original_context / wavelens - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return np.where(medium, smooth_freqs, out).astype(np.float32)


def yarn_rope(base: float, dims: int, factor: float, original_context: int, beta_fast: float = 32.0,
              beta_slow: float = 1.0, mscale: float | None = None, mscale_all_dim: float | None = None,
              truncate: bool = True) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023) as transformers' ``_compute_yarn_parameters``: ``(periods [dims/2], attention
    factor)``, the periods blending interpolated (times ``factor``) and original ones over the correction range of
    ``beta_fast`` to ``beta_slow`` rotations; the attention factor multiplies RoPE's cosines and sines.

    Raises:
        WeightsError: a factor or context that is not positive.
    """
    if not factor > 0 or not original_context > 0:
        raise WeightsError(f"YaRN RoPE scaling has factor {factor!r} and original context {original_context!r}; "
                           "both must be positive")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
            else get_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos = base ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    extrapolation = 1 - ramp
    inv = (1 / (factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation
    return (1 / inv.astype(np.float64)).astype(np.float32), float(attn)


def hf_rope_parameters(config: Any) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from a ``config.json``: transformers 5 nests both under ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling
