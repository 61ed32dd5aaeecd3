"""Qwen2 / Qwen2.5 dense models (and their distillations: DeepSeek-R1-Distill-Qwen, QwQ): Llama's layout with biases
on the query, key and value projections, RoPE on rotated halves (llama.cpp's NEOX order, so GGUF Q/K rows are not
permuted), tied output head in the small ones; optional sliding-window attention on the layers from
``max_window_layers`` on (``use_sliding_window``, off in every released config).

Reference: transformers' ``models/qwen2/modeling_qwen2.py``; mlx-lm's ``models/arch/qwen2.py``; llama.cpp's
``src/models/qwen2.cpp``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError
from mlx_engine.ml import Tensor
from mlx_engine.models.layers.base import DecoderModel
from mlx_engine.models.layers.config import (DecoderConfig, check_layer_count, check_rope_scaling, hf_rope_parameters,
                                      metadata_getter, vocab_size_of)


class Qwen2(DecoderModel):
    architecture = "qwen2"

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        get = metadata_getter(metadata, "qwen2")
        heads = get("attention.head_count", positive=True)
        hidden = get("embedding_length", positive=True)
        scaling = get("rope.scaling.type", None)
        check_rope_scaling(scaling, "qwen2")
        factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        return DecoderConfig(
            architecture="qwen2", vocab_size=vocab_size_of(weights, metadata, "qwen2"), hidden_size=hidden,
            num_layers=int(get("block_count")), num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            intermediate_size=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 32768)), rope_theta=float(get("rope.freq_base", 1000000.0)),
            rope_scale=1.0 / factor, attention_bias=True,
        )

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        heads = int(config["num_attention_heads"])
        layers = check_layer_count(config["num_hidden_layers"])
        theta, scaling = hf_rope_parameters(config)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        check_rope_scaling(kind, "qwen2")
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        types = config.get("layer_types") if window else None
        if window and not types:  # transformers' rule: the layers from max_window_layers on slide
            first = int(config.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        return DecoderConfig(
            architecture="qwen2", vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            num_layers=layers, num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            context_length=int(config.get("max_position_embeddings", 32768)), rope_theta=theta,
            rope_scale=1.0 / float(scaling["factor"]) if kind == "linear" else 1.0, attention_bias=True,
            sliding_window=int(window) - 1 if window else None, layer_types=list(types or []),
        )


class Qwen25VL(Qwen2):
    """Qwen2.5-VL's language model (``Qwen2_5_VLForConditionalGeneration``, ``model_type`` ``qwen2_5_vl``; Qwen-Image's
    text encoder): Qwen2's decoder, read from the ``text_config`` (or the top level of older configs) and the
    ``model.language_model.`` (or ``model.``) names; the vision tower (``visual.``) is not loaded here (:mod:`mlx_engine.models.vision.qwen25vl_vision` runs it).

    M-RoPE (``mrope_section``) gives the three sections of the rotary pairs (time, height, width) their own position
    ids; for text without images transformers' ``get_rope_index`` gives all three the token's index, so the rotation
    is Qwen2's and the config's ``mrope`` / ``default`` scaling entry is read as none. A batch with an image carries
    the three axes in ``Batch.mrope_positions`` (see :meth:`rope_index`).

    Reference: transformers' ``models/qwen2_5_vl/modeling_qwen2_5_vl.py`` (``get_rope_index``,
    ``apply_multimodal_rotary_pos_emb``) and ``configuration_qwen2_5_vl.py``.
    """

    architecture = "qwen2_5_vl"

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        text = {**config, **(config.get("text_config") or {})}
        section = None
        for key in ("rope_scaling", "rope_parameters"):
            entry = text.get(key) or {}
            section = entry.get("mrope_section") or section
            if entry.get("rope_type", entry.get("type")) in ("mrope", "default"):
                text[key] = {k: v for k, v in entry.items() if k == "rope_theta"} or None
        return dataclasses.replace(super().config_from_hf(text), architecture="qwen2_5_vl",
                                   mrope_section=tuple(int(v) for v in section) if section else None)

    @classmethod
    def sanitize(cls, weights: dict[str, Tensor], config: DecoderConfig, source: str) -> dict[str, Tensor]:
        """The language model's names as Qwen2's (``model.language_model.`` -> ``model.``); the vision tower
        (``visual.``, ``model.visual.``) dropped."""
        out = {}
        for name, t in weights.items():
            name = name.replace("model.language_model.", "model.")
            if not name.startswith(("visual.", "model.visual.")):
                out[name] = t
        return super().sanitize(out, config, source)

    @staticmethod
    def rope_index(tokens: "np.ndarray | list[int]", image_token_id: int,
                   grids: "list[tuple[int, int, int]]") -> np.ndarray:
        """M-RoPE positions int32 ``[3, N]`` of a prompt whose images' tokens are runs of ``image_token_id``, one run
        per entry of ``grids`` (each image's merged grid ``(t, h, w)``, ``t * h * w`` tokens), as transformers'
        ``get_rope_index``: a text token at running position ``p`` gets ``(p, p, p)``; an image's token at merged row
        ``r``, column ``c`` of frame ``f`` gets ``(p + f, p + r, p + c)`` with ``p`` the position after the text
        before it, and the text after the image continues at ``p + max(h, w)``.

        Raises:
            InvalidRequestError: runs of image tokens that do not match ``grids``.
        """
        tokens = np.asarray(tokens)
        is_image = tokens == image_token_id
        out, at, pos, k = [], 0, 0, 0
        n = len(tokens)
        while at < n:
            end = at
            while end < n and is_image[end] == is_image[at]:
                end += 1
            if not is_image[at]:
                out.append(np.broadcast_to(np.arange(pos, pos + end - at), (3, end - at)))
                pos += end - at
            else:
                if k >= len(grids) or int(np.prod(grids[k])) != end - at:
                    raise InvalidRequestError(f"the prompt's image tokens ({end - at} at {at}) do not match the "
                                              f"images' grids {list(grids)}")
                t, h, w = grids[k]
                f, r, c = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
                out.append(np.stack([f.reshape(-1), r.reshape(-1), c.reshape(-1)]) + pos)
                pos += max(h, w)
                k += 1
            at = end
        if k != len(grids):
            raise InvalidRequestError(f"the prompt has {k} image(s) for {len(grids)} grids")
        return np.concatenate(out, axis=1).astype(np.int32) if out else np.zeros((3, 0), np.int32)
