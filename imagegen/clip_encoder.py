"""The CLIP text encoder of FLUX.1 (``text_encoder``): transformers' ``CLIPTextModel`` on the ``ml`` interfaces and its
BPE tokenizer (``tokenizer``), read as diffusers' ``FluxPipeline._get_clip_prompt_embeds`` reads them: only the
pooled output is used.

Reference: transformers ``models/clip/modeling_clip.py`` (``CLIPTextTransformer``, ``CLIPEncoderLayer``,
``CLIPAttention``, ``CLIPMLP``) and ``convert_slow_tokenizer.py`` (``CLIPConverter``: the fast tokenizer built from
``vocab.json`` and ``merges.txt``, which is all a FLUX ``tokenizer/`` folder holds); the model is Radford et al. 2021
("Learning Transferable Visual Models From Natural Language Supervision"). One pass::

    ids [77] (<|startoftext|> prompt <|endoftext|>, padded to 77) -> token + position embeddings
      -> pre-LN causal self-attention and MLP (quick_gelu: x * sigmoid(1.702 x)) layers -> final LayerNorm
      -> pooled = the row of the end token

The end token's row: with ``eos_token_id == 2`` in the config (the original CLIP configs, FLUX's among them)
transformers takes the row of the largest id (``argmax``; ``<|endoftext|>`` is the last entry of CLIP's vocabulary),
otherwise the first ``eos_token_id``. Attention is causal, so the padding after it changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Context, Tensor

__all__ = ["CLIPTextEncoder", "clip_tokenizer"]

_PREFIX = "text_model."
#: the CLIP pre-tokenizer's pattern (transformers ``CLIPConverter``)
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _special(value, default: str) -> str:
    if isinstance(value, dict):  # an AddedToken saved as a dict
        value = value.get("content")
    return value if isinstance(value, str) else default


def clip_tokenizer(folder: Path):
    """A ``tokenizers.Tokenizer`` for a CLIP ``tokenizer/`` folder, padded and truncated to ``model_max_length``
    (77) as the pipeline asks: ``tokenizer.json`` when the folder has one, else built from ``vocab.json`` and
    ``merges.txt`` as transformers' ``CLIPConverter`` builds it (NFC, whitespace runs to one space, lowercase; the
    CLIP split pattern, byte-level, BPE with ``</w>`` word ends; ``<|startoftext|> ... <|endoftext|>``).

    Raises:
        WeightsError: neither ``tokenizer.json`` nor ``vocab.json`` + ``merges.txt``, or an unreadable config.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    cfg = {}
    if (folder / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise WeightsError(f"{folder / 'tokenizer_config.json'}: cannot read: {e}") from None
    bos = _special(cfg.get("bos_token"), "<|startoftext|>")
    eos = _special(cfg.get("eos_token"), "<|endoftext|>")
    unk = _special(cfg.get("unk_token"), eos)
    pad = _special(cfg.get("pad_token"), eos)
    length = int(cfg.get("model_max_length") or 77)
    length = 77 if length > 10 ** 6 else length  # transformers' "no limit" sentinel
    if (folder / "tokenizer.json").is_file():
        tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tk = Tokenizer(BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"), dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="</w>", fuse_unk=False,
                                     unk_token=unk))
        tk.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                              normalizers.Lowercase()])
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([bos, eos])
        tk.post_processor = processors.RobertaProcessing((eos, tk.token_to_id(eos)), (bos, tk.token_to_id(bos)),
                                                         trim_offsets=False, add_prefix_space=False)
    else:
        raise WeightsError(f"{folder}: no CLIP tokenizer (tokenizer.json, or vocab.json and merges.txt)")
    pad_id = tk.token_to_id(pad)
    if pad_id is None:
        raise WeightsError(f"{folder}: the pad token {pad!r} is not in the vocabulary")
    tk.enable_truncation(length)
    tk.enable_padding(length=length, pad_id=pad_id, pad_token=pad)
    return tk


