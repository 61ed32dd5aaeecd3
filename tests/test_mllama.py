"""Llama 3.2 Vision (Mllama) against transformers on a small random checkpoint: the tiling processor, the vision
encoder, first-step logits and 32 greedy tokens with one and two images, the encoder cache's life (chunked prefill,
prefix reuse, several sequences in one batch), and bad input.

transformers' port differs from Meta's reference in one line: for a token that sees no image (the text before the
first one) it zeroes the cross-attention layer's MLP output but not its attention output, so that text depends on
the image after it. We follow Meta (and vLLM): both are zeroed. The chat comparisons run transformers with that line
as Meta wrote it (``_meta_rule``); a prompt that starts with its image has no such token, and is compared with
transformers as it is."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.models.arch.mllama import cross_attention_mask
from mlx_engine.models.vision.mllama_vision import CLIP_MEAN, CLIP_STD, TiledImageProcessor, fit_size, tile_grid
from mlx_engine.models.generation.runner import GenerationStats, Request
from mlx_engine.models.vision.images import prompt_keys
from mlx_engine.models.generation.sampler import SamplerOptions
from tests.mllama_small import TILE, build_mllama
from tests.vision_small import engine_logits_and_tokens, photo

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mllama") / "mllama"
    return folder, build_mllama(folder)


@pytest.fixture(scope="module")
def model(mllama):
    m = mlx_engine.load(str(mllama[0]), context_length=1024, dtype="float32")
    yield m
    m.close()


def _hf_processor():
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    return MllamaImageProcessorPil(size={"height": TILE, "width": TILE}, max_image_tiles=4, image_mean=list(CLIP_MEAN),
                                   image_std=list(CLIP_STD))


@contextlib.contextmanager
def _meta_rule():
    """transformers' cross-attention layer with the attention output of a row that sees no image zeroed too, as in
    Meta's ``CrossAttention.forward`` (``output = output * full_text_row_masked_out_mask``)."""
    from transformers.models.mllama import modeling_mllama as mm

    layer = mm.MllamaCrossAttentionDecoderLayer
    original = layer.forward

    def forward(self, hidden_states, cross_attention_states, cross_attention_mask, attention_mask,
                full_text_row_masked_out_mask, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        attended, _ = self.cross_attn(hidden_states=self.input_layernorm(hidden_states),
                                      attention_mask=cross_attention_mask,
                                      cross_attention_states=cross_attention_states,
                                      past_key_values=past_key_values, **kwargs)
        if full_text_row_masked_out_mask is not None:
            attended = full_text_row_masked_out_mask[:, 0] * attended
        hidden_states = hidden_states + self.cross_attn_attn_gate.tanh() * attended
        m = self.mlp(self.post_attention_layernorm(hidden_states))
        if full_text_row_masked_out_mask is not None:
            m = full_text_row_masked_out_mask[:, 0] * m
        return hidden_states + self.cross_attn_mlp_gate.tanh() * m

    layer.forward = forward
    try:
        yield
    finally:
        layer.forward = original


def _reference(folder, tokens, images, image_id, n):
    """transformers' first-step logits and ``n`` greedy tokens (its processor's pixels and cross-attention mask),
    from the model loaded now (so that a patched layer class applies: loading wraps each layer's forward)."""
    from transformers import MllamaForConditionalGeneration
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    ref = MllamaForConditionalGeneration.from_pretrained(folder).eval()

    px = _hf_processor()(images=[list(images)], return_tensors="np")
    xmask = convert_sparse_cross_attention_mask_to_dense([get_cross_attention_token_mask(tokens, image_id)],
                                                         px["num_tiles"], 4, len(tokens))
    kw = dict(input_ids=torch.tensor([tokens]), pixel_values=torch.tensor(px["pixel_values"]),
              aspect_ratio_ids=torch.tensor(px["aspect_ratio_ids"]),
              aspect_ratio_mask=torch.tensor(px["aspect_ratio_mask"]), cross_attention_mask=torch.tensor(xmask),
              attention_mask=torch.ones(1, len(tokens), dtype=torch.long))  # (token 0 is BOS here, not padding)
    with torch.no_grad():
        out = ref.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.logits[0][0].numpy(), out.sequences[0, len(tokens):].tolist()


def test_tiling_equals_transformers():
    from transformers.models.mllama.image_processing_pil_mllama import (get_image_size_fit_to_canvas,
                                                                        get_optimal_tiled_canvas)

    for h in (1, 7, 16, 17, 31, 32, 48, 65, 200):
        for w in (1, 9, 16, 30, 33, 64, 120):
            canvas = get_optimal_tiled_canvas(h, w, 4, TILE)
            assert tuple(t * TILE for t in tile_grid(h, w, 4, TILE)) == tuple(int(c) for c in canvas)
            assert fit_size(h, w, *canvas, TILE) == tuple(int(s) for s in get_image_size_fit_to_canvas(
                h, w, int(canvas[0]), int(canvas[1]), TILE))


def test_preprocessing_equals_transformers():
    transparent = photo(5, (30, 30), "P")
    transparent.info["transparency"] = 0
    images = [photo(1), photo(2, (20, 30), "RGBA"), photo(3, (64, 64), "L"), photo(4, (33, 17), "P"), transparent,
              photo(6, (300, 200)), photo(7, (10, 60)), photo(8, (9, 9))]
    proc = TiledImageProcessor(TILE, 4)
    for img in images:
        ours = proc(img)
        want = _hf_processor()(images=[[img]], return_tensors="np")
        rows, cols = ours.shape[:2]
        assert want["num_tiles"] == [[rows * cols]]
        pixels = want["pixel_values"][0, 0, :rows * cols].transpose(0, 2, 3, 1)
        assert np.abs(ours.reshape(rows * cols, TILE, TILE, 3) - pixels).max() <= 1e-5


def test_vision_encoder_matches_transformers(mllama, model):
    _, ref = mllama
    vision = model.text_model.vision
    for img in (photo(11, (48, 40)), photo(12, (16, 50)), photo(13, (12, 12))):
        px = _hf_processor()(images=[[img]], return_tensors="np")
        with torch.no_grad():
            want = ref.model.vision_model(pixel_values=torch.tensor(px["pixel_values"]),
                                          aspect_ratio_ids=torch.tensor(px["aspect_ratio_ids"]),
                                          aspect_ratio_mask=torch.tensor(px["aspect_ratio_mask"])).last_hidden_state
        want = want[0, 0, :px["num_tiles"][0][0]].numpy()
        with vision.backend.new_context() as ctx:
            got = vision.hidden_states(ctx, vision.processor(img)).numpy()
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("count", [1, 2])
def test_chat_logits_and_greedy_tokens_match_transformers(mllama, model, count):
    folder, _ = mllama
    images = [photo(20 + i, (48 - 20 * i, 40 + 10 * i)) for i in range(count)]
    content = [{"type": "image", "image": images[0]}, {"type": "text", "text": "What is in this picture?"}]
    if count == 2:
        content += [{"type": "image", "image": images[1]}, {"type": "text", "text": "And here?"}]
    tokens, placed = model.chat_inputs([{"role": "user", "content": content}])
    assert [p.count for p in placed] == [1] * count and placed[0].start > 0  # text before the first image
    with _meta_rule():
        ref_first, ref_tokens = _reference(folder, tokens, images, model.text_model.vision.image_token_id, 32)
    first, got = engine_logits_and_tokens(model, tokens, placed, 32)
    assert np.abs(first - ref_first).max() <= 1e-3 * np.abs(ref_first).max()
    assert got == ref_tokens


def test_a_prompt_that_starts_with_its_image_matches_transformers_as_it_is(mllama, model):
    folder, _ = mllama
    images = [photo(30), photo(31, (20, 60))]
    tokens, placed = model.prompt_inputs("what is this?", images, raw=True)
    image_id = model.text_model.vision.image_token_id
    skip = placed[0].start  # a BOS, where the tokenizer adds one: no token before the images, so that
    tokens = tokens[skip:]  # transformers' and Meta's rules agree
    placed = [type(p)(p.start - skip, p.count, p.pixels) for p in placed]
    assert tokens[:2] == [image_id, image_id]  # adjacent images: one group
    ref_first, ref_tokens = _reference(folder, tokens, images, image_id, 32)
    first, got = engine_logits_and_tokens(model, tokens, placed, 32)
    assert np.abs(first - ref_first).max() <= 1e-3 * np.abs(ref_first).max()
    assert got == ref_tokens


def test_text_without_images_matches_transformers(mllama, model):
    _, ref = mllama
    tokens = model.tokenizer.encode("a text prompt with no image at all")
    with torch.no_grad():
        want = ref.generate(input_ids=torch.tensor([tokens]),
                            attention_mask=torch.ones(1, len(tokens), dtype=torch.long),  # (token 0 is no padding)
                            max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(tokens):].tolist()
    assert engine_logits_and_tokens(model, tokens, [], 16)[1] == want


def test_the_cross_attention_mask_is_the_processors():
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    rng = np.random.default_rng(0)
    for _ in range(40):
        n = 30
        ids = rng.integers(10, 20, n)
        places = sorted(rng.choice(n, rng.integers(1, 5), replace=False).tolist())
        if rng.random() < 0.4 and places[-1] + 1 < n:
            places.append(places[-1] + 1)  # a run of adjacent images
        ids[places] = 1
        rows = rng.integers(1, 4, len(places)).tolist()
        dense = convert_sparse_cross_attention_mask_to_dense([get_cross_attention_token_mask(ids.tolist(), 1)],
                                                             [rows], 4, n)[0]  # [n, images, tiles]
        want = np.concatenate([dense[:, i, :r] for i, r in enumerate(rows)], axis=1).astype(bool)
        visible, sees = cross_attention_mask([(0, p, r) for p, r in zip(places, rows)], np.zeros(n, np.int32),
                                             np.arange(n, dtype=np.int32))
        assert (visible == want).all() and (sees == want.any(axis=1)).all()
    # tokens of another sequence never see the image
    visible, sees = cross_attention_mask([(1, 0, 2)], np.array([0, 1]), np.array([5, 5]))
    assert sees.tolist() == [False, True]


def test_answers_depend_on_the_image(model):
    answers = {model.generate("what is this?", images=[photo(i)], max_tokens=12, temperature=0) for i in range(4)}
    assert len(answers) > 1


def test_chunked_prefill_and_batches_change_nothing(mllama, model):
    folder, _ = mllama
    small = mlx_engine.Model("mllama", folder, context_length=1024, dtype="float32", prefill_chunk=5)
    ask = dict(images=[photo(40), photo(41, (40, 16))], max_tokens=16, temperature=0)
    prompt = "look at the first picture, then compare it with this one"
    tokens, placed = small.prompt_inputs(prompt, ask["images"])
    assert len(small.runner.chunk_bounds(0, len(tokens), [])) > 3
    assert small.generate(prompt, **ask) == model.generate(prompt, **ask)
    small.close()
    # three sequences decoded together (two with images, one without) give what each gives alone
    runner = model.runner
    reqs = []
    for seq, images in enumerate(([photo(42)], [], [photo(43), photo(44)])):
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": "describe"}]
        tokens, placed = model.chat_inputs([{"role": "user", "content": content}])
        reqs.append(Request(tokens, SamplerOptions(temperature=0.0), max_tokens=12, sequence=seq, images=placed))
    alone = []
    for r in reqs:
        runner.reset()
        alone.append(list(runner.generate_tokens(Request(r.tokens, r.sampler, r.max_tokens, images=r.images),
                                                 GenerationStats())))
    runner.reset()
    assert runner.generate_batch(reqs) == alone
    runner.reset()


def test_prefix_reuse_knows_images(model):
    letters = {"response_format": {"type": "regex", "pattern": "[a-z]{3,6}"}, "max_tokens": 6, "temperature": 0}
    session = model.chat_session(**letters)  # answers that tokenize back to themselves
    "".join(p for p in session.send("describe it", images=[photo(50)]) if isinstance(p, str))
    first = session.last_stats
    held = model.runner.cached_length(session.sequence)
    tokens, placed = model.chat_inputs(session.messages + [{"role": "user", "content": "and the colours?"}])
    reused = model.runner.common_prefix(session.sequence, prompt_keys(tokens, placed))
    assert held - 1 <= reused and reused > placed[0].start  # the image included; a stop token the template
    "".join(p for p in session.send("and the colours?") if isinstance(p, str))  # writes otherwise runs again
    second = session.last_stats
    assert first.prefilled_tokens == first.prompt_tokens
    assert second.prefilled_tokens == len(tokens) - reused  # only the new message and its turn markers
    # the same words with another image at the same place: nothing from the image on is reused
    other = [{"role": "user", "content": "describe it", "images": [photo(51)]}]
    tokens, placed = model.chat_inputs(other)
    assert model.runner.common_prefix(session.sequence, prompt_keys(tokens, placed)) == placed[0].start
    # and the answer is the fresh one: the old image's keys left the encoder cache with its position
    fresh = mlx_engine.Model("fresh", model.path, context_length=1024, dtype="float32")
    want = fresh.chat(other, **letters)
    fresh.close()
    session.messages = list(other)
    session.messages.pop()
    reply = "".join(p for p in session.send("describe it", images=[photo(51)]) if isinstance(p, str))
    assert reply == want


def test_bad_input(mllama, model, tmp_path):
    with pytest.raises(InvalidRequestError, match="2 image place"):
        model.text_model.vision.place(model.tokenizer.encode("<|image|> a <|image|>"), [photo(1)])
    with pytest.raises(InvalidRequestError, match="not a tiling"):
        with model.text_model.backend.new_context() as ctx:
            model.text_model.vision.hidden_states(ctx, np.zeros((3, 2, TILE, TILE, 3), np.float32))
    with pytest.raises(UnsupportedError, match="goes with a Gemma 3 model"):  # llama.cpp's mmproj files
        mlx_engine.Model("x", mllama[0], mmproj=tmp_path / "mmproj.gguf")
    import gguf

    from tests.hybrid_small import write_gguf

    w = gguf.GGUFWriter(str(tmp_path / "mllama.gguf"), "mllama")  # ollama's form of the model
    w.add_uint32("mllama.block_count", 2)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    write_gguf(w)
    with pytest.raises(UnsupportedError, match="Hugging Face folders"):
        mlx_engine.load(str(tmp_path / "mllama.gguf"))
    # a projector that does not fit the text model: refused at load, nothing half loaded
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(mllama[0], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["multi_modal_projector.weight"] = tensors["multi_modal_projector.weight"][:, :40]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="do not belong together"):
        mlx_engine.load(str(bad))
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["cross_attention_layers"] = [1, 9]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="cross_attention_layers"):
        mlx_engine.load(str(bad))


