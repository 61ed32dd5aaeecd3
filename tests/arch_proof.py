"""The proof of an architecture (issue 60): a small random transformers model of the architecture's own config class,
with peaked logits and smollm2's real tokenizer, saved as a folder, converted by llama.cpp's converter (F32, Q8_0)
and quantizer (F16, Q8_0, Q4_K_M, Q6_K); our logits on each file against transformers' (on the GGUF's dequantized weights
for the others than F32) and against llama.cpp's. The architecture test modules call :func:`make` once per module and the
``check_*`` functions, which return the measured distance (a fraction of the reference logits' spread)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mlx_engine.batch import Batch
from mlx_engine.ml import DType
from mlx_engine.mlx import MLXBackend
from mlx_engine.models.registry import load_text_model
from mlx_engine.models.generation.runner import GenerationStats, Request, Runner
from mlx_engine.models.generation.sampler import SamplerOptions
from tests.conftest import NoText
from tests.hf_gguf import convert, llama_cpp_logits, peaked, quantize, save_tokenizer, spread

#: English text, tokenized by smollm2's tokenizer into the prompts (longer than every window and chunk in the tests).
TEXT = ("The quick brown fox jumps over the lazy dog near the river bank, while a small bird sings in the old oak "
        "tree and the farmer walks slowly home across the wide green field after a long day of honest work.")


@dataclass
class Made:
    """The files of one architecture's proof: the transformers ``model`` (float32, eval), its ``folder``, the GGUF
    files by llama.cpp's type name (``F32`` and those :func:`make` was asked for: ``Q8_0``, ``Q4_K_M``...) and the
    prompt ``tokens``."""

    model: object
    folder: Path
    gguf: dict[str, Path]
    tokens: list[int]


def smollm2_tokenizer(smollm2_gguf: Path) -> Callable[[Path], list[int]]:
    """A tokenizer writer for :func:`make`: smollm2's real BPE tokenizer (vocabulary 49152); returns the prompt."""
    def write(folder: Path) -> list[int]:
        from mlx_engine.models.text.tokenizer import Tokenizer

        save_tokenizer(smollm2_gguf, folder)
        return Tokenizer.from_folder(folder).encode(TEXT, add_bos=False)
    return write


def sentencepiece_tokenizer(vocab_size: int) -> Callable[[Path], list[int]]:
    """A tokenizer writer for :func:`make`: a SentencePiece ``tokenizer.model`` (BPE, at most ``vocab_size`` pieces)
    trained by the ``sentencepiece`` package on :data:`TEXT`, for the converters that read only that file (Gemma's);
    returns the prompt."""
    def write(folder: Path) -> list[int]:
        import io

        import sentencepiece as spm

        model = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT.split(", ") * 4), model_writer=model,
                                       vocab_size=vocab_size, model_type="bpe", hard_vocab_limit=False,
                                       pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.model").write_bytes(model.getvalue())
        return spm.SentencePieceProcessor(model_proto=model.getvalue()).encode(TEXT)
    return write


