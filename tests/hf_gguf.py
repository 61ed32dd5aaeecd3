"""Small random models as their users hold them, for the architecture proofs: a Hugging Face folder written by
transformers' own classes (``save_pretrained``, with a real tokenizer), the GGUF files that llama.cpp's own
``convert_hf_to_gguf.py`` writes from it, quantized by llama.cpp's quantizer (``llama_model_quantize``, the function
behind ``llama-quantize``), and llama.cpp's logits on those files. Converter and quantizer are those of the pinned
``llama-cpp-python`` source distribution (its vendored llama.cpp); nothing comes from a model hub.

The converter's source is cached outside the tree, in ``$MLX_ENGINE_TEST_CACHE`` (default
``~/.cache/mlx-engine-tests``), fetched once by ``pip download``; so are the files that the converter and the
quantizer write, by the bytes of their input and the versions of the packages that make them (a random model saved
twice with the same seed is converted once). Run as a script to fetch the source ahead of the tests::

    python -m tests.hf_gguf
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

#: The pinned source distribution: the same llama.cpp that the ``llama-cpp-python`` test dependency builds.
LLAMA_CPP_PYTHON = "0.3.36"

#: llama.cpp's file types by ``llama-quantize``'s names (``enum llama_ftype`` in llama.h).
FTYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_S": 14,
          "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "IQ4_XS": 30, "MXFP4_MOE": 38}


def cache_root() -> Path:
    root = Path(os.environ.get("MLX_ENGINE_TEST_CACHE") or Path.home() / ".cache" / "mlx-engine-tests")
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (a lock file), so that parallel test processes fetch and convert once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def llama_cpp_source() -> Path:
    """The vendored ``llama.cpp`` folder of the pinned source distribution (its converter, ``gguf-py`` and
    ``conversion`` package), fetched with pip on first use.

    Raises:
        RuntimeError: pip could not fetch the source distribution (the message ends with pip's output).
    """
    root = cache_root() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    source = root / "vendor" / "llama.cpp"
    done = root / ".complete"
    with _locked(cache_root() / ".llama-cpp-source.lock"):
        if done.exists():
            return source
        with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                  "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
                                 capture_output=True, text=True)
            archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if got.returncode != 0 or not archives:
                raise RuntimeError(f"could not fetch llama-cpp-python=={LLAMA_CPP_PYTHON}'s source: "
                                   f"{got.stdout[-2000:]}{got.stderr[-2000:]}")
            # Only the converter's Python side: the C++ sources are built by the llama-cpp-python install.
            with tarfile.open(archives[0]) as tar:
                top = tar.getnames()[0].split("/")[0]
                wanted = [m for m in tar.getmembers()
                          if m.name.startswith(f"{top}/vendor/llama.cpp/")
                          and (m.name.endswith(".py") or "/gguf-py/" in m.name or "/models/templates/" in m.name)]
                tar.extractall(tmp, members=wanted, filter="data")
            if root.exists():
                import shutil
                shutil.rmtree(root)
            os.replace(Path(tmp) / top, root)
        done.touch()
    return source


#: Made files unused for this long are removed from the cache (each use renews a file's time).
_KEEP_DAYS = 14


def _made_once(out: Path, key: tuple, inputs: Path, make) -> Path:
    """``out``, written by ``make(out)`` or copied from the cache of made files: keyed by ``key`` (what else decides
    the result: the tool, its options, the versions of the packages it runs) and the bytes of ``inputs`` (a file, or
    a folder's files with their names). A failed ``make`` caches nothing."""
    from importlib import metadata

    h = hashlib.sha256(repr(key).encode())
    for name in ("llama_cpp_python", "transformers", "tokenizers", "sentencepiece", "torch", "numpy", "safetensors"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            h.update(f"{name}={metadata.version(name)};".encode())
    files = [inputs] if inputs.is_file() else sorted(f for f in inputs.rglob("*") if f.is_file())
    for f in files:
        h.update(f"{f.relative_to(inputs) if f != inputs else ''}:{f.stat().st_size}:".encode())
        h.update(f.read_bytes())
    folder = cache_root() / "made"
    cached = folder / f"{h.hexdigest()}{out.suffix}"
    if cached.exists():
        shutil.copyfile(cached, out)
        os.utime(cached)
        return out
    make(out)
    folder.mkdir(exist_ok=True)
    part = folder / f".{cached.name}.{os.getpid()}.part"
    shutil.copyfile(out, part)
    os.replace(part, cached)  # whole or absent, whoever else writes the same file at the same time
    old = cached.stat().st_mtime - _KEEP_DAYS * 86400
    for f in folder.iterdir():
        with contextlib.suppress(OSError):
            if f.stat().st_mtime < old:
                f.unlink()
    return out


# The converter reads the tokenizer with AutoTokenizer, which in transformers 5 picks the class that the model type
# names (Qwen2Tokenizer for qwen2, ...) and that class rebuilds its own pre-tokenizer over the vocabulary. The real
# tokenizer written by save_tokenizer is another model's (smollm2's): read tokenizer.json as written, so that the
# converter recognises it by its pre-tokenizer hash, as it would the model's own.
#
# MLX_ENGINE_CONVERT_PRE names the pre-tokenizer outright: the converter knows real vocabularies by a hash of how they
# tokenize a check text, which a small trained WordPiece vocabulary cannot match; it is named as its family's
# ("bert-bge" for BERT), which is what the converter writes for a real bge or MiniLM model.
_CONVERT = """
import os, runpy, sys
from transformers import AutoTokenizer, TokenizersBackend
AutoTokenizer.from_pretrained = lambda path, *a, **k: TokenizersBackend.from_pretrained(path, *a, **k)
if os.environ.get("MLX_ENGINE_CONVERT_PRE"):
    sys.path.insert(0, os.path.dirname(sys.argv[1]))
    from conversion.base import TextModel
    TextModel.get_vocab_base_pre = lambda self, tokenizer: os.environ["MLX_ENGINE_CONVERT_PRE"]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(folder: "str | Path", out: "str | Path", outtype: str = "f32", pre: str | None = None,
            options: tuple[str, ...] = ()) -> Path:
    """``out``: the GGUF file that llama.cpp's ``convert_hf_to_gguf.py`` writes from the Hugging Face ``folder``
    (``outtype``: ``f32``, ``f16``, ``bf16`` or ``q8_0``), with the converter's own ``gguf`` package. ``pre``: the
    ``tokenizer.ggml.pre`` to write for a vocabulary the converter's hash list does not know (see ``_CONVERT``).
    ``options``: more of the converter's flags (``--sentence-transformers-dense-modules``).

    Raises:
        RuntimeError: the converter failed (the message ends with its output).
    """
    source = llama_cpp_source()

    def run(out: Path) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source / "gguf-py"), str(source)]),
                   NO_LOCAL_GGUF="", MLX_ENGINE_CONVERT_PRE=pre or "")
        got = subprocess.run([sys.executable, "-c", _CONVERT, str(source / "convert_hf_to_gguf.py"), str(folder),
                              "--outfile", str(out), "--outtype", outtype, *options], capture_output=True,
                             text=True, env=env)
        if got.returncode != 0 or not out.exists():
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder}: {got.stdout[-3000:]}{got.stderr[-3000:]}")

    # the converter names the model after its folder
    return _made_once(Path(out), ("convert", LLAMA_CPP_PYTHON, Path(folder).name, outtype, pre, tuple(options)),
                      Path(folder), run)


# llama.cpp must be the first native library in its process (see mlx_engine.bench.llama_cpp_peer).
_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(0 if rc == 0 else 1)
"""


def quantize(src: "str | Path", out: "str | Path", kind: str) -> Path:
    """``out``: ``src`` (an F32 / F16 GGUF) quantized to ``kind`` (a key of :data:`FTYPES`, e.g. ``Q4_K_M``) by
    llama.cpp's ``llama_model_quantize``, as ``llama-quantize src out kind`` would.

    Raises:
        KeyError: an unknown ``kind``.
        RuntimeError: the quantizer failed (the message ends with its output).
    """
    ftype = FTYPES[kind]

    def run(out: Path) -> None:
        got = subprocess.run([sys.executable, "-c", _QUANTIZE, str(src), str(out), str(ftype)],
                             capture_output=True, text=True)
        if got.returncode != 0 or not out.exists():
            raise RuntimeError(f"llama_model_quantize failed ({kind}) on {src}: "
                               f"{got.stdout[-3000:]}{got.stderr[-3000:]}")

    return _made_once(Path(out), ("quantize", ftype), Path(src), run)


# llama.cpp's plain CPU products (ggml-quants' dot products), as every machine computes them: its extra buffer types
# (weights repacked for its AVX2 / AVX-512 GEMMs, or for AMX where the build has it) are chosen by the CPU, compute
# in layouts of their own, and the AMX one crashes (SIGSEGV in decode) on this project's AMX machines.
_PLAIN_CPU = """
import llama_cpp
_default_params = llama_cpp.llama_cpp.llama_model_default_params
def _plain_params():
    params = _default_params()
    params.use_extra_bufts = False
    return params
llama_cpp.llama_cpp.llama_model_default_params = _plain_params
"""


_LOGITS = _PLAIN_CPU + """
import sys
import llama_cpp
import numpy as np
tokens = [int(t) for t in sys.argv[2].split(",")]
# its KV cache in float32 (GGML_TYPE_F32 = 0), not its default float16, so that parity bounds measure the model
llm = llama_cpp.Llama(sys.argv[1], n_ctx=max(len(tokens), 16), n_batch=max(len(tokens), 16), n_threads=2,
                      logits_all=True, verbose=False, type_k=0, type_v=0)
llm.eval(tokens)
np.save(sys.argv[3], np.asarray(llm.scores[:len(tokens)], np.float32))
"""


def llama_cpp_logits(path: "str | Path", tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits (float32 ``[len(tokens), vocab]``) for every position of ``tokens`` on the GGUF file
    ``path``, in a process of its own, with its KV cache in float32.

    Raises:
        RuntimeError: llama.cpp failed to load or run the file (the message ends with its output).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        got = subprocess.run([sys.executable, "-c", _LOGITS, str(path), ",".join(map(str, tokens)), str(out)],
                             capture_output=True, text=True)
        if got.returncode != 0 or not out.exists():
            raise RuntimeError(f"llama.cpp failed on {path}: {got.stdout[-3000:]}{got.stderr[-3000:]}")
        return np.load(out)


_EOG = """
import sys
import llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
vocab = llama_cpp.llama_model_get_vocab(model)
print(",".join(str(i) for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)))
"""


def llama_cpp_eog_ids(path: "str | Path") -> set[int]:
    """The token ids that end generation in llama.cpp (``llama_vocab_is_eog``) for the GGUF file ``path``, its
    vocabulary alone loaded, in a process of its own.

    Raises:
        RuntimeError: llama.cpp failed to load the file (the message ends with its output).
    """
    got = subprocess.run([sys.executable, "-c", _EOG, str(path)], capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {path}: {got.stdout[-3000:]}{got.stderr[-3000:]}")
    return {int(i) for i in got.stdout.split()[-1].split(",") if i}


_EMBED = _PLAIN_CPU + """
import json, sys
import llama_cpp
texts = json.loads(sys.argv[2])
llm = llama_cpp.Llama(sys.argv[1], embedding=True, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, verbose=False)
vectors = llm.embed(texts, normalize=True)
tokens = [llm.tokenize(t.encode(), add_bos=True) for t in texts]
print(json.dumps({"vectors": vectors, "tokens": tokens}))
"""


def llama_cpp_embeddings(path: "str | Path", texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    """llama.cpp's embeddings (float32 ``[len(texts)]`` rows, pooled as the GGUF says, L2-normalized
    (``normalize=True``)) of ``texts`` on the GGUF file ``path`` (``Llama(embedding=True).embed``), and its token ids of each text
    (special tokens added), in a process of its own.

    Raises:
        RuntimeError: llama.cpp failed to load or run the file (the message ends with its output).
    """
    import json

    got = subprocess.run([sys.executable, "-c", _EMBED, str(path), json.dumps(texts)], capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {path}: {got.stdout[-3000:]}{got.stderr[-3000:]}")
    out = json.loads(got.stdout.strip().splitlines()[-1])
    return np.asarray(out["vectors"], np.float32), out["tokens"]


_RANK = _PLAIN_CPU + """
import json, sys
import llama_cpp
query, documents = json.loads(sys.argv[2])
# its KV cache in float32 (GGML_TYPE_F32 = 0): a decoder reranker reads it (float16 moves p(yes) by ~1e-4)
llm = llama_cpp.Llama(sys.argv[1], embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, n_ctx=512,
                      n_batch=512, n_ubatch=512, n_threads=2, verbose=False, type_k=0, type_v=0)
vocab = llama_cpp.llama_model_get_vocab(llm.model)
eos = llama_cpp.llama_vocab_eos(vocab)
eos = llama_cpp.llama_vocab_sep(vocab) if eos == llama_cpp.LLAMA_TOKEN_NULL else eos
q = llm.tokenize(query.encode(), add_bos=False, special=False)
template = llama_cpp.llama_model_chat_template(llm.model, b"rerank")
scores, pairs = [], []
for doc in documents:  # the server's format_prompt_rerank
    if template:  # its rerank chat template, {query} then {document} replaced, special tokens parsed, none added
        prompt = template.decode().replace("{query}", query).replace("{document}", doc)
        tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    else:
        tokens = ([llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(vocab) else []) + q
        tokens += [eos] if llama_cpp.llama_vocab_get_add_eos(vocab) else []
        tokens += [llama_cpp.llama_vocab_sep(vocab)] if llama_cpp.llama_vocab_get_add_sep(vocab) else []
        tokens += llm.tokenize(doc.encode(), add_bos=False, special=False)
        tokens += [eos] if llama_cpp.llama_vocab_get_add_eos(vocab) else []
    llm._ctx.kv_cache_clear()
    llm._batch.reset()
    llm._batch.add_sequence(tokens, 0, False)
    llm._ctx.decode(llm._batch)
    scores.append(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)[0])
    pairs.append(tokens)
print(json.dumps({"scores": scores, "tokens": pairs}))
"""


def llama_cpp_rank(path: "str | Path", query: str, documents: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    """llama.cpp's rerank scores (float32 ``[len(documents)]``, the classifier's first output: raw, or ``p(yes)``
    for a Qwen3 reranker, whose two outputs llama.cpp puts through a softmax) of ``documents`` against ``query`` on
    the GGUF file ``path`` (``Llama(embedding=True, pooling_type=LLAMA_POOLING_TYPE_RANK)``), each pair's tokens as
    its server's ``format_prompt_rerank`` puts them (through the file's ``rerank`` chat template where it has one),
    and those tokens; in a process of its own.

    Raises:
        RuntimeError: llama.cpp failed to load or run the file (the message ends with its output).
    """
    import json

    got = subprocess.run([sys.executable, "-c", _RANK, str(path), json.dumps([query, documents])],
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {path}: {got.stdout[-3000:]}{got.stderr[-3000:]}")
    out = json.loads(got.stdout.strip().splitlines()[-1])
    return np.asarray(out["scores"], np.float32), out["tokens"]


def save_tokenizer(gguf_path: "str | Path", folder: "str | Path") -> None:
    """Writes into ``folder`` the real tokenizer held by the GGUF file ``gguf_path`` (e.g. the catalog's smollm2:
    ``tokenizer.json``, ``tokenizer_config.json``), as our GGUF vocabulary reader rebuilds it. For smollm2 it
    tokenizes llama.cpp's pre-tokenizer check text exactly as SmolLM's own ``tokenizer.json`` does (the converter
    recognises it as ``smollm``); transformers' own GGUF tokenizer conversion does not."""
    from mlx_engine.models.text.tokenizer import Tokenizer
    from mlx_engine.weights import open_weights

    with open_weights(gguf_path) as wf:
        metadata = dict(wf.metadata)
    Tokenizer.from_gguf(metadata, str(metadata.get("general.architecture", "llama"))).save_hf(folder)


def peaked(model, scale: float = 4.0, seed: int = 0) -> None:
    """Re-draws every weight of the torch ``model`` so that its logits are peaked: matrices N(0, (scale / sqrt(fan
    in))^2)-ish, norms near 1 and biases small, where transformers' default init gives nearly uniform logits that hide
    mistakes. Deterministic for a given ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (scale / fan_in ** 0.5))
            elif "norm" in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def spread(logits: np.ndarray) -> float:
    """The logits' spread: max minus min over the whole array, the scale that parity bounds are stated against."""
    return float(np.max(logits) - np.min(logits))


if __name__ == "__main__":
    print(llama_cpp_source())
