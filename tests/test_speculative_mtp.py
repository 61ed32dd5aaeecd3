"""Speculative decoding with the model's own multi-token-prediction (MTP) layer (issue 62): DeepSeek V3's MTP module
and GLM-4.5's next-token prediction layer, from a folder and (GLM-4.5) from llama.cpp's GGUF.

Oracles: transformers' own MTP implementation (``MtpModel``, loaded from the folder as its ``MTPCandidateGenerator``
loads it, fed transformers' own hidden states) for the layer's logits at every position of a prompt; the model's own
plain greedy tokens for the output with MTP drafts, token for token, through the API, ``run`` and the scheduler.

The checkpoints: a random transformers model of one layer more than the config then says, peaked (tests/hf_gguf.py),
its last layer turned into the MTP layer by adding the layer's own tensors (``eh_proj``, ``enorm``, ``hnorm``,
``shared_head.norm``, random) and ``num_nextn_predict_layers: 1``, as the released checkpoints lay it out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mlx_engine
from mlx_engine.batch import Batch
from mlx_engine.cli.main import main
from mlx_engine.errors import InvalidRequestError
from mlx_engine.ml import DType
from mlx_engine.mlx import MLXBackend
from mlx_engine.models.generation.runner import GenerationStats, Request, Runner
from mlx_engine.models.generation.sampler import SamplerOptions
from mlx_engine.models.registry import load_text_model
from mlx_engine.server.scheduler import TextScheduler
from tests import arch_proof
from tests.conftest import NoText
from tests.hf_gguf import convert, peaked
from tests.test_arch_glm4moe import _tokenizer as glm_tokenizer
from tests.test_server_scheduler import alone, run_until, submit

torch = pytest.importorskip("torch")

#: DeepSeek V3 (as tests/test_arch_deepseek2.py) with 2 layers and its MTP layer
DEEPSEEK = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
                v_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0})
#: GLM-4.5 (as tests/test_arch_glm4moe.py) with 2 layers and its next-token prediction layer
GLM = dict(vocab_size=49160, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_shared_experts=1, n_routed_experts=8,
           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
           routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, max_position_embeddings=512,
           tie_word_embeddings=False,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def _make(root: Path, config, write_tokenizer, seed: int) -> tuple[Path, list[int]]:
    """The folder of a random model of ``config`` whose last layer is made its MTP layer; the prompt's tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    peaked(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a correction bias on each router, large enough to change choices
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    folder = root / "hf"
    model.save_pretrained(folder)
    tokens = write_tokenizer(folder)
    n, d = config.num_hidden_layers - 1, config.hidden_size
    path = folder / "model.safetensors"
    tensors = load_file(path)
    p = f"model.layers.{n}."
    tensors[p + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=g) * (4.0 / (2 * d) ** 0.5)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[p + norm + ".weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n, "num_nextn_predict_layers": 1}))
    return folder, tokens


def _reference(folder: Path, tokens: list[int]) -> np.ndarray:
    """transformers' MTP logits ``[len(tokens) - 1, vocab]``: row ``j`` from its hidden state of position ``j`` and
    token ``j + 1`` (its ``MtpModel`` runs them at the token's position, ``j + 1``)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    n = main.config.num_hidden_layers
    # the released configs' MTP layer numbers are written into the class (61 for DeepSeek V3); ours is n
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = main(ids, output_hidden_states=True).hidden_states[-1]
        y = mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, len(tokens))[None], None, input_ids=ids[:, 1:])
        return mtp._project_to_logits(y)[0].float().numpy()


def _runner(path: Path, chunk: int = 512) -> Runner:
    backend = MLXBackend(path, dtype="float32", quantized=False, requantize=0)
    return Runner(load_text_model(backend), NoText(), context_length=512, max_sequences=2, prefill_chunk=chunk)


def _ours(path: Path, tokens: list[int]) -> tuple[np.ndarray, int]:
    """Our MTP logits at every position (one pass of the model, one of the MTP layer over its hidden states) and
    the drafter's first draft after ``tokens`` from a prefill in chunks of 8 (the MTP layer run chunk by chunk)."""
    r = _runner(path)
    head = r.mtp_head()
    n = len(tokens)
    with r.backend.new_context() as ctx:
        batch = Batch(np.asarray(tokens, np.int32), np.arange(n), np.zeros(n, np.int32), np.arange(n))
        _, hidden = r.model.forward(ctx, batch, r.cache, hidden_too=True)
        logits, _ = head.run(ctx, 1, tokens[1:], hidden[:-1], 0, outputs=np.arange(n - 1))
        rows = logits.astype(DType.FLOAT32).numpy()
    r = _runner(path, chunk=8)
    drafter = r.drafter(Request(tokens, speculative="mtp"))
    with r.backend.new_context() as ctx:
        r.prefill(ctx, 0, tokens[:-1])  # the model has run all but the last token, as before a verification
    return rows, drafter.draft(tokens, 1)[0]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smollm2_gguf):
    from transformers import DeepseekV3Config

    return _make(tmp_path_factory.mktemp("mtp_deepseek"), DeepseekV3Config(**DEEPSEEK),
                 arch_proof.smollm2_tokenizer(smollm2_gguf), seed=3)


