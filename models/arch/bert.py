"""BERT-family encoders for embeddings: BERT (all-MiniLM, bge-*, mxbai-embed-large), XLM-RoBERTa (bge-m3,
bge-reranker-v2-m3) and nomic-bert (nomic-embed-text: RoPE and a SwiGLU MLP), run with bidirectional attention over a
padded batch and no KV cache.

References: transformers' ``models/bert/modeling_bert.py`` (``BertModel``: post-norm layers, learned absolute
positions, token type 0, exact-erf GELU) and ``models/xlm_roberta/modeling_xlm_roberta.py`` (the same layers; positions
counted from ``pad_token_id + 1``, fairseq's ``make_positions``, so llama.cpp's converter drops the table's first
``pad_token_id + 1`` rows, as we do; a classification head ``out_proj(tanh(dense(x)))`` on the first token);
llama.cpp's ``src/models/bert.cpp`` (the same graph for ``bert`` and ``nomic-bert``: nomic rotates queries and keys
with NeoX-style RoPE, has no position table and an MLP ``down(silu(gate(x)) * up(x))``) and ``conversion/bert.py``
(the GGUF tensor names). Tensors are held under llama.cpp's names whatever the source; a Hugging Face folder's are
mapped onto them.

Shapes: token ids ``[B, L]`` (rows padded on the right), hidden states ``[B, L, D]``, attention ``[B, H, L, Dh]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mlx_engine.errors import WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.layers.config import check_layer_count, metadata_getter

#: Architectures as GGUF's ``general.architecture`` and Hugging Face's ``model_type`` spell them.
ENCODER_ARCHITECTURES = frozenset({"bert", "nomic-bert", "nomic_bert", "xlm-roberta", "xlm_roberta", "modernbert",
                                   "modern-bert"})  # ModernBERT runs in models/arch/modernbert.py

# transformers' BertModel names to llama.cpp's (conversion/bert.py after its "bert." prefix is dropped)
_HF_NAMES = [
    (r"embeddings\.word_embeddings\.weight", "token_embd.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "token_types.weight"),
    (r"embeddings\.position_embeddings\.weight", "position_embd.weight"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"token_embd_norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", r"blk.\1.attn_output_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"blk.\1.ffn_up.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"blk.\1.ffn_down.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"blk.\1.layer_output_norm.\2"),
    # BertForSequenceClassification's head: tanh(pooler(CLS)), then the classifier; llama.cpp's rank head has the
    # same graph (cls, tanh, cls.output) though its converter drops the pooler
    (r"pooler\.dense\.(weight|bias)", r"cls.\1"),
    (r"classifier\.(weight|bias)", r"cls.output.\1"),
    # XLMRobertaForSequenceClassification's head: out_proj(tanh(dense(CLS))), the same graph under other names
    (r"classifier\.dense\.(weight|bias)", r"cls.\1"),
    (r"classifier\.out_proj\.(weight|bias)", r"cls.output.\1"),
]
_HF_RE = [(re.compile(p + "$"), r) for p, r in _HF_NAMES]


@dataclass
class EncoderConfig:
    """Hyper-parameters of a BERT-family encoder.

    Attributes:
        architecture: ``bert``, ``xlm-roberta`` or ``nomic-bert``. context_length: the most tokens of one input
            (the position table's rows for BERT, after XLM-RoBERTa's offset). norm_eps: the layer norms' epsilon.
            rope_theta: nomic-bert's RoPE base (None: learned absolute positions, BERT). gated: the MLP is SwiGLU
            (nomic-bert), else ``down(gelu(up(x)))``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    norm_eps: float
    context_length: int
    rope_theta: float | None = None
    gated: bool = False

    def __post_init__(self) -> None:
        """Raises WeightsError for a size that is not a positive integer or heads that do not divide the width."""
        check_layer_count(self.num_layers)
        for name in ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "context_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 < v < 1 << 31:
                raise WeightsError(f"encoder config has {name} = {v!r}; it must be a positive integer below 2**31")
        if self.hidden_size % self.num_heads:
            raise WeightsError(f"encoder config has hidden size {self.hidden_size}, not a multiple of its "
                               f"{self.num_heads} heads")
        if not self.norm_eps > 0:
            raise WeightsError(f"encoder config has layer norm epsilon {self.norm_eps!r}; it must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def position_offset(config: Any) -> int:
    """The rows of a ``config.json``'s position table before position 0: ``pad_token_id + 1`` for XLM-RoBERTa (its
    positions start after the padding index), 0 for BERT."""
    if str(config.get("model_type", "bert")).replace("_", "-") != "xlm-roberta":
        return 0
    pad = config.get("pad_token_id", 1)
    return int(pad) + 1 if isinstance(pad, int) and pad >= 0 else 0


def config_from_hf(config: Any) -> EncoderConfig:
    """From a ``config.json`` (transformers' ``BertConfig`` or ``XLMRobertaConfig``). Raises WeightsError naming a
    missing or bad key."""
    try:
        arch = str(config.get("model_type", "bert")).replace("_", "-")
        if arch not in ("bert", "xlm-roberta"):
            raise WeightsError(f"config.json's model_type is {arch!r}: folders of BERT and XLM-RoBERTa models are "
                               "read (nomic-bert runs from its GGUF file, as llama.cpp's converter writes it)")
        act = config.get("hidden_act", "gelu")
        if act != "gelu":
            raise WeightsError(f"config.json's hidden_act is {act!r}; BERT models with 'gelu' are read")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise WeightsError("config.json's position_embedding_type is not 'absolute', which is what we run")
        return EncoderConfig(arch, int(config["vocab_size"]), int(config["hidden_size"]),
                             int(config["num_hidden_layers"]), int(config["num_attention_heads"]),
                             int(config["intermediate_size"]), float(config.get("layer_norm_eps", 1e-12)),
                             int(config.get("max_position_embeddings", 512)) - position_offset(config))
    except KeyError as e:
        raise WeightsError(f"config.json lacks {e}; is it a complete BERT model?") from None


def config_from_gguf(metadata: Any, weights: dict[str, Tensor]) -> EncoderConfig:
    """From GGUF metadata (``bert.*`` / ``nomic-bert.*`` keys as llama.cpp's converter writes them). Raises
    WeightsError."""
    arch = str(metadata["general.architecture"])
    get = metadata_getter(metadata, arch)
    emb = weights.get("token_embd.weight")
    if emb is None:
        raise WeightsError(f"the {arch} GGUF has no token_embd.weight")
    nomic = arch == "nomic-bert"
    return EncoderConfig(arch, int(emb.shape[0]), int(get("embedding_length", positive=True)),
                         int(get("block_count")), int(get("attention.head_count", positive=True)),
                         int(get("feed_forward_length", positive=True)),
                         float(get("attention.layer_norm_epsilon", 1e-12)), int(get("context_length", 512)),
                         float(get("rope.freq_base", 1000.0)) if nomic else None, gated=nomic)


def llama_cpp_names(weights: dict[str, Tensor], offset: int = 0) -> dict[str, Tensor]:
    """A Hugging Face BERT or XLM-RoBERTa checkpoint's tensors under llama.cpp's names (a ``bert.`` or ``roberta.``
    prefix dropped; the masked-LM head, which embeddings do not use, left out); the position table without its first
    ``offset`` rows (:func:`position_offset`), as llama.cpp's converter writes it."""
    out = {}
    for name, t in weights.items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        for rx, repl in _HF_RE:
            if rx.match(name):
                out[rx.sub(repl, name)] = t
                break
    if offset and "position_embd.weight" in out:
        out["position_embd.weight"] = out["position_embd.weight"][offset:]
    return out


class BertEncoder:
    """A BERT-family encoder on the ``ml`` interfaces: token ids to the last layer's hidden states.

    Attributes: config, batch_tokens (the most token rows of one padded pass: a bound on attention's memory).

    Errors at construction: ``WeightsError`` for a missing tensor or one whose shape disagrees with the config.
    """

    batch_tokens = 16384

    def __init__(self, config: EncoderConfig, weights: dict[str, Tensor], backend: Backend):
        self.config, self.backend, self.w = config, backend, weights
        self.dtype = backend.compute_dtype
        self._check()
        d = config.hidden_size
        # llama.cpp adds row 0 of the token type table to every token ("Sentence A"), as BertModel does by default
        types = weights.get("token_types.weight")
        self._type_row = None if types is None else types.take(backend.new_context().from_numpy(
            np.zeros(1, np.int32)), axis=0).reshape(1, 1, d).astype(self.dtype)

    @classmethod
    def from_backend(cls, backend: Backend, source: str) -> "BertEncoder":
        """From a loaded backend; ``source`` ``"gguf"`` or ``"hf"``. Raises WeightsError."""
        weights = dict(backend.weights)
        if source == "gguf":
            config = config_from_gguf(backend.metadata, weights)
        else:
            config = config_from_hf(backend.metadata)
            weights = llama_cpp_names(weights, position_offset(backend.metadata))
        return cls(config, weights, backend)

    def _check(self) -> None:
        c = self.config
        d, ff = c.hidden_size, c.intermediate_size
        want: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, d), "token_embd_norm.weight": (d,),
                                            "token_embd_norm.bias": (d,)}
        if c.rope_theta is None:
            want["position_embd.weight"] = (c.context_length, d)
        for i in range(c.num_layers):
            p = f"blk.{i}."
            if p + "attn_qkv.weight" in self.w:
                want[p + "attn_qkv.weight"] = (3 * d, d)
            else:
                want.update({p + "attn_q.weight": (d, d), p + "attn_k.weight": (d, d), p + "attn_v.weight": (d, d)})
            want.update({p + "attn_output.weight": (d, d), p + "attn_output_norm.weight": (d,),
                         p + "attn_output_norm.bias": (d,), p + "ffn_up.weight": (ff, d),
                         p + "ffn_down.weight": (d, ff), p + "layer_output_norm.weight": (d,),
                         p + "layer_output_norm.bias": (d,)})
            if c.gated:
                want[p + "ffn_gate.weight"] = (ff, d)
        missing = [n for n in want if n not in self.w]
        if missing:
            raise WeightsError(f"the {c.architecture} checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(missing[:3])}; is it a complete {c.architecture} model?")
        for name, shape in want.items():
            if tuple(self.w[name].shape) != shape:
                raise WeightsError(f"tensor {name} has shape {tuple(self.w[name].shape)} but the config implies "
                                   f"{shape}; the file is inconsistent")

    @property
    def has_rank_head(self) -> bool:
        """Whether the checkpoint holds a classification head (``cls.output.weight``): a cross-encoder."""
        return "cls.output.weight" in self.w

    def pooled(self, ctx: Context, inputs: Sequence[Sequence[int]], mode: str) -> np.ndarray:
        """Pooled hidden states float32 ``[len(inputs), hidden_size]`` of token-id inputs, run as one padded batch
        (see :func:`pool`)."""
        ids, lengths = padded(inputs)
        return pool(ctx, self.forward(ctx, ids, lengths), lengths, mode)

    def rank(self, ctx: Context, inputs: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None = None
             ) -> np.ndarray:
        """Classifier outputs float32 ``[len(inputs), labels]`` of (query, document) pair inputs: the first token's
        hidden state through ``tanh(cls(x))`` where the checkpoint has ``cls.weight``, then ``cls.output`` (llama.cpp's
        ``LLAMA_POOLING_TYPE_RANK`` head; transformers' ``BertForSequenceClassification``: pooler, classifier).
        ``types``: each token's segment (0 query, 1 document), as transformers' tokenizer gives; None: all 0, as
        llama.cpp runs. Raises WeightsError when the checkpoint has no classification head."""
        if not self.has_rank_head:
            raise WeightsError(f"the {self.config.architecture} checkpoint has no classification head "
                               "(cls.output.weight / classifier.weight): it embeds, it does not rerank")
        ids, lengths = padded(inputs)
        type_ids = None if types is None else padded(types)[0]
        x = pool(ctx, self.forward(ctx, ids, lengths, type_ids), lengths, "cls", as_tensor=True)
        if "cls.weight" in self.w:
            x = x.linear(self.w["cls.weight"], self.w.get("cls.bias")).tanh()
        return x.linear(self.w["cls.output.weight"], self.w.get("cls.output.bias")).astype(DType.FLOAT32).numpy()

    def forward(self, ctx: Context, ids: np.ndarray, lengths: np.ndarray, types: np.ndarray | None = None) -> Tensor:
        """The last layer's hidden states ``[B, L, D]`` (compute dtype) of token ids ``ids`` (int ``[B, L]``, row
        ``b`` holding ``lengths[b]`` tokens, then padding that no token attends to). ``types``: int ``[B, L]``
        token types (rows of ``token_types.weight``); None: type 0 for every token (llama.cpp's "Sentence A")."""
        c, w = self.config, self.w
        b, n = ids.shape
        flat = ctx.from_numpy(np.ascontiguousarray(ids, np.int32).reshape(-1))
        h = w["token_embd.weight"].take(flat, axis=0).reshape(b, n, c.hidden_size).astype(self.dtype)
        # XLM-RoBERTa's table has one row (type_vocab_size 1): every token is type 0 whatever the tokenizer says
        if types is not None and "token_types.weight" in w and w["token_types.weight"].shape[0] > 1:
            rows = ctx.from_numpy(np.ascontiguousarray(types, np.int32).reshape(-1))
            h = h + w["token_types.weight"].take(rows, axis=0).reshape(b, n, c.hidden_size).astype(self.dtype)
        elif self._type_row is not None:
            h = h + self._type_row
        if c.rope_theta is None:
            h = h + w["position_embd.weight"].take(ctx.arange(0, n), axis=0).astype(self.dtype)
        h = h.layer_norm(w["token_embd_norm.weight"], w["token_embd_norm.bias"], c.norm_eps)
        visible = np.arange(n)[None, :] < np.asarray(lengths)[:, None]
        mask = ctx.from_numpy(np.where(visible, 0.0, -np.inf).astype(np.float32).reshape(b, 1, 1, n), self.dtype)
        for i in range(c.num_layers):
            h = self._layer(ctx, i, h, mask)
        return h

    def _layer(self, ctx: Context, i: int, h: Tensor, mask: Tensor) -> Tensor:
        c, w, p = self.config, self.w, f"blk.{i}."
        b, n, d = h.shape
        hd = c.head_dim
        if p + "attn_qkv.weight" in w:
            qkv = h.linear(w[p + "attn_qkv.weight"], w.get(p + "attn_qkv.bias"))
            q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        else:
            q, k, v = (h.linear(w[p + f"attn_{x}.weight"], w.get(p + f"attn_{x}.bias")) for x in "qkv")
        q, k, v = (x.reshape(b, n, c.num_heads, hd).transpose(0, 2, 1, 3) for x in (q, k, v))
        if c.rope_theta is not None:  # llama.cpp's NEOX rotation: halves, not interleaved pairs
            q, k = (x.rope(0, hd, base=c.rope_theta) for x in (q, k))
        o = ctx.scaled_dot_product_attention(q, k, v, hd ** -0.5, mask)
        o = o.transpose(0, 2, 1, 3).reshape(b, n, d).linear(w[p + "attn_output.weight"], w.get(p + "attn_output.bias"))
        h = (o + h).layer_norm(w[p + "attn_output_norm.weight"], w[p + "attn_output_norm.bias"], c.norm_eps)
        if c.gated:
            up = h.linear(w[p + "ffn_up.weight"], w.get(p + "ffn_up.bias"))
            m = h.linear(w[p + "ffn_gate.weight"]).gated(up, "silu")
        else:
            m = h.linear(w[p + "ffn_up.weight"], w.get(p + "ffn_up.bias")).gelu()
        m = m.linear(w[p + "ffn_down.weight"], w.get(p + "ffn_down.bias"))
        return (m + h).layer_norm(w[p + "layer_output_norm.weight"], w[p + "layer_output_norm.bias"], c.norm_eps)