class CLIPTextEncoder:
    """CLIP's text transformer: prompts -> pooled features ``[B, hidden_size]``.

    Attributes:
        hidden_size: the pooled width (768 for FLUX's CLIP ViT-L/14): the transformer's ``pooled_projection_dim``.
    """

    def __init__(self, backend: Backend, tokenizer_folder: Path):
        cfg = backend.metadata
        self.backend = backend
        self.dtype = backend.compute_dtype
        act = cfg.get("hidden_act", "quick_gelu")
        if act not in ("quick_gelu", "gelu"):
            raise UnsupportedError(f"CLIP hidden_act {act!r} is not supported (quick_gelu, gelu)")
        self.act = act
        self.hidden_size = int(cfg.get("hidden_size", 512))
        self.heads = int(cfg.get("num_attention_heads", 8))
        self.layers = int(cfg.get("num_hidden_layers", 12))
        self.eps = float(cfg.get("layer_norm_eps", 1e-5))
        self.eos_token_id = int(cfg.get("eos_token_id", 2))
        w = {k[len(_PREFIX):] if k.startswith(_PREFIX) else k: v for k, v in backend.weights.items()}
        need = ["embeddings.token_embedding.weight", "embeddings.position_embedding.weight",
                "final_layer_norm.weight", "final_layer_norm.bias"]
        for i in range(self.layers):
            p = f"encoder.layers.{i}."
            need += [p + n + s for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.out_proj", "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")
                     for s in (".weight", ".bias")]
        missing = [n for n in need if n not in w]
        if missing:
            raise WeightsError(f"the CLIP text encoder checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(_PREFIX + n for n in missing[:3])}")
        self.w = w
        self.tokenizer = clip_tokenizer(tokenizer_folder)

    def token_ids(self, prompts: Sequence[str]) -> np.ndarray:
        """int32 ``[B, 77]``: each prompt's ids as the pipeline's ``tokenizer(padding="max_length",
        truncation=True)`` gives them."""
        return np.asarray([e.ids for e in self.tokenizer.encode_batch(list(prompts))], np.int32)

    def encode(self, ctx: Context, prompts: Sequence[str]) -> Tensor:
        """The pooled output ``[B, hidden_size]`` (compute dtype) of each prompt.

        Raises:
            InvalidRequestError: a prompt that is not a string, or more positions than the model has.
        """
        if not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError("every prompt must be a string")
        ids = self.token_ids(prompts)
        b, n = ids.shape
        pos_table = self.w["embeddings.position_embedding.weight"]
        if n > pos_table.shape[0]:
            raise InvalidRequestError(f"CLIP takes {pos_table.shape[0]} tokens, the tokenizer gave {n}")
        dt = self.dtype
        x = self.w["embeddings.token_embedding.weight"].take(ctx.from_numpy(ids.reshape(-1)), axis=0)
        x = x.reshape(b, n, self.hidden_size) + pos_table[:n]
        x = x.astype(dt) if x.dtype != dt else x
        for i in range(self.layers):
            p = f"encoder.layers.{i}."
            x = x + self._attention(ctx, self._ln(x, p + "layer_norm1"), p + "self_attn.")
            x = x + self._mlp(self._ln(x, p + "layer_norm2"), p + "mlp.")
        x = self._ln(x, "final_layer_norm")
        if self.eos_token_id == 2:  # transformers' legacy rule
            where = ids.argmax(axis=-1)
        else:
            where = (ids == self.eos_token_id).astype(np.int32).argmax(axis=-1)
        rows = ctx.from_numpy((np.arange(b) * n + where).astype(np.int32))
        return x.reshape(b * n, self.hidden_size).take(rows, axis=0)

    def _lin(self, x: Tensor, name: str) -> Tensor:
        return x.linear(self.w[name + ".weight"], self.w[name + ".bias"])

    def _ln(self, x: Tensor, name: str) -> Tensor:
        return x.layer_norm(self.w[name + ".weight"], self.w[name + ".bias"], self.eps)

    def _attention(self, ctx: Context, x: Tensor, pre: str) -> Tensor:
        b, n, d = x.shape
        h = self.heads
        q, k, v = (self._lin(x, pre + f"{c}_proj").reshape(b, n, h, d // h).transpose(0, 2, 1, 3) for c in "qkv")
        o = ctx.scaled_dot_product_attention(q, k, v, (d // h) ** -0.5, "causal")
        return self._lin(o.transpose(0, 2, 1, 3).reshape(b, n, d), pre + "out_proj")

    def _mlp(self, x: Tensor, pre: str) -> Tensor:
        h = self._lin(x, pre + "fc1")
        h = h * (h * 1.702).sigmoid() if self.act == "quick_gelu" else h.gelu()
        return self._lin(h, pre + "fc2")

    def close(self) -> None:
        """Free the weights (``backend.close()``)."""
        self.w = {}
        self.backend.close()
