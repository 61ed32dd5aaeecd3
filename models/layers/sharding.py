"""Which part of a model each rank of a distributed run holds: the plan, computed from the file before any tensor
is read, so that each rank reads only its share.

- **Pipeline parallelism**: the layers are cut into ``size`` consecutive stages, balanced by the bytes they occupy
  in the file (the last stage also carries the embeddings and the output head). Stage ``s`` runs on rank
  ``(s + 1) % size``: rank 0 embeds the tokens and sends the hidden states to rank 1, which runs the first layers;
  they travel up the ring, and rank 0 runs the last layers and the head, so that the logits are where the sampler
  is, and a head tied to the embeddings is held once.
- **Tensor parallelism** (Megatron-LM's layout, Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
  Language Models Using Model Parallelism", section 3): each rank holds a range of attention heads (rows of Q, K, V;
  the matching columns of the output projection) and a range of the MLP's columns (rows of gate and up, columns of
  down); the two row-sharded projections' outputs are summed over the ranks. Whole key/value groups go to a rank
  when there are at least as many as ranks; otherwise the ranks share a group, each computing its key/value head.
  The split need not be even (9 heads over 2 ranks: 6 and 3, by key/value group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError
from mlx_engine.models.layers.base import ModelPart
from mlx_engine.models.layers.config import ATTENTION_TYPES, DecoderConfig

__all__ = ["MODES", "Plan", "plan", "stage_rank"]

MODES = ("pipeline", "tensor")

_LAYER = re.compile(r"(?:^|\.)(?:blk|layers)\.(\d+)\.")
# The sharded tensors of a layer, by role, in GGUF's and Hugging Face's names.
_ROLES = [
    (re.compile(r"\.(?:attn_q|self_attn\.q_proj)\.(weight|bias)$"), "q"),
    (re.compile(r"\.(?:attn_k|self_attn\.k_proj)\.(weight|bias)$"), "k"),
    (re.compile(r"\.(?:attn_v|self_attn\.v_proj)\.(weight|bias)$"), "v"),
    (re.compile(r"\.(?:attn_output|self_attn\.o_proj)\.weight$"), "o"),
    (re.compile(r"\.(?:ffn_gate|mlp\.gate_proj)\.weight$"), "gate"),
    (re.compile(r"\.(?:ffn_up|mlp\.up_proj)\.weight$"), "up"),
    (re.compile(r"\.(?:ffn_down|mlp\.down_proj)\.weight$"), "down"),
]
#: MLP columns go to ranks in multiples of the K-quants' super-block where there are enough of them (a cut inside one
#: leaves a weight of two-level scales with a float32 scale and bias per group instead: 10 bits per Q6_K element where
#: the file has 6.56), else of 32, the quantization group of every other GGUF type and of our repacks
MLP_UNITS = (256, 32)


def stage_rank(stage: int, size: int) -> int:
    """The rank that runs pipeline stage ``stage`` (the last stage on rank 0)."""
    return (stage + 1) % size


def _even(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``0 .. n - 1`` cut into ``parts`` consecutive ranges whose sizes differ by at most one."""
    return i * n // parts, (i + 1) * n // parts


def _is_embedding(name: str) -> bool:
    return name == "token_embd.weight" or name.endswith("embed_tokens.weight")


def _is_head(name: str) -> bool:
    return name in ("output.weight", "output_norm.weight") or name.endswith(("lm_head.weight", "model.norm.weight"))


@dataclass
class Plan:
    """One rank's share of a model.

    Attributes:
        mode: ``pipeline`` or ``tensor``. rank, size: this rank and how many there are.
        stages: pipeline: the layers of each stage, in order (stage ``s`` on :func:`stage_rank`). Tensor: one stage
            with every layer.
        heads, kv_heads: tensor: this rank's query heads and key/value heads, ``(start, stop)``; pipeline: all.
        mlp: tensor: this rank's columns of the MLP, ``(start, stop)``; pipeline: all.
        head_dim: the size of one attention head.
    """

    mode: str
    rank: int
    size: int
    stages: list[range]
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    head_dim: int

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 in tensor mode)."""
        if self.mode == "tensor":
            return 0
        return (self.rank - 1) % self.size

    @property
    def layers(self) -> range:
        """The layers this rank holds."""
        return self.stages[self.stage]

    def part(self, config: DecoderConfig, reduce: Any = None) -> tuple[DecoderConfig, ModelPart]:
        """This rank's config (its heads and MLP columns) and :class:`ModelPart`."""
        if self.mode == "pipeline":
            last = self.stage == len(self.stages) - 1
            return config, ModelPart(self.layers, embed=last, head=last)
        local = replace(config, num_heads=self.heads[1] - self.heads[0],
                        num_kv_heads=self.kv_heads[1] - self.kv_heads[0], intermediate_size=self.mlp[1] - self.mlp[0])
        return local, ModelPart(self.layers, embed=True, head=True, reduce=reduce)

    def tensors(self, wf: Any) -> dict[str, "tuple[int, int, int] | None"]:
        """What this rank reads of the file: tensor name -> None (all of it) or ``(axis, start, stop)``."""
        out: dict[str, tuple[int, int, int] | None] = {}
        names = wf.names()
        last = self.stage == len(self.stages) - 1
        d = self.head_dim
        for name in names:
            m = _LAYER.search(name)
            if m is None:
                if self.mode == "pipeline" and not last and (_is_embedding(name) or _is_head(name)):
                    continue
                out[name] = None
                continue
            if int(m.group(1)) not in self.layers:
                continue
            role = next((r for rx, r in _ROLES if rx.search(name)), None)
            if self.mode == "pipeline" or role is None:
                out[name] = None
            elif role == "q":
                out[name] = (0, self.heads[0] * d, self.heads[1] * d)
            elif role in ("k", "v"):
                out[name] = (0, self.kv_heads[0] * d, self.kv_heads[1] * d)
            elif role == "o":
                out[name] = (1, self.heads[0] * d, self.heads[1] * d)
            elif role in ("gate", "up"):
                out[name] = (0, *self.mlp)
            else:
                out[name] = (1, *self.mlp)
        return out


