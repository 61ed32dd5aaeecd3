"""FLUX.2 (dev and klein) against diffusers on small random pipelines saved in diffusers' folder layout
(``tests/flux2_small.py``): the transformer, the text encoders' stacked hidden states (left padding with rows that
see nothing, right padding, truncation), the VAE decode with its BatchNorm and 2x2 unpacking, and the final image of
two steps from the same noise, text to image and with one and two reference images; plus the errors.

Tolerances (float32 on both sides): components within 1e-4 (their outputs are of order 1-4; float32 sums of a few
hundred terms in another order differ by ~1e-6), final latents within 1e-4, pixels within 1/255 after rounding (a
value within 1e-5 of a rounding boundary may land on either side; measured float differences are ~6e-6)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from PIL import Image  # noqa: E402

from mlx_engine.errors import InvalidRequestError, UnsupportedError  # noqa: E402
from mlx_engine.imagegen.flux2 import Flux2Pipeline  # noqa: E402
from mlx_engine.imagegen.flux2_text import SYSTEM_MESSAGE  # noqa: E402
from mlx_engine.imagegen.flux2_transformer import Flux2Transformer  # noqa: E402
from mlx_engine.imagegen.registry import load_pipeline  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402
from tests import flux2_small as small  # noqa: E402

COMPONENT_TOL = 1e-4
LATENT_TOL = 1e-4
PIXEL_TOL = 1  # of 255
PROMPT = "a red circle on a blue background"
PROMPTS = [PROMPT, "", "a yellow triangle at the bottom right, make the circle green, a small green square in the top "
           "left corner"]
MAX_LEN = {"dev": 48, "klein": 24}  # dev's system message takes 35 tokens: both pad, and the long prompt is cut


def F32(folder):
    return MLXBackend(folder, dtype="float32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    return {kind: small.build_folder(root / kind, kind) for kind in ("dev", "klein")}


@pytest.fixture(scope="module")
def refs(folders):
    """diffusers' pipelines on the saved folders."""
    return {kind: small.load(f) for kind, f in folders.items()}


@pytest.fixture(scope="module")
def pipes(folders):
    out = {kind: Flux2Pipeline(f, F32, keep_text_encoder=True) for kind, f in folders.items()}
    yield out
    for p in out.values():
        p.close()


