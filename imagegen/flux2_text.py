"""The FLUX.2 text encoders: Mistral 3 (FLUX.2 dev) or Qwen3 (FLUX.2 klein) from ``models/``, read as diffusers'
``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` and ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` read them.

Reference: diffusers 0.42 ``pipelines/flux2/pipeline_flux2.py`` and ``pipeline_flux2_klein.py``::

    dev:   messages = [system: SYSTEM_MESSAGE, user: prompt.replace("[IMG]", "")] (content as [{"type": "text"...}])
           ids, mask = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                      padding="max_length", truncation=True, max_length=512)
    klein: text = tokenizer.apply_chat_template([user: prompt], add_generation_prompt=True, enable_thinking=False)
           ids, mask = tokenizer(text, padding="max_length", truncation=True, max_length=512)
    hidden = text_encoder(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    embeds = stack([hidden[k] for k in layers], dim=1) -> [B, L, len(layers) * D]   (layers (10, 20, 30) / (9, 18, 27))

``hidden_states[0]`` is the embedding output, ``hidden_states[k]`` the output of layer ``k - 1`` (0-based), and
``hidden_states[num_layers]`` the final-normed output of the last layer. Every one of the ``max_length`` rows is kept,
the pad rows too: a pad row's hidden states depend on what it sees, so the attention here is transformers' exactly.
Token ``q`` of a prompt sees token ``k`` of the same prompt when ``k <= q`` (positions ``0 .. max_length - 1``,
padding included, as transformers numbers them) and ``k`` is not padding. A row that sees nothing (a pad row before
the prompt, with left padding) gets a zero attention output, as PyTorch's scaled-dot-product attention gives for a
fully masked row. The padding side is the tokenizer's (``padding_side`` of ``tokenizer_config.json``; else left for
Llama tokenizers, as transformers' ``LlamaTokenizer`` class, right otherwise).

The forward pass runs the engine's own text model (:mod:`mlx_engine.models.arch.mistral3`,
:mod:`mlx_engine.models.arch.qwen3`) over all prompts at once, through a one-pass KV cache (:class:`MaskedPass`)
that holds that mask, and reads the hidden states between layers by running the layers in consecutive parts (the
pipeline-parallel mechanism: :class:`~mlx_engine.models.layers.base.ModelPart`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError, InvalidRequestError, UnsupportedError
from mlx_engine.kvcache import Cache
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.layers.base import DecoderModel, ModelPart
from mlx_engine.models.text.tokenizer import Tokenizer

__all__ = ["Flux2TextEncoder", "MaskedPass", "SYSTEM_MESSAGE", "padding_side"]

#: FLUX.2 dev's system message (diffusers ``pipelines/flux2/system_messages.py`` ``SYSTEM_MESSAGE``, from Black Forest
#: Labs' ``flux2/src/flux2/system_messages.py``), its line break included.
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")

#: tokenizer classes whose transformers class pads on the left when the config does not say (``padding_side =
#: "left"`` class attributes).
_LEFT_PADDING_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def padding_side(tokenizer_folder: Path) -> str:
    """``"left"`` or ``"right"``: the side transformers pads this tokenizer on (``tokenizer_config.json``'s
    ``padding_side``, else the tokenizer class's default)."""
    try:
        config = json.loads((tokenizer_folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    side = config.get("padding_side") if isinstance(config, dict) else None
    if side in ("left", "right"):
        return side
    return "left" if isinstance(config, dict) and config.get("tokenizer_class") in _LEFT_PADDING_CLASSES else "right"


class MaskedPass(Cache):
    """A KV cache for one forward pass with a given visibility matrix (no cells kept across passes).

    ``put`` keeps the layer's keys and values; ``get`` returns them with the additive mask made from ``visible``
    ``[N, N]`` (True where query ``i`` sees key ``j``). Rows that see nothing get one more key and value, both zero,
    that only they see: their attention output is zero (PyTorch's result for a fully masked row, which a softmax over
    nothing cannot give).
    """

    def __init__(self, visible: np.ndarray):
        self.visible = np.asarray(visible, bool)
        self._layer = 0
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}
        self._mask: Tensor | None = None
        self._blind = ~self.visible.any(axis=1)

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        self.dtype = dtype

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        n = len(batch.positions)
        if reserve or self.visible.shape != (n, n):
            raise CacheError(f"this one-pass cache was made for {self.visible.shape[0]} tokens, not {n}")
        visible = self.visible
        if self._blind.any():
            visible = np.concatenate([visible, self._blind[:, None]], axis=1)
        self._mask = ctx.attention_mask(visible, self.dtype)

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        if self._blind.any():
            key = ctx.concatenate([key, ctx.zeros((*key.shape[:2], 1, key.shape[3]), key.dtype)], axis=2)
            value = ctx.concatenate([value, ctx.zeros((*value.shape[:2], 1, value.shape[3]), value.dtype)], axis=2)
        self._kv[self._layer] = (key, value)

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor | None]:
        k, v = self._kv[self._layer]
        return k, v, self._mask

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        raise CacheError("a one-pass cache holds no sequences to share")

    def can_resume(self, seq: int, pos: int) -> bool:
        return False

    def remove(self, seq: int, begin: int, end: int | None) -> None:
        raise CacheError("a one-pass cache holds no sequences to remove from")

    def close(self) -> None:
        self._kv.clear()
        self._mask = None


class Flux2TextEncoder:
    """Prompts -> FLUX.2 text features ``[L, len(layers) * D]``.

    Args:
        model: the text model (Mistral 3 or Qwen3, a :class:`DecoderModel`). tokenizer: its tokenizer.
        backend: the model's backend (closed by :meth:`close`).
        system_message: dev's system message (the prompt goes in Mistral's chat layout), or None for klein (one user
            message, ``enable_thinking=False``).
        pad_side: ``"left"`` or ``"right"`` (:func:`padding_side`).

    Raises:
        UnsupportedError: the model has no pad token to pad with (``pad_token`` of the tokenizer config).
    """

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, backend: Backend, *, system_message: str | None,
                 pad_side: str = "right"):
        self.model: DecoderModel | None = model
        self.tokenizer = tokenizer
        self.backend = backend
        self.system_message = system_message
        self.pad_side = pad_side
        pad = tokenizer.special_tokens.get("pad_token")
        self.pad_id = tokenizer.token_to_id(pad) if pad else None
        if self.pad_id is None:
            raise UnsupportedError("the FLUX.2 text encoder's tokenizer has no pad token (pad_token), which the "
                                   "pipeline pads every prompt with")
        if any(model.is_sliding(i) or not model.is_attention(i) for i in range(model.config.num_layers)):
            raise UnsupportedError(f"a {model.architecture} text model with sliding-window or recurrent layers is not "
                                   "a FLUX.2 text encoder (Mistral 3 and Qwen3 attend over every token)")
        self.hidden_size = model.config.hidden_size
        self.num_layers = model.config.num_layers
        self._parts: dict[tuple[int, int], DecoderModel] = {}

    def token_ids(self, prompt: str, max_sequence_length: int) -> list[int]:
        """The prompt's token ids, templated as the pipeline does and cut to ``max_sequence_length`` (no padding)."""
        tok = self.tokenizer
        if self.system_message is not None:
            messages = [{"role": "system", "content": [{"type": "text", "text": self.system_message}]},
                        {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]}]
            ids = tok.encode_chat(messages, add_generation_prompt=False)
        else:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           enable_thinking=False)
            ids = tok.encode(text)
        return ids[:max_sequence_length]

    def encode(self, ctx: Context, prompts: Sequence[str], max_sequence_length: int,
               layers: Sequence[int]) -> list[Tensor]:
        """Text features of each prompt.

        Args:
            ctx: the context to compute in.
            prompts: plain prompts (templated here); ``""`` is valid (klein's negative prompt).
            max_sequence_length: every prompt is padded (or cut) to this many tokens (diffusers' default 512).
            layers: indices into transformers' ``hidden_states`` (``0 .. num_layers``), stacked in this order.

        Returns:
            one tensor ``[max_sequence_length, len(layers) * D]`` per prompt, in the model's compute dtype (row ``l``
            is token ``l``'s hidden states of the layers, concatenated). A prompt given more than once is encoded
            once.

        Raises:
            InvalidRequestError: no prompts, a prompt that is not a string, ``max_sequence_length < 1``, a layer out
                of range, or the encoder was closed.
        """
        model = self.model
        if model is None:
            raise InvalidRequestError("the text encoder was closed")
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError(f"give one or more prompts (strings), got {prompts!r}")
        if max_sequence_length < 1:
            raise InvalidRequestError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        layers = [int(k) for k in layers]
        if not layers or not all(0 <= k <= self.num_layers for k in layers):
            raise InvalidRequestError(f"text encoder layers {layers} must be in 0..{self.num_layers} (transformers' "
                                      "hidden_states indices)")
        unique = list(dict.fromkeys(prompts))
        length = max_sequence_length
        ids = np.full((len(unique), length), self.pad_id, np.int32)
        real = np.zeros((len(unique), length), bool)
        for s, p in enumerate(unique):
            t = self.token_ids(p, length)
            at = slice(0, len(t)) if self.pad_side == "right" else slice(length - len(t), length)
            ids[s, at] = t
            real[s, at] = True
        n = len(unique) * length
        pos = np.tile(np.arange(length, dtype=np.int32), len(unique))
        seq = np.repeat(np.arange(len(unique), dtype=np.int32), length)
        visible = ((seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & real.reshape(-1)[None, :])
        batch = Batch(ids.reshape(-1), pos, seq)
        cache = MaskedPass(visible)
        cache.init(self.backend, model.dtype, len(unique), length, n)
        try:
            cache.start_forward(ctx, batch)
            taps = self._run(ctx, model, batch, cache, sorted(set(layers)))
            out = ctx.concatenate([taps[k] for k in layers], axis=-1)[0]  # [N, len(layers) * D]
            rows = {p: out[s * length:(s + 1) * length] for s, p in enumerate(unique)}
            ctx.evaluate(*rows.values())
        finally:
            cache.close()
        return [rows[p] for p in prompts]

    def _run(self, ctx: Context, model: DecoderModel, batch: Batch, cache: Cache,
             wanted: list[int]) -> dict[int, Tensor]:
        """``hidden_states[k]`` ``[1, N, D]`` for each ``k`` of ``wanted`` (sorted): the layers run in consecutive
        parts that end where a wanted state is, each part a view of the model over its layers; the layers after the
        last wanted state do not run."""
        h = model.embed(ctx, batch)
        taps, done = {}, 0
        for k in wanted:
            stop = min(k, self.num_layers)
            if stop > done:
                part = self._parts.get((done, stop))
                if part is None:
                    part = self._parts[done, stop] = type(model)(model.config, model.w, model.backend,
                                                                 ModelPart(range(done, stop), embed=False, head=False))
                h = part.run_layers(ctx, batch, h, cache)
                done = stop
            taps[k] = h
        if self.num_layers in taps:  # the last entry of hidden_states is after the final norm
            taps[self.num_layers] = h.rms_norm(model.w["model.norm.weight"], model.config.rms_norm_eps)
        return taps

    def close(self) -> None:
        """Free the text model's weights (``backend.close()``); the encoder cannot encode afterwards."""
        self.model = None
        self._parts.clear()
        self.backend.close()
