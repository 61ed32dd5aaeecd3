"""Parity of ``mlx_engine.imagegen.text_encoder.TextEncoder`` with diffusers' ``ZImagePipeline._encode_prompt`` on a small random
transformers Qwen3 (a bare ``Qwen3Model``, as diffusers saves Z-Image's text encoder, and a ``Qwen3ForCausalLM``)
and a small byte-level BPE tokenizer with a Qwen3-style chat template (float32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from diffusers import ZImagePipeline  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config  # noqa: E402

from mlx_engine.imagegen.text_encoder import TextEncoder  # noqa: E402
from mlx_engine.errors import InvalidRequestError  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402
from mlx_engine.models.text.tokenizer import Tokenizer  # noqa: E402

# The parts of Qwen3's template that _encode_prompt exercises: ChatML turns, and an empty think block after the
# generation prompt only when enable_thinking is false (the pipeline passes true).
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS = [
    "a photograph of an astronaut riding a horse on the moon",
    "a red cat sitting on a wooden chair, studio lighting, 35mm",
    "Une peinture à l'huile d'un phare au coucher du soleil",
    "user assistant system think",
    "1234567890 !?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+~`",
]
HIDDEN, LAYERS = 64, 3
PROMPTS = ["a red cat on a chair", "", "an astronaut riding a horse on the moon, oil painting, Phare à l'huile 42"]


def _tokenizer_folder(folder):
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return tk.get_vocab_size()


@pytest.fixture(scope="module", params=["Qwen3Model", "Qwen3ForCausalLM"])
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("zimage_te")
    vocab = _tokenizer_folder(root / "tokenizer")
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    cls = getattr(transformers, request.param)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
    model.save_pretrained(root / "text_encoder")
    hf_tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    ours = TextEncoder.from_backend(MLXBackend(root / "text_encoder", dtype="float32"),
                                    Tokenizer.from_folder(root / "tokenizer"))
    return model, hf_tok, ours, request.param


def _reference(model, hf_tok, prompts, max_sequence_length):
    pipe = type("Pipe", (), {})()
    pipe.tokenizer, pipe.text_encoder = hf_tok, model
    with torch.no_grad():
        out = ZImagePipeline._encode_prompt(pipe, list(prompts), device=torch.device("cpu"),
                                            max_sequence_length=max_sequence_length)
    return [o.numpy() for o in out]


@pytest.mark.parametrize("max_len", [64, 8])
def test_matches_diffusers(checkpoint, max_len):
    model, hf_tok, ours, kind = checkpoint
    ref = _reference(model, hf_tok, PROMPTS, max_len)
    ctx = ours.backend.new_context()
    out = [o.numpy() for o in ours.encode(ctx, PROMPTS, max_sequence_length=max_len)]
    assert [o.shape for o in out] == [r.shape for r in ref]
    assert len({r.shape[0] for r in ref}) == (3 if max_len == 64 else 1)  # ragged, or all cut to max_len
    scale = max(np.abs(r).max() for r in ref)
    err = max(np.abs(o - r).max() for o, r in zip(out, ref)) / scale
    assert err < 1e-4, f"{kind}: max abs diff / max abs ref = {err:.2e}"
    print(f"{kind} max_len={max_len}: relative error {err:.2e}")
    # The same tokens as transformers' tokenizer on the same templated text.
    for p in PROMPTS:
        text = hf_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=True)
        assert ours.prompt_text(p) == text
        assert ours.token_ids(p, max_len) == hf_tok(text, truncation=True, max_length=max_len).input_ids


def test_layer_is_second_to_last(checkpoint):
    """``hidden_states[-2]``: the output of layer N-2, not normed (and not the final hidden state)."""
    model, hf_tok, ours, _ = checkpoint
    ids = torch.tensor([ours.token_ids(PROMPTS[0])])
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hs) == LAYERS + 1 and ours.output_layer == LAYERS - 2
    ctx = ours.backend.new_context()
    out = ours.encode(ctx, [PROMPTS[0]])[0].numpy()
    assert np.abs(out - hs[LAYERS - 1][0].numpy()).max() < 1e-4 * np.abs(out).max()
    assert np.abs(out - hs[-1][0].numpy()).max() > 1e-2


def test_batch_equals_one_by_one(checkpoint):
    _, _, ours, _ = checkpoint
    ctx = ours.backend.new_context()
    together = [o.numpy() for o in ours.encode(ctx, PROMPTS)]
    for p, t in zip(PROMPTS, together):
        alone = ours.encode(ctx, [p])[0].numpy()
        np.testing.assert_allclose(alone, t, rtol=0, atol=1e-5 * np.abs(t).max())


def test_a_repeated_prompt_is_encoded_once(checkpoint):
    """The empty negative prompt of every image in a batch, or one caption asked for twice: encoded once, each entry
    the features that prompt gives in a batch without repeats."""
    _, _, ours, _ = checkpoint
    ctx = ours.backend.new_context()
    once = [o.numpy() for o in ours.encode(ctx, [PROMPTS[0], ""])]
    asked = [PROMPTS[0], "", PROMPTS[0], "", ""]
    calls = []
    forward = ours.model.forward
    ours.model.forward = lambda ctx, batch, *a, **k: calls.append(len(batch)) or forward(ctx, batch, *a, **k)
    try:
        got = [o.numpy() for o in ours.encode(ctx, asked)]
    finally:
        del ours.model.forward
    assert calls == [len(ours.token_ids(PROMPTS[0])) + len(ours.token_ids(""))]  # one pass over the two prompts
    for p, g in zip(asked, got):
        np.testing.assert_array_equal(g, once[0 if p else 1])


def test_errors_and_close(checkpoint):
    _, _, ours, _ = checkpoint
    ctx = ours.backend.new_context()
    with pytest.raises(InvalidRequestError):
        ours.encode(ctx, [])
    with pytest.raises(InvalidRequestError):
        ours.encode(ctx, ["x"], max_sequence_length=0)
    with pytest.raises(InvalidRequestError):
        ours.encode(ctx, [3])  # type: ignore[list-item]
    # close() frees the weights; the encoder refuses to run afterwards.
    backend = MLXBackend(ours.backend.path, dtype="float32")
    enc = TextEncoder.from_backend(backend, ours.tokenizer)
    assert backend.weights
    enc.close()
    assert not backend.weights and enc.model is None
    with pytest.raises(InvalidRequestError, match="closed"):
        enc.encode(ctx, ["x"])
