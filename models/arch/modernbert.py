"""ModernBERT encoders (ModernBERT-base / -large and the embedding models built on it: gte-modernbert,
nomic-embed-text-v2's kin, granite-embedding-r2): pre-norm layers without biases, RoPE with two bases (global
layers and local ones), local layers attending within a sliding window both ways, a gated GELU MLP (GeGLU) and a final
norm. ModernBERT cross-encoders (``ModernBertForSequenceClassification``: gte-reranker-modernbert-base, the ms-marco
ModernBERT rerankers) pool the final hidden states, then run a head and a classifier (:meth:`ModernBertEncoder.rank`).

References: transformers' ``models/modernbert/modeling_modernbert.py`` (``ModernBertModel``: ``embeddings.norm`` after
the token embedding; layer 0's ``attn_norm`` is the identity; ``Wqkv`` fused; NeoX-style RoPE, base
``rope_parameters["full_attention"]`` (160000) on global layers and ``["sliding_attention"]`` (10000) on local ones;
``layer_types`` from ``global_attn_every_n_layers``: layer ``i`` global when ``i % n == 0``; a local token sees keys
at distance at most ``local_attention // 2``, ``masking_utils.sliding_window_bidirectional_overlay``;
``Wo(act(input) * gate)`` with ``input, gate = Wi(x).chunk(2)``; ``final_norm``) and llama.cpp's
``src/models/modern-bert.cpp`` with ``conversion/bert.py`` (``ModernBertModel``: the GGUF names, ``sliding_window``
holding ``local_attention``, ``LLAMA_SWA_TYPE_SYMMETRIC``: masked where the distance exceeds half of it). The
cross-encoder: transformers' ``ModernBertForSequenceClassification`` (``classifier_pooling`` ``cls``, the first
token, or ``mean`` over the attended tokens; ``head``: ``norm(act(dense(x)))``, ``classifier_activation`` GELU;
then ``classifier``) and llama.cpp's ``build_pooling`` for ``LLAMA_POOLING_TYPE_RANK`` (``cls``, GELU for
``LLM_ARCH_MODERN_BERT``, ``cls.norm``, ``cls.output``; ``{arch}.classifier.pooling_type`` 2 CLS or 1 mean, mean when
absent: ``llama_model_modern_bert::load_arch_hparams``).

Shapes: token ids ``[B, L]`` (rows padded on the right), hidden states ``[B, L, D]``, attention ``[B, H, L, Dh]``.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from mlx_engine.errors import WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor
from mlx_engine.models.arch.bert import BertEncoder, EncoderConfig, padded, pool
from mlx_engine.models.layers.config import metadata_getter

#: ModernBERT as Hugging Face's ``model_type`` and GGUF's ``general.architecture`` spell it.
MODERNBERT_ARCHITECTURES = frozenset({"modernbert", "modern-bert"})

_HF_NAMES = [
    (r"embeddings\.tok_embeddings\.weight", "token_embd.weight"),
    (r"embeddings\.norm\.weight", "token_embd_norm.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"blk.\1.attn_norm.weight"),
    (r"layers\.(\d+)\.attn\.Wqkv\.weight", r"blk.\1.attn_qkv.weight"),
    (r"layers\.(\d+)\.attn\.Wo\.weight", r"blk.\1.attn_output.weight"),
    (r"layers\.(\d+)\.mlp_norm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"layers\.(\d+)\.mlp\.Wi\.weight", r"blk.\1.ffn_up.weight"),
    (r"layers\.(\d+)\.mlp\.Wo\.weight", r"blk.\1.ffn_down.weight"),
    (r"final_norm\.weight", "output_norm.weight"),
    # ModernBertForSequenceClassification's head and classifier, as llama.cpp's converter names them (with labels)
    (r"head\.dense\.(weight|bias)", r"cls.\1"),
    (r"head\.norm\.weight", "cls.norm.weight"),
    (r"classifier\.(weight|bias)", r"cls.output.\1"),
]
#: llama.cpp's ``{arch}.classifier.pooling_type`` values (``enum llama_pooling_type``) a ModernBERT head pools by.
_GGUF_RANK_POOLING = {1: "mean", 2: "cls"}
_HF_RE = [(re.compile(p + "$"), r) for p, r in _HF_NAMES]


class ModernBertEncoder(BertEncoder):
    """A ModernBERT encoder on the ``ml`` interfaces: token ids to the final-normed hidden states.

    Attributes beyond :class:`BertEncoder`'s: global_layers (the layers attending to every token), local_theta
    (the local layers' RoPE base), half_window (a local token sees keys at most this far, both ways), rank_pooling
    (a cross-encoder's pooling before its head: ``cls`` or ``mean``).

    Errors at construction: ``WeightsError`` for a missing tensor, a bias (we run the bias-free layout; the
    classification head's dense and classifier may have theirs), or a shape that disagrees with the config.
    """

    def __init__(self, config: EncoderConfig, weights: dict[str, Tensor], backend: Backend,
                 global_layers: set[int], local_theta: float, half_window: int, rank_pooling: str = "cls"):
        self.global_layers, self.local_theta, self.half_window = global_layers, local_theta, half_window
        self.rank_pooling = rank_pooling
        super().__init__(config, weights, backend)

    @classmethod
    def from_backend(cls, backend: Backend, source: str) -> "ModernBertEncoder":
        """From a loaded backend; ``source`` ``"gguf"`` or ``"hf"``. Raises WeightsError naming a bad key or
        tensor."""
        md, weights = backend.metadata, dict(backend.weights)
        try:
            return cls._from_gguf(md, weights, backend) if source == "gguf" else cls._from_hf(md, weights, backend)
        except KeyError as e:
            raise WeightsError(f"the ModernBERT checkpoint lacks {e}") from None

    @classmethod
    def _from_hf(cls, md: Any, weights: dict[str, Tensor], backend: Backend) -> "ModernBertEncoder":
        if md.get("hidden_activation", "gelu") != "gelu":
            raise WeightsError(f"config.json's hidden_activation is {md.get('hidden_activation')!r}; ModernBERT "
                               "with 'gelu' (GeGLU) is read")
        if md.get("norm_bias") or md.get("attention_bias") or md.get("mlp_bias"):
            raise WeightsError("config.json asks for biases (norm_bias / attention_bias / mlp_bias); ModernBERT "
                               "runs without them")
        n = int(md["num_hidden_layers"])
        every = int(md.get("global_attn_every_n_layers", 3))
        types = md.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(n)]
        rope = md.get("rope_parameters") or {}
        glob = float((rope.get("full_attention") or {}).get("rope_theta", md.get("global_rope_theta", 160000.0)))
        local = float((rope.get("sliding_attention") or {}).get("rope_theta", md.get("local_rope_theta", 10000.0)))
        config = EncoderConfig("modernbert", int(md["vocab_size"]), int(md["hidden_size"]), n,
                               int(md["num_attention_heads"]), int(md["intermediate_size"]),
                               float(md.get("norm_eps", 1e-5)), int(md.get("max_position_embeddings", 8192)),
                               rope_theta=glob, gated=True)
        out = {}
        for name, t in weights.items():
            name = name.removeprefix("model.")
            for rx, repl in _HF_RE:
                if rx.match(name):
                    out[rx.sub(repl, name)] = t
        pooling = md.get("classifier_pooling", "cls")  # transformers' ModernBertConfig default
        if "cls.output.weight" in out:  # a cross-encoder: its head must be one we run
            if pooling not in ("cls", "mean"):
                raise WeightsError(f"config.json's classifier_pooling is {pooling!r}; 'cls' and 'mean' are run")
            if md.get("classifier_activation", "gelu") != "gelu":
                raise WeightsError(f"config.json's classifier_activation is {md.get('classifier_activation')!r}; "
                                   "ModernBERT cross-encoders with 'gelu' (llama.cpp's only one) are read")
        return cls(config, out, backend, {i for i, t in enumerate(types) if t == "full_attention"}, local,
                   int(md.get("local_attention", 128)) // 2, pooling)

    @classmethod
    def _from_gguf(cls, md: Any, weights: dict[str, Tensor], backend: Backend) -> "ModernBertEncoder":
        get = metadata_getter(md, "modern-bert")
        emb = weights.get("token_embd.weight")
        if emb is None:
            raise WeightsError("the modern-bert GGUF has no token_embd.weight")
        act = get("hidden_act", "gelu")
        if act != "gelu":
            raise WeightsError(f"the GGUF's modern-bert.hidden_act is {act!r}; ModernBERT with gelu is read")
        n = int(get("block_count"))
        # llama.cpp's load_swa_pattern(ml, 3, true): layer i global when i % pattern == 0 (the first one global)
        every = int(get("attention.sliding_window_pattern", 3))
        config = EncoderConfig("modern-bert", int(emb.shape[0]), int(get("embedding_length", positive=True)), n,
                               int(get("attention.head_count", positive=True)),
                               int(get("feed_forward_length", positive=True)),
                               # llama.cpp's converter writes it as layer_norm_rms_epsilon (its loader reads
                               # layer_norm_epsilon): either is this model's LayerNorm epsilon
                               float(get("attention.layer_norm_epsilon", get("attention.layer_norm_rms_epsilon",
                                                                             1e-5))),
                               int(get("context_length", 8192)),
                               rope_theta=float(get("rope.freq_base", 160000.0)), gated=True)
        kind = get("classifier.pooling_type", 1)  # llama.cpp pools a modern-bert head by mean where the file is silent
        pooling = _GGUF_RANK_POOLING.get(kind) if isinstance(kind, int) and not isinstance(kind, bool) else None
        if pooling is None and "cls.output.weight" in weights:  # a cross-encoder: its head must be one we run
            raise WeightsError(f"the GGUF's modern-bert.classifier.pooling_type is {kind!r:.60}; 1 (mean) and 2 "
                               "(CLS) are run")
        return cls(config, weights, backend, {i for i in range(n) if i % every == 0},
                   float(get("rope.freq_base_swa", 10000.0)), int(get("attention.sliding_window", 128)) // 2,
                   pooling or "mean")

    def _check(self) -> None:
        c = self.config
        d, ff = c.hidden_size, c.intermediate_size
        want: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, d), "token_embd_norm.weight": (d,),
                                            "output_norm.weight": (d,)}
        for i in range(c.num_layers):
            p = f"blk.{i}."
            want.update({p + "attn_qkv.weight": (3 * d, d), p + "attn_output.weight": (d, d),
                         p + "ffn_norm.weight": (d,), p + "ffn_up.weight": (2 * ff, d), p + "ffn_down.weight": (d, ff)})
            if i:  # layer 0's attention norm is the identity
                want[p + "attn_norm.weight"] = (d,)
        if self.has_rank_head:
            labels = int(self.w["cls.output.weight"].shape[0])
            want.update({"cls.weight": (d, d), "cls.norm.weight": (d,), "cls.output.weight": (labels, d)})
            if "cls.bias" in self.w:
                want["cls.bias"] = (d,)
            if "cls.output.bias" in self.w:
                want["cls.output.bias"] = (labels,)
        missing = [n for n in want if n not in self.w]
        if missing:
            raise WeightsError(f"the ModernBERT checkpoint lacks {len(missing)} tensors, e.g. "
                               f"{', '.join(missing[:3])}; is it a complete ModernBERT model?")
        biases = [n for n in self.w if n.endswith(".bias") and not n.startswith("cls")]
        if biases:
            raise WeightsError(f"the ModernBERT checkpoint has biases ({biases[0]}, ...); we run the bias-free "
                               "layout")
        for name, shape in want.items():
            if tuple(self.w[name].shape) != shape:
                raise WeightsError(f"tensor {name} has shape {tuple(self.w[name].shape)} but the config implies "
                                   f"{shape}; the file is inconsistent")

    def rank(self, ctx: Context, inputs: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None = None
             ) -> np.ndarray:
        """Classifier outputs float32 ``[len(inputs), labels]`` of (query, document) pair inputs: the final-normed
        hidden states pooled by ``rank_pooling`` (the first token, or the mean over the input's tokens), then
        ``cls.output(norm(gelu(cls(x))))`` (transformers' ``ModernBertForSequenceClassification``: ``head``, then
        ``classifier``; llama.cpp's rank head for modern-bert). ``types`` is ignored (ModernBERT has no token types).
        Raises WeightsError when the checkpoint has no classification head."""
        if not self.has_rank_head:
            raise WeightsError("the ModernBERT checkpoint has no classification head (classifier.weight / "
                               "cls.output.weight): it embeds, it does not rerank")
        w, eps = self.w, self.config.norm_eps
        ids, lengths = padded(inputs)
        x = pool(ctx, self.forward(ctx, ids, lengths), lengths, self.rank_pooling, as_tensor=True)
        x = x.linear(w["cls.weight"], w.get("cls.bias")).gelu().layer_norm(w["cls.norm.weight"], None, eps)
        return x.linear(w["cls.output.weight"], w.get("cls.output.bias")).astype(DType.FLOAT32).numpy()

    def forward(self, ctx: Context, ids: np.ndarray, lengths: np.ndarray, types: np.ndarray | None = None) -> Tensor:
        """The final-normed hidden states ``[B, L, D]`` (compute dtype) of token ids ``ids`` (int ``[B, L]``, row
        ``b`` holding ``lengths[b]`` tokens, then padding that no token attends to). ``types`` is ignored
        (ModernBERT has no token types)."""
        c, w = self.config, self.w
        b, n = ids.shape
        flat = ctx.from_numpy(np.ascontiguousarray(ids, np.int32).reshape(-1))
        h = w["token_embd.weight"].take(flat, axis=0).reshape(b, n, c.hidden_size).astype(self.dtype)
        h = h.layer_norm(w["token_embd_norm.weight"], None, c.norm_eps)
        keys = np.arange(n)[None, None, :] < np.asarray(lengths)[:, None, None]  # [B, 1, L]
        near = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]) <= self.half_window  # [L, L]
        masks = {True: keys[:, None], False: (keys & near[None])[:, None]}  # global, local: [B, 1, 1|L, L]
        masks = {g: ctx.from_numpy(np.where(m, 0.0, -np.inf).astype(np.float32), self.dtype) for g, m in masks.items()}
        for i in range(c.num_layers):
            h = self._modern_layer(ctx, i, h, masks[i in self.global_layers])
        return h.layer_norm(w["output_norm.weight"], None, c.norm_eps)

    def _modern_layer(self, ctx: Context, i: int, h: Tensor, mask: Tensor) -> Tensor:
        c, w, p = self.config, self.w, f"blk.{i}."
        b, n, d = h.shape
        hd = c.head_dim
        x = h.layer_norm(w[p + "attn_norm.weight"], None, c.norm_eps) if i else h
        qkv = x.linear(w[p + "attn_qkv.weight"])
        q, k, v = (t.reshape(b, n, c.num_heads, hd).transpose(0, 2, 1, 3)
                   for t in (qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]))
        theta = c.rope_theta if i in self.global_layers else self.local_theta
        q, k = (t.rope(0, hd, base=theta) for t in (q, k))  # NeoX halves (transformers' rotate_half)
        o = ctx.scaled_dot_product_attention(q, k, v, hd ** -0.5, mask)
        h = h + o.transpose(0, 2, 1, 3).reshape(b, n, d).linear(w[p + "attn_output.weight"])
        x = h.layer_norm(w[p + "ffn_norm.weight"], None, c.norm_eps).linear(w[p + "ffn_up.weight"])
        ff = c.intermediate_size
        m = (x[..., :ff].gelu() * x[..., ff:]).linear(w[p + "ffn_down.weight"])
        return h + m
