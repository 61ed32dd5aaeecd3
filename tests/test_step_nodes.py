"""Graph nodes per decode step, ours beside mlx-lm's (issue 66, "the GPU step"): on a GPU a decode step of a small
model is bound by the operations launched, one per graph node evaluated. Counted on the CPU with our CPU kernels off
(``MLX_ENGINE_KERNELS=0``: MLX's own operations only, as on a GPU), from the lazy graph of one decode step's logits
(``mx.export_to_dot``), for the same model in mlx-lm (its own model classes, for a GGUF file on the float weights of
``tests.reference.mlx_lm_folder``, 4-bit ``nn.quantize``d, one step with its ``KVCache``). On the CPU, MLX writes
``mx.fast``'s operations (RMSNorm, RoPE, attention) out as their primitives, for both engines alike. Each count runs in
a process of its own (the kernels are chosen once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_gguf import save_tokenizer
from tests.reference import mlx_lm_folder

REPO = Path(__file__).resolve().parents[1]

_COUNT = r"""
import collections, io, json, re, sys
import mlx.core as mx

def nodes(arr):
    f = io.StringIO()
    mx.export_to_dot(f, arr)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue()))

engine, path = sys.argv[1], sys.argv[2]
prompt = list(range(10, 30))
if engine == "ours":
    import mlx_engine
    m = mlx_engine.load(path, progress=False, context_length=128)
    assert "kernels: off" in m.backend_name, m.backend_name
    with m.backend.new_context() as ctx:
        m.runner.prefill(ctx, 0, prompt)
        got = nodes(m.runner.decode(ctx, [5], [len(prompt)], [0]).a)
    layers = m.runner.model.config.num_layers
else:
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache
    from pathlib import Path
    from mlx_lm.utils import load_model
    model = load_model(Path(path))[0]
    nn.quantize(model, group_size=32, bits=4)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    got = nodes(model(mx.array([[5]]), cache=cache))
    layers = len(model.layers)
print(json.dumps({"nodes": sum(got.values()), "by_kind": dict(got), "layers": layers}))
"""


def _count(engine: str, path: Path) -> dict:
    env = dict(os.environ, MLX_ENGINE_KERNELS="0", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", _COUNT, engine, str(path)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llama_1b_shape(tmp_path_factory, smollm2_gguf) -> Path:
    """A Llama 3.2 1B-shaped folder (its hidden size, heads, KV heads, head size, MLP width and RoPE scaling) with 1
    of its 16 layers, smollm2's tokenizer and vocabulary, and random float16 weights in transformers' names: a
    decode step's nodes are per layer, plus the head's, whatever the weights hold."""
    import numpy as np
    from safetensors.numpy import save_file

    hidden, inter, heads, kv, hd, layers, vocab = 2048, 8192, 32, 8, 64, 1, 49152
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192},
              "tie_word_embeddings": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
              "hidden_act": "silu", "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": np.ones(hidden, np.float16),
                        p + "post_attention_layernorm.weight": np.ones(hidden, np.float16),
                        p + "self_attn.q_proj.weight": w(heads * hd, hidden),
                        p + "self_attn.k_proj.weight": w(kv * hd, hidden),
                        p + "self_attn.v_proj.weight": w(kv * hd, hidden),
                        p + "self_attn.o_proj.weight": w(hidden, heads * hd),
                        p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                        p + "mlp.down_proj.weight": w(hidden, inter)})
    folder = tmp_path_factory.mktemp("llama-1b-shape")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    save_tokenizer(smollm2_gguf, folder)
    return folder


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "llama-1b-shape"])
def test_a_decode_step_has_no_more_nodes_than_mlx_lms(model, request, record_property):
    path = request.getfixturevalue({"smollm2": "smollm2_gguf", "gemma3": "gemma3_gguf",
                                    "llama-1b-shape": "llama_1b_shape"}[model])
    ours, theirs = _count("ours", path), _count("mlx-lm", mlx_lm_folder(path) if path.suffix == ".gguf" else path)
    record_property("nodes", {"ours": ours["nodes"], "mlx_lm": theirs["nodes"]})
    assert ours["layers"] == theirs["layers"] > 0
    # both graphs are whole steps: at least the 7 projections of every layer and the head
    assert sum(ours["by_kind"].get(k, 0) for k in ("Matmul", "QuantizedMatmul")) >= 7 * ours["layers"] + 1
    assert theirs["by_kind"].get("QuantizedMatmul", 0) >= 7 * theirs["layers"] + 1
    assert ours["nodes"] <= theirs["nodes"], (ours, theirs)
