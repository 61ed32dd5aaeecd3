"""KV caches, written against the ``mlx_engine.ml`` interfaces (no MLX import here).

- :class:`CausalCache`: every earlier position of the token's own sequence.
- :class:`SlidingWindowCache`, :class:`SlidingWindowMemoryCache`: positions ``p - W .. p``, bounded storage.
- :class:`ChunkedAttentionCache`: positions of the token's chunk.
- :class:`LatentCache`: a causal cache of multi-head latent attention's latents (values within the keys).
- :class:`EncoderCache`: cross-attention keys and values of an encoder output.
- :class:`WrapperCache`: one of the above per layer type.
- :class:`RecurrentCache`: a KV cache plus per-sequence recurrent state and checkpoints (hybrid models).

See :mod:`mlx_engine.kvcache.base` for the interface and its semantics: the core every cache implements
(:class:`Cache`) and the optional capabilities, checked with ``isinstance`` (:class:`FusedSteps`: a decode step's
fused attention and compiled-step tensors; :class:`Checkpoints`: recurrent state's checkpoints;
:class:`EncoderInputs`: cross-attention's encoder rows).
"""

from mlx_engine.kvcache.base import Cache, Checkpoints, EncoderInputs, FusedSteps, LayerShape, ShiftFn
from mlx_engine.kvcache.causal import CausalCache
from mlx_engine.kvcache.encoder import EncoderCache
from mlx_engine.kvcache.latent import LatentCache
from mlx_engine.kvcache.recurrent import RecurrentCache
from mlx_engine.kvcache.windowed import ChunkedAttentionCache, SlidingWindowCache, SlidingWindowMemoryCache
from mlx_engine.kvcache.wrapper import WrapperCache

__all__ = ["Cache", "CausalCache", "Checkpoints", "ChunkedAttentionCache", "EncoderCache", "EncoderInputs", "FusedSteps",
           "LatentCache", "LayerShape", "RecurrentCache", "ShiftFn", "SlidingWindowCache", "SlidingWindowMemoryCache",
           "WrapperCache"]
