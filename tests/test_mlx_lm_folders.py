"""mlx-community's quantized folders (issue 60): a small random transformers model of each family, saved with
``save_pretrained`` beside smollm2's real tokenizer, converted by mlx-lm's own ``mlx_lm.convert(..., quantize=True)``
(4 and 8 bits, group size 64, bfloat16 as mlx-community's folders hold the rest; Qwen3-MoE's routers at 8 bits by the
model's own quantization predicate, a per-layer override in ``config.json``; mlx-lm's ``mixed_4_6`` recipe on Llama:
6-bit value and down projections and head beside 4-bit layers, per-layer overrides again). Our logits on each folder,
read by our safetensors reader with the quantized products our CPU kernels run, against mlx-lm's own model on the
same folder (its ``load_model``, the non-quantized parameters widened to float32 so that both compute in float32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import arch_proof

pytest.importorskip("torch")
pytest.importorskip("mlx_lm")

#: Both sides multiply the same quantized integers, scales and biases in float32; they differ only in the order of
#: the sums (and MLX's and our kernels' dequantization order), a few ulps per product: 1e-4 of the logits' spread,
#: the bound of the GGUF proofs (tests/arch_proof.py), where measured distances are 1e-6 to 1e-5.
BOUND = 1e-4


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, rope_theta=10000.0)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True, rope_theta=10000.0)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       tie_word_embeddings=True, rope_theta=10000.0)


def _gemma3():  # a sliding window of 8 under the prompt, alternating with a global layer
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            sliding_window_pattern=2,  # what mlx-lm reads (transformers 5 writes layer_types)
                            max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _qwen3_moe():  # 8 experts of width 64, top-2, renormalised
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False,
                          rope_theta=10000.0)


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3, "qwen3_moe": _qwen3_moe}
#: (family, bits, mlx-lm's quantization recipe or None)
CASES = [(f, bits, None) for f in sorted(FAMILIES) for bits in (4, 8)] + [("llama", 4, "mixed_4_6")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_gguf) -> dict[str, tuple[Path, list[int]]]:
    """Each family's random Hugging Face folder (peaked logits) and the prompt's tokens, made on first use."""
    made: dict[str, tuple[Path, list[int]]] = {}

    def get(family: str) -> tuple[Path, list[int]]:
        if family not in made:
            import torch
            from transformers import AutoModelForCausalLM

            from tests.hf_gguf import peaked

            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval()
            peaked(model)
            folder = tmp_path_factory.mktemp(family) / "hf"
            model.save_pretrained(folder)
            # the names of the released checkpoints' config.json (transformers 4's), which mlx-lm reads:
            # transformers 5 writes rope_parameters and num_local_experts instead
            config = json.loads((folder / "config.json").read_text())
            rope = config["rope_parameters"]
            if "full_attention" in rope:  # Gemma 3: one per layer type
                config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
                rope = rope["full_attention"]
            config["rope_theta"] = rope["rope_theta"]
            if "num_local_experts" in config:
                config["num_experts"] = config["num_local_experts"]
            (folder / "config.json").write_text(json.dumps(config))
            made[family] = folder, arch_proof.smollm2_tokenizer(smollm2_gguf)(folder)
        return made[family]
    return get


def _mlx_lm_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    """mlx-lm's logits (float32 ``[N, vocab]``) on its own folder, its float parameters widened to float32 (exactly:
    bfloat16 values), the quantized weights as stored."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model = load_model(folder)[0]
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype in (mx.bfloat16, mx.float16) else p,
                          model.parameters()))
    return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))


@pytest.mark.parametrize("family, bits, recipe", CASES)
def test_an_mlx_lm_quantized_folder_matches_mlx_lm(family, bits, recipe, folders, tmp_path):
    from mlx_lm import convert

    from mlx_engine.mlx import MLXBackend

    folder, tokens = folders(family)
    out = tmp_path / "mlx"
    convert(str(folder), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64, dtype="bfloat16",
            quant_predicate=recipe)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    overrides = {k: v["bits"] for k, v in quantization.items() if isinstance(v, dict)}
    if recipe == "mixed_4_6":
        assert {6, 4} <= set(overrides.values()), overrides
    if family == "qwen3_moe":
        assert [overrides[f"model.layers.{i}.mlp.gate"] for i in range(2)] == [8, 8], overrides
    # what users run: the quantized weights stay quantized, each at its own width
    widths = {t.bits for t in MLXBackend(out, dtype="float32").weights.values() if hasattr(t, "bits")}
    assert widths == {bits} | set(overrides.values()), (widths, overrides)
    d = arch_proof.distance(arch_proof.ours(out, tokens, float_weights=False), _mlx_lm_logits(out, tokens))
    print(f"{family} {bits}-bit {recipe or ''} vs mlx-lm:", d)
    assert d <= BOUND, d
