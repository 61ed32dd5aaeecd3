"""The tensors of multi-token-prediction (next-token prediction, "nextn") layers: DeepSeek V3's MTP module and GLM-4.5's
next-token prediction layer, ``num_nextn_predict_layers`` of them past the ``num_hidden_layers`` layers of the
checkpoint. An architecture's ``sanitize`` keeps them apart from its layers (:func:`mtp_weights`), for the drafter of
:mod:`mlx_engine.models.generation.mtp`.

Names: the hub's ``model.layers.<N + j>.*`` (``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``, optionally
``shared_head.head`` and ``embed_tokens``, and a decoder block under its usual names); llama.cpp's converter (GLM-4.5,
GLM-4.7-Flash; not DeepSeek V3, whose MTP it skips) writes the block as ``blk.<N + j>.*`` and the layer's own
tensors as ``blk.<N + j>.nextn.*`` (``shared_head_norm``, ``shared_head_head``).
"""

from __future__ import annotations

from mlx_engine.ml import Tensor

__all__ = ["MTP_PREFIX", "MTP_OWN", "mtp_weights"]

#: where MTP layer ``j``'s tensors are kept: ``mtp.<j>.<name>``, its decoder block under the usual names
#: (``mtp.0.self_attn.q_a_proj.weight``) and its own tensors as the hub names them (:data:`MTP_OWN`).
MTP_PREFIX = "mtp."
#: the MTP layer's own tensors (the rest is its decoder block)
MTP_OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight")
_GGUF_OWN = {"shared_head_norm.weight": "shared_head.norm.weight", "shared_head_head.weight": "shared_head.head.weight"}


def mtp_weights(weights: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """``weights`` with the MTP layers' tensors moved under :data:`MTP_PREFIX`: ``model.layers.<N + j>.*``
    (``N = num_layers``; a GGUF's block tensors already renamed to the hub's names) and llama.cpp's
    ``blk.<N + j>.nextn.*``. For an architecture's ``sanitize``, after its own renames."""
    out: dict[str, Tensor] = {}
    for name, t in weights.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= num_layers:
            out[f"{MTP_PREFIX}{int(parts[2]) - num_layers}.{'.'.join(parts[3:])}"] = t
        elif len(parts) >= 4 and parts[0] == "blk" and parts[2] == "nextn" and int(parts[1]) >= num_layers:
            own = ".".join(parts[3:])
            out[f"{MTP_PREFIX}{int(parts[1]) - num_layers}.{_GGUF_OWN.get(own, own)}"] = t
        else:
            out[name] = t
    return out