def _images():
    rng = np.random.default_rng(5)  # two sizes: 72x80 crops to 64x80, 100x64 to 96x64
    return [Image.fromarray(rng.integers(0, 256, (80, 72, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (64, 100, 3), dtype=np.uint8))]


# ---------------------------------------------------------------------------------------------------- components


def _transformer_inputs():
    """A batch of two: noisy tokens on a 4x4 grid and 8 reference tokens at time id 10, 12 text tokens, distinct
    timesteps and guidance scales."""
    rng = np.random.default_rng(0)
    b, lt = 2, 12
    x = rng.standard_normal((b, 16 + 8, 16)).astype(np.float32)
    txt = rng.standard_normal((b, lt, 96)).astype(np.float32)
    y, xx = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    ry, rx = np.meshgrid(np.arange(2), np.arange(4), indexing="ij")
    img_ids = np.concatenate([
        np.stack([np.zeros(16), y.ravel(), xx.ravel(), np.zeros(16)], -1),
        np.stack([np.full(8, 10), ry.ravel(), rx.ravel(), np.zeros(8)], -1)]).astype(np.int64)
    txt_ids = np.stack([np.zeros(lt)] * 3 + [np.arange(lt)], -1).astype(np.int64)
    return x, img_ids, txt, txt_ids, np.array([0.7, 0.3], np.float32), np.array([4.0, 2.5], np.float32)


def _reference_transformer(model, x, img_ids, txt, txt_ids, t, g):
    with torch.no_grad():
        return model(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(txt),
                     timestep=torch.from_numpy(t), img_ids=torch.from_numpy(img_ids)[None],
                     txt_ids=torch.from_numpy(txt_ids)[None], guidance=None if g is None else torch.from_numpy(g),
                     return_dict=False)[0].numpy()


def _our_transformer(tr, x, img_ids, txt, txt_ids, t, g):
    with tr.backend.new_context() as ctx:
        return tr(ctx, ctx.from_numpy(x), img_ids, ctx.from_numpy(txt), txt_ids, t, g).numpy()


@pytest.mark.parametrize("kind", ["dev", "klein"])
def test_transformer_matches_diffusers(refs, pipes, kind):
    x, img_ids, txt, txt_ids, t, g = _transformer_inputs()
    g = g if kind == "dev" else None  # klein has no guidance embedder
    want = _reference_transformer(refs[kind].transformer, x, img_ids, txt, txt_ids, t, g)
    got = _our_transformer(pipes[kind].transformer, x, img_ids, txt, txt_ids, t, g)
    assert np.abs(got - want).max() <= COMPONENT_TOL


def test_quantized_transformer_matches_diffusers_on_its_weights(folders, refs):
    """8-bit blocks (groups of 32): equal within 1e-4 to diffusers on the dequantized weights (the quantized matmul
    computes what it claims); the embedders, modulations and output layers stay float."""
    import copy

    q = Flux2Transformer.from_backend(F32(folders["dev"] / "transformer"), quantize_bits=8, group_size=32)
    quantized = {n for n, w in q.w.items() if w.is_quantized}
    assert {"transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.1.attn.to_out.weight"} <= quantized
    assert not any(n.startswith(Flux2Transformer.FLOAT_PREFIXES) for n in quantized)
    model = copy.deepcopy(refs["dev"].transformer)
    state = model.state_dict()
    with torch.no_grad():
        for n in quantized:
            state[n].copy_(torch.from_numpy(q.w[n].dequantize().numpy()))
    x, img_ids, txt, txt_ids, t, g = _transformer_inputs()
    want = _reference_transformer(model, x, img_ids, txt, txt_ids, t, g)
    assert np.abs(_our_transformer(q, x, img_ids, txt, txt_ids, t, g) - want).max() <= COMPONENT_TOL


@pytest.mark.parametrize("kind", ["dev", "klein"])
def test_text_encoder_matches_diffusers(refs, pipes, kind):
    """All ``max_sequence_length`` rows of three prompts (the empty one and one cut short among them): dev pads on
    the left, so its first pad rows see no token at all; klein pads on the right."""
    ref, length = refs[kind], MAX_LEN[kind]
    with torch.no_grad():
        if kind == "dev":
            want = ref._get_mistral_3_small_prompt_embeds(ref.text_encoder, ref.tokenizer, PROMPTS,
                                                           max_sequence_length=length,
                                                           hidden_states_layers=small.TEXT_LAYERS)
        else:
            want = ref._get_qwen3_prompt_embeds(ref.text_encoder, ref.tokenizer, PROMPTS, max_sequence_length=length,
                                                hidden_states_layers=small.TEXT_LAYERS)
    if kind == "dev":
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as diffusers_system_message

        assert SYSTEM_MESSAGE == diffusers_system_message
    te = pipes[kind]._load_text_encoder()
    lens = [len(te.token_ids(p, length)) for p in PROMPTS]
    assert min(lens) < length and max(lens) == length  # padding and truncation both happen
    assert te.pad_side == ("left" if kind == "dev" else "right")
    got = np.stack([e.numpy() for e in pipes[kind].encode_prompt(PROMPTS, length, small.TEXT_LAYERS)])
    assert got.shape == tuple(want.shape)
    assert np.abs(got - want.numpy()).max() <= COMPONENT_TOL


def test_vae_decode_matches_diffusers(refs, pipes):
    """Latents [B, 128 / 8 here, h, w] -> BatchNorm undone -> unpatchified -> decoded (a decoder wider than the
    encoder, quant convs), as the pipeline's last step."""
    ref = refs["dev"]
    lat = small.noise((2, 16, 3, 4), seed=7)
    with torch.no_grad():
        z = torch.from_numpy(lat)
        mean = ref.vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(ref.vae.bn.running_var.view(1, -1, 1, 1) + ref.vae.config.batch_norm_eps)
        want = ref.vae.decode(ref._unpatchify_latents(z * std + mean), return_dict=False)[0]
        want = want.permute(0, 2, 3, 1).numpy()
    pipe = pipes["dev"]
    with pipe.backend.new_context() as ctx:
        got = pipe.vae.decode(ctx, pipe.vae_input(ctx.from_numpy(lat))).numpy()
    assert got.shape == want.shape == (2, 48, 64, 3)
    assert np.abs(got - want).max() <= COMPONENT_TOL


# ---------------------------------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize("kind,edits", [("dev", 0), ("klein", 0), ("dev", 1), ("klein", 2)],
                         ids=["dev", "klein-cfg", "dev-one-reference", "klein-cfg-two-references"])
