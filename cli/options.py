"""Command-line options that several commands share."""

from __future__ import annotations

import click

from mlx_engine.ml import ACTIVATIONS

#: ``--activations``: :func:`mlx_engine.load`'s ``activations`` (None: ``$MLX_ENGINE_ACTIVATIONS``, else float32).
ACTIVATIONS_OPTION = click.option(
    "--activations", type=click.Choice(ACTIVATIONS), default=None,
    help="What the CPU's quantized products do with x: float32 (exact: the float model's tokens), int8 (llama.cpp's "
         "Q8_0 / Q8_K numerics, faster; needs AVX-512 VNNI or AVX2) or int16 (16 bits per 32 elements: the float "
         "path's perplexity to 0.01 %, faster than float32; same CPUs). Default: $MLX_ENGINE_ACTIVATIONS, else "
         "float32.")
