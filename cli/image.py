"""The ``image`` command: text to image (and image to image, and image editing) with a diffusers folder.

``mlx-engine image "a red circle on a blue background" --model path/to/z-image`` writes ``image-0001.png`` (the next
free number in the current folder, so an existing file is never overwritten), with the prompt, negative prompt, seed
(also when it was drawn at random), steps, guidance, size, model, strength, init and edit images (paths and sha256),
and the engine version in the PNG's text chunks; ``--from-metadata FILE.png`` reads them back and makes the same
image again (options given on the command line win over the file's). The image is written to a hidden temporary file in the target folder and moved
into place at the end, so Ctrl-C (exit status 130) leaves no partial file.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import click

from mlx_engine.errors import InvalidRequestError
from mlx_engine.store import format_bytes
from mlx_engine.store.format import printable

DEFAULT_STEM = "image"


def next_free_name(folder: Path, stem: str = DEFAULT_STEM) -> Path:
    """``folder/stem-NNNN.png`` with NNNN one more than the highest number already there (0001 in an empty folder)."""
    highest = 0
    for f in folder.glob(f"{stem}-*.png"):
        tail = f.name[len(stem) + 1:-4]
        if tail.isdigit():
            highest = max(highest, int(tail))
    return folder / f"{stem}-{highest + 1:04d}.png"


def _place_without_overwrite(tmp: Path, folder: Path) -> Path:
    """Give the finished temporary file the next free default name without ever replacing a file: a hard link
    fails when the name exists (another process may have taken it since we looked), and we try the next one."""
    for _ in range(10000):
        target = next_free_name(folder)
        try:
            os.link(tmp, target)
        except FileExistsError:
            continue
        except OSError:  # a file system without hard links: open the name exclusively, then move over it
            try:
                fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.close(fd)
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        return target
    raise InvalidRequestError(f"{folder}: could not find a free file name for the image")


def _is_path(name: str) -> bool:
    """A model or init image named by a file path (rather than a packaged name such as ``shapes:64``)."""
    return "/" in name or "\\" in name or name.startswith((".", "~")) or Path(name).suffix.lower() in (
        ".png", ".jpg", ".jpeg", ".webp", ".gguf", ".safetensors")


@click.command("image", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("prompt", nargs=-1)
@click.option("--model", "-m", default=None,
              help="The image model: a diffusers Z-Image folder, or shapes:64 (the default).")
@click.option("--negative-prompt", default=None, help="What guidance steers away from (with --guidance > 0).")
@click.option("--width", type=int, default=None,
              help="Width in pixels (default: the model's). shapes:64: 64, multiples of 8; Z-Image: 1024, "
                   "multiples of 16.")
@click.option("--height", type=int, default=None, help="Height in pixels (default: the model's, as for --width).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Denoising steps (default: the model's: 16 for shapes:64, 9 for Z-Image-Turbo).")
@click.option("--guidance", type=click.FloatRange(min=0), default=None,
              help="Guidance scale, diffusers' guidance_scale; 0 = off (default: the model's: 2 for shapes:64, "
                   "0 for Z-Image).")
@click.option("--seed", type=click.IntRange(0, 2 ** 64 - 1), default=None,
              help="Noise seed (default: a random one, written into the PNG).")
@click.option("--image", "init_image", default=None, metavar="FILE", help="Init image for image-to-image.")
@click.option("--edit", "edit_images", multiple=True, metavar="FILE",
              help="An image to edit, for a model that edits images (FLUX.1 Kontext, FLUX.2); repeat for several.")
@click.option("--strength", type=click.FloatRange(0, 1), default=None,
              help="Image-to-image: how much to change the init image, 0..1 (default 0.6).")
@click.option("--output", "-o", default=None, metavar="FILE",
              help="The PNG to write (replaced if it exists), or a folder for the default name. Default: "
                   "image-NNNN.png in the current folder, never overwriting a file.")
@click.option("--quantize", type=click.Choice(["4", "8"]), default=None,
              help="Quantize the diffusion transformer and the text encoders (not CLIP) to 4 or 8 bits as they "
                   "are read.")
@click.option("--from-metadata", "from_metadata", default=None, metavar="FILE.png",
              help="Take the settings (prompt, seed, size, model...) from a PNG this command wrote.")
@click.option("--device", type=click.Choice(["cpu", "gpu", "metal", "cuda"]), default=None,
              help="Device (default: $MLX_ENGINE_DEVICE, else the GPU where MLX has one, else the CPU).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary; print only the file name.")
def image(prompt: tuple[str, ...], model: str | None, negative_prompt: str | None, width: int | None,
          height: int | None, steps: int | None, guidance: float | None, seed: int | None, init_image: str | None,
          edit_images: tuple[str, ...], strength: float | None, output: str | None, quantize: str | None,
          from_metadata: str | None, device: str | None, quiet: bool) -> None:
    """Generate an image from PROMPT and write it as a PNG (its path is printed on stdout).

    \b
    Examples:
      mlx-engine image "a red circle on a blue background" --seed 1     # shapes:64, the default: 64x64
      mlx-engine image --from-metadata image-0001.png                   # the same image again
      mlx-engine image "a lighthouse at dusk" -m ./z-image --width 768 --height 512   # a Z-Image folder
      mlx-engine image "a watercolour of the same scene" -m ./z-image --image photo.png --strength 0.6
      mlx-engine image "make the sky stormy" -m ./flux-kontext --edit photo.png         # edit an image
    """
    from mlx_engine import api

    settings: dict = {}
    if from_metadata is not None:
        settings = api.read_image_parameters(from_metadata)
        # A PNG is not trusted to make us read local files: paths it names are used only when given again.
        for key, flag in (("init_image", "--image"), ("model", "--model")):
            named = settings.get(key)
            if isinstance(named, str) and _is_path(named) and not (init_image if key == "init_image" else model):
                settings.pop(key)
                if key == "init_image":
                    settings.pop("init_image_sha256", None)
                click.echo(f"Note: the metadata names {key.replace('_', ' ')} {printable(named)!r}; files named in "
                           f"a PNG are not read unless you give them again ({flag} {printable(named)}).", err=True)
        named = settings.get("edit_images")
        if named and not edit_images:  # as the init image: files a PNG names are read only when given again
            settings.pop("edit_images")
            settings.pop("edit_images_sha256", None)
            shown = " ".join(f"--edit {printable(str(n))}" for n in named)
            click.echo(f"Note: the metadata names edit images; files named in a PNG are not read unless you give them "
                       f"again ({shown}).", err=True)
    given = {"model": model, "negative_prompt": negative_prompt, "width": width, "height": height,
             "steps": steps, "guidance": guidance, "seed": seed, "strength": strength,
             "quantize": int(quantize) if quantize else None}
    if prompt:
        given["prompt"] = " ".join(prompt)
    if init_image is not None:
        given["init_image"] = init_image
        settings.pop("init_image_sha256", None)
    if edit_images:
        given["edit_images"] = list(edit_images)
        settings.pop("edit_images_sha256", None)
    for k, v in given.items():
        if v is not None:
            settings[k] = v
    if "prompt" not in settings:
        raise InvalidRequestError("no prompt: give it as an argument (or use --from-metadata FILE.png)")
    if settings.get("init_image") is None:
        if strength is not None:
            raise InvalidRequestError("--strength applies to image to image: give an init image with --image FILE")
        settings.pop("strength", None)

    init = None
    if settings.get("init_image") is not None:
        init = api.open_init_image(settings["init_image"])  # read and hashed once
        want = settings.get("init_image_sha256")
        if want and want != init.sha256:
            click.echo(f"Warning: {init.path} differs from the init image the metadata describes "
                       "(sha256 mismatch); the result will differ.", err=True)

    edits = None
    if settings.get("edit_images"):
        edits = [api.open_init_image(f) for f in settings["edit_images"]]  # each read and hashed once
        for e, want in zip(edits, settings.get("edit_images_sha256") or []):
            if want and want != e.sha256:
                click.echo(f"Warning: {e.path} differs from the edit image the metadata describes (sha256 "
                           "mismatch); the result will differ.", err=True)

    # where the image goes (checked before the model is loaded)
    explicit = None
    if output is not None:
        out = Path(output).expanduser()
        if out.is_dir():
            folder = out
        else:
            explicit = out if out.suffix else out.with_suffix(".png")
            folder = explicit.parent
    else:
        folder = Path(".")
    if not folder.is_dir():
        raise InvalidRequestError(f"{folder}: no such folder for the output image")
    if not os.access(folder, os.W_OK):
        raise InvalidRequestError(f"{folder}: cannot write there")

    model_name = settings.get("model")
    label = model_name or api.DEFAULT_IMAGE_MODEL
    if not quiet and label is not None:
        click.echo(f"Loading {label}...", err=True)
    pipe = None
    tmp_path: Path | None = None
    bar = None
    try:
        pipe = api.load_image_model(model_name, quantize=settings.get("quantize"), device=device)
        state = {"last": 0.0}

        def on_step(step: int, total: int, latents, elapsed: float) -> None:
            nonlocal bar
            if quiet:
                return
            if bar is None:
                from tqdm import tqdm

                bar = tqdm(total=total, desc="denoising", unit="step", file=sys.stderr, leave=True,
                           dynamic_ncols=True)
            active, peak = pipe.memory()
            bar.set_postfix_str(f"{elapsed - state['last']:.2f} s/step, memory {format_bytes(active)}, "
                                f"peak {format_bytes(peak)}", refresh=False)
            state["last"] = elapsed
            bar.update(1)

        img = api.generate_image(settings["prompt"], model=pipe, negative_prompt=settings.get("negative_prompt"),
                                 width=settings.get("width"), height=settings.get("height"),
                                 steps=settings.get("steps"), guidance=settings.get("guidance"),
                                 seed=settings.get("seed"), image=init, strength=settings.get("strength"),
                                 callback=on_step, edit_images=edits)
        if bar is not None:
            bar.close()
            bar = None
        fd, name = tempfile.mkstemp(prefix=".image-", suffix=".png.part", dir=folder)
        os.close(fd)
        tmp_path = Path(name)
        api.save_image(img, tmp_path)
        if explicit is not None:
            os.replace(tmp_path, explicit)
            target = explicit
        else:
            target = _place_without_overwrite(tmp_path, folder)
        tmp_path = None
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        click.echo("Cancelled; no image written.", err=True)
        sys.exit(130)
    finally:
        if bar is not None:
            bar.close()
        if tmp_path is not None:
            try:
                tmp_path.unlink()
            except OSError:
                pass
        if pipe is not None:
            pipe.close()
    s = img.info["stats"]
    if not quiet:
        click.echo(f"seed {s.seed}, {s.summary()}", err=True)
    click.echo(str(target))
