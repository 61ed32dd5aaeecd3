"""The Z-Image text encoder: Qwen3 from ``models/``, read as diffusers' ``ZImagePipeline._encode_prompt`` reads it.

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

__all__ = ["TextEncoder"]


class TextEncoder:
    """Prompts -> caption features for the Z-Image transformer.

    Attributes:
        model: the text model (a :class:`mlx_engine.models.layers.base.DecoderModel`, Qwen3 for Z-Image); None after :meth:`close`.
        tokenizer: its tokenizer (with the chat template).
        hidden_size: ``D``, the width of the features (the transformer's ``cap_feat_dim``).
        output_layer: the 0-based layer whose output is returned: ``num_layers - 2`` (``hidden_states[-2]``).
    """

    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, backend: Backend):
        self.model: DecoderModel | None = model
        self.tokenizer = tokenizer
        self.backend = backend
        self.hidden_size = model.config.hidden_size
        self.output_layer = model.config.num_layers - 2

    @classmethod
    def from_backend(cls, backend: Backend, tokenizer: Tokenizer) -> "TextEncoder":
        """Build from a backend loaded on the pipeline's ``text_encoder/`` folder and the tokenizer of its
        ``tokenizer/`` folder (:meth:`mlx_engine.models.text.tokenizer.Tokenizer.from_folder`).

        Raises:
            WeightsError, UnsupportedError: as :func:`mlx_engine.models.registry.load_text_model`.
        """
        return cls(load_text_model(backend), tokenizer, backend)

    def prompt_text(self, prompt: str) -> str:
        """The prompt in the chat template, as ``_encode_prompt`` renders it: one user message,
        ``add_generation_prompt=True``, ``enable_thinking=True`` (for Qwen3's template: no empty think block)."""
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  enable_thinking=True)

    def token_ids(self, prompt: str, max_sequence_length: int = 512) -> list[int]:
        """Token ids of the templated prompt, cut to ``max_sequence_length`` (the tokenizer's ``truncation=True``)."""
        return self.tokenizer.encode(self.prompt_text(prompt))[:max_sequence_length]

    def encode(self, ctx: Context, prompts: Sequence[str], max_sequence_length: int = 512) -> list[Tensor]:
        """Caption features of each prompt.

        Args:
            ctx: the context to compute in.
            prompts: the prompts (plain text; the chat template is applied here). An empty string is valid (the
                pipeline's default negative prompt).
            max_sequence_length: the most tokens kept per templated prompt (diffusers' default 512).

        Returns:
            one tensor ``[L_i, D]`` per prompt in the backend's compute dtype: the hidden states after layer
            ``num_layers - 2`` (not normed) of its ``L_i`` tokens. A prompt given more than once is encoded once
            (a batch's repeated prompts, and the empty negative prompt of each image): its entries share a tensor.

        Raises:
            InvalidRequestError: no prompts, a prompt that is not a string, ``max_sequence_length < 1``, or the
                encoder was closed.
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
        ids = [self.token_ids(p, max_sequence_length) for p in unique]
        lens = [len(i) for i in ids]
        batch = Batch(np.concatenate([np.asarray(i, np.int32) for i in ids]),
                      np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
                      np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(lens)]))
        cache = self.model.make_cache()
        cache.init(self.backend, self.model.dtype, len(prompts), max(lens), len(batch))
        try:
            h = self.model.forward(ctx, batch, cache, output_layer=self.output_layer)[0]  # [N, D]
            ctx.evaluate(h)
        finally:
            cache.close()
        rows, start = {}, 0
        for p, n in zip(unique, lens):
            rows[p] = h[start:start + n]
            start += n
        return [rows[p] for p in prompts]

    def close(self) -> None:
        """Free the text model's weights (``backend.close()``): the pipeline calls this before denoising. The
        encoder cannot encode afterwards."""
        self.model = None
        self.backend.close()
