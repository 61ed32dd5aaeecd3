"""Images in prompts with Gemma 3's vision part, against transformers on a small random checkpoint: preprocessing,
the SigLIP tower, first-step logits and greedy tokens with one and two images, chunked prefill with a boundary inside
an image, prefix reuse that knows images, and bad input."""

from __future__ import annotations

import io

import numpy as np
import pytest

import mlx_engine
from mlx_engine.errors import InvalidRequestError
from mlx_engine.models.vision.images import ImageProcessor, load_image
from mlx_engine.models.vision.images import prompt_keys
from tests.hybrid_small import write_gguf
from tests.vision_small import IMAGE_SIZE, build_gemma3_vision, engine_logits_and_tokens, photo, reference_pixels

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gemma3v(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision") / "gemma3v"
    return folder, build_gemma3_vision(folder)


@pytest.fixture(scope="module")
def model(gemma3v):
    m = mlx_engine.load(str(gemma3v[0]), context_length=1024, dtype="float32")
    yield m
    m.close()


def _exif_rotated_jpeg(tmp_path):
    from PIL import Image

    img = photo(7, (40, 24))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.jpg"
    img.save(path, exif=exif.tobytes(), quality=95)
    return path


def test_preprocessing_equals_transformers(tmp_path):
    from transformers.image_utils import load_image as hf_load_image

    from PIL import Image

    transparent = photo(5, (30, 30), "P")
    transparent.info["transparency"] = 0
    images = [photo(1), photo(2, (20, 30), "RGBA"), photo(3, (64, 64), "L"), photo(4, (33, 17), "P"), transparent,
              photo(6, (300, 200)), Image.open(_exif_rotated_jpeg(tmp_path))]
    ours = np.stack([ImageProcessor(IMAGE_SIZE)(im) for im in images])
    want = reference_pixels(images).transpose(0, 2, 3, 1)
    assert np.abs(ours - want).max() <= 1e-5
    # a file as transformers' load_image reads it: EXIF orientation applied (40x24 shown as 24x40)
    path = _exif_rotated_jpeg(tmp_path)
    assert load_image(path).size == hf_load_image(str(path)).size == (24, 40)
    assert np.abs(ImageProcessor(IMAGE_SIZE)(path) - reference_pixels([hf_load_image(str(path))])[0]
                  .transpose(1, 2, 0)).max() <= 1e-5


def _reference(ref, model, tokens, images, n):
    """transformers' first-step logits and ``n`` greedy tokens for ``tokens`` with ``images``."""
    tt = torch.tensor([[1 if t == ref.config.image_token_index else 0 for t in tokens]])
    pixels = torch.tensor(reference_pixels(images))
    ids = torch.tensor([tokens])
    with torch.no_grad():
        first = ref(input_ids=ids, pixel_values=pixels, token_type_ids=tt).logits[0, -1].numpy()
        out = ref.generate(input_ids=ids, pixel_values=pixels, token_type_ids=tt, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return first, out[0, len(tokens):].tolist()


def test_tower_matches_transformers(gemma3v, model):
    _, ref = gemma3v
    pixels = np.stack([ImageProcessor(IMAGE_SIZE)(photo(i)) for i in (1, 2)])
    with torch.no_grad():
        want = ref.model.vision_tower(pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2)).last_hidden_state.numpy()
    with model.text_model.backend.new_context() as ctx:
        got = model.text_model.vision.tower_output(ctx, pixels).numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("count", [1, 2])
def test_logits_and_greedy_tokens_match_transformers(gemma3v, model, count):
    _, ref = gemma3v
    images = [photo(10 + i, (40 + 8 * i, 36)) for i in range(count)]
    tokens, placed = model.prompt_inputs("what is in these pictures?", images)
    assert [p.count for p in placed] == [16] * count
    ref_first, ref_tokens = _reference(ref, model, tokens, images, 32)
    first, got = engine_logits_and_tokens(model, tokens, placed, 32)
    assert np.abs(first - ref_first).max() <= 1e-3 * np.abs(ref_first).max()
    assert got == ref_tokens


def test_answers_depend_on_the_image(model):
    answers = {model.generate("what is this?", images=[photo(i)], max_tokens=12, temperature=0) for i in range(4)}
    assert len(answers) > 1


def test_a_chunk_boundary_inside_an_image_changes_nothing(gemma3v):
    folder, _ = gemma3v
    whole = mlx_engine.Model("g3v", folder, context_length=1024, dtype="float32", prefill_chunk=512)
    small = mlx_engine.Model("g3v", folder, context_length=1024, dtype="float32", prefill_chunk=12)
    tokens, placed = small.prompt_inputs("look", [photo(3)])
    start = placed[0].start
    assert start % 12 != 0 and (start + 16) // 12 > start // 12  # a 12-token boundary falls inside the image
    bounds = small.runner.chunk_bounds(0, len(tokens), [(start, start + 16)])
    assert all(not (start < e < start + 16) for _, e in bounds)
    assert small.generate("look", images=[photo(3)], max_tokens=16, temperature=0) == \
        whole.generate("look", images=[photo(3)], max_tokens=16, temperature=0)
    whole.close()
    small.close()


def test_prefix_reuse_knows_images(model):
    letters = {"response_format": {"type": "regex", "pattern": "[a-z ]{3,6}"}, "max_tokens": 6, "temperature": 0}
    session = model.chat_session(**letters)  # answers that tokenize back to themselves
    "".join(p for p in session.send("describe it", images=[photo(20)]) if isinstance(p, str))
    first = session.last_stats
    held = model.runner.cached_length(session.sequence)
    tokens, placed = model.chat_inputs(session.messages + [{"role": "user", "content": "and the colours?"}])
    assert model.runner.common_prefix(session.sequence, prompt_keys(tokens, placed)) == held  # image included
    "".join(p for p in session.send("and the colours?") if isinstance(p, str))
    second = session.last_stats
    assert first.prefilled_tokens == first.prompt_tokens
    assert second.prefilled_tokens == len(tokens) - held  # only the new message and its turn markers
    # the same words with another image at the same place: nothing from the image on is reused
    other = model.chat_session()
    other.messages = [{"role": "user", "content": "describe it", "images": [photo(21)]}]
    tokens, placed = model.chat_inputs(other.messages)
    assert model.runner.common_prefix(session.sequence, prompt_keys(tokens, placed)) == placed[0].start


def test_bad_image_input(model, tmp_path, smollm2_model):
    not_image = tmp_path / "notes.txt"
    not_image.write_text("hello")
    with pytest.raises(InvalidRequestError, match="not an image"):
        model.generate("what is this?", images=[not_image])
    with pytest.raises(InvalidRequestError, match="no such image file"):
        model.generate("what is this?", images=[str(tmp_path / "missing.png")])
    with pytest.raises(InvalidRequestError, match="URLs are not fetched"):
        model.generate("what is this?", images=["https://example.com/cat.png"])
    with pytest.raises(InvalidRequestError, match="cannot read images"):
        smollm2_model.generate("what is this?", images=[photo(1)])
    buf = io.BytesIO()
    photo(1).save(buf, format="PNG")
    assert model.generate("what is this?", images=[buf.getvalue()], max_tokens=2, temperature=0)
    tiny = mlx_engine.load(str(model.path), context_length=24, dtype="float32")
    with pytest.raises(InvalidRequestError, match="context holds 24"):
        tiny.generate("what is this?", images=[photo(1)])
    tiny.close()


def test_the_server_reads_images_from_both_apis(gemma3v, model, tmp_path, monkeypatch):
    import base64

    import httpx
    import ollama
    import openai

    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    folder, _ = gemma3v
    buf = io.BytesIO()
    photo(30).save(buf, format="PNG")
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
        r = client.chat.completions.create(model=str(folder), messages=[{"role": "user", "content": parts}],
                                           max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want
        o = ollama.Client(host=srv.url).chat(model=str(folder), options={"num_predict": 8, "temperature": 0},
                                             messages=[{"role": "user", "content": "what is this?", "images": [b64]}])
        assert o.message.content == want
        with pytest.raises(openai.BadRequestError, match="data: URL"):
            client.chat.completions.create(model=str(folder), max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}])
        # bad images: a 400 that says what is wrong, and the server goes on
        from PIL import Image

        huge = io.BytesIO()
        Image.new("L", (9000, 8000)).save(huge, format="PNG")  # 72M pixels in a small file
        bad = [("not base64 at all!" * 8, "is not valid base64"),
               (base64.b64encode(b"not an image" * 20).decode(), "not an image"),
               (base64.b64encode(huge.getvalue()).decode(), "at most")]
        for image, message in bad:
            r = httpx.post(srv.url + "/api/chat", json={"model": str(folder), "stream": False, "messages": [
                {"role": "user", "content": "what is this?", "images": [image]}]})
            assert r.status_code == 400 and message in r.json()["error"], r.text
        o = ollama.Client(host=srv.url).chat(model=str(folder), options={"num_predict": 8, "temperature": 0},
                                             messages=[{"role": "user", "content": "what is this?", "images": [b64]}])
        assert o.message.content == want
    finally:
        srv.stop()


