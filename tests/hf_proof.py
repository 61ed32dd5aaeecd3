"""The proof of an architecture, shared by its test modules: a small random model made by transformers from the
architecture's own config class (peaked weights, smollm2's real tokenizer), the GGUF files llama.cpp's converter and
quantizer write from it, and our logits, transformers' and llama.cpp's on them (see ``tests/hf_gguf.py``).

Bounds are stated against the logits' spread (max minus min): 1e-4 between us and transformers (float32),
1e-3 between us and llama.cpp (which keeps its KV cache in float16), perplexity within 1 % on Q4_K_M.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tests.hf_gguf import convert, quantize, save_tokenizer

#: A prompt of plain English, tokenized by smollm2's tokenizer into more tokens than any window or chunk we test.
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each of the one hundred and "
        "twelve steps, and lit the great lamp so that the fishing boats could find their way home through the fog.")


@dataclass
class Made:
    """The files of one random model: its folder and GGUF files by type (``f32``, ``q8_0``, ``Q4_K_M``)."""

    folder: Path
    gguf: dict[str, Path]
    tokens: list[int]


def make_model(model: Any, root: Path, smollm2_gguf: Path, kinds: tuple[str, ...] = ("f32", "q8_0", "Q4_K_M"),
               tokenizer_class: str | None = None) -> Made:
    """Saves the torch ``model`` (peaked already) with smollm2's tokenizer into ``root/hf`` and converts it;
    ``tokenizer_class`` overrides the one named in ``tokenizer_config.json`` (the converter of some architectures
    chooses its vocabulary reader by it)."""
    import json

    from mlx_engine.models.tokenizer import Tokenizer

    folder = root / "hf"
    model.save_pretrained(folder)
    save_tokenizer(smollm2_gguf, folder)
    if tokenizer_class is not None:
        path = folder / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        path.write_text(json.dumps({**cfg, "tokenizer_class": tokenizer_class}))
    out: dict[str, Path] = {}
    for kind in kinds:
        if kind in ("f32", "q8_0"):
            out[kind] = convert(folder, root / f"model-{kind}.gguf", kind)
        else:
            out[kind] = quantize(out["f32"], root / f"model-{kind}.gguf", kind)
    tokens = Tokenizer.from_folder(folder).encode(TEXT)
    return Made(folder, out, tokens)


def torch_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits ``[len(tokens), vocab]``."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def torch_greedy(model: Any, tokens: list[int], n: int = 32) -> list[int]:
    """``n`` greedy tokens after ``tokens`` by transformers (its own cache)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def ours(path: Path, tokens: list[int], n: int = 32, context: int = 512, chunk: int = 16,
         activations: str | None = None) -> tuple[np.ndarray, list[int]]:
    """Our float32 logits ``[len(tokens), vocab]`` on the file or folder ``path`` (prefill in chunks of ``chunk``, so
    that the cache's window and chunk masks work across forward passes), and ``n`` greedy tokens after them (one
    decode step each: the compiled step). ``context``: the context the model is told it runs with
    (``DecoderModel.use_context``); the cache holds the tokens whatever it is. ``activations``: ``MLXBackend``'s
    (``int8``: quantized weights' products take 8-bit activations, as llama.cpp's do)."""
    from mlx_engine.batch import Batch
    from mlx_engine.mlx import MLXBackend
    from mlx_engine.models.registry import load_text_model

    backend = MLXBackend(path, dtype="float32", **({} if activations is None else {"activations": activations}))
    try:
        model = load_text_model(backend)
        model.use_context(context)
        cache = model.make_cache()
        cache.init(backend, model.dtype, 1, max(context, len(tokens) + n), chunk)
        ctx = backend.new_context()
        rows = []
        for b in range(0, len(tokens), chunk):
            rows.append(model.forward(ctx, Batch.single(np.array(tokens[b:b + chunk]), b, logits="all"),
                                      cache).numpy())
        logits = np.concatenate(rows)
        out, tok, pos = [], int(logits[-1].argmax()), len(tokens)
        for _ in range(n):
            out.append(tok)
            tok = int(model.forward(ctx, Batch.single(np.array([tok]), pos), cache).argmax(-1).item())
            pos += 1
        return logits, out
    finally:
        backend.close()


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """Max absolute difference of two logit arrays, over the spread of ``b`` (the reference)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / (np.max(b) - np.min(b)))


def perplexity(logits: np.ndarray, tokens: list[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``tokens[1:]`` under ``logits [len(tokens), vocab]``."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-np.mean(logp[np.arange(len(tokens) - 1), tokens[1:]])))


def dequantized_into(model: Any, gguf_path: Path, arch: str,
                     fix: Callable[[str, np.ndarray], dict[str, np.ndarray]] | None = None) -> Any:
    """``model`` (a transformers model of the same config) with its weights replaced by the GGUF file's tensors,
    dequantized with the ``gguf`` package (``gguf.quants.dequantize``) and renamed back through the converter's own
    name map (``gguf.get_tensor_name_map``). ``fix(hf_name, array)`` undoes what the converter did beyond renaming
    (a Q/K row permutation, a fused projection): it returns the Hugging Face tensors the GGUF tensor stands for."""
    import gguf
    import torch

    state = model.state_dict()
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    tmap = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    back: dict[str, str] = {}
    for name in state:
        got = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if got is not None:
            back.setdefault(got, name)
    reader = gguf.GGUFReader(gguf_path)
    new: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name.startswith("rope_factors") or t.name == "rope_freqs.weight":
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        name = back.get(t.name)
        if fix is not None:
            new.update(fix(t.name if name is None else name, arr))
        elif name is not None:
            new[name] = arr
        else:
            raise KeyError(f"GGUF tensor {t.name} has no Hugging Face name")
    if "lm_head.weight" in state and "lm_head.weight" not in new:  # tied head
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    missing = set(state) - set(new)
    assert not missing, f"the GGUF file does not give {sorted(missing)[:5]}"
    model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in new.items()})
    return model


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's converter's ``LlamaModel.permute`` of Q/K rows (``[heads * Dh, ...]``)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
