"""Prompt-following evaluation of an image model on the shapes data (default: the packaged ``shapes:64``).

    python -m training.evaluate --n 120 --steps 8            # prints accuracies, with captions and with ""

For ``n`` held-out (caption, seed) pairs (seeds of the held-out split of :mod:`mlx_engine.imagegen.shapes_data`, long captions:
shape, colours, size and position all named), the model draws the caption; each image is classified with pixel
measurements:

- background colour: the palette colour nearest to the median of the image's border pixels (2 pixels wide);
- shape colour: the most frequent nearest-palette colour among the non-background pixels (those farther than
  ``BG_DISTANCE`` from the background's palette colour);
- position: the cell of a 3 x 3 grid holding the centroid of the non-background pixels.

The same images are then generated with the caption replaced by ``""`` (the same noise): their accuracies should be
near chance (1/8 background, about 1/7 shape colour, 1/9 position), which shows the text conditioning is real.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

from mlx_engine.imagegen import shapes_data

__all__ = ["classify", "evaluate", "eval_pairs", "EvalReport", "BG_DISTANCE"]

_NAMES = list(shapes_data.COLOURS)
_PALETTE = np.array([shapes_data.COLOURS[n] for n in _NAMES], np.float32)
#: RGB distance from the background colour above which a pixel belongs to the shape
BG_DISTANCE = 80.0


def _nearest(rgb: np.ndarray) -> np.ndarray:
    d = ((rgb[..., None, :].astype(np.float32) - _PALETTE) ** 2).sum(-1)
    return d.argmin(-1)


def classify(img: np.ndarray) -> dict:
    """``{"background", "colour", "position"}`` of a uint8 ``[H, W, 3]`` image (None where nothing stands out)."""
    a = np.asarray(img)[..., :3].astype(np.float32)
    h, w, _ = a.shape
    border = np.concatenate([a[:2].reshape(-1, 3), a[-2:].reshape(-1, 3), a[:, :2].reshape(-1, 3),
                             a[:, -2:].reshape(-1, 3)])
    bg = int(_nearest(np.median(border, axis=0)))
    fg = np.sqrt(((a - _PALETTE[bg]) ** 2).sum(-1)) > BG_DISTANCE
    out = {"background": _NAMES[bg], "colour": None, "position": None}
    if fg.sum() < 4:
        return out
    labels = _nearest(a[fg])
    counts = np.bincount(labels, minlength=len(_NAMES))
    counts[bg] = 0
    if counts.max() > 0:
        out["colour"] = _NAMES[int(counts.argmax())]
    ys, xs = np.nonzero(fg)
    col = min(2, int((xs.mean() + 0.5) / w * 3))
    row = min(2, int((ys.mean() + 0.5) / h * 3))
    out["position"] = shapes_data.POSITIONS[row * 3 + col]
    return out


def eval_pairs(n: int) -> list[shapes_data.ShapeSample]:
    """The first ``n`` held-out samples with long captions."""
    out, start = [], 0
    while len(out) < n:
        for s in shapes_data.seeds(64, held_out=True, start=start):
            x = shapes_data.sample(s)
            if not x.short and len(out) < n:
                out.append(x)
            start = s + 1
    return out


@dataclass
class EvalReport:
    n: int
    accuracy: dict
    empty_prompt_accuracy: dict
    rows: list

    def summary(self) -> str:
        f = lambda d: ", ".join(f"{k} {v:.0%}" for k, v in d.items())  # noqa: E731
        return (f"{self.n} held-out pairs: with captions: {f(self.accuracy)}; "
                f"with an empty prompt: {f(self.empty_prompt_accuracy)}")


def _accuracy(preds: list[dict], truth: list[shapes_data.ShapeSample]) -> dict:
    keys = {"background": "background", "colour": "colour", "position": "position"}
    return {k: float(np.mean([p[k] == getattr(t, a) for p, t in zip(preds, truth)])) for k, a in keys.items()}


def evaluate(pipe, n: int = 100, steps: int | None = None, batch: int = 25, guidance: float | None = None,
             seed: int = 1000, empty: bool = True, save_dir=None) -> EvalReport:
    """Generate and classify ``n`` held-out pairs with ``pipe`` (a loaded ``ZImagePipeline``); batch ``b`` of
    ``batch`` images uses noise seed ``seed + b`` (the same noise for the empty-prompt run)."""
    truth = eval_pairs(n)
    runs = {"caption": [], "empty": []}
    for b in range(0, n, batch):
        part = truth[b:b + batch]
        for kind in (("caption", "empty") if empty else ("caption",)):
            prompts = [x.caption if kind == "caption" else "" for x in part]
            res = pipe.generate(prompts, seed=seed + b // batch, steps=steps, guidance=guidance)
            for i, im in enumerate(res.images):
                a = np.asarray(im)
                runs[kind].append(classify(a))
                if save_dir is not None:
                    im.save(f"{save_dir}/{kind}-{b + i:03d}.png")
    rows = [{"caption": t.caption, "seed": t.seed, "pred": p} for t, p in zip(truth, runs["caption"])]
    return EvalReport(n, _accuracy(runs["caption"], truth),
                      _accuracy(runs["empty"], truth) if empty else {}, rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="image model (default: the packaged shapes:64)")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--guidance", type=float, default=None)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--save", default=None, help="folder to save the images in")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from mlx_engine.api import load_image_model

    pipe = load_image_model(a.model, keep_text_encoder=True)
    try:
        r = evaluate(pipe, a.n, a.steps, a.batch, a.guidance, save_dir=a.save)
    finally:
        pipe.close()
    print(json.dumps({"n": r.n, "caption": r.accuracy, "empty": r.empty_prompt_accuracy}) if a.json
          else r.summary())


if __name__ == "__main__":
    main()
