"""What one ``start_forward`` of a causal cache decided (:class:`Forward`): the batch's cells, the range of cells
it attends to, and the mask; read by every layer's ``put`` / ``attend`` / ``get`` of that forward pass."""

from __future__ import annotations

from typing import Optional

import numpy as np

from mlx_engine.ml import Context, DType, Tensor


class Forward:
    """What one ``start_forward`` decided: the cells of the batch, the used range, and the mask."""

    __slots__ = ("n", "locs", "span", "loc_tensor", "used", "mask", "runs", "reserve", "pos", "seqs", "cells")

    def __init__(self, n: int, locs: Optional[np.ndarray], span: Optional[tuple[int, int]], used: int,
                 mask: Optional[Tensor], reserve: bool, pos: Optional[np.ndarray] = None,
                 seqs: Optional[np.ndarray] = None, runs: Optional[list[tuple[int, int]]] = None):
        self.n, self.locs, self.span, self.used, self.mask, self.reserve = n, locs, span, used, mask, reserve
        self.pos, self.seqs = pos, seqs
        self.runs = runs  # one token whose visible cells are one or two runs [lo, hi): attended alone, unmasked
        self.loc_tensor: Optional[Tensor] = None
        self.cells: Optional[Tensor] = None  # INT32 [5] for Context.cached_attention, made once

    def attended(self) -> tuple[tuple[int, int, int, int], Optional[Tensor]]:
        """``((lo, hi, lo2, hi2), mask)``: the runs of cells that the batch attends to (the second empty where
        there is one), and the mask over ``[lo, hi)`` (None: all visible)."""
        if self.mask is None:
            return (0, self.used, 0, 0), None
        if self.runs is not None:
            (lo, hi), (lo2, hi2) = (self.runs + [(0, 0)])[:2]
            return (lo, hi, lo2, hi2), None
        return (0, self.used, 0, 0), self.mask

    def cells_tensor(self, ctx: Context) -> Tensor:
        """``(start, lo, hi, lo2, hi2)`` as an INT32 tensor ``[5]`` (made once per forward)."""
        if self.cells is None:
            self.cells = ctx.from_numpy(np.array([self.span[0], *self.attended()[0]], np.int32), DType.INT32)
        return self.cells