def test_the_cli_reads_images(gemma3v, model, tmp_path, home):
    from tests.test_cli import invoke

    folder, _ = gemma3v
    path = tmp_path / "photo.png"
    photo(40).save(path)
    want = model.generate("What is in this picture?", images=[path], max_tokens=6, temperature=0)
    r = invoke("run", str(folder), "What is in this picture?", "--image", str(path), "--max-tokens", "6",
               "--temperature", "0")
    assert r.exit_code == 0 and r.output.rstrip("\n") == want.rstrip("\n")
    r = invoke("run", str(folder), "What?", "--image", str(tmp_path / "missing.png"))
    assert r.exit_code != 0 and "no such image file" in r.output
    # chat: /image attaches to the next message; a path typed into a message is attached too (and taken out)
    script = f"/image {path}\nWhat is in this picture?\nand this {path}\n/bye\n"
    r = invoke("chat", str(folder), "--max-tokens", "6", "--temperature", "0", input=script)
    assert r.exit_code == 0, r.output
    first = model.chat([{"role": "user", "content": "What is in this picture?", "images": [path]}], max_tokens=6,
                       temperature=0)
    assert f"Attached {path.name}" in r.output and first.strip() in r.output


def test_a_text_model_with_llama_cpps_mmproj_file_reads_images(gemma3v, model, tmp_path):
    from mlx_engine.errors import UnsupportedError, WeightsError
    from tests.vision_small import mmproj_gguf, text_only_folder

    folder, ref = gemma3v
    text = text_only_folder(folder, tmp_path / "text")
    mmproj = mmproj_gguf(ref, tmp_path / "mmproj.gguf")
    assert mlx_engine.Model("text", text, dtype="float32").text_model.vision is None  # text alone reads no image
    paired = mlx_engine.Model("paired", text, dtype="float32", context_length=1024, mmproj=mmproj)
    pixels = np.stack([ImageProcessor(IMAGE_SIZE)(photo(50))])
    with paired.text_model.backend.new_context() as ctx:
        a = paired.text_model.vision.tower_output(ctx, pixels).numpy()
    with model.text_model.backend.new_context() as ctx:
        b = model.text_model.vision.tower_output(ctx, pixels).numpy()
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    ask = dict(images=[photo(50)], max_tokens=12, temperature=0)
    assert paired.generate("what is this?", **ask) == model.generate("what is this?", **ask)
    paired.close()
    from tests.test_cli import invoke

    r = invoke("run", str(text), "what is this?", "--mmproj", str(mmproj), "--image", str(_png(tmp_path, 50)),
               "--max-tokens", "12", "--temperature", "0")
    assert r.exit_code == 0 and r.output.rstrip("\n") == model.generate("what is this?", **ask).rstrip("\n")
    # an mmproj that does not belong to the text model, and one of another projector: refused, nothing loaded
    with pytest.raises(UnsupportedError, match="goes with a Gemma 3 model"):
        mlx_engine.Model("x", _qwen3_folder(tmp_path), mmproj=mmproj)
    import gguf

    reader = gguf.GGUFReader(str(mmproj))
    narrow = tmp_path / "narrow.gguf"
    w = gguf.GGUFWriter(str(narrow), "clip")
    for name, f in reader.fields.items():
        if not name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        a = np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
        w.add_tensor(t.name, a[:, :32] if t.name == "mm.input_projection.weight" else a)
    write_gguf(w)
    with pytest.raises(WeightsError, match="do not belong together"):
        mlx_engine.Model("x", text, mmproj=narrow)


