"""Llama 3.2 Vision's text model (``MllamaForConditionalGeneration``'s language model): a Llama 3.1 decoder with
cross-attention layers inserted (``cross_attention_layers``) that read an image's encoder output.

A cross-attention layer (Meta's ``CrossAttentionTransformerBlock``): ``x = RMSNorm(h)``; queries ``x Wq`` with a
per-head RMSNorm, keys ``states Wk`` with a per-head RMSNorm and values ``states Wv`` of the image rows (no RoPE);
``h += tanh(attn_gate) * (attention Wo)``; ``h += tanh(mlp_gate) * MLP(RMSNorm(h))``. The keys and values are
computed once, when the image enters the sequence, and kept in the encoder cache.

Which image a token sees (transformers' ``get_cross_attention_token_mask``): the latest image at or before it, or the
whole run when several images sit at adjacent positions; a token that sees no image (the text before the first one)
gets nothing from the layer. That last rule is Meta's reference and vLLM's: both attention and MLP outputs of such a
row are multiplied by zero; transformers' port zeroes only the MLP's (its attention output for such rows is a
uniform average over the image rows), which makes the text before an image depend on it.

References: transformers' ``models/mllama/modeling_mllama.py``; Meta's ``llama_models/models/llama3/multimodal/
model.py``. The embedding has 8 rows beyond the output vocabulary; the image token ``<|image|>`` is the first.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import UnsupportedError, WeightsError
from mlx_engine.kvcache import EncoderInputs
from mlx_engine.ml import Context, Tensor
from mlx_engine.models.layers.config import DecoderConfig
from mlx_engine.models.arch.llama import Llama

if TYPE_CHECKING:
    from mlx_engine.kvcache import Cache

_CROSS_NAMES = {"cross_q": "cross_attn.q_proj.weight", "cross_k": "cross_attn.k_proj.weight",
                "cross_v": "cross_attn.v_proj.weight", "cross_o": "cross_attn.o_proj.weight",
                "cross_q_norm": "cross_attn.q_norm.weight", "cross_k_norm": "cross_attn.k_norm.weight",
                "cross_attn_gate": "cross_attn_attn_gate", "cross_mlp_gate": "cross_attn_mlp_gate"}


def cross_attention_mask(inputs: list[tuple[int, int, int]], sequences: np.ndarray,
                         positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which encoder rows each token of a batch sees.

    Args:
        inputs: ``(sequence, position, rows)`` of the stored images, in the order of the encoder cache's rows.
        sequences, positions: the batch's tokens (int ``[N]``).

    Returns:
        ``(visible bool [N, S], sees bool [N])``: a token sees the rows of the latest image of its own sequence at or
        before its position, and of the images at the positions just before that one without a gap (a run of
        adjacent ``<|image|>`` tokens counts as one group).
    """
    total = sum(r for _, _, r in inputs)
    visible = np.zeros((len(positions), total), bool)
    at = 0
    spans = []  # (sequence, position, first row, rows, the position where the image's run starts)
    for i, (seq, pos, rows) in enumerate(inputs):
        prev = spans[-1] if spans else None
        run = prev[4] if prev and prev[0] == seq and prev[1] == pos - 1 else pos
        spans.append((seq, pos, at, rows, run))
        at += rows
    for seq, pos, first, rows, run in spans:
        # the token sees this image when it is at or after it and the latest image at or before the token is
        # in the same run
        later = [p for s, p, _, _, r in spans if s == seq and r != run and p > pos]
        end = min(later, default=None)
        mine = (sequences == seq) & (positions >= pos)
        if end is not None:
            mine &= positions < end
        visible[mine, first:first + rows] = True
    return visible, visible.any(axis=1)