def make(root: Path, config, write_tokenizer: Callable[[Path], list[int]], seed: int = 0,
         prepare: "Callable[[object], None] | None" = None, complete: Callable[[object, Path], None] | None = None,
         tokenizer_class: str | None = None, kinds: tuple[str, ...] = ("Q8_0", "Q4_K_M")) -> Made:
    """Build, save, convert and quantize a random model of the transformers ``config`` under ``root``, with the
    tokenizer that ``write_tokenizer(folder)`` writes (it returns the prompt's tokens). The F32 file is the
    converter's; the ``kinds`` (``llama-quantize`` types, keys of ``tests.hf_gguf.FTYPES``) are made from it by
    llama.cpp's quantizer (one converter run). Its F16 file holds the same tensors, byte for byte, as the converter's
    ``--outtype f16`` (measured on a Llama model; both round to nearest even).

    Args:
        prepare: ``prepare(model)`` sets what :func:`~tests.hf_gguf.peaked` does not draw (buffers such as a
            router's bias).
        complete: ``complete(model, folder)`` adds to the saved folder what the released checkpoints hold and
            transformers does not save (Qwen3.5's multi-token-prediction block, which llama.cpp's converter
            requires), before the conversion.
        tokenizer_class: overrides the class named in ``tokenizer_config.json`` (some converters choose their
            vocabulary reader by it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    peaked(model, seed=seed)
    if prepare is not None:
        prepare(model)
    folder = root / "hf"
    model.save_pretrained(folder)
    tokens = write_tokenizer(folder)
    if tokenizer_class is not None:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": tokenizer_class}))
    if complete is not None:
        complete(model, folder)
    files = {"F32": convert(folder, root / "f32.gguf", "f32")}
    for kind in kinds:
        files[kind] = quantize(files["F32"], root / f"{kind.lower()}.gguf", kind)
    return Made(model, folder, files, tokens)


def runner(path: Path, float_weights: bool = True, activations: str | None = None, context: int | None = None,
           room: int = 512) -> Runner:
    """Our runner on ``path`` in float32, its cache holding ``room`` tokens. ``float_weights``: quantized tensors
    dequantized at load, as the reference computes; else the CPU's quantized kernels, as a user runs them, with
    ``activations`` as :class:`MLXBackend` takes them (``"int8"`` for llama.cpp's numerics). ``context``: the
    context the model is told it runs with (``DecoderModel.use_context``: LongRoPE's factors follow it), whatever
    the cache holds."""
    backend = (MLXBackend(path, dtype="float32", quantized=False, requantize=0) if float_weights
               else MLXBackend(path, dtype="float32", activations=activations))
    r = Runner(load_text_model(backend), NoText(), context_length=room, max_sequences=1, prefill_chunk=room)
    if context is not None:
        r.model.use_context(context)
    return r


def ours(path: Path, tokens: list[int], float_weights: bool = True, activations: str | None = None,
         chunk: int | None = None, context: int | None = None) -> np.ndarray:
    """Our logits (float32 ``[N, vocab]``) at every position of ``tokens``: one forward pass, or passes of
    ``chunk`` tokens (the cache's window and chunk masks then work across passes). The rest: as :func:`runner`."""
    n = len(tokens)
    r = runner(path, float_weights, activations, context, room=max(512, n))
    chunk = chunk or n
    rows = []
    with r.backend.new_context() as ctx:
        r.reset(0)
        for b in range(0, n, chunk):
            idx = np.arange(b, min(n, b + chunk))
            batch = Batch(np.asarray(tokens[b:b + chunk], np.int32), idx, np.zeros(len(idx), np.int32),
                          np.arange(len(idx)))
            rows.append(r.model.forward(ctx, batch, r.cache).astype(DType.FLOAT32).numpy())
    return np.concatenate(rows)


def ours_greedy(path: Path, tokens: list[int], n: int, context: int | None = None) -> list[int]:
    """``n`` greedy tokens of ours after ``tokens`` (prefill, then one-token decode steps)."""
    req = Request(list(tokens), SamplerOptions(temperature=0.0), max_tokens=n, sequence=0)
    r = runner(path, context=context, room=max(512, len(tokens) + n))
    return list(r.generate_tokens(req, GenerationStats()))


def reference(model, tokens: list[int]) -> np.ndarray:
    """transformers' logits (float32 ``[N, vocab]``) at every position of ``tokens``."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def routers_seen(made: Made, routers: dict[int, object]) -> dict[int, tuple]:
    """``{layer: (input, output)}`` of each router module of ``routers`` (by layer) while transformers runs the
    made prompt: what the tests of mixtures of experts read to show that routing matters on it."""
    seen: dict[int, tuple] = {}
    hooks = [r.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out)))
             for i, r in routers.items()]
    try:
        reference(made.model, made.tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def reference_greedy(model, tokens: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of transformers after ``tokens`` (its own cache, no end-of-sequence stop)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def distance(logits: np.ndarray, ref: np.ndarray) -> float:
    """The max absolute difference of ``logits`` from ``ref``, as a fraction of ``ref``'s spread."""
    assert logits.shape == ref.shape, (logits.shape, ref.shape)
    return float(np.abs(logits - ref).max()) / spread(ref)


def dequantized_model(made: Made, path: Path, arch: str,
                      undo: Callable[[str, np.ndarray], np.ndarray] = lambda name, a: a,
                      read: "Callable[[str, Callable[[str], np.ndarray]], np.ndarray | None]" = lambda n, array: None):
    """A copy of ``made.model`` holding the weights of the GGUF file ``path`` as the ``gguf`` package dequantizes
    them, each found by the converter's own name map (``gguf.get_tensor_name_map``); ``undo(hf_name, array)``
    undoes what the converter changed in a tensor (Gemma's ``+ 1`` on norms, Llama's Q/K row permutation);
    ``read(hf_name, array)`` makes a tensor the map does not find from the file's tensors, ``array(gguf_name)``
    dequantized (None: not such a tensor), e.g. a fused tensor the converter split."""
    import gguf
    import torch

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    model = copy.deepcopy(made.model)
    names = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    state, arrays = {}, {}

    def array(gguf_name: str) -> np.ndarray:
        if gguf_name not in arrays:
            t = tensors[gguf_name]
            arrays[gguf_name] = gguf.quants.dequantize(t.data, t.tensor_type)
        return arrays[gguf_name]

    for name, p in model.state_dict().items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        made_up = read(name, array) if gguf_name not in tensors else None
        if made_up is not None:
            a = made_up.reshape(p.shape)
        elif gguf_name not in tensors:  # a tied output head: the embeddings, loaded under their own name
            assert name == "lm_head.weight", f"{name} ({gguf_name}) is not in {path.name}"
            continue
        else:
            a = array(gguf_name).reshape(p.shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(undo(name, a.astype(np.float32))))
    model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def nll(logits: np.ndarray, tokens: list[int]) -> float:
    """Mean negative log-likelihood (natural log) of ``tokens[1:]`` under ``logits [N, vocab]``."""
    x = logits[:-1].astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    logp = x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean())


def check_folder(made: Made, chunk: int | None = None, context: int | None = None) -> float:
    """Our logits on the folder against transformers' (prefill in passes of ``chunk`` tokens; ``context`` as for
    :func:`runner`); the same 32 greedy tokens. Returns the distance."""
    d = distance(ours(made.folder, made.tokens, chunk=chunk, context=context), reference(made.model, made.tokens))
    assert d <= 1e-4, d
    assert (ours_greedy(made.folder, made.tokens, 32, context=context)
            == reference_greedy(made.model, made.tokens, 32))
    return d


def check_gguf(made: Made, kind: str, arch: str, undo=lambda name, a: a, read=lambda name, array: None,
               chunk: int | None = None, context: int | None = None) -> float:
    """Our logits on a GGUF file against transformers' on its dequantized weights (``undo``, ``read``: see
    :func:`dequantized_model`; ``chunk``, ``context``: see :func:`ours`). Returns the distance."""
    path = made.gguf[kind]
    ref = reference(made.model if kind == "F32" else dequantized_model(made, path, arch, undo, read), made.tokens)
    d = distance(ours(path, made.tokens, chunk=chunk, context=context), ref)
    assert d <= 1e-4, (kind, d)
    return d


def check_llama_cpp(made: Made, quantized: str = "Q4_K_M", activations: str | None = None,
                    tokens: list[int] | None = None, context: int | None = None,
                    bound: float = 0.1) -> tuple[float, float, float]:
    """llama.cpp's logits on the F32 file against ours (within 1e-3 of the spread), and the perplexities of the
    prompt on the ``quantized`` file (ours with the quantized kernels as users run them, with ``activations`` as
    :func:`runner` takes them; llama.cpp's): ``(distance, ours, llama.cpp's)``. ``tokens``: a prompt of its own
    (default the made one); ``context``: as for :func:`runner`.

    The perplexities are held to ``bound`` (default 10 %): llama.cpp's CPU dot products quantize the activations (to
    Q8_0 / Q8_1 blocks of 32 with float16 scales for Q4_0..Q8_0 weights, to Q8_K blocks of 256 for K-quants), and a
    random model with peaked logits amplifies that rounding layer after layer (its logits even on Q8_0 land far
    outside 1e-3 of the spread from the exact dequantized reference, which ours match to 1e-4). ``activations="int8"``
    computes as llama.cpp's products do (Q8_0 / Q8_1 blocks for those types, Q8_K for K-quant rows); where a file
    holds only Q8_0 / Q8_1 types (the hidden-64 models of tests/test_arch_families.py) the issue's 1 % is met. The
    modules that compare with float32 activations keep a wider bound; it still catches a misread tensor or a wrong
    layer, which move the perplexity by orders of magnitude.
    """
    tokens = made.tokens if tokens is None else tokens
    d = distance(ours(made.gguf["F32"], tokens, context=context), llama_cpp_logits(made.gguf["F32"], tokens))
    assert d <= 1e-3, d
    q = made.gguf[quantized]
    mine = float(np.exp(nll(ours(q, tokens, float_weights=False, activations=activations, context=context), tokens)))
    theirs = float(np.exp(nll(llama_cpp_logits(q, tokens), tokens)))
    assert abs(mine - theirs) <= bound * theirs, (mine, theirs)
    return d, mine, theirs


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's converter's ``LlamaModel.permute`` of Q/K rows (``[heads * Dh, ...]``)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_undo(heads: int, kv_heads: int) -> Callable[[str, np.ndarray], np.ndarray]:
    """An ``undo`` for :func:`dequantized_model`: the Q/K row permutation that llama.cpp's converter applies to
    Llama-like architectures (Llama, SmolLM3, Granite, Mistral 3), undone."""
    def undo(name: str, a: np.ndarray) -> np.ndarray:
        if name.endswith("q_proj.weight"):
            return unpermute(a, heads)
        if name.endswith("k_proj.weight"):
            return unpermute(a, kv_heads)
        return a
    return undo


def check_ollama(made: Made, name: str, arch: str, models: Path, quantized: str = "Q4_K_M") -> None:
    """The ``quantized`` file laid out under ``models`` (``$OLLAMA_MODELS``, set by the caller) as ollama stores a
    pulled ``name`` (an ollama library name, e.g. ``qwen2.5:0.5b``): ``mlx_engine.load(name)`` reads its blob as the
    ``arch`` architecture, with the perplexity of the file loaded by its path."""
    import mlx_engine
    from tests.test_store import write_ollama_model

    base, tag = name.split(":")
    write_ollama_model(models, base, tag, made.gguf[quantized])
    by_name = mlx_engine.load(name, pull=False)
    by_path = mlx_engine.load(str(made.gguf[quantized]))
    try:
        assert by_name.path.parent == models / "blobs" and by_name.architecture == arch
        assert by_name.perplexity(TEXT) == by_path.perplexity(TEXT)
    finally:
        by_name.close()
        by_path.close()


def check_refused(made: Made, folder: Path, change: dict, match: str) -> None:
    """The folder with ``change`` merged into its ``config.json`` (written to ``folder``) is refused at load with a
    ``WeightsError`` whose message matches ``match``."""
    import json
    import shutil

    import pytest

    from mlx_engine.errors import WeightsError

    shutil.copytree(made.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(WeightsError, match=match):
        load_text_model(MLXBackend(folder, dtype="float32"))
