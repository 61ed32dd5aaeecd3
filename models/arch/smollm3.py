"""SmolLM3: Llama's layout with no RoPE in every ``no_rope_layer_interval``-th layer (NoPE; the config's
``no_rope_layers``, 1 where a layer rotates), GQA, tied output head; optional sliding windows on NoPE layers
(``use_sliding_window``, off in the released model). llama.cpp's converter permutes its Q/K rows as Llama's.

A NoPE layer rotates by angle zero (RoPE scale 0), which leaves queries and keys exactly as they are (``cos 0 = 1``,
``sin 0 = 0``), so it takes the shared decoder's fused paths unchanged.

References: transformers' ``models/smollm3/modeling_smollm3.py``; mlx-lm's ``models/arch/smollm3.py``; llama.cpp's
``src/models/smollm3.cpp`` (which hard-codes the interval 4, GGUF has no key for it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mlx_engine.ml import Tensor
from mlx_engine.models.layers.config import DecoderConfig, check_layer_count
from mlx_engine.models.arch.llama import Llama


@dataclass
class SmolLM3Config(DecoderConfig):
    """:class:`DecoderConfig` plus ``nope_layers``: the 0-based layers without RoPE."""

    nope_layers: frozenset[int] = frozenset()


def _with_nope(config: DecoderConfig, rotates: list[Any]) -> SmolLM3Config:
    if len(rotates) != config.num_layers:
        raise ValueError(f"no_rope_layers has {len(rotates)} entries for {config.num_layers} layers")
    values = {f.name: getattr(config, f.name) for f in fields(DecoderConfig)}
    values["architecture"] = "smollm3"
    return SmolLM3Config(**values, nope_layers=frozenset(i for i, r in enumerate(rotates) if not r))


class SmolLM3(Llama):
    architecture = "smollm3"

    @classmethod
    def config_from_gguf(cls, metadata: Any, weights: dict[str, Tensor]) -> DecoderConfig:
        as_llama = {("llama." + k[len("smollm3."):] if k.startswith("smollm3.") else k): v
                    for k, v in metadata.items()}
        config = super().config_from_gguf(as_llama, weights)
        return _with_nope(config, [(i + 1) % 4 != 0 for i in range(config.num_layers)])

    @classmethod
    def config_from_hf(cls, config: Any) -> DecoderConfig:
        layers = check_layer_count(config["num_hidden_layers"])
        interval = int(config.get("no_rope_layer_interval", 4))
        rotates = config.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(layers)]
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        # Llama's reader takes sliding_window as every layer's; SmolLM3's config says which layers slide.
        base = super().config_from_hf({**config, "sliding_window": None})
        if window:
            base.sliding_window = int(window) - 1
            base.layer_types = list(config.get("layer_types") or
                                    ["full_attention" if r else "sliding_attention" for r in rotates])
        return _with_nope(base, rotates)

    def _rope_scale(self, layer: int) -> float:
        return 0.0 if layer in self.config.nope_layers else super()._rope_scale(layer)
