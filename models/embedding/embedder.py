"""Embeddings: an encoder (``models/arch/bert.py``) or a decoder embedder (``models/embedding/decoder_embedding.py``), its tokenizer and the sentence-transformers pipeline around it
(pooling, normalization, prompts, Matryoshka truncation), read from a folder in sentence-transformers' layout or from a
GGUF file as llama.cpp's converter writes it.

What is read, and from where:

- A folder: ``modules.json`` (the modules in order: ``Transformer``, ``Pooling``, ``Dense`` after pooling (its
  ``config.json`` and ``model.safetensors``), ``Normalize``; another module is refused), the Pooling module's ``config.json`` (``pooling_mode_cls_token``,
  ``pooling_mode_mean_tokens``, ``pooling_mode_lasttoken``, or ``pooling_mode``), ``sentence_bert_config.json``
  (``max_seq_length``), ``config_sentence_transformers.json`` (``prompts``, ``default_prompt_name``). A folder without
  ``modules.json`` pools by mean, as sentence-transformers does for a plain transformers model.
- A GGUF file: ``{arch}.pooling_type`` (1 mean, 2 CLS, 3 last; llama.cpp's ``enum llama_pooling_type``; 0, none, is
  refused: no one vector per text) and ``{arch}.attention.causal`` (false for encoders; a decoder embedder, such as
  Qwen3-Embedding's ``qwen3``, attends causally as llama.cpp's default; EmbeddingGemma's ``gemma-embedding`` both
  ways), its ``dense_2`` / ``dense_3`` Dense weights.

The pipeline follows sentence-transformers (``SentenceTransformer.encode``, ``models/Pooling.py``,
``models/Normalize.py``): token ids with the tokenizer's special tokens, inputs longer than ``max_seq_length`` cut
there (the special tokens kept), the pooled vector L2-normalized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.ml import Backend, DType
from mlx_engine.models.arch.bert import ENCODER_ARCHITECTURES, BertEncoder
from mlx_engine.models.arch.gemma3 import EMBEDDING_GGUF
from mlx_engine.models.arch.modernbert import MODERNBERT_ARCHITECTURES, ModernBertEncoder
from mlx_engine.models.embedding.decoder_embedding import DecoderEncoder
from mlx_engine.models.text.tokenizer import Tokenizer

#: llama.cpp's ``enum llama_pooling_type`` values that give one vector per text.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
#: llama.cpp's ``LLAMA_POOLING_TYPE_RANK``: a reranker.
GGUF_POOLING_RANK = 4
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
#: sentence-transformers' ``Dense`` activations we run (its ``activation_function`` path), by name.
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}


@dataclass
class Dense:
    """A sentence-transformers ``Dense`` module after pooling: ``activation(x @ weight.T + bias)``.

    Attributes: weight float32 ``[out, in]``; bias float32 ``[out]`` or None; activation ``identity`` or ``tanh``.
    """

    weight: np.ndarray
    bias: np.ndarray | None
    activation: str

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x`` float32 ``[n, in]`` to float32 ``[n, out]`` (computed in float64)."""
        y = x.astype(np.float64) @ self.weight.T.astype(np.float64)
        if self.bias is not None:
            y += self.bias
        return (np.tanh(y) if self.activation == "tanh" else y).astype(np.float32)