@pytest.fixture(scope="module")
def glm(tmp_path_factory, smollm2_gguf):
    from transformers import Glm4MoeConfig

    folder, tokens = _make(tmp_path_factory.mktemp("mtp_glm"), Glm4MoeConfig(**GLM), glm_tokenizer(smollm2_gguf),
                           seed=4)
    return folder, tokens, convert(folder, folder.parent / "f32.gguf", "f32")


def test_deepseek_mtp_logits_match_transformers(deepseek):
    folder, tokens = deepseek
    ref = _reference(folder, tokens)
    ours, first = _ours(folder, tokens)
    d = arch_proof.distance(ours, ref)
    assert d <= 1e-4, d
    assert first == int(ref[-1].argmax())
    print(f"deepseek_v3 MTP logits vs transformers: {d:.1e}")


def test_glm_mtp_logits_match_transformers_from_the_folder_and_the_gguf(glm):
    folder, tokens, gguf = glm
    ref = _reference(folder, tokens)
    for path in (folder, gguf):
        ours, first = _ours(path, tokens)
        d = arch_proof.distance(ours, ref)
        assert d <= 1e-4, (path.name, d)
        assert first == int(ref[-1].argmax())
        print(f"glm4_moe MTP logits ({path.name}) vs transformers: {d:.1e}")


def _greedy(model, tokens, speculative, n=48):
    model.runner.reset()
    stats = GenerationStats()
    req = Request(tokens, SamplerOptions(temperature=0.0), n, speculative=speculative, draft_tokens=4)
    return list(model.runner.generate_tokens(req, stats)), stats


@pytest.mark.parametrize("which", ["deepseek", "glm"])
def test_greedy_with_mtp_drafts_is_plain_greedy(which, request):
    folder = request.getfixturevalue(which)[0]
    m = mlx_engine.load(str(folder), progress=False, context_length=256)
    try:
        tokens = m.tokenizer.encode(arch_proof.TEXT, add_bos=False)
        plain, _ = _greedy(m, tokens, "off", n=32)
        fast, stats = _greedy(m, tokens, "mtp", n=32)
        assert fast == plain
        assert stats.verify_steps > 0 and stats.draft_proposed > 0
        # a second turn on the same sequence reuses the cached prefix, and the MTP cells of it
        follow = tokens + plain + m.tokenizer.encode(" and then", add_bos=False)
        plain2, _ = _greedy(m, follow, "off", n=32)
        m.runner.reset()
        list(m.runner.generate_tokens(Request(tokens, SamplerOptions(temperature=0.0), 32, speculative="mtp",
                                              draft_tokens=4), GenerationStats()))
        stats = GenerationStats()
        again = list(m.runner.generate_tokens(Request(follow, SamplerOptions(temperature=0.0), 32,
                                                      speculative="mtp", draft_tokens=4), stats))
        assert again == plain2 and stats.prefilled_tokens < len(follow) and stats.draft_proposed > 0
    finally:
        m.close()