def _qwen3_folder(tmp_path):
    from tests.test_distributed import _hf_folder

    return _hf_folder(tmp_path)


def _png(tmp_path, seed: int):
    path = tmp_path / f"photo{seed}.png"
    photo(seed).save(path)
    return path


def test_ollamas_vision_tensors_read_like_the_folder(gemma3v, model, tmp_path):
    from mlx_engine.mlx import MLXBackend
    from mlx_engine.models.vision.vision import Gemma3Vision
    from tests.vision_small import ollama_vision_gguf

    _, ref = gemma3v
    backend = MLXBackend(ollama_vision_gguf(ref, tmp_path / "blob.gguf"), dtype="float32")
    vision = Gemma3Vision.from_backend(backend, model.text_model.config.hidden_size, model.tokenizer.token_to_id)
    pixels = ImageProcessor(IMAGE_SIZE)(photo(60))
    ours, want = vision.encode(pixels).numpy(), model.text_model.vision.encode(pixels).numpy()
    assert np.abs(ours - want).max() <= 1e-5 * np.abs(want).max()
    theirs = model.text_model.vision
    assert (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id, vision.tokens_per_image) == \
        (theirs.image_token_id, theirs.boi_token_id, theirs.eoi_token_id, theirs.tokens_per_image)
    backend.close()
