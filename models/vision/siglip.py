"""The SigLIP vision encoder (Zhai et al., "Sigmoid Loss for Language Image Pre-Training", 2023) as Gemma 3 uses it:
a ViT whose output is the last hidden state after the final LayerNorm (no pooling head).

``pixels [B, H, W, 3]`` (channels last, normalised) -> patches of ``patch_size`` through a strided convolution ->
plus learned position embeddings -> ``num_hidden_layers`` pre-norm blocks (LayerNorm, multi-head self-attention with
biases, LayerNorm, MLP with tanh-approximated GELU) -> LayerNorm -> ``[B, P, D]``, ``P = (image_size / patch_size)^2``
patches in row-major order.

Reference: transformers' ``models/siglip/modeling_siglip.py`` (``SiglipVisionEmbeddings``, ``SiglipEncoderLayer``,
``SiglipVisionTransformer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_engine.errors import WeightsError
from mlx_engine.ml import Context, Tensor


@dataclass
class SiglipConfig:
    """Hyper-parameters of the vision tower (a Hugging Face ``vision_config``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, config: Any) -> "SiglipConfig":
        """Raises ``WeightsError`` for sizes that are not positive or do not divide."""
        try:
            c = cls(int(config["hidden_size"]), int(config["intermediate_size"]), int(config["num_hidden_layers"]),
                    int(config["num_attention_heads"]), int(config["image_size"]), int(config["patch_size"]),
                    float(config.get("layer_norm_eps", 1e-6)))
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"the vision tower's config is incomplete or invalid: {e}") from e
        if min(c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.image_size, c.patch_size) <= 0 \
                or c.hidden_size % c.num_heads or c.image_size % c.patch_size or c.num_layers > 1024:
            raise WeightsError(f"the vision tower's config is inconsistent: {c}")
        return c

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipVision:
    """The tower over weights named as in a Hugging Face checkpoint, below ``vision_tower.`` (``embeddings.*``,
    ``encoder.layers.N.*``, ``post_layernorm.*``; a ``vision_model.`` level is accepted)."""

    def __init__(self, config: SiglipConfig, weights: dict[str, Tensor]):
        self.config = config
        w = {n.replace("vision_model.", "", 1): t for n, t in weights.items()}
        d, p = config.hidden_size, config.patch_size
        want = {"embeddings.patch_embedding.weight": (d, 3, p, p), "embeddings.patch_embedding.bias": (d,),
                "embeddings.position_embedding.weight": (config.patches_per_side ** 2, d),
                "post_layernorm.weight": (d,), "post_layernorm.bias": (d,)}
        for i in range(config.num_layers):
            q = f"encoder.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                want.update({q + f"self_attn.{name}.weight": (d, d), q + f"self_attn.{name}.bias": (d,)})
            want.update({q + "layer_norm1.weight": (d,), q + "layer_norm1.bias": (d,), q + "layer_norm2.weight": (d,),
                         q + "layer_norm2.bias": (d,), q + "mlp.fc1.weight": (config.intermediate_size, d),
                         q + "mlp.fc1.bias": (config.intermediate_size,), q + "mlp.fc2.bias": (d,),
                         q + "mlp.fc2.weight": (d, config.intermediate_size)})
        for name, shape in want.items():
            if name not in w:
                raise WeightsError(f"the vision tower lacks vision_tower.{name}; is the checkpoint complete?")
            if tuple(w[name].shape) != shape:
                raise WeightsError(f"vision_tower.{name} has shape {tuple(w[name].shape)}, the config implies {shape}")
        self.w = {n: w[n] for n in want}
        # MLX convolutions are channels-last: [out, kh, kw, in]
        self.patch_weight = self.w["embeddings.patch_embedding.weight"].dequantize().transpose(0, 2, 3, 1)

    def __call__(self, ctx: Context, pixels: Tensor) -> Tensor:
        """``pixels [B, H, W, 3]`` float -> last hidden states ``[B, P, D]``."""
        c, w = self.config, self.w
        b = pixels.shape[0]
        n = c.patches_per_side ** 2
        x = pixels.conv2d(self.patch_weight, w["embeddings.patch_embedding.bias"], stride=c.patch_size)
        x = x.reshape(b, n, c.hidden_size) + w["embeddings.position_embedding.weight"]
        heads, dh = c.num_heads, c.hidden_size // c.num_heads
        eps = c.layer_norm_eps
        for i in range(c.num_layers):
            p = f"encoder.layers.{i}."
            y = x.layer_norm(w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"], eps)

            def proj(name: str) -> Tensor:
                t = y.linear(w[p + f"self_attn.{name}.weight"], w[p + f"self_attn.{name}.bias"])
                return t.reshape(b, n, heads, dh).transpose(0, 2, 1, 3)

            o = ctx.scaled_dot_product_attention(proj("q_proj"), proj("k_proj"), proj("v_proj"), dh ** -0.5, None)
            o = o.transpose(0, 2, 1, 3).reshape(b, n, c.hidden_size)
            x = x + o.linear(w[p + "self_attn.out_proj.weight"], w[p + "self_attn.out_proj.bias"])
            y = x.layer_norm(w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"], eps)
            y = y.linear(w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]).gelu(approximate=True)
            x = x + y.linear(w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])
        return x.layer_norm(w["post_layernorm.weight"], w["post_layernorm.bias"], eps)
