"""``mlx-engine image`` end to end on a small random Z-Image folder saved by diffusers (``tests/zimage_small.py``):
files, PNG metadata and its round trip (``--from-metadata`` reproduces the same pixels), no overwriting, image to
image, Ctrl-C, and clear errors (missing component folder, unsupported size, corrupt weights)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("diffusers")
pytest.importorskip("torch")

from PIL import Image  # noqa: E402

import mlx_engine  # noqa: E402
from mlx_engine.cli.main import main  # noqa: E402
from mlx_engine.imagegen.metadata import read_png_parameters  # noqa: E402
from tests.zimage_small import build_folder, copy_folder  # noqa: E402

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("zimage-cli") / "small-zimage")


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).copy()


def test_writes_numbered_files_with_metadata(folder, workdir):
    (workdir / "image-0001.png").write_bytes(b"not mine")  # an existing file is never overwritten
    r = invoke("image", PROMPT, "--model", folder, "--width", 64, "--height", 32, "--steps", 2, "--seed", 5)
    assert r.exit_code == 0, r.output
    out = workdir / "image-0002.png"
    assert r.stdout.strip() == "image-0002.png"
    assert (workdir / "image-0001.png").read_bytes() == b"not mine"
    with Image.open(out) as im:
        assert im.size == (64, 32) and im.format == "PNG"
        text = dict(im.text)
    assert text["prompt"] == PROMPT and text["seed"] == "5" and text["steps"] == "2"
    assert text["width"] == "64" and text["height"] == "32" and text["guidance"] == "0.0"
    assert text["model"] == str(folder.resolve())
    assert text["engine_version"] == mlx_engine.__version__
    # the progress bar and the summary go to stderr
    assert "denoising" in r.stderr and "s/step" in r.stderr and "peak" in r.stderr and "seed 5" in r.stderr

    r2 = invoke("image", PROMPT, "--model", folder, "--width", 64, "--height", 32, "--steps", 2, "--seed", 5, "-q")
    assert r2.exit_code == 0 and r2.stdout.strip() == "image-0003.png"
    assert np.array_equal(pixels(out), pixels(workdir / "image-0003.png"))  # same seed, same pixels
    assert not list(workdir.glob(".image-*"))  # no temporary files left


def test_from_metadata_reproduces_the_pixels(folder, workdir):
    r = invoke("image", "a green square", "--model", folder, "--width", 48, "--height", 64, "--steps", 3,
               "--guidance", 2.0, "--negative-prompt", "blurry", "-o", "first.png")  # random seed
    assert r.exit_code == 0, r.output
    meta = read_png_parameters(workdir / "first.png")
    assert isinstance(meta["seed"], int) and meta["negative_prompt"] == "blurry" and meta["guidance"] == 2.0
    assert meta["steps"] == 3 and (meta["width"], meta["height"]) == (48, 64)

    # paths named in a PNG are not followed unless given again: the model folder is named, not loaded
    r = invoke("image", "--from-metadata", "first.png", "--steps", 1, "-o", "default-model.png")
    assert f"the metadata names model {str(folder.resolve())!r}" in r.stderr and "--model" in r.stderr
    assert read_png_parameters(workdir / "default-model.png")["model"] != str(folder.resolve())

    r = invoke("image", "--from-metadata", "first.png", "--model", folder, "-o", "again.png")
    assert r.exit_code == 0, r.output
    assert np.array_equal(pixels(workdir / "first.png"), pixels(workdir / "again.png"))
    again = read_png_parameters(workdir / "again.png")
    assert {k: again[k] for k in meta} == meta

    # an option on the command line wins over the file's
    r = invoke("image", "--from-metadata", "first.png", "--model", folder, "--seed", meta["seed"] + 1, "-o",
               "other.png")
    assert r.exit_code == 0
    assert read_png_parameters(workdir / "other.png")["seed"] == meta["seed"] + 1
    assert not np.array_equal(pixels(workdir / "first.png"), pixels(workdir / "other.png"))


def test_image_to_image(folder, workdir):
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)).save("init.png")
    r = invoke("image", PROMPT, "--model", folder, "--image", "init.png", "--strength", 0.5, "--steps", 4,
               "--seed", 1, "-o", "out")
    assert r.exit_code == 0, r.output
    meta = read_png_parameters(workdir / "out.png")  # a suffix is added
    assert meta["strength"] == 0.5 and meta["init_image"] == str((workdir / "init.png").resolve())
    assert pixels(workdir / "out.png").shape == (32, 48, 3)  # the init image's size
    r = invoke("image", "--from-metadata", "out.png", "-o", "ignored.png")
    assert "the metadata names init image" in r.stderr and "--image" in r.stderr  # not read without --image
    r = invoke("image", "--from-metadata", "out.png", "--model", folder, "--image", "init.png", "-o", "out2.png")
    assert r.exit_code == 0, r.output
    assert np.array_equal(pixels(workdir / "out.png"), pixels(workdir / "out2.png"))


def test_output_folder_and_explicit_file(folder, workdir):
    (workdir / "pics").mkdir()
    r = invoke("image", PROMPT, "-m", folder, "--width", 32, "--height", 32, "--steps", 1, "--seed", 1, "-o", "pics")
    assert r.exit_code == 0 and r.stdout.strip() == str(Path("pics", "image-0001.png"))
    r = invoke("image", PROMPT, "-m", folder, "--width", 32, "--height", 32, "--steps", 1, "--seed", 2, "-o",
               "pics/image-0001.png")  # an explicit file name is replaced
    assert r.exit_code == 0 and read_png_parameters(workdir / "pics" / "image-0001.png")["seed"] == 2


@pytest.mark.parametrize("args,message", [
    (["--width", 60], "unsupported width 60: width and height must be multiples of 16"),
    (["--height", 4096], "unsupported height 4096"),
    (["--steps", 0], "Invalid value for '--steps'"),
    (["--strength", 0.5, "--image", "missing.png"], "missing.png: no such init image file"),
    (["-o", "no/such/folder/x.png"], "no such folder"),
    (["--strength", 0.5], "--strength applies to image to image"),
], ids=["width", "height", "steps", "init-image", "output-folder", "strength-without-image"])
def test_request_errors(folder, workdir, args, message):
    r = invoke("image", PROMPT, "--model", folder, *args)
    assert r.exit_code != 0 and message in r.output
    if r.exit_code == 1 and "Invalid value" not in r.output:
        assert r.output.splitlines()[-1].startswith("Error: ") and "Traceback" not in r.output
    assert not list(workdir.iterdir())


def test_model_errors(folder, workdir, tmp_path, monkeypatch):
    from mlx_engine import api
    from mlx_engine.api import image as image_api

    monkeypatch.setattr(api, "DEFAULT_IMAGE_MODEL", None)  # what the CLI names
    monkeypatch.setattr(image_api, "DEFAULT_IMAGE_MODEL", None)  # what loading falls back to
    r = invoke("image", PROMPT)
    assert r.exit_code == 1 and r.output.startswith("Error: no image model given")
    r = invoke("image", PROMPT, "--model", tmp_path / "missing")
    assert r.exit_code == 1 and "no such image model" in r.output
    r = invoke("image")
    assert r.exit_code == 1 and "no prompt" in r.output

    no_vae = copy_folder(folder, tmp_path / "no-vae")
    shutil.rmtree(no_vae / "vae")
    r = invoke("image", PROMPT, "--model", no_vae, "--steps", 1)
    assert r.exit_code == 1 and r.output.splitlines()[-1].startswith("Error: ")
    assert "missing component folder vae/" in r.output

    corrupt = copy_folder(folder, tmp_path / "corrupt", link_weights=False)
    shard = sorted((corrupt / "transformer").glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = invoke("image", PROMPT, "--model", corrupt, "--steps", 1)
    assert r.exit_code == 1 and r.output.splitlines()[-1].startswith("Error: ") and shard.name in r.output
    assert "Traceback" not in r.output

    Image.new("RGB", (8, 8)).save(workdir / "plain.png")
    r = invoke("image", "--from-metadata", "plain.png")
    assert r.exit_code == 1 and "no generation metadata" in r.output
    assert sorted(p.name for p in workdir.iterdir()) == ["plain.png"]


def test_ctrl_c_leaves_no_file(folder, workdir, monkeypatch):
    """A KeyboardInterrupt in the middle of the denoising loop: exit 130, no image, no temporary file."""
    from mlx_engine.imagegen.zimage import ZImagePipeline

    real = ZImagePipeline.generate

    def interrupted(self, *a, callback=None, **kw):
        def cb(step, total, latents, elapsed):
            callback(step, total, latents, elapsed)
            if step == 1:
                raise KeyboardInterrupt

        return real(self, *a, callback=cb, **kw)

    monkeypatch.setattr(ZImagePipeline, "generate", interrupted)
    r = invoke("image", PROMPT, "--model", folder, "--steps", 3, "--seed", 1)
    assert r.exit_code == 130 and "Cancelled" in r.output
    assert list(workdir.iterdir()) == []


def test_ctrl_c_in_a_real_process(folder, tmp_path):
    """SIGINT to a running ``mlx-engine image``: it stops, exits 130, and leaves nothing in the folder."""
    out = tmp_path / "sigint"
    out.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # A job started in the background by a non-interactive shell (as CI may be) inherits an ignored SIGINT;
    # a user's terminal does not, so the child restores Python's handler first.
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from mlx_engine.imagegen.zimage import ZImagePipeline\n"
            "real = ZImagePipeline.generate\n"
            "def slow(self, *a, callback=None, **kw):\n"
            "    def cb(*x):\n"
            "        callback(*x)\n"
            "        print('STEP', flush=True, file=sys.stderr)\n"
            "        time.sleep(30)\n"
            "    return real(self, *a, callback=cb, **kw)\n"
            "ZImagePipeline.generate = slow\n"
            "from mlx_engine.cli.main import main\n"
            "sys.argv = ['mlx-engine', 'image', sys.argv[1], '--model', sys.argv[2], '--steps', '3']\n"
            "main()\n")
    repo = Path(__file__).resolve().parents[1]
    p = subprocess.Popen([sys.executable, "-c", code, PROMPT, str(folder)], cwd=out, stderr=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=dict(env, PYTHONPATH=str(repo)))
    deadline = time.time() + 60
    seen = ""
    while time.time() < deadline:
        line = p.stderr.readline()
        seen += line
        if "STEP" in line or not line:
            break
    assert "STEP" in seen, seen
    p.send_signal(signal.SIGINT)
    try:
        rest, err = p.communicate(timeout=120)  # generous: a loaded machine is slow to unwind and exit
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == 130, seen + err
    assert "Cancelled" in err
    assert list(out.iterdir()) == []


def test_image_help_gives_the_default_models_defaults():
    """``image --help`` names the defaults of shapes:64 (the default model) beside Z-Image's, and its first example
    runs on the default model."""
    out = " ".join(CliRunner().invoke(main, ["image", "--help"]).output.split())
    assert "16 for shapes:64, 9 for Z-Image-Turbo" in out and "2 for shapes:64, 0 for Z-Image" in out
    assert "shapes:64: 64, multiples of 8; Z-Image: 1024, multiples of 16" in out
    assert 'mlx-engine image "a red circle on a blue background" --seed 1 # shapes:64, the default' in out