class Mllama(Llama):
    architecture = "mllama"
    images_in_stream = False
    extra_token_rows = 8

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        raise UnsupportedError("Llama 3.2 Vision (mllama) is read from Hugging Face folders; its GGUF form (ollama's "
                               "mllama files) is not supported yet")

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        text = dict(config.get("text_config") or config)
        base = Llama.config_from_hf(text)
        cross = text.get("cross_attention_layers")
        if not isinstance(cross, list) or not all(isinstance(i, int) and 0 <= i < base.num_layers for i in cross):
            raise WeightsError(f"the Mllama config's cross_attention_layers {cross!r} are not layers of the "
                               f"{base.num_layers}-layer text model")
        types = ["cross_attention" if i in cross else "full_attention" for i in range(base.num_layers)]
        return replace(base, architecture="mllama", layer_types=types)

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """The hub's names (``language_model.model.*``, ``language_model.lm_head``) and transformers 5's
        (``model.language_model.*``) to ``model.*`` / ``lm_head``; the vision tensors are read by
        ``models/vision/mllama_vision.py``."""
        out = {}
        for name, t in weights.items():
            for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[name] = t
        return out

    def mixer_shapes(self, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        c = self.config
        d, q, kv, p = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, f"model.layers.{layer}."
        shapes = {"cross_q": (q, d), "cross_k": (kv, d), "cross_v": (kv, d), "cross_o": (d, q),
                  "cross_q_norm": (c.head_dim,), "cross_k_norm": (c.head_dim,), "cross_attn_gate": (1,),
                  "cross_mlp_gate": (1,)}
        return {p + _CROSS_NAMES[k]: s for k, s in shapes.items()}, {}

    def _layer_weights(self, i: int) -> dict[str, Tensor | None]:
        w = super()._layer_weights(i)
        if self.config.layer_types[i] == "cross_attention":
            w.update({k: self.w.get(f"model.layers.{i}.{v}") for k, v in _CROSS_NAMES.items()})
        return w

    def make_cache(self, kv_bits: int | None = None) -> "Cache":
        """Self-attention layers in a causal cache, cross-attention layers in the encoder cache."""
        from mlx_engine.kvcache import CausalCache, EncoderCache, WrapperCache

        types = self.config.layer_types
        return WrapperCache([CausalCache(shift_fn=self.shift, kv_bits=kv_bits), EncoderCache()],
                            [1 if t == "cross_attention" else 0 for t in types])

    def mixer_layer(self, ctx: Context, layer: int, w: dict[str, Tensor | None], h: Tensor, cache: "Cache",
                    batch: Batch) -> Tensor:
        """A cross-attention layer: stores the keys and values of the batch's new images, then attends to the
        images each token sees; a batch none of whose tokens sees an image passes through unchanged."""
        c = self.config
        eps, heads, kv_heads, dh = c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim
        cache.set_layer(layer)
        if batch.images:
            states = [rows.astype(self.dtype) for _, rows in batch.images]
            x = states[0] if len(states) == 1 else ctx.concatenate(states, axis=0)
            s = x.shape[0]
            k = x.linear(w["cross_k"]).reshape(1, s, kv_heads, dh).transpose(0, 2, 1, 3).rms_norm(w["cross_k_norm"],
                                                                                                  eps)
            v = x.linear(w["cross_v"]).reshape(1, s, kv_heads, dh).transpose(0, 2, 1, 3)
            cache.put(ctx, k, v)
        mask, sees = self._cross_mask(ctx, batch, cache)
        if sees is None:
            return h
        n = h.shape[1]
        x = h.rms_norm(w["attn_norm"], eps)
        q = x.linear(w["cross_q"]).reshape(1, n, heads, dh).transpose(0, 2, 1, 3).rms_norm(w["cross_q_norm"], eps)
        keys, values, _ = cache.get(ctx)
        o = ctx.scaled_dot_product_attention(q, keys, values, dh ** -0.5, mask)
        o = o.transpose(0, 2, 1, 3).reshape(1, n, heads * dh)
        if not isinstance(sees, bool):
            o = o * sees
        h = h + w["cross_attn_gate"].tanh() * o.linear(w["cross_o"])
        x = h.rms_norm(w["post_attn_norm"], eps)
        m = (x.linear(w["gate"]).silu() * x.linear(w["up"])).linear(w["down"])
        if not isinstance(sees, bool):
            m = m * sees
        return h + w["cross_mlp_gate"].tanh() * m

    def _cross_mask(self, ctx: Context, batch: Batch, cache: "Cache") -> tuple[Any, Any]:
        """``(mask, sees)`` for the batch, computed at its first cross-attention layer and kept for the others:
        ``mask`` additive ``[N, S]`` or None (every token sees every row); ``sees`` ``[1, N, 1]`` of 0/1 (the rows
        that see some image), True when all do, None when none does."""
        kept = getattr(self, "_cross_for", None)
        if kept is not None and kept[0] is batch:
            return kept[1]
        inputs = cache.encoder_inputs() if isinstance(cache, EncoderInputs) else []
        result: tuple[Any, Any] = (None, None)
        if inputs:
            visible, sees = cross_attention_mask(inputs, batch.sequences, batch.positions)
            if sees.any():
                mask = None
                if not visible[sees].all():
                    additive = np.where(visible | ~sees[:, None], 0.0, -np.inf).astype(np.float32)
                    mask = ctx.from_numpy(additive).astype(self.dtype)
                gate = True if sees.all() else ctx.from_numpy(sees.astype(np.float32)[None, :, None]).astype(
                    self.dtype)
                result = (mask, gate)
        self._cross_for = (batch, result)  # one batch at a time: forward passes run on one thread
        return result
