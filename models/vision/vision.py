"""Gemma 3's vision part (``Gemma3ForConditionalGeneration``): the SigLIP tower, the multi-modal projector, and where an
image goes in the prompt.

- Projector (transformers' ``Gemma3MultiModalProjector``): the tower's ``[P, Dv]`` patches, as a square grid, average
  pooled to ``mm_tokens_per_image`` tokens (256: a 64x64 grid in 4x4 blocks), RMS-normed with Gemma's ``1 + w``
  (``mm_soft_emb_norm``), then ``@ mm_input_projection_weight [Dv, D]`` into the text model's width. These rows
  replace the image's placeholder tokens and are not scaled by ``sqrt(D)`` as token embeddings are.
- Prompt (transformers' ``Gemma3Processor``): the chat template writes ``<start_of_image>`` for each image; it is
  expanded to ``"\\n\\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\\n\\n"``, and the image's
  rows take the places of the soft tokens. The tokens of one image attend to each other both ways
  (``Cache.set_causal``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.vision.images import ImageProcessor, PromptImage
from mlx_engine.models.vision.siglip import SiglipConfig, SiglipVision


# llama.cpp's mmproj tensor names (gguf-py's MODEL_ARCH.MMPROJ map) to the Hugging Face SigLIP ones
_MMPROJ_MAP = {"v.patch_embd.": "embeddings.patch_embedding.", "v.position_embd.": "embeddings.position_embedding.",
               "v.post_ln.": "post_layernorm.", "v.blk.": "encoder.layers.", ".attn_q.": ".self_attn.q_proj.",
               ".attn_k.": ".self_attn.k_proj.", ".attn_v.": ".self_attn.v_proj.", ".attn_out.": ".self_attn.out_proj.",
               ".ln1.": ".layer_norm1.", ".ln2.": ".layer_norm2.", ".ffn_up.": ".mlp.fc1.", ".ffn_down.": ".mlp.fc2."}
_MMPROJ_NAMES = re.compile("|".join(re.escape(k) for k in _MMPROJ_MAP))


# ollama's Gemma 3 vision names (after ``v.``) to the Hugging Face SigLIP ones
_OLLAMA_MAP = {"blk.": "encoder.layers.", ".attn_q.": ".self_attn.q_proj.", ".attn_k.": ".self_attn.k_proj.",
               ".attn_v.": ".self_attn.v_proj.", ".attn_output.": ".self_attn.out_proj."}
_OLLAMA_NAMES = re.compile("|".join(re.escape(k) for k in _OLLAMA_MAP))


class Gemma3Vision:
    """The image encoder of a Gemma 3 checkpoint: ``encode`` gives an image's embedding rows ``[tokens, D]``.

    Attributes:
        tokens_per_image: rows per image (``mm_tokens_per_image``).
        image_token_id, boi_token_id, eoi_token_id: the placeholder and the begin / end-of-image markers.
        processor: the image preprocessing (``image_size`` square, mean and std 0.5).
    """

    boi_text = "<start_of_image>"
    eoi_text = "<end_of_image>"
    image_text = "<image_soft_token>"

    def __init__(self, tower: SiglipVision, projection: Tensor, norm: Tensor, tokens_per_image: int,
                 token_ids: tuple[int, int, int], backend: Backend, text_width: int, own_backend: bool = False):
        """``projection [Dv, D]`` (``mm_input_projection_weight``), ``norm [Dv]`` the soft-embedding norm's full
        scale (``1 + w``); ``token_ids``: the image placeholder, begin and end of image. ``own_backend``: the vision
        weights came in a file of their own (an ``mmproj``), closed with :meth:`close`.

        Raises:
            WeightsError: a projector that does not fit the tower and the text model, or tokens per image that do
                not pool the tower's patch grid.
        """
        self.tower, self.backend, self.own_backend = tower, backend, own_backend
        vc = tower.config
        self.tokens_per_image = tokens_per_image
        side = int(round(tokens_per_image ** 0.5))
        if side * side != tokens_per_image or vc.patches_per_side % side:
            raise WeightsError(f"{tokens_per_image} tokens per image do not pool a {vc.patches_per_side}-patch "
                               "grid evenly")
        self.side, self.pool = side, vc.patches_per_side // side
        self.image_token_id, self.boi_token_id, self.eoi_token_id = token_ids
        if tuple(projection.shape) != (vc.hidden_size, text_width) or tuple(norm.shape) != (vc.hidden_size,):
            raise WeightsError(f"the multi-modal projector has shape {tuple(projection.shape)}, but the vision tower "
                               f"is {vc.hidden_size} wide and the text model {text_width}: they do not belong "
                               "together")
        self.projection = projection.dequantize().transpose(1, 0)  # [D, Dv] for linear
        self.norm = norm.dequantize()
        self.eps = vc.layer_norm_eps
        self.processor = ImageProcessor(vc.image_size)

    @classmethod
    def from_backend(cls, backend: Backend, text_width: int,
                     token_id: Callable[[str], "int | None"]) -> "Gemma3Vision | None":
        """The vision part of a Hugging Face checkpoint (``Gemma3ForConditionalGeneration``) or of an ollama Gemma 3
        model file (one GGUF with the text model, ``v.*`` and ``mm.*`` tensors and ``gemma3.vision.*`` keys), or
        None for a text-only one. Raises ``WeightsError``."""
        meta = backend.metadata
        if "gemma3.vision.block_count" in meta:
            return cls._from_ollama(backend, text_width, token_id)
        if "vision_config" not in meta or not any("vision_tower." in n for n in backend.weights):
            return None
        weights = dict(backend.weights)
        tower = SiglipVision(SiglipConfig.from_hf(meta.get("vision_config") or {}),
                             {n.split("vision_tower.", 1)[1]: t for n, t in weights.items() if "vision_tower." in n})
        proj = {n.split("multi_modal_projector.", 1)[1]: t for n, t in weights.items()
                if "multi_modal_projector." in n}
        w, norm = proj.get("mm_input_projection_weight"), proj.get("mm_soft_emb_norm.weight")
        if w is None or norm is None:
            raise WeightsError("the checkpoint has a vision tower but no multi_modal_projector weights")
        ids = (int(meta.get("image_token_index", meta.get("image_token_id", 262144))),
               int(meta.get("boi_token_index", 255999)), int(meta.get("eoi_token_index", 256000)))
        return cls(tower, w, norm.dequantize() + 1.0, int(meta.get("mm_tokens_per_image", 256)), ids, backend,
                   text_width)

    @classmethod
    def from_mmproj(cls, backend: Backend, text_width: int, token_id: Callable[[str], "int | None"]) -> "Gemma3Vision":
        """The vision part from llama.cpp's separate ``mmproj`` GGUF (``convert_hf_to_gguf.py --mmproj``:
        ``clip.projector_type`` ``gemma3``, ``clip.vision.*`` keys, ``v.*`` and ``mm.*`` tensors, the soft-embedding
        norm already ``1 + w``). ``token_id(text)`` looks the image tokens up in the text model's vocabulary.

        Raises:
            UnsupportedError: an mmproj of another projector. WeightsError: missing keys or tensors, or one that
                does not belong to the text model.
        """
        meta = backend.metadata
        kind = meta.get("clip.projector_type")
        if kind != "gemma3":
            raise UnsupportedError(f"this mmproj file's projector is {kind!r}; only Gemma 3's (gemma3) is read")
        try:
            config = {"hidden_size": meta["clip.vision.embedding_length"],
                      "intermediate_size": meta["clip.vision.feed_forward_length"],
                      "num_hidden_layers": meta["clip.vision.block_count"],
                      "num_attention_heads": meta["clip.vision.attention.head_count"],
                      "image_size": meta["clip.vision.image_size"], "patch_size": meta["clip.vision.patch_size"],
                      "layer_norm_eps": meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)}
        except KeyError as e:
            raise WeightsError(f"the mmproj file lacks the key {e}; is it a complete llama.cpp mmproj?") from None
        config = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in config.items()}
        weights = {_MMPROJ_NAMES.sub(lambda m: _MMPROJ_MAP[m.group(0)], n): t for n, t in backend.weights.items()}
        tower = SiglipVision(SiglipConfig.from_hf(config), {n: t for n, t in weights.items()
                                                            if not n.startswith("mm.")})
        w, norm = weights.get("mm.input_projection.weight"), weights.get("mm.soft_emb_norm.weight")
        if w is None or norm is None:
            raise WeightsError("the mmproj file has no mm.input_projection / mm.soft_emb_norm tensors")
        scale = int(meta.get("clip.vision.projector.scale_factor", 4))
        tokens = (tower.config.patches_per_side // max(scale, 1)) ** 2
        ids = tuple(token_id(t) for t in (cls.image_text, cls.boi_text, cls.eoi_text))
        if None in ids:
            raise WeightsError("the text model's vocabulary has no <image_soft_token> / <start_of_image> / "
                               "<end_of_image>: this mmproj does not belong to it")
        return cls(tower, w, norm, tokens, ids, backend, text_width, own_backend=True)

    @classmethod
    def _from_ollama(cls, backend: Backend, text_width: int,
                     token_id: Callable[[str], "int | None"]) -> "Gemma3Vision":
        """ollama's layout (``convert/convert_gemma3.go``): SigLIP's names under ``v.`` with ``encoder.layers`` as
        ``blk`` and the attention projections as ``attn_q/k/v/output``; the projector as ``mm.mm_*``, its norm with
        the one added (every ``*_norm.weight`` of ollama's Gemma converter)."""
        meta = backend.metadata

        def key(name: str) -> Any:
            v = meta.get(f"gemma3.vision.{name}")
            if v is None:
                raise WeightsError(f"the model file lacks gemma3.vision.{name}; is its vision part complete?")
            return v.item() if isinstance(v, np.generic) else v

        config = {"hidden_size": key("embedding_length"), "intermediate_size": key("feed_forward_length"),
                  "num_hidden_layers": key("block_count"), "num_attention_heads": key("attention.head_count"),
                  "image_size": key("image_size"), "patch_size": key("patch_size"),
                  "layer_norm_eps": meta.get("gemma3.vision.attention.layer_norm_epsilon", 1e-6)}
        tower_w = {}
        for n, t in backend.weights.items():
            if n.startswith("v."):
                n = "embeddings." + n[2:] if n.startswith(("v.patch_embedding.", "v.position_embedding.")) else n[2:]
                tower_w[_OLLAMA_NAMES.sub(lambda m: _OLLAMA_MAP[m.group(0)], n)] = t
        tower = SiglipVision(SiglipConfig.from_hf(config), tower_w)
        weights = backend.weights
        w, norm = weights.get("mm.mm_input_projection.weight"), weights.get("mm.mm_soft_emb_norm.weight")
        if w is None or norm is None:
            raise WeightsError("the model file has a vision tower but no mm.mm_input_projection / "
                               "mm.mm_soft_emb_norm tensors")
        ids = tuple(token_id(t) for t in (cls.image_text, cls.boi_text, cls.eoi_text))
        if None in ids:
            raise WeightsError("the model's vocabulary has no <image_soft_token> / <start_of_image> / <end_of_image>")
        tokens = meta.get("gemma3.mm.tokens_per_image", 256)
        return cls(tower, w, norm, int(tokens), ids, backend, text_width)

    def close(self) -> None:
        """Let go of the weights of a vision part read from a file of its own."""
        if self.own_backend:
            self.backend.close()

    def tower_output(self, ctx: Context, pixels: np.ndarray) -> Tensor:
        """The SigLIP tower's last hidden states ``[B, P, Dv]`` for ``pixels [B, S, S, 3]``."""
        return self.tower(ctx, ctx.from_numpy(np.asarray(pixels, np.float32)))

    def encode(self, pixels: np.ndarray) -> Tensor:
        """One image's rows ``[tokens, D]`` (float32), computed in a context of its own and evaluated."""
        with self.backend.new_context() as ctx:
            x = self.tower_output(ctx, pixels[None])                       # [1, P, Dv]
            g, k, dv = self.side, self.pool, x.shape[-1]
            x = x.reshape(g, k, g, k, dv).mean(axis=3).mean(axis=1)         # average pool k x k
            x = x.reshape(g * g, dv).rms_norm(self.norm, self.eps).linear(self.projection)
            x = x.astype(DType.FLOAT32)
            ctx.evaluate(x)
            return x

    def expand(self, text: str) -> str:
        """A rendered prompt with each ``<start_of_image>`` the template wrote expanded to the image's full token
        sequence; one a user typed (marked by :meth:`Tokenizer.encode_chat` with U+FFFF) stays text."""
        full = f"\n\n{self.boi_text}{self.image_text * self.tokens_per_image}{self.eoi_text}\n\n"
        return re.sub("(?<!\uffff)" + re.escape(self.boi_text), lambda _: full, text)

    def place(self, tokens: Sequence[int], images: Sequence[Any]) -> list[PromptImage]:
        """The images at the runs of placeholder tokens of ``tokens``, in order.

        Raises:
            InvalidRequestError: the prompt has a different number of image places than images were given.
        """
        ids = np.asarray(tokens)
        is_img = ids == self.image_token_id
        starts = np.flatnonzero(is_img & ~np.r_[False, is_img[:-1]])
        if len(starts) != len(images):
            raise InvalidRequestError(f"the prompt has {len(starts)} image place(s) but {len(images)} image(s) were "
                                      "given")
        out = []
        for start, image in zip(starts.tolist(), images):
            run = int(np.argmin(np.r_[is_img[start:], False]))
            if run != self.tokens_per_image:
                raise InvalidRequestError(f"an image place of {run} tokens; this model takes "
                                          f"{self.tokens_per_image} per image")
            out.append(PromptImage(start, run, self.processor(image)))
        return out


def split_images(messages: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Messages with their images as the chat template's ``{"type": "image"}`` parts (before the message's text),
    and the image sources in the order the template will place them.

    A message gives images as ollama does (``"images": [...]``) or as content parts (``{"type": "image", "image":
    ...}``, OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``); a source is anything
    :func:`~mlx_engine.models.vision.images.load_image` reads. Messages without images are returned unchanged.

    Raises:
        InvalidRequestError: an unknown content part, or an image part without its image.
    """
    out, sources = [], []
    for m in messages:
        given = m.get("images") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if not given and not (isinstance(content, list) and any(_is_image(p) for p in content)):
            out.append(m)
            continue
        if given is not None and not isinstance(given, (list, tuple)):
            raise InvalidRequestError("a message's images must be a list")
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in given or ()]
        sources += list(given or ())
        for p in content if isinstance(content, list) else [{"type": "text", "text": content or ""}]:
            if _is_image(p):
                src = p.get("image") or p.get("url") or p.get("path")
                if isinstance(p.get("image_url"), dict):
                    src = p["image_url"].get("url")
                elif isinstance(p.get("image_url"), str):
                    src = p["image_url"]
                if not src:
                    raise InvalidRequestError(f"an image part without its image: {p!r:.200}")
                parts.append({"type": "image"})
                sources.append(src)
            elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str):
                parts.append({"type": "text", "text": p.get("text", "")})
            else:
                raise InvalidRequestError(f"a message part must be text or an image, got {p!r:.200}")
        out.append({**{k: v for k, v in m.items() if k != "images"}, "content": parts})
    return out, sources


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url", "input_image")


def chat_prompt(tokenizer: Any, vision: "Gemma3Vision | None", messages: Sequence[Any],
                **template_vars: Any) -> tuple[list[int], list[PromptImage]]:
    """Token ids of a conversation through the chat template, and its images at their places.

    Raises:
        InvalidRequestError: images for a model without a vision part, or images the template did not place.
    """
    messages, sources = split_images(messages)
    if not sources:
        return tokenizer.encode_chat(messages, **template_vars), []
    if vision is None:
        raise InvalidRequestError("this model has no vision part: it cannot read images (use a vision model, "
                                  "such as a Gemma 3 4B or larger)")
    ids = tokenizer.encode_chat(messages, expand=vision.expand, **template_vars)
    return ids, vision.place(ids, sources)