def test_the_mtp_cache_after_a_speculative_answer_predicts_as_transformers(deepseek):
    """After an answer whose drafts were mostly rejected (random weights: the chained cells removed each time, the
    model's hidden states of every verification pass taken), the MTP layer's next draft is transformers' prediction
    on the whole text."""
    folder, tokens = deepseek
    m = mlx_engine.load(str(folder), progress=False, context_length=256)
    try:
        out, stats = _greedy(m, tokens, "mtp", n=24)
        assert stats.verify_steps > 5
        text = tokens + out
        draft = m.runner.mtp.draft(0, text, 1, m.runner.model.config.vocab_size)
    finally:
        m.close()
    assert draft == [int(_reference(folder, text)[-1].argmax())]


def test_a_perfect_mtp_layer_is_always_accepted(deepseek, tmp_path):
    """Every layer's attention and MLP outputs zeroed (``o_proj``, ``down_proj``: the model's logits at a position
    then depend on its token alone), the MTP layer's ``eh_proj`` passing the embedding half through, ``enorm`` 1 and
    ``shared_head.norm`` the model's final norm: the MTP layer predicts exactly what the model will (its logits are
    the model's at the next position, up to a positive scale), chained drafts too. Every draft token is accepted and
    the answer is plain greedy's."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "perfect"
    folder.mkdir()
    for f in deepseek[0].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    n, d = DEEPSEEK["num_hidden_layers"] - 1, DEEPSEEK["hidden_size"]
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
            tensors[name] = torch.zeros_like(t)
    p = f"model.layers.{n}."
    tensors[p + "eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
    tensors[p + "enorm.weight"] = torch.ones(d)
    tensors[p + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    m = mlx_engine.load(str(folder), progress=False, context_length=256)
    try:
        tokens = deepseek[1]
        plain, _ = _greedy(m, tokens, "off", n=40)
        fast, stats = _greedy(m, tokens, "mtp", n=40)
    finally:
        m.close()
    assert fast == plain
    assert stats.draft_proposed > 30 and stats.draft_accepted == stats.draft_proposed
    assert stats.verify_steps <= 40 // 5 + 1  # up to 4 drafts and the model's own token per pass


def test_run_with_mtp_prints_the_plain_answer(deepseek):
    def run(*extra):
        r = CliRunner().invoke(main, ["run", str(deepseek[0]), "--temperature", "0",
                                                          "--max-tokens", "24", *extra, "The quick brown fox"],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return r.output
    assert run("--speculative", "mtp") == run("--speculative", "off")


def test_the_scheduler_drafts_with_mtp_for_four_sequences(glm):
    m = mlx_engine.Model("glm-mtp", glm[0], context_length=256, max_sequences=4, prefill_chunk=16)
    try:
        prompts = [m.tokenizer.encode(t, add_bos=False) for t in
                   ("The quick brown fox", arch_proof.TEXT, "a small bird sings", arch_proof.TEXT[:60])]
        want = [alone(m, p, 32, temperature=0) for p in prompts]
        sched = TextScheduler(m.runner, speculative="mtp")
        got = [submit(sched, p, 32, temperature=0)[1] for p in prompts[:3]]
        got.append(submit(sched, prompts[3], 32, temperature=0, speculative="off")[1])
        run_until(sched, lambda: all(c.done for c in got))
        assert [c.error for c in got] == [None] * 4
        assert [c.answer for c in got] == want
        assert got[0].stats.verify_steps > 0 and got[3].stats.verify_steps == 0
    finally:
        m.close()


def test_mtp_without_mtp_layers_is_a_clear_error(smollm2_model):
    with pytest.raises(InvalidRequestError, match=r"speculative=mtp needs multi-token-prediction layers, and .*"
                                                  r"\(llama\) has none"):
        smollm2_model.generate("Hello", max_tokens=4, speculative="mtp")
