"""Multi-head latent attention's cache (DeepSeek V2 / V3, Kimi K2, GLM-4.7-Flash): the compressed form that
llama.cpp's ``deepseek2`` graph and mlx-lm's ``deepseek_v3`` keep, one latent per token instead of every head's key
and value."""

from __future__ import annotations

from typing import Optional

from mlx_engine.kvcache.base import ShiftFn
from mlx_engine.kvcache.causal import CausalCache


class LatentCache(CausalCache):
    """A causal cache that holds, per token and layer, one key row ``[rope + latent]``: the RoPE key shared by every
    head (rotated, first, so that the model's ``shift_fn`` re-rotates exactly those features), then the normed latent
    ``c`` (``kv_lora_rank`` features), which is also the value. ``put(ctx, key, None)`` takes ``key
    [1, 1, N, rope + latent]``; ``get`` returns ``(keys [1, 1, S, rope + latent], values [1, 1, S, latent], mask)``,
    the values a view of the keys' last ``latent`` features (nothing stored twice). DeepSeek-V3 so keeps
    ``64 + 512 = 576`` numbers per token and layer where its expanded keys and values take ``128 * (192 + 128)``.

    Args:
        latent: the latent's size (``kv_lora_rank``).
        shift_fn, kv_bits, kv_group_size: as :class:`CausalCache` (a quantized cache needs ``rope + latent`` to be a
            multiple of the group size).

    Raises ``ValueError`` for a latent < 1 (and as :class:`CausalCache`).
    """

    def __init__(self, latent: int, shift_fn: Optional[ShiftFn] = None, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64):
        super().__init__(shift_fn, kv_bits, kv_group_size, values_in_keys=latent)
