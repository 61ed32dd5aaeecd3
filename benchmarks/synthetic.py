"""Random-weight GGUF files with the shapes of the models people run, for speed at real sizes.

    python -m benchmarks.synthetic 1b --types Q4_K_M Q8_0            # make (once, cached) and print the paths
    python -m benchmarks.synthetic 3b --types Q4_K_M --bench --compare llama.cpp   # then mlx-engine bench each
    python -m benchmarks.synthetic 1b --decode --activations int8   # decode only, ours and llama.cpp alternating

Each file goes the way a user's does: a Hugging Face folder (``config.json`` from transformers' own config class,
``model.safetensors`` in bfloat16 with the tensor names and shapes transformers' model has, the catalog smollm2
model's real tokenizer), llama.cpp's own ``convert_hf_to_gguf.py`` to F16, then llama.cpp's quantizer
(``llama_model_quantize``, as ``llama-quantize``) to each type; the tools are those of the pinned
``llama-cpp-python`` source distribution (``tests/hf_gguf.py``). The weights are drawn N(0, 0.02^2) (norms 1): the
values do not matter for speed, the bytes do. The vocabulary is the model's own size (token ids past smollm2's
49,152 are padding tokens the converter adds), so the embedding and the output head weigh what they do in the real
model.

Shapes (from the models' published ``config.json``): Llama 3.2 1B and 3B, Llama 3.1 8B, and the layers of
Qwen3-30B-A3B and gpt-oss-20b (with fewer layers than theirs: see ``SHAPES``; ``--layers N`` makes an even smaller
one, a quick check that a shape builds and loads). Files are cached in ``$MLX_ENGINE_TEST_CACHE/synthetic`` (default
``~/.cache/mlx-engine-tests/synthetic``); the F16 file and the folder are deleted once every type asked for exists.

``--decode`` measures decode alone, the figure the bench takes minutes to reach among its others: this engine and
llama.cpp (llama-cpp-python, a process of its own, as many threads as our kernels) on the same file, each
``--rounds`` times in turn (greedy ``--tokens`` tokens after a 32-token prompt, a fresh cache each), and prints each
round's tokens/s and ratio and the median ratio. On a shared machine read that median, not the rates.

Not a test: these machines are shared and noisy; run the bench on a quiet machine and read its ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


from tests import hf_gguf

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

#: name: (transformers config class, config keys)
SHAPES: dict[str, tuple[str, dict]] = {
    "1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True, max_position_embeddings=131072,
                                rms_norm_eps=1e-5)),
    "3b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True, max_position_embeddings=131072,
                                rms_norm_eps=1e-5)),
    "8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=False,
                                max_position_embeddings=131072, rms_norm_eps=1e-5)),
    # Qwen3-30B-A3B has 48 layers (about 61 GB in bfloat16): 12 keep the per-token work of a layer and fit a 24 GB,
    # 2-core machine's disk and memory while being made; decode tokens/s scale by about 12/48 against the real one.
    "moe-30b-a3b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                            moe_intermediate_size=768, num_hidden_layers=12, num_attention_heads=32,
                                            num_key_value_heads=4, head_dim=128, num_experts=128,
                                            num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0,
                                            tie_word_embeddings=False, max_position_embeddings=40960,
                                            rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[])),
    # gpt-oss-20b has 24 layers (about 42 GB in bfloat16, its experts about 80%): 8 keep a layer's per-token work
    # and its sliding / full alternation, and fit as above. Its published folder holds the experts in MXFP4, which
    # llama.cpp's converter only repacks; from a bfloat16 folder it writes float experts, so the released file's
    # layout (experts MXFP4, the rest Q8_0) is llama-quantize's MXFP4_MOE type: ask --types MXFP4_MOE.
    "gpt-oss-20b": ("GptOssConfig", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                         num_hidden_layers=8, num_attention_heads=64, num_key_value_heads=8,
                                         head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                         sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                         swiglu_limit=7.0, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                          "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                          "truncate": False,
                                                          "original_max_position_embeddings": 4096})),
}


def cache_dir() -> Path:
    d = hf_gguf.cache_root() / "synthetic"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes transformers' causal-LM model saves for ``config``, without allocating it."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def make_folder(shape: str, folder: Path, smollm2_gguf: Path, seed: int = 0, layers: int | None = None) -> Path:
    """A Hugging Face folder with ``shape``'s config (``layers`` layers where given) and random bfloat16 weights,
    written a tensor at a time."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cls_name, keys = SHAPES[shape]
    config = getattr(transformers, cls_name)(**{**keys, **({"num_hidden_layers": layers} if layers else {})})
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]  # what the converter reads the model by
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    hf_gguf.save_tokenizer(smollm2_gguf, folder)
    g = torch.Generator().manual_seed(seed)
    shard, shard_bytes, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, shard_bytes, n = {}, 0, n + 1

    for name, dims in _tensor_shapes(config).items():
        if len(dims) == 1:
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (torch.randn(dims, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes > 2 << 30:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return folder


def make(shape: str, types: list[str], smollm2_gguf: Path, layers: int | None = None) -> dict[str, Path]:
    """The GGUF file of ``shape`` (``layers`` layers where given) for each of ``types`` (``F16`` or a key of
    ``hf_gguf.FTYPES``), made if absent."""
    root = cache_dir()
    stem = f"{shape}-{layers}l" if layers else shape
    out = {t: root / f"{stem}-{t}.gguf" for t in types}
    missing = [t for t, p in out.items() if not p.exists()]
    if missing:
        f16 = root / f"{stem}-F16.gguf"
        if not f16.exists():
            folder = make_folder(shape, root / f"{stem}-hf", smollm2_gguf, layers=layers)
            hf_gguf.convert(folder, root / f"{stem}-F16.partial", "f16")
            (root / f"{stem}-F16.partial").rename(f16)
            shutil.rmtree(folder)
        for t in missing:
            if t != "F16":
                partial = root / f"{stem}-{t}.partial"
                hf_gguf.quantize(f16, partial, t)
                partial.rename(out[t])
        if "F16" not in types:
            f16.unlink()
    return out


def decode_ratio(path: Path, rounds: int, tokens: int, activations: str | None) -> float:
    """Median over ``rounds`` of our decode tokens/s over llama.cpp's on ``path``, the two run in turn; prints each
    round. Raises RuntimeError where llama-cpp-python is not installed (the message says how)."""
    import statistics

    from mlx_engine.api import load
    from mlx_engine.bench.llama_cpp_peer import LlamaCppPeer
    from mlx_engine.bench.run import EngineSide, cpu_threads, random_prompt

    model = load(str(path), progress=False, context_length=512, activations=activations)
    ours = EngineSide(model)
    peer = LlamaCppPeer(path, n_ctx=512, threads=cpu_threads())
    prompt = random_prompt(32, 32000, seed=0)
    try:
        ours.run(prompt, 4), peer.run(prompt, 4)  # warm-up: weights paged in, buffers made
        ratios = []
        for i in range(rounds):
            a = ours.run(prompt, tokens)["decode_tps"]
            b = peer.run(prompt, tokens)["decode_tps"]
            ratios.append(a / b)
            print(f"round {i + 1}: ours {a:.2f} tokens/s, llama.cpp {b:.2f}: {a / b:.2f}x", flush=True)
    finally:
        peer.close()
    med = statistics.median(ratios)
    print(f"{path.name} ({model.activations} activations, {cpu_threads()} threads): median decode ratio "
          f"{med:.2f}x over {rounds} rounds of {tokens} tokens", flush=True)
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_K_M"], help="llama-quantize types (and F16)")
    ap.add_argument("--layers", type=int, default=None, help="this many layers instead of the shape's")
    ap.add_argument("--bench", action="store_true", help="run mlx-engine bench on each file")
    ap.add_argument("--compare", action="append", default=[], choices=["llama.cpp", "mlx-lm"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--activations", default=None)
    ap.add_argument("--decode", action="store_true", help="decode alone beside llama.cpp, alternating (see above)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    bad = [t for t in args.types if t != "F16" and t not in hf_gguf.FTYPES]
    if bad:
        ap.error(f"unknown type(s) {', '.join(bad)}; choose from F16, {', '.join(hf_gguf.FTYPES)}")
    from mlx_engine.store import Store

    smollm2 = Store().resolve("smollm2:135m", pull=True, progress=False).path
    files = make(args.shape, args.types, Path(smollm2), args.layers)
    for t, p in files.items():
        print(f"{args.shape} {t}: {p} ({p.stat().st_size / 1e9:.2f} GB)", flush=True)
        if args.decode:
            decode_ratio(p, args.rounds, args.tokens, args.activations)
        if args.bench:
            cmd = [str(Path(sys.executable).parent / "mlx-engine"), "bench", str(p), "--reps", str(args.reps)]
            for c in args.compare:
                cmd += ["--compare", c]
            if args.activations:
                cmd += ["--activations", args.activations]
            subprocess.run(cmd, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