def padded(inputs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32 [B, L], lengths [B])``: the inputs padded on the right with 0."""
    lengths = np.array([len(x) for x in inputs])
    ids = np.zeros((len(inputs), int(lengths.max())), np.int32)
    for b, x in enumerate(inputs):
        ids[b, :len(x)] = x
    return ids, lengths


def pool(ctx: Context, h: Tensor, lengths: np.ndarray, mode: str, as_tensor: bool = False) -> "np.ndarray | Tensor":
    """Pooled embeddings float32 ``[B, D]`` of hidden states ``h [B, L, D]`` whose row ``b`` holds ``lengths[b]``
    tokens: ``mean`` over those tokens, ``cls`` the first token, ``last`` the last one (sentence-transformers'
    ``Pooling``; llama.cpp's pooling types 1, 2 and 3); ``as_tensor``: a Tensor ``[B, D]`` in ``h``'s dtype.
    Raises ValueError for another mode."""
    b, n, d = h.shape
    lengths = np.asarray(lengths, np.int64)
    if mode == "mean":
        m = ctx.from_numpy((np.arange(n)[None, :] < lengths[:, None]).astype(np.float32)[:, :, None], h.dtype)
        mean = (h * m).sum(axis=1) / ctx.from_numpy(lengths.astype(np.float32)[:, None], h.dtype)
        return mean if as_tensor else mean.astype(DType.FLOAT32).numpy()
    if mode in ("cls", "last"):
        rows = np.arange(b) * n + (0 if mode == "cls" else lengths - 1)
        picked = h.reshape(b * n, d).take(ctx.from_numpy(rows.astype(np.int32)), axis=0)
        return picked if as_tensor else picked.astype(DType.FLOAT32).numpy()
    raise ValueError(f"pooling {mode!r}: mean, cls and last are the ones we run")
