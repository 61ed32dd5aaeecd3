"""The T5 text encoder of FLUX.1 (``text_encoder_2``): transformers' ``T5EncoderModel`` on the ``ml`` interfaces, with
its tokenizer (``tokenizer_2``), read as diffusers' ``FluxPipeline._get_t5_prompt_embeds`` reads it.

Reference: transformers ``models/t5/modeling_t5.py`` (``T5EncoderModel``, ``T5Stack``, ``T5Block``,
``T5Attention._relative_position_bucket`` and ``compute_bias``, ``T5LayerNorm``, ``T5DenseGatedActDense``); the model
is Raffel et al. 2020 ("Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer"), v1.1
(gated-GELU feed-forward). One pass::

    ids [L] -> shared embedding -> per block: x + SelfAttention(RMS(x)) (no 1/sqrt(d) scale; the first block's
    relative position bias [H, L, L] added to every block's scores) ; x + FF(RMS(x)) -> final RMS -> [L, d_model]

``T5LayerNorm`` is an RMS norm without mean subtraction (its variance in float32). The pipeline pads every prompt to
``max_sequence_length`` tokens with ``<pad>`` and passes no attention mask: every token, the pads included, sees every
other, and all ``max_sequence_length`` rows go to the transformer. So does this encoder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["T5Encoder", "relative_position_buckets"]

#: ``feed_forward_proj`` values and their activation (transformers' ``T5Config``: ``gated-gelu`` means ``gelu_new``,
#: the tanh approximation; a plain ``gelu`` is the exact one).
_ACTS = {"gated-gelu": "gelu_tanh", "gelu": "gelu", "gated-relu": "relu", "relu": "relu"}


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bucket ``[L, L]`` int64 of key ``j`` for query ``i`` in a bidirectional T5 encoder
    (``T5Attention._relative_position_bucket``): half the buckets for keys after the query; within each half, exact
    buckets for distances below ``n / 2``, then logarithmic buckets up to ``max_distance``."""
    pos = np.arange(length, dtype=np.int64)
    rel = pos[None, :] - pos[:, None]  # memory - query
    n = num_buckets // 2
    buckets = (rel > 0).astype(np.int64) * n
    rel = np.abs(rel)
    exact = n // 2
    with np.errstate(divide="ignore", invalid="ignore"):  # rel = 0: masked by the where below
        # float32 as torch computes it, truncated toward zero by .to(long)
        large = exact + (np.log(rel.astype(np.float32) / np.float32(exact)) / np.float32(math.log(max_distance / exact))
                         * np.float32(n - exact)).astype(np.int64)
    large = np.minimum(large, n - 1)
    return buckets + np.where(rel < exact, rel, large)


