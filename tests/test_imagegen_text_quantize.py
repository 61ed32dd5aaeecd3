"""``--quantize 8|4`` on the image pipelines' text encoders (``imagegen.quantize.quantizing``: the text backend's load
``transform`` quantizes each linear weight of the language model, or of T5, before the next tensor is read).

Oracles: the float encoders (held against transformers and diffusers in tests/test_imagegen_text_encoder.py,
test_imagegen_qwen_image.py, test_imagegen_flux.py and test_imagegen_flux2.py), and quantizing them after a full
float load (``quantize.quantize_linears``), on small random transformers checkpoints of each kind the pipelines run:
Qwen3 (Z-Image's ``TextEncoder`` and FLUX.2 klein's ``Flux2TextEncoder``), Qwen2.5-VL's language model (Qwen-Image's
``TextEncoder``), Mistral 3 (FLUX.2 dev's ``Flux2TextEncoder``) and T5 (FLUX.1's ``T5Encoder``), every linear width a
multiple of 64 (the group size) so that every linear layer quantizes.

- Same bits: both loads hold the same quantized tensors (packed words, scales, biases) and the same float ones, and
  the encoders give identical features (``np.array_equal``: the same ``mx.quantize`` of the same float tensor, then
  the same graph).
- Close to float: the relative error ``|q - f| / |f|`` (Frobenius norms over every prompt's features) of the quantized
  encoder's features against the float encoder's is below :data:`BOUND`, and a broken quantization (every group
  given another group's scale and bias) is above 1, farther from the float features than zero; and the quantized
  encoder is the float one run on the dequantized weights, to float32's rounding (:data:`DEQUANTIZED_BOUND`).
- Lower peak: a text encoder quantized as read peaks (``Backend.peak_memory() - memory_before_load``) at most at what
  ``imagegen.memory`` estimates (the quantized weights, counted exactly, plus the largest float tensor quantized),
  under half the float size (measured on a Qwen3 of 21.4 MB in float32: 7.46 MB at 8 bits, 4.85 MB at 4, against
  6.03 + 1.57 and 3.36 + 1.57 MB; on a T5 of 11.1 MB: 4.67 and 3.30 MB, against 3.19 + 1.57 and 1.81 + 1.57 MB).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import mlx.core as mx  # noqa: E402

from mlx_engine.imagegen import memory  # noqa: E402
from mlx_engine.imagegen.quantize import (T5_FLOAT, TEXT_MODEL_FLOAT, quantize_linears, quantizer,  # noqa: E402
                                          quantizing)
from mlx_engine.mlx import MLXBackend  # noqa: E402
from mlx_engine.mlx.tensor import MLXQuantizedTensor  # noqa: E402
from tests.hf_gguf import peaked  # noqa: E402

PROMPTS = ["a red circle on a blue background", "", "a small green square in the top left corner, dance monkey"]
#: the encoder of each pipeline: (its text folder, its tokenizer folder)
KINDS = {"zimage": ("qwen3", "qwen_tok"), "klein": ("qwen3", "qwen_tok"), "qwen_image": ("qwen25vl", "qwen_tok"),
         "dev": ("mistral3", "mistral_tok"), "t5": ("t5", "t5_tok")}
#: |q - f| / |f| of the features, at most: measured 0.021 to 0.030 at 8 bits and 0.28 to 0.48 at 4 (T5 the most;
#: 4-bit affine groups of 64 Gaussian weights are off by about 9 % each, and every layer adds its share), where a
#: quantization with the wrong group order gives 1.36 to 1.62 (T5's tokenizer, a Unigram trained here, varies a little
#: from run to run, and with it T5's figures)
BOUND = {8: 0.04, 4: 0.6}
#: |q - d| / |d| against the float encoder on the dequantized weights, at most: measured 6e-7 to 1.8e-6 (float32
#: sums in another order)
DEQUANTIZED_BOUND = 1e-5


def F32(folder: Path, **kw) -> MLXBackend:
    return MLXBackend(folder, dtype="float32", **kw)


def _keep(kind: str) -> tuple[str, ...]:
    return T5_FLOAT if kind == "t5" else TEXT_MODEL_FLOAT


def _qwen3(vocab: int, width: int = 64, ff: int = 128, heads: int = 4):
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(hidden_size=width, intermediate_size=ff, num_hidden_layers=4,
                                  num_attention_heads=heads, num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0))


def _qwen25vl(vocab: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 2048,
                     "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"}},
        # a tower whose linear layers could quantize: --quantize must leave them as stored
        vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 64},
        hidden_size=64, vocab_size=vocab))


def _mistral3(tok):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                     "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 1000000000.0,
                     "sliding_window": None, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                     "pad_token_id": tok.pad_token_id},
        vision_config={"model_type": "pixtral", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                       "intermediate_size": 128, "image_size": 30, "patch_size": 6, "num_channels": 3},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), vision_feature_layer=-1, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))


def _t5(vocab: int, width: int = 64, ff: int = 128, heads: int = 4):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab, d_model=width, d_kv=16, d_ff=ff, num_layers=2, num_heads=heads,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
                                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def _save(model, folder: Path, seed: int) -> Path:
    # transformers' init leaves attention nearly idle; N(0, 1 / fan_in) matrices keep each layer's output at its
    # input's scale, so that a weight's error is not amplified from layer to layer as with larger weights
    peaked(model, scale=1.0, seed=seed)
    model.eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from tests import flux2_small, flux_small, zimage_small

    d = tmp_path_factory.mktemp("textq")
    qwen_tok = zimage_small.small_tokenizer()
    qwen_tok.save_pretrained(d / "qwen_tok")
    mistral_tok = flux2_small._tokenizer("dev")
    mistral_tok.save_pretrained(d / "mistral_tok")
    t5_tok = flux_small.t5_tokenizer()
    t5_tok.save_pretrained(d / "t5_tok")
    torch.manual_seed(0)
    _save(_qwen3(len(qwen_tok)), d / "qwen3", 1)
    _save(_qwen25vl(len(qwen_tok)), d / "qwen25vl", 2)
    _save(_mistral3(mistral_tok), d / "mistral3", 3)
    _save(_t5(len(t5_tok)), d / "t5", 4)
    # wider ones, whose weights outweigh the allocator's fixed costs, for the load peak
    _save(_qwen3(len(qwen_tok), width=384, ff=1024, heads=8), d / "qwen3_big", 5)
    _save(_t5(len(t5_tok), width=384, ff=1024, heads=8), d / "t5_big", 6)
    return d


def _encode(kind: str, root: Path, make_backend) -> tuple[np.ndarray, dict]:
    """The features of PROMPTS (every prompt's rows, concatenated) from the pipeline's encoder of ``kind`` made
    with ``make_backend``, and its backend's weights."""
    from mlx_engine.imagegen.flux2_text import SYSTEM_MESSAGE, Flux2TextEncoder, padding_side
    from mlx_engine.imagegen.qwen_image import PROMPT_TEMPLATE, TEMPLATE_DROP
    from mlx_engine.imagegen.t5_encoder import T5Encoder
    from mlx_engine.imagegen.text_encoder import TextEncoder
    from mlx_engine.models.registry import load_text_checkpoint

    model, tok = (root / n for n in KINDS[kind])
    if kind == "t5":
        enc = T5Encoder(make_backend(model), tok)
        with enc.backend.new_context() as ctx:
            feats = [enc.encode(ctx, PROMPTS, 32).numpy()]
        return np.concatenate([f.reshape(-1, f.shape[-1]) for f in feats]), dict(enc.backend.weights)
    text = load_text_checkpoint(model, make_backend, tokenizer_folder=tok)
    if kind in ("zimage", "qwen_image"):
        opts = {"template": PROMPT_TEMPLATE, "drop": TEMPLATE_DROP, "hidden_state": -1} if kind == "qwen_image" else {}
        enc = TextEncoder(text.model, text.tokenizer, text.backend, **opts)
        run = lambda ctx: enc.encode(ctx, PROMPTS)  # noqa: E731
    else:
        enc = Flux2TextEncoder(text.model, text.tokenizer, text.backend, pad_side=padding_side(tok),
                               system_message=SYSTEM_MESSAGE if kind == "dev" else None)
        run = lambda ctx: enc.encode(ctx, PROMPTS, 96 if kind == "dev" else 32, (1, 2, 4))  # noqa: E731
    with text.backend.new_context() as ctx:
        feats = [f.numpy() for f in run(ctx)]
    return np.concatenate(feats), dict(text.backend.weights)


def _after_load(bits: int, keep: tuple[str, ...]):
    """A backend factory that loads in float, then quantizes (the path quantizing replaces)."""
    def make(folder: Path) -> MLXBackend:
        b = F32(folder)
        quantize_linears(b, dict(b.weights), bits, 64, keep)
        return b
    return make


def _broken(bits: int, keep: tuple[str, ...]):
    """A backend factory that quantizes as read, then hands each group another group's scale and bias (the groups
    taken in reverse order over the whole weight): a quantization with the wrong group order."""
    q = quantizer(bits, 64, keep)

    def transform(name, t):
        qt = q(name, t)
        if qt is t:
            return t
        flip = [a.reshape(-1)[::-1].reshape(a.shape) for a in (qt.scales, qt.biases)]
        mx.eval(*flip)
        return MLXQuantizedTensor(qt.w, *flip, qt.group_size, qt.bits)
    return lambda folder: F32(folder, transform=transform)


def _dequantized(bits: int, keep: tuple[str, ...]):
    """A backend factory whose weights are the quantized ones dequantized (float32): the float encoder on the
    weights the quantized one holds."""
    q = quantizer(bits, 64, keep)

    def transform(name, t):
        qt = q(name, t)
        return t if qt is t else qt.dequantize()
    return lambda folder: F32(folder, transform=transform)


def _arrays(t) -> list[np.ndarray]:
    return [np.array(a) for a in (t.w, t.scales, t.biases)] if t.is_quantized else [t.numpy()]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_quantized_as_read_is_quantized_after_load(root, kind, bits):
    keep = _keep(kind)
    f_plain, w_plain = _encode(kind, root, F32)
    f_after, w_after = _encode(kind, root, _after_load(bits, keep))
    f_read, w_read = _encode(kind, root, quantizing(F32, bits, keep))
    # every 2-D tensor outside the kept prefixes quantizes (every width here is a multiple of 64): the linear layers,
    # and a decoder's token embedding; norms, T5's tables and the vision towers stay as stored
    want = {n for n, t in w_plain.items() if t.ndim == 2 and not n.startswith(keep)}
    assert any(".mlp." in n or "DenseReluDense" in n for n in want)
    assert any("q_proj" in n or "SelfAttention.q." in n for n in want)
    assert kind == "t5" or any("embed_tokens" in n for n in want)
    assert {n for n, t in w_read.items() if t.is_quantized} == want
    assert {n for n, t in w_after.items() if t.is_quantized} == want
    assert w_read.keys() == w_after.keys() == w_plain.keys()
    for n, t in w_read.items():
        if t.is_quantized:
            assert (t.bits, t.group_size) == (bits, 64) == (w_after[n].bits, w_after[n].group_size), n
        assert all(np.array_equal(a, b) for a, b in zip(_arrays(t), _arrays(w_after[n]), strict=True)), n
    assert np.array_equal(f_read, f_after)
    assert not np.array_equal(f_read, f_plain)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", list(KINDS))
def test_quantized_features_are_close_to_float(root, kind):
    """``|q - f| / |f|`` below BOUND, a quantization with the wrong group order above 1 (worse than no features),
    and the quantized encoder within DEQUANTIZED_BOUND of the float one on the dequantized weights (each figure
    printed)."""
    keep = _keep(kind)
    f, _ = _encode(kind, root, F32)
    line = []
    for bits in (8, 4):
        q, _ = _encode(kind, root, quantizing(F32, bits, keep))
        bad, _ = _encode(kind, root, _broken(bits, keep))
        deq, _ = _encode(kind, root, _dequantized(bits, keep))
        err, err_bad, err_deq = _rel(q, f), _rel(bad, f), _rel(q, deq)
        line.append(f"{bits}-bit {err:.4f} (wrong group order {err_bad:.4f}; against the dequantized weights "
                    f"{err_deq:.1e})")
        assert err < BOUND[bits], line
        assert err_bad > 1.0, line  # farther from the float features than zero is
        assert err_deq < DEQUANTIZED_BOUND, line
    print(f"{kind}: " + ", ".join(line))


@pytest.mark.parametrize("kind", ["qwen3_big", "t5_big"])
def test_text_load_peak_falls(root, kind):
    """The load's own peak against ``imagegen.memory``'s estimate of a text encoder quantized as read: the quantized
    weights (counted exactly) plus the one float tensor being quantized; the float load holds the whole encoder."""
    folder, keep = root / kind, T5_FLOAT if kind == "t5_big" else TEXT_MODEL_FLOAT
    full = F32(folder)
    float_bytes, float_peak = full.weights_nbytes(), full.peak_memory() - full.memory_before_load
    full.close()
    tensors = memory.folder_tensors(folder)
    lines = [f"{kind}: float32 {float_bytes / 1e6:.2f} MB, load peak {float_peak / 1e6:.2f} MB"]
    assert float_peak >= float_bytes
    for bits in (8, 4):
        q = quantizing(F32, bits, keep)(folder)
        peak, kept = q.peak_memory() - q.memory_before_load, q.weights_nbytes()
        q.close()
        transient = memory.quantize_transient_bytes(tensors, 4, quantize=bits, float_prefixes=keep)
        lines.append(f"{bits}-bit {kept / 1e6:.2f} MB, load peak {peak / 1e6:.2f} MB (estimate "
                     f"{kept / 1e6:.2f} + {transient / 1e6:.2f} MB)")
        assert kept == memory.weight_bytes(tensors, 4, quantize=bits, float_prefixes=keep)
        assert peak <= kept + transient, lines
        assert peak < float_bytes / 2, lines
    print("; ".join(lines))