def test_generate_matches_diffusers(refs, pipes, kind, edits):
    """Two steps from the same noise (klein with classifier-free guidance against the empty prompt); with edit
    images the size is the first one's (cropped to multiples of 16) and their tokens join every step."""
    images = _images()[:edits] or None
    width, height = (64, 48) if images is None else (None, None)
    shape = (1, 16, 3, 4) if images is None else (1, 16, 80 // 16, 72 // 16)
    init = small.noise(shape, seed=1)
    want_lat, want_px = small.reference_generate(refs[kind], PROMPT, init, steps=2, guidance=4.0, width=width,
                                                 height=height, images=images, max_sequence_length=MAX_LEN[kind])
    result = pipes[kind].generate(PROMPT, width=width, height=height, steps=2, guidance=4.0, noise=init,
                                  edit_images=images, max_sequence_length=MAX_LEN[kind],
                                  text_encoder_out_layers=small.TEXT_LAYERS)
    assert result.images[0].size == (want_px.shape[2], want_px.shape[1])
    assert np.abs(result.latents - want_lat).max() <= LATENT_TOL
    assert np.abs(result.pixels - want_px).max() <= 1e-4
    got_u8 = np.asarray(result.images[0]).astype(np.int16)
    assert np.abs(got_u8 - (want_px[0] * 255).round().astype(np.int16)).max() <= PIXEL_TOL
    if edits == 1:  # one image needs no list
        again = pipes[kind].generate(PROMPT, steps=2, guidance=4.0, noise=init, edit_images=images[0],
                                     max_sequence_length=MAX_LEN[kind], text_encoder_out_layers=small.TEXT_LAYERS)
        assert np.array_equal(again.latents, result.latents)


def test_distilled_klein_runs_without_guidance(folders, refs, tmp_path):
    """``is_distilled`` in model_index.json: one pass per step whatever the guidance (diffusers warns and ignores
    it), and the defaults are 4 steps at guidance 1."""
    folder = tmp_path / "distilled"
    shutil.copytree(folders["klein"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    ref = small.load(folder)
    init = small.noise((1, 16, 3, 4), seed=2)
    want_lat, _ = small.reference_generate(ref, PROMPT, init, steps=2, guidance=4.0, width=64, height=48,
                                           max_sequence_length=MAX_LEN["klein"])
    with Flux2Pipeline(folder, F32) as pipe:
        assert (pipe.defaults["steps"], pipe.defaults["guidance"]) == (4, 1.0)
        result = pipe.generate(PROMPT, width=64, height=48, steps=2, guidance=4.0, noise=init,
                               max_sequence_length=MAX_LEN["klein"], text_encoder_out_layers=small.TEXT_LAYERS)
    assert np.abs(result.latents - want_lat).max() <= LATENT_TOL


# ---------------------------------------------------------------------------------------------------- behaviour


def test_registry_seed_and_callback(folders):
    """The registry picks the pipeline by _class_name; a seed gives the same image twice; the callback sees every
    step's [B, 128 / 8 here, h, w] latents."""
    pipe = load_pipeline(folders["klein"], F32)
    try:
        assert isinstance(pipe, Flux2Pipeline) and pipe.kind == "Flux2KleinPipeline"
        seen = []
        kw = dict(width=32, height=32, steps=2, guidance=1.0, max_sequence_length=16,
                  text_encoder_out_layers=small.TEXT_LAYERS)
        a = pipe.generate(PROMPT, seed=3, callback=lambda i, n, lat, s: seen.append((i, n, lat.shape)), **kw)
        b = pipe.generate(PROMPT, seed=3, **kw)
        c = pipe.generate(PROMPT, seed=4, **kw)
    finally:
        pipe.close()
    assert seen == [(0, 2, (1, 16, 2, 2)), (1, 2, (1, 16, 2, 2))]
    assert a.stats.seed == 3 and np.array_equal(a.latents, b.latents)
    assert not np.array_equal(a.latents, c.latents)


def test_bad_requests(pipes):
    dev, klein = pipes["dev"], pipes["klein"]
    kw = dict(steps=1, max_sequence_length=16, text_encoder_out_layers=small.TEXT_LAYERS)
    with pytest.raises(InvalidRequestError, match="negative prompt"):
        dev.generate(PROMPT, negative_prompt="blurry", **kw)
    with pytest.raises(InvalidRequestError, match="edit_images"):
        klein.generate(PROMPT, image=_images()[0], strength=0.5, **kw)
    with pytest.raises(InvalidRequestError, match="too small"):
        klein.generate(PROMPT, edit_images=[Image.new("RGB", (48, 96))], **kw)
    with pytest.raises(InvalidRequestError, match="at most 4 edit images"):
        klein.generate(PROMPT, edit_images=_images() * 3, **kw)
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        klein.generate(PROMPT, edit_images=[Image.new("RGB", (64, 640))], **kw)
    with pytest.raises(InvalidRequestError, match="multiples of 16"):
        klein.generate(PROMPT, width=40, height=32, **kw)
    with pytest.raises(InvalidRequestError, match=r"noise has shape"):
        klein.generate(PROMPT, width=32, height=32, noise=small.noise((1, 16, 4, 4)), **kw)
    with pytest.raises(InvalidRequestError, match="joint_attention_dim"):
        klein.generate(PROMPT, steps=1, max_sequence_length=16, text_encoder_out_layers=(1, 2))
    with pytest.raises(InvalidRequestError, match="layers"):
        klein.generate(PROMPT, steps=1, max_sequence_length=16, text_encoder_out_layers=(1, 2, 9))


def test_unsupported_folder(folders, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(folders["klein"], folder)
    cfg = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**cfg, "patch_size": 2}))
    with pytest.raises(UnsupportedError, match="patch_size"):
        Flux2Pipeline(folder, F32)
