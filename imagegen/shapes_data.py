"""Procedural shapes: seeded RGB images with exact captions, the training data of the default image model.

Each sample is one shape (circle, square or triangle) of one colour on a plain background of another colour, small or
large, at one of nine positions (the centre, the four sides, the four corners), drawn with NumPy (anti-aliased by 4x
supersampling). Its caption says all of it, long ("a small red circle in the top left on a blue background") or short
("a red circle on a blue background": size and position left out, the position then drawn at random).

Everything is a function of an integer seed (``sample(seed)``); the held-out split is by seed hash
(:func:`is_held_out`), so training and evaluation never share a drawing. No ``mlx`` here (NumPy only).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

__all__ = ["SHAPES", "COLOURS", "SIZES", "POSITIONS", "ShapeSample", "sample", "draw", "caption", "is_held_out",
           "seeds", "POSITION_CENTRES"]

SHAPES = ("circle", "square", "triangle")
#: palette (RGB uint8), far apart so the evaluation can classify a pixel by its nearest entry
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (35, 70, 225), "yellow": (245, 225, 40),
    "orange": (250, 140, 20), "purple": (140, 50, 180), "white": (245, 245, 245), "black": (15, 15, 15),
}
SIZES = ("small", "large")
POSITIONS = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
#: centre of each position as a fraction of the side (x, y); the grid cell of a position is its row/column of thirds
POSITION_CENTRES = {p: ((i % 3 + 0.5) / 3.0, (i // 3 + 0.5) / 3.0) for i, p in enumerate(POSITIONS)}
#: radius (half side) of a shape as a fraction of the image side
SIZE_RADIUS = {"small": 0.11, "large": 0.16}


@dataclass(frozen=True)
class ShapeSample:
    """One drawing: what it shows and its caption. ``centre``: (x, y) as fractions of the side."""

    seed: int
    shape: str
    colour: str
    background: str
    size: str
    position: str
    centre: tuple[float, float]
    short: bool

    @property
    def caption(self) -> str:
        return caption(self.shape, self.colour, self.background, None if self.short else self.size,
                       None if self.short else self.position)


def caption(shape: str, colour: str, background: str, size: str | None = None, position: str | None = None) -> str:
    """``"a small red circle in the top left on a blue background"``; without size and position the short form
    ``"a red circle on a blue background"``. The position reads "in the top left", "at the top", "on the left",
    "in the centre"."""
    words = ["a"] + ([size] if size else []) + [colour, shape]
    if position:
        if position == "centre":
            words.append("in the centre")
        elif position in ("top", "bottom"):
            words.append(f"at the {position}")
        elif position in ("left", "right"):
            words.append(f"on the {position}")
        else:
            words.append(f"in the {position}")
    words.append(f"on a {background} background")
    return " ".join(words)


def _hash(seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"shapes-{seed}".encode()).digest()[:8], "little")


def is_held_out(seed: int, every: int = 10) -> bool:
    """Whether ``seed`` belongs to the held-out split (about one seed in ``every``, by a hash of the seed)."""
    return _hash(seed) % every == 0


def seeds(n: int, held_out: bool = False, start: int = 0) -> list[int]:
    """The first ``n`` seeds from ``start`` of the training split (or of the held-out split)."""
    out, s = [], start
    while len(out) < n:
        if is_held_out(s) == held_out:
            out.append(s)
        s += 1
    return out


def sample(seed: int, short_fraction: float = 0.2) -> ShapeSample:
    """The sample of ``seed``: shape, colours (shape != background), size, position, and whether the caption is the
    short form (probability ``short_fraction``). Deterministic."""
    rng = np.random.default_rng(_hash(seed))
    shape = SHAPES[rng.integers(len(SHAPES))]
    names = list(COLOURS)
    colour = names[rng.integers(len(names))]
    background = [c for c in names if c != colour][rng.integers(len(names) - 1)]
    size = SIZES[rng.integers(len(SIZES))]
    position = POSITIONS[rng.integers(len(POSITIONS))]
    cx, cy = POSITION_CENTRES[position]
    jitter = rng.uniform(-0.04, 0.04, size=2)
    short = bool(rng.random() < short_fraction)
    return ShapeSample(seed, shape, colour, background, size, position,
                       (float(cx + jitter[0]), float(cy + jitter[1])), short)


def draw(s: ShapeSample, side: int = 64, supersample: int = 4) -> np.ndarray:
    """The image of ``s``: uint8 ``[side, side, 3]``."""
    n = side * supersample
    c = (np.arange(n, dtype=np.float32) + 0.5) / n
    x, y = c[None, :], c[:, None]
    cx, cy = s.centre
    r = SIZE_RADIUS[s.size]
    if s.shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    elif s.shape == "square":
        h = r * 0.9
        inside = (np.abs(x - cx) <= h) & (np.abs(y - cy) <= h)
    else:  # upward triangle, apex at the top
        top, bottom = cy - r, cy + r * 0.8
        half = (y - top) / (bottom - top) * r * 1.05
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half)
    fg = np.array(COLOURS[s.colour], np.float32)
    bg = np.array(COLOURS[s.background], np.float32)
    img = np.where(inside[..., None], fg, bg)
    img = img.reshape(side, supersample, side, supersample, 3).mean(axis=(1, 3))
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def batch(seed_list, side: int = 64, short_fraction: float = 0.2) -> tuple[np.ndarray, list[str]]:
    """Images uint8 ``[N, side, side, 3]`` and captions of the seeds."""
    ss = [sample(int(s), short_fraction) for s in seed_list]
    return np.stack([draw(x, side) for x in ss]), [x.caption for x in ss]