def _dense(folder: Path, config: Any, width: int) -> Dense:
    """A ``Dense`` module from its folder (``config.json``; ``model.safetensors`` holding ``linear.weight`` and
    ``linear.bias``), taking ``width`` features. Raises WeightsError (a bad or missing file, a width that does not
    chain) or UnsupportedError (an activation we do not run)."""
    if not isinstance(config, dict):
        raise WeightsError(f"{folder / 'config.json'}: a Dense module's config is an object")
    act = config.get("activation_function", "torch.nn.modules.activation.Tanh")  # sentence-transformers' default
    if act not in _DENSE_ACTIVATIONS:
        raise UnsupportedError(f"{folder}: the Dense module's activation {act!r}; we run "
                               f"{', '.join(_DENSE_ACTIVATIONS)}")
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError) as e:
        raise WeightsError(f"{folder / 'model.safetensors'}: cannot read the Dense module's weights ({e})") from None
    weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
    if weight is None or weight.ndim != 2 or weight.shape[1] != width:
        raise WeightsError(f"{folder}: the Dense module's linear.weight must be [out, {width}], not "
                           f"{None if weight is None else list(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise WeightsError(f"{folder}: the Dense module's linear.bias must be [{weight.shape[0]}]")
    return Dense(weight.astype(np.float32), None if bias is None else bias.astype(np.float32),
                 _DENSE_ACTIVATIONS[act])


@dataclass
class EmbeddingSpec:
    """How an encoder's hidden states become one vector per text.

    Attributes:
        pooling: ``mean``, ``cls`` or ``last``. normalize: the model's pipeline ends in L2 normalization.
        max_tokens: the most tokens of one input (``max_seq_length``, else the model's context).
        prompts: named prompts prepended to a text (``{"query": "search_query: "}``); default_prompt: the name
            applied when none is given, or None. dense: the ``Dense`` modules after pooling, in order.
    """

    pooling: str = "mean"
    normalize: bool = True
    max_tokens: int = 512
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    dense: list[Dense] = field(default_factory=list)


def is_embedder(metadata: Any, path: Path) -> bool:
    """Whether the checkpoint at ``path`` (its metadata: GGUF keys or ``config.json``) is one we embed with: an
    encoder architecture; a GGUF whose ``{arch}.pooling_type`` pools (1, 2, 3: llama.cpp's converter writes it from
    the sentence-transformers folder it converts); a folder whose ``modules.json`` lists a Pooling module."""
    arch = str(metadata.get("general.architecture", metadata.get("model_type")))
    if arch in ENCODER_ARCHITECTURES or is_decoder_reranker(metadata, path):
        return True
    if "general.architecture" in metadata:
        return metadata.get(f"{arch}.pooling_type") in GGUF_POOLING
    try:
        modules = json.loads((Path(path) / "modules.json").read_text(encoding="utf-8"))
        return any(str(m.get("type", "")).endswith("Pooling") for m in modules)
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def is_decoder_reranker(metadata: Any, path: Path) -> bool:
    """Whether a decoder checkpoint is a yes / no reranker (Qwen3-Reranker): a GGUF whose ``{arch}.pooling_type``
    is 4 (``LLAMA_POOLING_TYPE_RANK``); a folder of a ``...ForCausalLM`` that llama.cpp's converter takes for one
    (``Qwen3Model._is_qwen3_reranker``: a ``# Qwen3-Reranker`` heading in its ``README.md``, or ``qwen3-reranker`` in
    the folder's name or the config's ``_name_or_path``)."""
    arch = str(metadata.get("general.architecture", metadata.get("model_type")))
    if arch in ENCODER_ARCHITECTURES:
        return False
    if "general.architecture" in metadata:
        return metadata.get(f"{arch}.pooling_type") == GGUF_POOLING_RANK
    names = metadata.get("architectures") or [""]
    if not str(names[0]).endswith("ForCausalLM"):
        return False
    hints = (Path(path).name, str(metadata.get("_name_or_path", "")))
    if any("qwen3-reranker" in h.lower() for h in hints):
        return True
    try:
        return "# qwen3-reranker" in (Path(path) / "README.md").read_text(encoding="utf-8").lower()
    except OSError:
        return False


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: cannot read it as JSON ({e})") from None


def spec_from_folder(folder: Path, context_length: int, width: int) -> EmbeddingSpec:
    """The pipeline of a sentence-transformers folder whose transformer gives ``width`` features. Raises
    WeightsError (a bad file, named) or UnsupportedError (a module or pooling mode we do not run, or a Dense module
    before pooling)."""
    spec = EmbeddingSpec(pooling="mean", normalize=False, max_tokens=context_length)
    modules = _json(folder / "modules.json") if (folder / "modules.json").is_file() else []
    if not isinstance(modules, list):
        raise WeightsError(f"{folder / 'modules.json'}: a list of modules is expected")
    pooled = False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else ""
        if kind not in _ST_MODULES:
            raise UnsupportedError(f"{folder / 'modules.json'} lists a {kind or m!r} module; we run "
                                   f"{', '.join(_ST_MODULES)} only")
        if kind == "Transformer" and m.get("path", "") not in ("", "."):
            raise UnsupportedError(f"{folder}: the transformer is in {m['path']}/; give that folder's parent a "
                                   "config.json and weights at its top (sentence-transformers' current layout)")
        if kind == "Pooling":
            spec.pooling = _pooling_mode(_json(folder / m.get("path", "") / "config.json"), folder)
            pooled = True
        if kind == "Dense":
            if not pooled:
                raise UnsupportedError(f"{folder / 'modules.json'}: a Dense module before pooling; we run them after")
            sub = folder / m.get("path", "")
            spec.dense.append(_dense(sub, _json(sub / "config.json"), spec.dense[-1].weight.shape[0]
                                     if spec.dense else width))
        if kind == "Normalize":
            spec.normalize = True
    if (folder / "sentence_bert_config.json").is_file():
        limit = _json(folder / "sentence_bert_config.json").get("max_seq_length")
        if isinstance(limit, int) and limit > 0:
            spec.max_tokens = min(limit, context_length)
    if (folder / "config_sentence_transformers.json").is_file():
        st = _json(folder / "config_sentence_transformers.json")
        prompts = st.get("prompts") or {}
        spec.prompts = {str(k): str(v) for k, v in prompts.items() if isinstance(v, str)}
        spec.default_prompt = st.get("default_prompt_name") or None
    return spec


def _pooling_mode(config: Any, folder: Path) -> str:
    if not isinstance(config, dict):
        raise WeightsError(f"{folder}: the pooling module's config.json is not an object")
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    if config.get("pooling_mode_cls_token"):
        return "cls"
    if config.get("pooling_mode_lasttoken"):
        return "last"
    mode = {"lasttoken": "last"}.get(config.get("pooling_mode"), config.get("pooling_mode"))
    if mode in ("mean", "cls", "last"):
        return mode
    raise UnsupportedError(f"{folder}: the pooling module asks for {config!r}; we pool by mean, CLS or last token")


def spec_from_gguf(metadata: Any, context_length: int, weights: Any = None, width: int = 0) -> EmbeddingSpec:
    """The pipeline of a GGUF file (llama.cpp normalizes embeddings by default: ``embd_normalize`` 2), with the
    ``Dense`` modules that llama.cpp's converter writes (``--sentence-transformers-dense-modules``: ``dense_2.weight``
    ``[out, in]`` then ``dense_3.weight``, no bias; llama.cpp applies them after pooling, without activation) taken
    from ``weights`` (name to Tensor), the first taking ``width`` features. Raises UnsupportedError for a pooling
    type that gives no one vector per text or an attention direction the architecture does not have; WeightsError
    for Dense weights that do not chain."""
    arch = str(metadata["general.architecture"])
    kind = int(metadata.get(f"{arch}.pooling_type", 0))
    if kind not in GGUF_POOLING:
        raise UnsupportedError(f"the GGUF's {arch}.pooling_type is {kind}; we pool by mean (1), CLS (2) or last "
                               "token (3)")
    both_ways = arch in ENCODER_ARCHITECTURES or arch == EMBEDDING_GGUF
    if bool(metadata.get(f"{arch}.attention.causal", not both_ways)) == both_ways:
        raise UnsupportedError(f"the GGUF's {arch}.attention.causal is {both_ways}; "
                               f"{f'{arch} attends both ways' if both_ways else 'we run decoders causally'}")
    spec = EmbeddingSpec(pooling=GGUF_POOLING[kind], normalize=True, max_tokens=context_length)
    for name in ("dense_2.weight", "dense_3.weight"):
        t = (weights or {}).get(name)
        if t is None:
            continue
        w = t.dequantize().astype(DType.FLOAT32).numpy()
        need = spec.dense[-1].weight.shape[0] if spec.dense else width
        if w.ndim != 2 or w.shape[1] != need:
            raise WeightsError(f"the GGUF's {name} must be [out, {need}], not {list(w.shape)}")
        spec.dense.append(Dense(w, None, "identity"))
    return spec


def _gguf_specials(metadata: Any, tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The token ids llama.cpp puts before and after a text of a byte-level or SentencePiece GGUF vocabulary
    (``tokenizer.ggml.add_bos_token``, ``add_eos_token``: ``llama_vocab::impl::tokenize``); None for a WordPiece one,
    whose tokenizer adds [CLS] and [SEP] itself."""
    if metadata.get("tokenizer.ggml.model") == "bert":
        return None
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    first = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    last = [int(eos)] if bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None else []
    return first, last


def _yes_no(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of the tokens ``yes`` and ``no`` (Qwen3-Reranker's card: ``convert_tokens_to_ids``). Raises
    WeightsError for a vocabulary without them."""
    ids = tuple(tokenizer.backend.token_to_id(t) for t in ("yes", "no"))
    if None in ids:
        raise WeightsError("a yes / no reranker's vocabulary must hold the tokens 'yes' and 'no'")
    return ids[0], ids[1]


class Embedder:
    """An encoder, its tokenizer and its pipeline: texts or token ids to float32 vectors.

    Attributes: encoder (:class:`BertEncoder` or :class:`DecoderEncoder`), tokenizer, spec
    (:class:`EmbeddingSpec`), dim (the vector width), ranks (a cross-encoder), gguf (read from a GGUF file).
    """

    def __init__(self, backend: Backend, path: Path):
        gguf = path.is_file()
        self.backend = backend
        arch = backend.metadata.get("general.architecture", backend.metadata.get("model_type"))
        self.tokenizer = Tokenizer.from_gguf(backend.metadata) if gguf else Tokenizer.from_folder(path)
        if str(arch) in ENCODER_ARCHITECTURES:
            kind = ModernBertEncoder if str(arch) in MODERNBERT_ARCHITECTURES else BertEncoder
            self.encoder: "BertEncoder | DecoderEncoder" = kind.from_backend(backend, "gguf" if gguf else "hf")
        else:
            self.encoder = DecoderEncoder.from_backend(
                backend, _yes_no(self.tokenizer) if is_decoder_reranker(backend.metadata, path) else None)
        ctx_len = self.encoder.config.context_length
        # a tokenizer.json may pad every text to a fixed length and cut it (all-MiniLM-L6-v2's pads to 128 with
        # [PAD]): the padded batches and :meth:`fit` do that here, with a mask
        self.tokenizer.backend.no_padding()
        self.tokenizer.backend.no_truncation()
        #: a cross-encoder (a classification head): it reranks (models/embedding/rerank.py) and gives no embeddings
        self.ranks = self.encoder.has_rank_head
        if self.ranks:
            self.spec = EmbeddingSpec(pooling="cls", normalize=False, max_tokens=ctx_len)
        else:
            width = self.encoder.config.hidden_size
            self.spec = (spec_from_gguf(backend.metadata, ctx_len, backend.weights, width) if gguf
                         else spec_from_folder(path, ctx_len, width))
        self.gguf = gguf
        self.dim = self.spec.dense[-1].weight.shape[0] if self.spec.dense else self.encoder.config.hidden_size
        self._around = _gguf_specials(backend.metadata, self.tokenizer) if gguf else None
        mask = self.tokenizer.backend.encode("a", add_special_tokens=True).special_tokens_mask
        # the special tokens after a text ([SEP], <|endoftext|>), kept when it is cut
        self._tail = (len(self._around[1]) if self._around is not None
                      else next((i for i, m in enumerate(reversed(mask)) if not m), 0))

    def tokenize(self, texts: Sequence[str], *, prompt_name: str | None = None, truncate: bool = True,
                 fit: bool = True) -> list[list[int]]:
        """Token ids of each text (the model's prompt prepended, the tokenizer's special tokens around it).

        An input longer than ``spec.max_tokens`` is cut to it, its trailing special tokens kept (as the tokenizer's
        own truncation does); with ``truncate=False`` it is refused; with ``fit=False`` it is returned whole (the
        server flags the inputs it then cuts with :meth:`fit`).

        Raises:
            InvalidRequestError: a text that is not a string or is empty; an unknown ``prompt_name``; an input too
                long with ``truncate=False`` (the message gives both lengths).
        """
        name = prompt_name if prompt_name is not None else self.spec.default_prompt
        if name is not None and name not in self.spec.prompts:
            raise InvalidRequestError(f"prompt_name {name!r} is not one of this model's prompts "
                                      f"({', '.join(self.spec.prompts) or 'it has none'})")
        prefix = self.spec.prompts.get(name, "") if name is not None else ""
        out = []
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"input {i} must be a non-empty string, not {text!r:.60}")
            if self._around is None:
                ids = self.tokenizer.backend.encode(prefix + text, add_special_tokens=True).ids
            else:
                first, last = self._around
                ids = first + self.tokenizer.backend.encode(prefix + text, add_special_tokens=False).ids + last
            out.append(self.fit(ids, truncate, i) if fit else ids)
        return out

    def fit(self, ids: list[int], truncate: bool, index: int = 0) -> list[int]:
        """``ids`` within ``spec.max_tokens`` (cut before the trailing special tokens), or InvalidRequestError when
        they exceed it and ``truncate`` is False."""
        limit = self.spec.max_tokens
        if len(ids) <= limit:
            return list(ids)
        if not truncate:
            raise InvalidRequestError(f"input {index} has {len(ids)} tokens, more than the model's {limit}; shorten "
                                      "it or let it be truncated (truncate: true)")
        tail = ids[len(ids) - self._tail:] if self._tail else []
        return list(ids[:limit - len(tail)]) + tail

    def embed_ids(self, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None,
                  normalize: bool = True) -> np.ndarray:
        """Float32 vectors ``[len(inputs), dimensions or dim]`` of token-id inputs, in one or more forward passes
        (inputs sorted by length, at most the encoder's ``batch_tokens`` token rows each).

        ``dimensions``: keep the first ``dimensions`` components (Matryoshka), then normalize. ``normalize``: divide
        each vector by its L2 norm (sentence-transformers' ``Normalize``; llama.cpp's default); False: as pooled.

        Raises:
            InvalidRequestError: an empty input or token ids outside the vocabulary; ``dimensions`` not in
                ``1..dim``.
        """
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or not 0 < dimensions <= self.dim):
            raise InvalidRequestError(f"dimensions must be an integer from 1 to {self.dim}, not {dimensions!r}")
        vocab = self.encoder.config.vocab_size
        for i, ids in enumerate(inputs):
            if not len(ids) or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab
                                   for t in ids):
                raise InvalidRequestError(f"input {i} must be a non-empty list of token ids from 0 to {vocab - 1}")
        out = np.zeros((len(inputs), self.dim), np.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        start, budget = 0, self.encoder.batch_tokens
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(inputs[order[end]]) <= budget:
                end += 1
            rows = order[start:end]
            pooled = self._forward([inputs[i] for i in rows])
            for dense in self.spec.dense:  # sentence-transformers' Dense modules, after pooling
                pooled = dense(pooled)
            out[rows] = pooled
            start = end
        if dimensions is not None:
            out = out[:, :dimensions].copy()
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)  # torch's F.normalize eps
        return out

    def _forward(self, inputs: list[Sequence[int]]) -> np.ndarray:
        with self.backend.new_context() as ctx:
            return self.encoder.pooled(ctx, inputs, self.spec.pooling)
