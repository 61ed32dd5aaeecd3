"""The decode plan: how each layer of a one-token decode step runs, decided once per loaded model.

A decode step can take one of several forms per layer, from the fastest to the plainest: the KV cache's fused
attention (RoPE, the cache write and attention as one node, ``FusedSteps.attend``), the same with RoPE in the
compiled block (a backend that rotates from positions, a GPU), compiled blocks with attention apart, or op by op.
What decides the form is known at load: the model's switches, its config (a score cap, query temperature), its
weights (attention sinks), what the backend offers (RoPE angles made once per step, the ``LayerFusion``
capability) and how the model is split over ranks. :func:`decode_plan` answers once and
:class:`~mlx_engine.models.layers.base.DecoderModel` reads the answer each step; only the cache's state of the moment (a
quantized cache, a wrapped sliding-window ring) can still send a fused layer's attention apart, step by step, with
the same numbers. ``mlx-engine run --verbose`` prints the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

FUSED = "fused"
"""Compiled blocks; RoPE, the cache write and attention as the KV cache's one node, with the step's RoPE angles."""
FUSED_ROTATED = "fused-rotated"
"""Compiled blocks with RoPE in the block; the cache write and attention as one node (the backend makes no angles)."""
COMPILED = "compiled"
"""Compiled blocks; RoPE, the cache write and attention apart (the reason says why)."""
OPS = "ops"
"""Op by op, as a prefill runs."""
MIXER = "mixer"
"""A token mixer that is not self-attention through the KV cache (a recurrent or cross-attention layer)."""
OWN = "own"
"""The architecture's own layer code (its ``run_layers``)."""


@dataclass(frozen=True)
class LayerPlan:
    """How one layer runs in a decode step.

    Attributes:
        form: one of :data:`FUSED`, :data:`FUSED_ROTATED`, :data:`COMPILED`, :data:`OPS`, :data:`MIXER`,
            :data:`OWN`.
        reason: why the layer's attention does not fuse ("" where it does).
        tail: the part after attention (output projection, norms, gated MLP) runs as the backend's one operation
            (``LayerFusion.output_mlp``).
    """

    form: str
    reason: str = ""
    tail: bool = False

    @property
    def fused(self) -> bool:
        """Its attention takes the cache's fused path (:data:`FUSED` or :data:`FUSED_ROTATED`)."""
        return self.form in (FUSED, FUSED_ROTATED)


@dataclass(frozen=True)
class DecodePlan:
    """The decode plan of one loaded model (see the module docstring).

    Attributes:
        layers: the plan of each layer the model holds, by its 0-based index.
        whole: one-token steps run as one traced graph (``models/layers/step.py``), the embedding to the logits.
        whole_reason: why they do not ("" where they do).
    """

    layers: Mapping[int, LayerPlan] = field(default_factory=dict)
    whole: bool = False
    whole_reason: str = ""

    def describe(self) -> str:
        """The plan in a few lines: the whole step, then each run of layers that take the same form, with the
        reason."""
        lines = ["decode step: " + ("compiled whole" if self.whole else f"layer by layer ({self.whole_reason})")]
        runs: list[tuple[int, int, LayerPlan]] = []
        for i, lp in self.layers.items():
            if runs and runs[-1][2] == lp and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i, lp)
            else:
                runs.append((i, i, lp))
        for a, b, lp in runs:
            where = f"layer {a}" if a == b else f"layers {a}-{b}"
            lines.append(f"  {where}: {lp.form}" + (f" ({lp.reason})" if lp.reason else "")
                         + (", the MLP in one node" if lp.tail else ""))
        return "\n".join(lines)


@dataclass(frozen=True)
class PlanInputs:
    """What :func:`decode_plan` reads of a model (given by the model: this module does not import it).

    Attributes:
        layer_types: the config's type of each layer held (``layer_types``), by index; ``attention``: whether each
            attends through the KV cache.
        switches: ``(compile_decode, fuse_attention, compile_step)``, the model's switches.
        own_layers: the architecture runs its own layer code (the reason), or "".
        softcap: the config's attention score cap (Gemma 2), or None. sinks: the layers with attention sinks.
        query_temperature: the config has one (Llama 4's tuning). angles: the backend makes a step's RoPE angles.
        tail: the layers whose part after attention the backend runs as one operation.
        reduce, embed, head: the model part's (tensor and pipeline parallelism).
    """

    layer_types: Mapping[int, str]
    attention: Mapping[int, bool]
    switches: tuple[bool, bool, bool]
    own_layers: str
    softcap: "float | None"
    sinks: frozenset
    query_temperature: bool
    angles: bool
    tail: frozenset
    reduce: "Callable | None"
    embed: bool
    head: bool


def _attention_reason(p: PlanInputs, layer: int) -> str:
    """Why the layer's attention cannot take the cache's fused attention ("" where it can)."""
    if not p.switches[1]:
        return "fused attention is switched off"
    if p.softcap is not None:
        return "attention soft-capping: the fused attention has no score cap"
    if layer in p.sinks:
        return "attention sinks: the fused attention has no sinks"
    return ""


def decode_plan(p: PlanInputs) -> DecodePlan:
    """The plan of a model from what it says of itself (:class:`PlanInputs`)."""
    compile_decode, _, compile_step = p.switches
    plans: dict[int, LayerPlan] = {}
    for i, kind in p.layer_types.items():
        if p.own_layers:
            plans[i] = LayerPlan(OWN, p.own_layers)
        elif not p.attention[i]:
            plans[i] = LayerPlan(MIXER, f"a {kind} layer")
        elif not compile_decode:
            plans[i] = LayerPlan(OPS, "compiled decode steps are switched off")
        else:
            reason = _attention_reason(p, i)
            plans[i] = LayerPlan(COMPILED if reason else FUSED if p.angles else FUSED_ROTATED, reason, i in p.tail)
    unfused = next((i for i, lp in plans.items() if not lp.fused), None)
    whole_reason = ""
    if not compile_step:
        whole_reason = "whole-step compilation is switched off"
    elif p.reduce is not None:
        whole_reason = "tensor parallelism: each layer's products are summed over the ranks"
    elif not (p.embed and p.head):
        whole_reason = "pipeline parallelism: this rank holds a part of the layers"
    elif p.query_temperature:
        whole_reason = "query temperature: a trace would hold one position's"
    elif unfused is not None:
        whole_reason = f"layer {unfused} does not fuse: {plans[unfused].reason}"
    return DecodePlan(plans, not whole_reason, whole_reason)