class T5Encoder:
    """T5's encoder stack and its tokenizer: prompts -> ``[L, d_model]`` features.

    Attributes:
        hidden_size: ``d_model`` (4096 for FLUX's T5 v1.1 XXL).
    """

    def __init__(self, backend: Backend, tokenizer_folder: Path):
        from tokenizers import Tokenizer as HFTokenizer

        cfg = backend.metadata
        self.backend = backend
        self.dtype = backend.compute_dtype
        ff = cfg.get("feed_forward_proj", "relu")
        if ff not in _ACTS:
            raise UnsupportedError(f"T5 feed_forward_proj {ff!r} is not supported (known: {', '.join(_ACTS)})")
        self.gated = ff.startswith("gated-")
        self.act = _ACTS[ff]
        self.layers = int(cfg.get("num_layers", 24))
        self.heads = int(cfg.get("num_heads", 64))
        self.d_kv = int(cfg.get("d_kv", 64))
        self.hidden_size = int(cfg.get("d_model", 4096))
        self.eps = float(cfg.get("layer_norm_epsilon", 1e-6))
        self.num_buckets = int(cfg.get("relative_attention_num_buckets", 32))
        self.max_distance = int(cfg.get("relative_attention_max_distance", 128))
        w = dict(backend.weights)
        if "shared.weight" not in w and "encoder.embed_tokens.weight" in w:
            w["shared.weight"] = w["encoder.embed_tokens.weight"]
        need = ["shared.weight", "encoder.final_layer_norm.weight",
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        for i in range(self.layers):
            p = f"encoder.block.{i}.layer."
            need += [p + f"0.SelfAttention.{n}.weight" for n in "qkvo"] + [p + "0.layer_norm.weight",
                                                                           p + "1.layer_norm.weight"]
            need += [p + f"1.DenseReluDense.{n}.weight" for n in (("wi_0", "wi_1", "wo") if self.gated
                                                                  else ("wi", "wo"))]
        missing = [n for n in need if n not in w]
        if missing:
            raise WeightsError(f"the T5 encoder checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}")
        self.w = w
        tok_file = tokenizer_folder / "tokenizer.json"
        if not tok_file.is_file():
            raise WeightsError(f"{tokenizer_folder}: no tokenizer.json (the T5 tokenizer of tokenizer_2/)")
        self.tokenizer = HFTokenizer.from_file(str(tok_file))
        self.pad_id = self.tokenizer.token_to_id("<pad>")
        if self.pad_id is None:
            self.pad_id = 0

    def token_ids(self, prompt: str, max_sequence_length: int) -> list[int]:
        """The ids the pipeline feeds: the prompt's tokens and ``</s>`` (the tokenizer's post-processor), cut to
        ``max_sequence_length`` (``truncation=True``: ``</s>`` kept), padded with ``<pad>`` to that length."""
        tk = self.tokenizer
        tk.enable_truncation(max_sequence_length)
        tk.enable_padding(length=max_sequence_length, pad_id=self.pad_id, pad_token="<pad>")
        return tk.encode(prompt).ids

    def encode(self, ctx: Context, prompts: Sequence[str], max_sequence_length: int) -> Tensor:
        """Features ``[B, max_sequence_length, d_model]`` in the compute dtype, one row of ``B`` per prompt.

        Raises:
            InvalidRequestError: ``max_sequence_length < 1`` or a prompt that is not a string.
        """
        if max_sequence_length < 1:
            raise InvalidRequestError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        if not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError("every prompt must be a string")
        ids = np.asarray([self.token_ids(p, max_sequence_length) for p in prompts], np.int32)  # [B, L]
        b, n = ids.shape
        dt = self.dtype
        x = self.w["shared.weight"].take(ctx.from_numpy(ids.reshape(-1)), axis=0).reshape(b, n, self.hidden_size)
        x = x.astype(dt) if x.dtype != dt else x
        buckets = relative_position_buckets(n, self.num_buckets, self.max_distance)
        table = self.w["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]  # [buckets, H]
        bias = table.take(ctx.from_numpy(buckets.reshape(-1).astype(np.int32)), axis=0).reshape(n, n, self.heads)
        bias = bias.transpose(2, 0, 1).reshape(1, self.heads, n, n).astype(dt)
        for i in range(self.layers):
            p = f"encoder.block.{i}.layer."
            x = x + self._attention(ctx, self._norm(x, p + "0.layer_norm.weight"), p + "0.SelfAttention.", bias)
            x = x + self._ff(self._norm(x, p + "1.layer_norm.weight"), p + "1.DenseReluDense.")
        return self._norm(x, "encoder.final_layer_norm.weight")

    def _norm(self, x: Tensor, name: str) -> Tensor:
        """``T5LayerNorm``: ``w * x / sqrt(mean(x^2) + eps)``, the mean in float32."""
        dt = x.dtype
        y = x if dt == DType.FLOAT32 else x.astype(DType.FLOAT32)
        y = y.rms_norm(None, self.eps)
        return (y if dt == DType.FLOAT32 else y.astype(dt)) * self.w[name]

    def _attention(self, ctx: Context, x: Tensor, pre: str, bias: Tensor) -> Tensor:
        b, n, _ = x.shape
        h, d = self.heads, self.d_kv
        q, k, v = (x.linear(self.w[pre + f"{c}.weight"]).reshape(b, n, h, d).transpose(0, 2, 1, 3) for c in "qkv")
        o = ctx.scaled_dot_product_attention(q, k, v, 1.0, bias)  # T5 folds the 1/sqrt(d) into its init
        return o.transpose(0, 2, 1, 3).reshape(b, n, h * d).linear(self.w[pre + "o.weight"])

    def _ff(self, x: Tensor, pre: str) -> Tensor:
        """``T5DenseGatedActDense`` (``wo(act(wi_0 x) * wi_1 x)``) or ``T5DenseActDense`` (``wo(act(wi x))``)."""
        act = {"gelu_tanh": lambda t: t.gelu(approximate=True), "gelu": lambda t: t.gelu(),
               "relu": lambda t: t.maximum(0.0)}[self.act]
        if self.gated:
            h = act(x.linear(self.w[pre + "wi_0.weight"])) * x.linear(self.w[pre + "wi_1.weight"])
        else:
            h = act(x.linear(self.w[pre + "wi.weight"]))
        return h.linear(self.w[pre + "wo.weight"])

    def close(self) -> None:
        """Free the weights (``backend.close()``)."""
        self.w = {}
        self.backend.close()
