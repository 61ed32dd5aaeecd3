"""The text encoder of the image pipelines: a ``models/`` text model read as the diffusers pipelines read theirs
(Z-Image: Qwen3, as ``ZImagePipeline._encode_prompt``; Qwen-Image: Qwen2.5-VL's language model, as
``QwenImagePipeline._get_qwen_prompt_embeds``, see the options of :class:`TextEncoder`).

Reference: diffusers 0.42 ``pipelines/z_image/pipeline_z_image.py`` (``_encode_prompt``)::

    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)
    ids, mask = tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True)
    hidden = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    embeddings = [hidden[i][mask[i]] for i in range(len(texts))]

``hidden_states[-2]`` of a transformers ``Qwen3Model`` with ``N`` layers is the output of layer ``N - 2`` (0-based),
before the final norm (``hidden_states`` holds the embeddings, the outputs of layers ``0 .. N - 2``, and the
final-normed output of layer ``N - 1``). The pipeline keeps the rows of the real (unpadded) prompt tokens. Padding is
on the right (Qwen's tokenizer), so with a causal mask the real tokens never see the pad tokens: running each prompt
alone, at positions ``0 .. L - 1``, gives the same hidden states. Here every prompt of a call runs in one forward pass
as its own sequence of one causal cache (sequences are kept apart by the cache's mask), and the last layer is never
run. (Were a tokenizer to pad on the left, transformers would place the tokens at later positions; RoPE attention
depends only on position differences, so the result would be the same.)

The text encoder folder is what diffusers saves: a transformers ``Qwen3Model`` (tensor names without the ``model.``
prefix, no ``lm_head``; :meth:`mlx_engine.models.arch.qwen3.Qwen3.sanitize` adds the prefix) or a ``Qwen3ForCausalLM``.

Qwen-Image (diffusers ``pipelines/qwenimage/pipeline_qwenimage.py``) formats the prompt into a fixed template, keeps
``hidden_states[-1]`` (the final-normed output) of the real tokens and drops the template's first 34 tokens; the
same per-sequence reasoning holds (Qwen2.5-VL's M-RoPE gives text tokens positions ``0 .. L - 1`` on all three
sections, which is Qwen2's RoPE).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.errors import InvalidRequestError
from mlx_engine.ml import Backend, Context, Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.registry import load_text_model
from mlx_engine.models.text.tokenizer import Tokenizer

__all__ = ["TextEncoder", "IMAGE_PAD"]

#: Qwen2.5-VL's image placeholder token (``Qwen2VLProcessor``'s ``image_token``).
IMAGE_PAD = "<|image_pad|>"


class TextEncoder:
    """Prompts -> caption features for a diffusion transformer.

    Args:
        model, tokenizer, backend: the text model, its tokenizer and backend.
        hidden_state: which of transformers' ``hidden_states`` to return: ``-2`` (Z-Image: the output of layer
            ``num_layers - 2``, not normed) or ``-1`` (Qwen-Image: the final-normed output of the last layer).
        template: a ``str.format`` template with one ``{}`` for the prompt (Qwen-Image's); None applies the chat
            template (one user message, ``add_generation_prompt``, ``enable_thinking``: Z-Image's).
        drop: leading tokens of the templated prompt whose features are dropped (Qwen-Image: 34).

    Attributes:
        model: the text model (a :class:`mlx_engine.models.layers.base.DecoderModel`); None after :meth:`close`.
        tokenizer: its tokenizer (with the chat template).
        hidden_size: ``D``, the width of the features (the transformer's ``cap_feat_dim``).
        output_layer: the 0-based layer whose output is returned (``num_layers - 2``), or None for the final-normed
            output.
    """

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, backend: Backend, *, hidden_state: int = -2,
                 template: str | None = None, drop: int = 0):
        if hidden_state not in (-1, -2):
            raise ValueError(f"hidden_state must be -1 or -2, got {hidden_state}")
        self.model: DecoderModel | None = model
        self.tokenizer = tokenizer
        self.backend = backend
        self.hidden_size = model.config.hidden_size
        self.output_layer = None if hidden_state == -1 else model.config.num_layers - 2
        self.template = template
        self.drop = int(drop)

    @classmethod
    def from_backend(cls, backend: Backend, tokenizer: Tokenizer) -> "TextEncoder":
        """Build from a backend loaded on the pipeline's ``text_encoder/`` folder and the tokenizer of its
        ``tokenizer/`` folder (:meth:`mlx_engine.models.text.tokenizer.Tokenizer.from_folder`).

        Raises:
            WeightsError, UnsupportedError: as :func:`mlx_engine.models.registry.load_text_model`.
        """
        return cls(load_text_model(backend), tokenizer, backend)

    def prompt_text(self, prompt: str) -> str:
        """The prompt in the encoder's template, or in the chat template as Z-Image's ``_encode_prompt`` renders it:
        one user message, ``add_generation_prompt=True``, ``enable_thinking=True`` (for Qwen3's template: no empty
        think block)."""
        if self.template is not None:
            return self.template.format(prompt)
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  enable_thinking=True)

    def token_ids(self, prompt: str, max_sequence_length: int = 512) -> list[int]:
        """Token ids of the templated prompt, cut to ``drop + max_sequence_length`` (the tokenizer's
        ``truncation=True``; the features of the first ``drop`` are dropped later)."""
        return self.tokenizer.encode(self.prompt_text(prompt))[:self.drop + max_sequence_length]

    def encode(self, ctx: Context, prompts: Sequence[str], max_sequence_length: int = 512,
               images: "Sequence[tuple[Tensor, tuple[int, int, int]]] | None" = None) -> list[Tensor]:
        """Caption features of each prompt.

        Args:
            ctx: the context to compute in.
            prompts: the prompts (plain text; the chat template is applied here). An empty string is valid (the
                pipeline's default negative prompt).
            max_sequence_length: the most tokens kept per templated prompt (diffusers' default 512).
            images: Qwen-Image-Edit's input images, the same for every prompt: each image's rows ``[k, D]`` (the
                vision tower's merged features) and merged grid ``(t, h, w)``, ``k = t * h * w``. The template then
                holds one ``<|image_pad|>`` per image, expanded to ``k`` tokens whose embeddings are the rows (as
                ``Qwen2VLProcessor`` and ``Qwen2_5_VLModel``), and the tokens get M-RoPE positions
                (:meth:`mlx_engine.models.arch.qwen2.Qwen25VL.rope_index`). Such prompts are not cut.

        Returns:
            one tensor ``[L_i, D]`` per prompt in the backend's compute dtype: the hidden states after layer
            ``num_layers - 2`` (not normed), or the final-normed ones, of its ``L_i`` tokens after the first
            ``drop``. A prompt given more than once is encoded once
            (a batch's repeated prompts, and the empty negative prompt of each image): its entries share a tensor.

        Raises:
            InvalidRequestError: no prompts, a prompt that is not a string, ``max_sequence_length < 1``, a templated
                prompt no longer than ``drop`` tokens, or the encoder was closed.
        """
        if self.model is None:
            raise InvalidRequestError("the text encoder was closed")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequestError("no prompts to encode")
        if max_sequence_length < 1:
            raise InvalidRequestError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        for p in prompts:
            if not isinstance(p, str):
                raise InvalidRequestError(f"a prompt must be a string, got {type(p).__name__}")
        unique = list(dict.fromkeys(prompts))
        if images:
            ids = [self._image_ids(p, images) for p in unique]
        else:
            ids = [self.token_ids(p, max_sequence_length) for p in unique]
        lens = [len(i) for i in ids]
        if min(lens) <= self.drop:
            raise InvalidRequestError(f"the prompt template gives {min(lens)} tokens; this text encoder drops the "
                                      f"first {self.drop} (is the tokenizer the model's own?)")
        batch = Batch(np.concatenate([np.asarray(i, np.int32) for i in ids]),
                      np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
                      np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(lens)]))
        if images:
            self._place_images(batch, ids, images)
        cache = self.model.make_cache()
        cache.init(self.backend, self.model.dtype, len(prompts), max(lens), len(batch))
        try:
            h = self.model.forward(ctx, batch, cache, hidden_only=self.output_layer is None,
                                   output_layer=self.output_layer)[0]  # [N, D]
            ctx.evaluate(h)
        finally:
            cache.close()
        rows, start = {}, 0
        for p, n in zip(unique, lens):
            rows[p] = h[start + self.drop:start + n]
            start += n
        return [rows[p] for p in prompts]

    def _image_ids(self, prompt: str, images: Sequence[tuple[Tensor, tuple[int, int, int]]]) -> list[int]:
        """The templated prompt's ids with its ``<|image_pad|>`` token repeated ``k`` times for each image.

        Raises:
            InvalidRequestError: a tokenizer without ``<|image_pad|>``, or a template with another count of them
                than images."""
        pad = self.tokenizer.token_to_id(IMAGE_PAD)
        if pad is None:
            raise InvalidRequestError(f"the tokenizer has no {IMAGE_PAD} token: is it Qwen2.5-VL's?")
        ids = self.tokenizer.encode(self.prompt_text(prompt))
        at = [i for i, t in enumerate(ids) if t == pad]
        if len(at) != len(images):
            raise InvalidRequestError(f"the prompt template holds {len(at)} {IMAGE_PAD} for {len(images)} image(s)")
        out: list[int] = []
        last = 0
        for i, (rows, _) in zip(at, images):
            out += ids[last:i] + [pad] * rows.shape[0]
            last = i + 1
        return out + ids[last:]

    def _place_images(self, batch: Batch, ids: list[list[int]],
                      images: Sequence[tuple[Tensor, tuple[int, int, int]]]) -> None:
        """Put the images' rows at their tokens in every sequence of ``batch`` and give its tokens M-RoPE
        positions."""
        from mlx_engine.models.arch.qwen2 import Qwen25VL

        pad = self.tokenizer.token_to_id(IMAGE_PAD)
        grids = [grid for _, grid in images]
        mrope, start = [], 0
        for seq in ids:
            mrope.append(Qwen25VL.rope_index(seq, pad, grids))
            i = 0
            for rows, _ in images:
                i = seq.index(pad, i)
                batch.images.append((start + i, rows))
                i += rows.shape[0]
            start += len(seq)
        batch.mrope_positions = np.concatenate(mrope, axis=1)

    def close(self) -> None:
        """Free the text model's weights (``backend.close()``): the pipeline calls this before denoising. The
        encoder cannot encode afterwards."""
        self.model = None
        self.backend.close()