def test_every_door_reads_images(mllama, model, tmp_path, home, monkeypatch):
    import base64
    import io

    import ollama
    import openai

    from mlx_engine.server import ServerConfig
    from tests.test_cli import invoke
    from tests.test_server import RunningServer, free_port

    folder, _ = mllama
    path = tmp_path / "photo.png"
    photo(60).save(path)
    want = model.generate("What is in this picture?", images=[path], max_tokens=8, temperature=0)
    r = invoke("run", str(folder), "What is in this picture?", "--image", str(path), "--max-tokens", "8",
               "--temperature", "0")
    assert r.exit_code == 0 and r.output.rstrip("\n") == want.rstrip("\n")
    buf = io.BytesIO()
    photo(61).save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    want = model.chat([{"role": "user", "content": "what is this?", "images": [buf.getvalue()]}], max_tokens=8,
                      temperature=0)
    monkeypatch.setenv("MLX_ENGINE_HOME", str(tmp_path / "home"))
    srv = RunningServer(ServerConfig(port=free_port(), models=[str(folder)], max_sequences=2, context_length=1024,
                                     store_root=str(tmp_path / "home")))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                 {"type": "text", "text": "what is this?"}]
        cached = []
        for _ in range(2):  # the second from the server's prefix cache (the image's keys shared)
            r = client.chat.completions.create(model=str(folder), messages=[{"role": "user", "content": parts}],
                                               max_tokens=8, temperature=0)
            assert r.choices[0].message.content == want
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        image_at = model.chat_inputs([{"role": "user", "content": "what is this?", "images": [b64]}])[1][0].start
        assert cached[0] == 0 and cached[1] > image_at
        o = ollama.Client(host=srv.url).chat(model=str(folder), options={"num_predict": 8, "temperature": 0},
                                             messages=[{"role": "user", "content": "what is this?", "images": [b64]}])
        assert o.message.content == want
    finally:
        srv.stop()
