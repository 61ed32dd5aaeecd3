"""A tiny llama or gemma3 GGUF (random weights, a byte-level tokenizer of 260 tokens), written with ``gguf``'s
writer, and the mutations of its scalar metadata and tensor shapes that the model fuzz applies.

Used by ``test_hostile_models.py``; runnable as the fuzz's child: ``python tests/hostile_gguf.py SEED COUNT FOLDER``
prints one JSON line per mutation (what was changed, the outcome, seconds) and a last line with the peak RSS.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import sys
import time
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 2, 4, 2, 8, 64


def _byte_alphabet() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def base_model(arch: str) -> tuple[dict, dict]:
    """``(metadata, tensors)`` of a valid tiny model: metadata maps key -> (value, GGUFValueType name or None for a
    string/bool/int/float the writer infers), tensors maps GGUF name -> float32 array in NumPy order."""
    rng = np.random.default_rng(0)
    tokens = _byte_alphabet() + ["Ġt", "he", "<s>", "</s>"]
    vocab = len(tokens)
    meta = {
        f"{arch}.context_length": (256, "UINT32"), f"{arch}.embedding_length": (HIDDEN, "UINT32"),
        f"{arch}.block_count": (LAYERS, "UINT32"), f"{arch}.feed_forward_length": (FFN, "UINT32"),
        f"{arch}.attention.head_count": (HEADS, "UINT32"), f"{arch}.attention.head_count_kv": (KV_HEADS, "UINT32"),
        f"{arch}.attention.key_length": (HEAD_DIM, "UINT32"), f"{arch}.attention.value_length": (HEAD_DIM, "UINT32"),
        f"{arch}.rope.freq_base": (10000.0, "FLOAT32"), f"{arch}.attention.layer_norm_rms_epsilon": (1e-5, "FLOAT32"),
        "tokenizer.ggml.model": ("gpt2", "STRING"), "tokenizer.ggml.pre": ("default", "STRING"),
        "tokenizer.ggml.tokens": (tokens, "ARRAY:STRING"),
        "tokenizer.ggml.token_type": ([1] * 258 + [3, 3], "ARRAY:INT32"),
        "tokenizer.ggml.merges": (["Ġ t", "h e"], "ARRAY:STRING"),
        "tokenizer.ggml.bos_token_id": (258, "UINT32"), "tokenizer.ggml.eos_token_id": (259, "UINT32"),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m.content }}\n{% endfor %}", "STRING"),
    }
    if arch == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = (4, "UINT32")
        meta[f"{arch}.rope.scaling.factor"] = (1.0, "FLOAT32")

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors = {"token_embd.weight": w(vocab, HIDDEN), "output_norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        tensors.update({p + "attn_norm.weight": 1 + w(HIDDEN), p + "ffn_norm.weight": 1 + w(HIDDEN),
                        p + "attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN),
                        p + "attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                        p + "attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                        p + "attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
                        p + "ffn_gate.weight": w(FFN, HIDDEN), p + "ffn_up.weight": w(FFN, HIDDEN),
                        p + "ffn_down.weight": w(HIDDEN, FFN)})
        if arch == "gemma3":
            tensors.update({p + "attn_q_norm.weight": 1 + w(HEAD_DIM), p + "attn_k_norm.weight": 1 + w(HEAD_DIM),
                            p + "post_attention_norm.weight": 1 + w(HIDDEN), p + "post_ffw_norm.weight": 1 + w(HIDDEN)})
    return meta, tensors


def write(path: Path, arch: str, meta: dict, tensors: dict) -> Path:
    import gguf
    from gguf import GGUFValueType as V

    wr = gguf.GGUFWriter(str(path), arch)
    for key, (value, kind) in meta.items():
        if kind is None:
            wr.add_key_value(key, value, _infer(value))
        elif kind.startswith("ARRAY:"):
            wr.add_key_value(key, value, V.ARRAY, sub_type=V[kind[6:]])
        else:
            wr.add_key_value(key, value, V[kind])
    for name, t in tensors.items():
        wr.add_tensor(name, t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def _infer(value):
    from gguf import GGUFValueType as V

    if isinstance(value, bool):
        return V.BOOL
    if isinstance(value, int):
        return V.INT64 if value < 0 else V.UINT64
    if isinstance(value, float):
        return V.FLOAT64
    return V.STRING


SCALARS = [0, -1, 1, 3, 7, 2**31 - 1, 2**32 - 1, 2**40, math.nan, math.inf, -math.inf, -1e-5, 0.0, 1e-30, 1e30, 0.5,
           2.5, "x", "", True, False]


def mutate(rng: np.random.Generator, arch: str) -> tuple[str, dict, dict]:
    """One mutation of the base model: ``(description, metadata, tensors)``."""
    meta, tensors = base_model(arch)
    r = rng.random()
    if r < 0.55:  # a scalar metadata value
        keys = [k for k, (v, kind) in meta.items() if not kind.startswith("ARRAY")]
        key = keys[rng.integers(len(keys))]
        value = SCALARS[rng.integers(len(SCALARS))]
        meta[key] = (value, None)
        return f"{key} = {value!r}", meta, tensors
    if r < 0.65:  # a key removed
        keys = sorted(meta)
        key = keys[rng.integers(len(keys))]
        del meta[key]
        return f"{key} removed", meta, tensors
    names = sorted(tensors)
    name = names[rng.integers(len(names))]
    t = tensors[name]
    kind = rng.integers(4)
    if kind == 0 and t.ndim == 2:
        tensors[name] = np.ascontiguousarray(t.T)
        what = "transposed"
    elif kind == 1:
        tensors[name] = t[..., : max(1, t.shape[-1] - int(rng.integers(1, 4)))].copy()
        what = "shorter rows"
    elif kind == 2:
        tensors[name] = np.concatenate([t, t[:1]], axis=0)
        what = "one row more"
    else:
        del tensors[name]
        what = "removed"
    return f"tensor {name} {what}", meta, tensors


def main(seed: int, count: int, folder: Path) -> None:
    import mlx_engine
    from mlx_engine.errors import EngineError

    rng = np.random.default_rng(seed)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(count):
        arch = ("llama", "gemma3")[i % 2]
        what, meta, tensors = mutate(rng, arch)
        path = write(folder / f"m{i}.gguf", arch, meta, tensors)
        t0 = time.perf_counter()
        try:
            model = mlx_engine.load(str(path), progress=False)
            answer = model.generate("hello there", max_tokens=3, raw=True)
            outcome = "answer" if isinstance(answer, str) else f"not a str: {type(answer).__name__}"
            del model
        except EngineError as e:
            outcome = f"EngineError: {type(e).__name__}: {str(e)[:160]}"
        except BaseException as e:  # the defect the fuzz looks for
            outcome = f"RAW {type(e).__name__}: {str(e)[:300]}"
        gc.collect()
        path.unlink()
        print(json.dumps({"i": i, "mutation": what, "outcome": outcome, "seconds": time.perf_counter() - t0}),
              flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"base_kb": base, "peak_kb": peak}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