def _stages(layer_bytes: list[int], last_extra: int, size: int) -> list[range]:
    """Cut the layers into ``size`` consecutive non-empty stages minimising the largest stage's bytes (the last
    stage also holds ``last_extra`` bytes): a small dynamic programme over cut points."""
    n = len(layer_bytes)
    pre = np.concatenate(([0], np.cumsum(layer_bytes, dtype=np.int64)))
    inf = float("inf")
    # best[s][j]: the smallest largest-stage for layers 0 .. j - 1 in stages 0 .. s - 1; cut[s][j]: the last cut
    best = [[inf] * (n + 1) for _ in range(size + 1)]
    cut = [[0] * (n + 1) for _ in range(size + 1)]
    best[0][0] = 0
    for s in range(1, size + 1):
        extra = last_extra if s == size else 0
        for j in range(s, n - (size - s) + 1):
            for i in range(s - 1, j):
                cost = max(best[s - 1][i], int(pre[j] - pre[i]) + extra)
                if cost < best[s][j]:
                    best[s][j], cut[s][j] = cost, i
    bounds, j = [], n
    for s in range(size, 0, -1):
        i = cut[s][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def _split_heads(c: DecoderConfig, rank: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    h, kv = c.num_heads, c.num_kv_heads
    rep = h // kv
    if h < size:
        raise UnsupportedError(f"tensor parallelism over {size} ranks needs at least {size} attention heads; this "
                               f"model has {h}: use fewer ranks, or --parallel pipeline")
    if kv >= size:
        g0, g1 = _even(kv, size, rank)
        return (g0 * rep, g1 * rep), (g0, g1)
    # fewer key/value heads than ranks: the ranks of a group share its key/value head and split its query heads
    group = next(g for g in range(kv) if _even(size, kv, g)[0] <= rank < _even(size, kv, g)[1])
    r0, r1 = _even(size, kv, group)
    if rep < r1 - r0:
        raise UnsupportedError(f"tensor parallelism over {size} ranks: key/value group {group} has {rep} query "
                               f"heads for {r1 - r0} ranks; use fewer ranks, or --parallel pipeline")
    a, b = _even(rep, r1 - r0, rank - r0)
    return (group * rep + a, group * rep + b), (group, group + 1)


def plan(wf: Any, c: DecoderConfig, mode: str, rank: int, size: int) -> Plan:
    """This rank's :class:`Plan` for the open weight file ``wf`` whose config is ``c``
    (:func:`mlx_engine.models.registry.file_config`).

    Raises:
        UnsupportedError: a hybrid model (recurrent layers), fewer layers than ranks (pipeline), fewer heads or MLP column blocks than ranks (tensor).
        InvalidRequestError: an unknown mode.
    """
    if mode not in MODES:
        raise InvalidRequestError(f"unknown parallel mode {mode!r}; use pipeline or tensor")
    layers = c.num_layers
    if not set(c.layer_types) <= ATTENTION_TYPES:
        raise UnsupportedError(f"{c.architecture} is a hybrid model (layers with a recurrent state); it runs on one "
                               "machine only for now, without --parallel")
    if mode == "pipeline":
        if layers < size:
            raise UnsupportedError(f"pipeline parallelism over {size} ranks needs at least {size} layers; this "
                                   f"model has {layers}")
        per_layer = [0] * layers
        embed = head = 0
        for name in wf.names():
            m = _LAYER.search(name)
            if m is not None and int(m.group(1)) < layers:
                per_layer[int(m.group(1))] += wf.nbytes(name)
            elif _is_embedding(name):
                embed += wf.nbytes(name)
            elif _is_head(name):
                head += wf.nbytes(name)
        stages = _stages(per_layer, embed + head, size)
        every = (0, c.num_heads)
        return Plan(mode, rank, size, stages, every, (0, c.num_kv_heads), (0, c.intermediate_size), c.head_dim)
    heads, kv_heads = _split_heads(c, rank, size)
    unit = next((u for u in MLP_UNITS if c.intermediate_size % u == 0 and c.intermediate_size // u >= size), 1)
    blocks = c.intermediate_size // unit
    if blocks < size:
        raise UnsupportedError(f"tensor parallelism over {size} ranks: the MLP has {c.intermediate_size} columns, "
                               f"too few to share; use fewer ranks, or --parallel pipeline")
    # the larger MLP parts to the lower ranks, where _even puts the larger head counts on the higher ones
    m0, m1 = (blocks - b for b in reversed(_even(blocks, size, size - 1 - rank)))
    return Plan(mode, rank, size, [range(layers)], heads, kv_heads, (m0 * unit, m1 * unit), c.head_dim)
