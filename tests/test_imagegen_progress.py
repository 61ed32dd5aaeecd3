"""Progress and cancellation go the same way for every image pipeline family (Z-Image, FLUX.1, FLUX.2, Qwen-Image),
on small random diffusers folders: ``mlx-engine image`` shows one bar with the steps and the memory and leaves no
file on Ctrl-C, and ``mlx_engine.generate_image``'s step callback (the server's path: its callback runs the text
models' steps between an image's steps, and raises to cancel) is called once per step and cancels the generation,
leaving the pipeline usable and no memory held."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("diffusers")
pytest.importorskip("torch")

import mlx_engine  # noqa: E402
from mlx_engine.cli.main import main  # noqa: E402
from mlx_engine.imagegen.flux import FluxPipeline  # noqa: E402
from mlx_engine.imagegen.flux2 import Flux2Pipeline  # noqa: E402
from mlx_engine.imagegen.qwen_image import QwenImagePipeline  # noqa: E402
from mlx_engine.imagegen.zimage import ZImagePipeline  # noqa: E402

FAMILIES = {"zimage": ZImagePipeline, "flux": FluxPipeline, "flux2": Flux2Pipeline, "qwen": QwenImagePipeline}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from tests import flux2_small, flux_small, qwen_image_small, zimage_small

    d = tmp_path_factory.mktemp("imgprogress")
    return {"zimage": zimage_small.build_folder(d / "z"), "flux": flux_small.build_folder(d / "f"),
            "flux2": flux2_small.build_folder(d / "f2", "klein"), "qwen": qwen_image_small.build_folder(d / "q")}


def _small_generate(monkeypatch, family: str, interrupt_after: int | None = None):
    """Patch the family's ``generate``: the small FLUX.2 text encoder has 4 layers (tests/flux2_small.py's
    ``TEXT_LAYERS`` replace klein's 9, 18, 27), and optionally a Ctrl-C after step ``interrupt_after``."""
    from tests.flux2_small import TEXT_LAYERS

    cls = FAMILIES[family]
    real = cls.generate

    def generate(self, *a, callback=None, **kw):
        if family == "flux2":
            kw["text_encoder_out_layers"] = TEXT_LAYERS

        def cb(step, total, latents, elapsed):
            callback(step, total, latents, elapsed)
            if step == interrupt_after:
                raise KeyboardInterrupt

        return real(self, *a, callback=cb, **kw)

    monkeypatch.setattr(cls, "generate", generate)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cli_bar_and_ctrl_c(folders, family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _small_generate(monkeypatch, family, interrupt_after=1)
    r = CliRunner().invoke(main, ["image", "a red circle", "--model", str(folders[family]), "--steps", "3",
                                  "--width", "64", "--height", "64", "--seed", "1"], catch_exceptions=False)
    assert r.exit_code == 130 and "Cancelled; no image written." in r.output, r.output
    assert "2/3" in r.output and "memory" in r.output and "peak" in r.output, r.output  # the bar, at its 2nd step
    assert list(tmp_path.iterdir()) == []


class Stop(Exception):
    pass


@pytest.mark.parametrize("family", list(FAMILIES))
def test_callback_per_step_and_cancel(folders, family, monkeypatch):
    _small_generate(monkeypatch, family)
    pipe = mlx_engine.load_image_model(folders[family])
    try:
        steps = []
        img = mlx_engine.generate_image("a red circle", model=pipe, width=64, height=64, steps=2, seed=1,
                                        callback=lambda step, total, *_: steps.append((step, total)))
        assert steps == [(0, 2), (1, 2)] and img.size == (64, 64)

        seen = []

        def cancel(step, total, latents, elapsed):
            seen.append((step, total))
            if step == 1:
                raise Stop

        before = pipe.backend.active_memory()  # after a first generation made the tables the pipeline keeps
        try:  # not pytest.raises: its traceback would keep the generation's frames (and their tensors) alive
            mlx_engine.generate_image("a red circle", model=pipe, width=64, height=64, steps=3, seed=1,
                                      callback=cancel)
            raise AssertionError("the callback's exception did not stop the generation")
        except Stop:
            pass
        gc.collect()
        assert seen == [(0, 3), (1, 3)]
        assert pipe.backend.active_memory() <= before  # the cancelled job's latents and features are freed
    finally:
        pipe.close()


def test_server_answers_a_chat_while_a_flux_image_is_denoised(folders, smollm2_gguf, tmp_path):
    """The server's image requests go through ``generate_image`` with a callback that runs the text models' steps:
    a chat request sent while a FLUX.1 image is being denoised is answered before the image is done."""
    import threading
    import time

    import httpx
    import openai

    from mlx_engine.server import ServerConfig
    from tests.conftest import link_model
    from tests.test_server import RunningServer, free_port

    link_model(smollm2_gguf.parent, tmp_path)
    flux = str(folders["flux"])
    srv = RunningServer(ServerConfig(port=free_port(), models=["smollm2:135m"], context_length=512,
                                     store_root=str(tmp_path), models_dirs=[str(folders["flux"].parent)]))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        finished = {}

        def image():
            client.images.generate(model=flux, prompt="a red circle", size="64x64",
                                   extra_body={"seed": 1, "steps": 150})
            finished["image"] = time.monotonic()

        t = threading.Thread(target=image)
        t.start()
        for _ in range(600):
            models = httpx.get(srv.url + "/status").json()["models"]
            if any(m.get("in_flight") for name, m in models.items() if name != "smollm2:135m"):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the FLUX image never started: {models}")
        r = client.chat.completions.create(model="smollm2:135m", max_tokens=4,
                                           messages=[{"role": "user", "content": "Name a fruit."}])
        finished["text"] = time.monotonic()
        t.join()
        assert r.choices[0].message.content and finished["text"] < finished["image"]
    finally:
        srv.stop()
