"""FLUX.2 (dev, klein) and Qwen-Image-Edit (Edit, Edit Plus) at every door, end to end on the small random folders of
``tests/flux2_small.py`` and ``tests/qwen_image_edit_small.py`` (their parity with diffusers is
tests/test_imagegen_flux2.py's and tests/test_imagegen_qwen_image_edit.py's): ``mlx-engine image`` (with ``--edit``,
once or twice, and without) writes a PNG that decodes, whose metadata records each edit image's path and sha256, and
from which ``--from-metadata`` (given the same ``--edit`` files again) makes the same pixels; the server's
``/v1/images/generations`` and ``/v1/images/edits`` answer the real ``openai`` client with the image the Python API
makes for the same seed, and a 400 that says what to do when a model needs an image to edit and gets none.

Kept lean: two steps at 32-64 pixels; the FLUX.2 folders say (``mlx_engine.json``) to stack the small text
encoder's hidden states 1, 2, 4 over 16 tokens, as the parity tests do; the Qwen-Image-Edit VAE area is 256 x 256
instead of 1024 x 1024 (``VAE_AREA``, as the Plus parity test: the same code runs).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("torch")

from PIL import Image  # noqa: E402

import mlx_engine  # noqa: E402
from tests import flux2_small  # noqa: E402
from tests.qwen_image_edit_small import build_folder as build_qwen_edit  # noqa: E402

PROMPT = "make the circle green"
#: (folder, edit images given, width, height) of each command-line run
CLI_CASES = [("flux2-dev", 0, 32, 48), ("flux2-dev", 1, None, None), ("flux2-klein", 2, 48, 32),
             ("qwen-edit", 1, 64, 64), ("qwen-edit-plus", 2, 64, 48)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("edit-doors")
    out = {}
    for kind in ("dev", "klein"):
        f = flux2_small.build_folder(root / f"flux2-{kind}", kind)
        (f / "mlx_engine.json").write_text(json.dumps({
            "max_sequence_length": 16, "text_encoder_out_layers": list(flux2_small.TEXT_LAYERS)}))
        out[f"flux2-{kind}"] = f
    out["qwen-edit"] = build_qwen_edit(root / "qwen-edit")
    out["qwen-edit-plus"] = build_qwen_edit(root / "qwen-edit-plus", plus=True)
    return out


@pytest.fixture(scope="module", autouse=True)
def small_vae_area():
    from mlx_engine.imagegen import qwen_image_edit

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen_image_edit, "VAE_AREA", 256 * 256)
        yield


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """Two PNGs of random pixels, 72x80 and 100x64 (FLUX.2 crops them to 64x80 and 96x64)."""
    rng = np.random.default_rng(5)
    folder = tmp_path_factory.mktemp("photos")
    out = []
    for i, (h, w) in enumerate([(80, 72), (64, 100)]):
        p = folder / f"photo{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(p)
        out.append(p)
    return out


def _pixels(path_or_image) -> np.ndarray:
    im = Image.open(path_or_image) if isinstance(path_or_image, (str, Path)) else path_or_image
    return np.asarray(im.convert("RGB"))


@pytest.mark.parametrize("name,edits,width,height", CLI_CASES,
                         ids=[f"{name}-{edits}-edits" for name, edits, _, _ in CLI_CASES])
def test_cli_end_to_end(folders, photos, tmp_path, name, edits, width, height):
    from click.testing import CliRunner

    from mlx_engine.cli.main import main

    def run(*args):
        r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return Path(r.output.strip().splitlines()[-1])

    folder, files = folders[name], photos[:edits]
    edit_args = [a for f in files for a in ("--edit", f)]
    size = ["--width", width, "--height", height] if width else []
    first = run("image", PROMPT, "-m", folder, *edit_args, *size, "--seed", 3, "--steps", 2, "-q", "-o",
                tmp_path / "a.png")
    with Image.open(first) as im:
        assert im.format == "PNG"
    a = _pixels(first)
    want_size = (width, height) if width else (64, 80)  # FLUX.2: the first edit image's cropped size
    assert a.shape == (want_size[1], want_size[0], 3) and a.std() > 0
    params = mlx_engine.read_image_parameters(first)
    assert params["seed"] == 3 and params["steps"] == 2 and (params["width"], params["height"]) == want_size
    assert params.get("edit_images", []) == [str(f.resolve()) for f in files]
    assert params.get("edit_images_sha256", []) == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    again = run("image", "--from-metadata", first, "-m", folder, *edit_args, "-q", "-o", tmp_path / "b.png")
    assert np.array_equal(a, _pixels(again))


def test_server_with_openai_client(folders, photos, tmp_path):
    """Each folder through ``client.images.generate`` (FLUX.2) and ``client.images.edit`` (one image, or ``image[]``
    for two): the PNG the API makes with the same seed; an edit model asked to generate without an image, 400."""
    import openai

    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    def decoded(r) -> np.ndarray:
        return _pixels(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))))

    root = next(iter(folders.values())).parent
    srv = RunningServer(ServerConfig(port=free_port(), store_root=str(tmp_path / "home"), models_dirs=[str(root)]))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        for name, size in (("flux2-dev", (32, 48)), ("flux2-klein", (48, 32))):
            model = str(folders[name])
            r = client.images.generate(model=model, prompt=PROMPT, size=f"{size[0]}x{size[1]}",
                                       extra_body={"seed": 4, "steps": 2})
            want = mlx_engine.generate_image(PROMPT, model=model, width=size[0], height=size[1], seed=4, steps=2)
            got = decoded(r)
            assert got.shape == (size[1], size[0], 3) and np.array_equal(got, _pixels(want)), name
        for name, edits in (("flux2-dev", 1), ("flux2-klein", 2), ("qwen-edit", 1), ("qwen-edit-plus", 2)):
            model, files = str(folders[name]), photos[:edits]
            image = files[0].open("rb") if edits == 1 else [f.open("rb") for f in files]
            r = client.images.edit(model=model, image=image, prompt=PROMPT, size="64x48",
                                   extra_body={"seed": 5, "steps": 2})
            want = mlx_engine.generate_image(PROMPT, model=model, edit_images=files, width=64, height=48, seed=5,
                                             steps=2)
            got = decoded(r)
            assert got.shape == (48, 64, 3) and np.array_equal(got, _pixels(want)), name
        with pytest.raises(openai.BadRequestError, match="edits an image"):
            client.images.generate(model=str(folders["qwen-edit"]), prompt=PROMPT, size="64x64",
                                   extra_body={"steps": 1})
    finally:
        srv.stop()
