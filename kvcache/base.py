"""The ``Cache`` interface every KV cache implements, and the ``shift_fn`` contract (after ollama's ``kvcache.Cache``).

Vocabulary:

- **cell**: one slot of storage. Each cell holds the keys and values of one token (one position) for every layer, and
  the set of sequences that own it. Cells are a pool shared by all sequences; a cell owned by several sequences (after
  :meth:`Cache.copy_prefix`) is stored once.
- **prefill**: a forward pass over many tokens of a prompt; **decode**: a forward pass over one new token per sequence.
- **window** ``W`` (sliding-window attention): the token at position ``p`` sees positions ``p - W .. p`` of its own
  sequence (``W + 1`` keys). Gemma 3's Hugging Face ``sliding_window = 512`` counts the token itself: ``W = 511``.
- **memory** ``M >= W``: how many positions before the lowest position of a sequence in a batch a sliding-window cache
  keeps (so that a sequence can be rolled back a little and resumed). ``M = W`` without it.
- **chunk** ``C`` (chunked attention, Llama 4): the token at ``p`` sees positions ``floor(p / C) * C .. p``.

The life of a cache, as the model and runner drive it::

    cache.init(backend, dtype, max_sequences, capacity, max_batch)   # once
    cache.reserve(ctx, [(H_kv, Dk, Dv)] * n_layers)                  # optional: allocate the worst case at load
    for each batch:
        cache.start_forward(ctx, batch)          # finds cells, builds the mask once (may raise CacheFullError)
        for layer in range(n_layers):            # inside the model
            cache.set_layer(layer)
            cache.put(ctx, k, v)                 # k [1, H_kv, N, Dk], v [1, H_kv, N, Dv]
            k, v, mask = cache.get(ctx)          # k [1, H_kv, S, Dk], v [1, H_kv, S, Dv], mask [N, S] or None
            out = ctx.scaled_dot_product_attention(q, k, v, scale, mask)

Reserving memory at load time (ollama's worst-case graph) can be done in either of two ways:

1. ``cache.reserve(ctx, layer_shapes)``: allocates (and evaluates) storage for every layer at its full size, so that
   an out-of-memory error happens at load time; records nothing.
2. ``cache.start_forward(ctx, worst_case_batch, reserve=True)`` followed by the model's usual forward pass: every
   ``put`` allocates the layer's full storage without storing anything (its arguments only give the shapes; zeros are
   fine), and every ``get`` returns the full storage with an all-visible ``[N, cells]`` mask, which is the largest
   attention the cache can ask for. No cell is recorded: the cache holds exactly what it held before.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Optional

from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError
from mlx_engine.ml import Backend, CacheConfig, Context, DType, RopeAngles, Tensor

ShiftFn = Callable[[Context, int, Tensor, Tensor], Tensor]
"""``shift_fn(ctx, layer, keys, shift) -> keys``: re-rotate stored keys after their positions changed.

``keys`` is ``[1, H_kv, n, Dk]`` in the cache's dtype (dequantized for a quantized cache), ``shift`` an INT32 tensor
``[n]`` with the position delta of each key (negative after :meth:`Cache.remove`). The model applies RoPE with angle
``delta * theta_i`` (the rotation by the difference of positions) and returns a tensor of the same shape.
"""

LayerShape = Optional[tuple[int, int, int]]
"""``(H_kv, Dk, Dv)`` for one layer in :meth:`Cache.reserve`; ``None`` for a layer the cache does not serve."""


class Cache(abc.ABC):
    """A KV cache: storage for the keys and values of past tokens, and the attention mask over them.

    All methods raise :class:`mlx_engine.errors.CacheError` when used before :meth:`init` or after :meth:`close`.
    """

    # ---- used by the model ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def set_layer(self, layer: int) -> None:
        """Select the layer that the next :meth:`put` and :meth:`get` work on (0-based)."""

    @abc.abstractmethod
    def put(self, ctx: Context, key: Tensor, value: Optional[Tensor]) -> None:
        """Store the keys and values of the current batch for the current layer.

        Args:
            key: ``[1, H_kv, N, Dk]``, ``N = len(batch)`` of the last :meth:`start_forward`, token ``i`` of the batch at
                index ``i`` of axis 2.
            value: ``[1, H_kv, N, Dv]`` (``Dv`` may differ from ``Dk``); None for a cache whose values are the keys'
                last features (:class:`~mlx_engine.kvcache.LatentCache`).

        The layer's storage is allocated on the first ``put`` (in the dtype given to :meth:`init`; inputs of another
        dtype are cast). Raises ``ValueError`` when the shapes do not match the batch or the layer's earlier shapes.
        """

    @abc.abstractmethod
    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """The keys, values and mask for the current layer's attention.

        Returns:
            ``(keys [1, H_kv, S, Dk], values [1, H_kv, S, Dv], mask)`` where ``S`` is the used range of cells (the
            highest used cell + 1, rounded up to ``config.padding``), in the cache's dtype. ``mask`` is additive,
            ``[N, S]`` in ``config.mask_dtype`` (``0`` visible, ``-inf`` hidden), the same tensor for every layer of
            one forward pass; ``None`` when every returned key is visible to every token of the batch (for example a
            single-sequence decode step in a causal cache).

        The keys and values are views of the cache's storage. Let go of them after the forward pass: while a view
        is alive, the next ``put`` of the layer must copy the whole storage instead of updating it in place.
        """

    def set_causal(self, ctx: Context, both_ways: Sequence[tuple[int, int]], window_both_ways: bool = False) -> None:
        """Let the tokens of each ``[begin, end)`` range of the current batch see each other both ways, for this
        forward pass only (see :meth:`CausalCache.set_causal`; ``window_both_ways``: a sliding window bounds them ahead
        too). Raises ``CacheError`` where the cache has no causal mask to change."""
        if both_ways:
            raise CacheError(f"{type(self).__name__} cannot let tokens attend both ways")

    def set_config(self, config: CacheConfig) -> None:
        """Override the backend's preferred layout (padding, mask dtype, growth step). Call before the first
        :meth:`start_forward`; :meth:`init` uses ``backend.cache_config()`` when this was never called."""

    # ---- used by the runner --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        """Set the cache up.

        Args:
            backend: makes contexts (for :meth:`remove`'s key shifts) and gives the default :class:`CacheConfig`.
            dtype: the storage dtype of keys and values (and of the scales of a quantized cache).
            max_sequences: sequences that may live in the cache at once; ids are ``0 .. max_sequences - 1``.
            capacity: the most tokens one sequence may hold (the context length). Cells are pooled: a causal cache
                has ``max_sequences * capacity`` of them, and one sequence may use the room others leave.
            max_batch: the most tokens one forward pass may hold (the prefill chunk size).
        """

    @abc.abstractmethod
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        """Find cells for every token of ``batch`` and build the mask (once, for all layers).

        ``batch.positions`` and ``batch.sequences`` (int32 ``[N]``) say where each token goes. A sequence must not
        already hold a position of the batch (``remove`` it first).

        Raises:
            CacheFullError: no room for the batch; the message names the capacity. The cache is left exactly as it
                was (cells, positions, storage, and the previous forward's mask).
            CacheError: an invalid batch (sequence id out of range, more than ``max_batch`` tokens, a position the
                sequence already holds); the cache is left unchanged.

        With ``reserve=True`` nothing is recorded: see the module docstring.
        """

    def reserve(self, ctx: Context, layer_shapes: Sequence[LayerShape]) -> None:
        """Allocate and evaluate the full storage of every layer now, so that running out of memory happens at load
        time, not in the middle of a generation. ``layer_shapes[layer] = (H_kv, Dk, Dv)``, or ``None`` for a layer
        this cache does not serve. Records nothing. The default does nothing (caches with no fixed worst case)."""

    @abc.abstractmethod
    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Make ``dst_seq`` hold the positions ``0 .. length - 1`` of ``src_seq`` (and nothing else), sharing the
        cells rather than copying the storage."""

    @abc.abstractmethod
    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue with its next token at position ``pos`` (after ``remove(seq, pos, None)``):
        the cache still holds everything the token at ``pos`` needs to see."""

    def restore_point(self, seq: int, pos: int) -> int:
        """The largest position ``r <= pos`` at which ``seq`` can resume (``remove(seq, r, None)`` then succeeds):
        ``pos`` itself for a KV cache that can resume there, else 0. A recurrent cache answers with its checkpoints."""
        return pos if self.can_resume(seq, pos) else 0

    @abc.abstractmethod
    def remove(self, seq: int, begin: int, end: Optional[int]) -> None:
        """Drop the positions ``begin .. end - 1`` of ``seq`` (``end=None``: to the end).

        Later positions of ``seq`` are renumbered down by ``end - begin``, and their keys re-rotated through the
        ``shift_fn`` for every layer.

        Raises:
            CacheError: a key to renumber lives in a cell shared with another sequence, or renumbering is needed and
                the cache has no ``shift_fn`` (ollama's ``ErrNotSupported``). The cache is left unchanged; the runner
                should then drop the whole sequence with ``remove(seq, 0, None)``, which never fails.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the storage. The cache must be :meth:`init`-ed again before reuse."""

    def nbytes(self) -> int:
        """Bytes of device storage the cache holds now (keys, values, and the scales of a quantized cache)."""
        return 0

    # ---- two-phase operations, so that a WrapperCache can be all-or-nothing -------------------------------------
    def prepare_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> Callable[[], None]:
        """Check that ``start_forward(ctx, batch, reserve)`` can succeed, changing nothing, and return a function
        that performs it (that function does not raise cache errors). The default is not atomic: it defers to
        :meth:`start_forward`."""
        return lambda: self.start_forward(ctx, batch, reserve)

    def prepare_remove(self, seq: int, begin: int, end: Optional[int]) -> Callable[[], None]:
        """Check that ``remove(seq, begin, end)`` can succeed, changing nothing, and return a function that performs
        it. The default is not atomic: it defers to :meth:`remove`."""
        return lambda: self.remove(seq, begin, end)


class FusedSteps(abc.ABC):
    """An optional capability of a :class:`Cache` (checked with ``isinstance``): a decode step's cache write and
    attention as one backend operation (:meth:`attend`), and the tensors a decode step compiled whole reads
    (:meth:`step_tensors`). A cache without it is written and read by ``put`` and ``get`` alone."""

    @abc.abstractmethod
    def attend(self, ctx: Context, q: Tensor, key: Tensor, value: Tensor, scale: float, angles: Optional[RopeAngles],
               dims: int, traditional: bool) -> Optional[Tensor]:
        """:meth:`put` and attention over :meth:`get` in one, with RoPE: ``q [1, H, N, Dk]`` and ``key`` (shaped as
        for :meth:`put`) not yet rotated; ``angles`` are the batch's RoPE angles (``Context.rope_angles``), applied
        to both as ``Tensor.rope(angles, dims, traditional=traditional)``, or None for ``q`` and ``key`` rotated
        already. Returns the attention output
        ``[1, H, N, Dv]`` (as ``Context.scaled_dot_product_attention`` of the rotated ``q`` over :meth:`get` with
        ``scale``), the keys and values stored; or ``None`` with nothing stored where the cache or the backend has
        no such path (this default): the caller then rotates, puts, gets and attends apart. A decode step so runs as
        one graph node where it would run as seven."""

    @abc.abstractmethod
    def step_tensors(self, ctx: Context, layers: Sequence[int]) -> Optional[tuple[list[Tensor], list[Tensor]]]:
        """For a decode step compiled whole (after :meth:`start_forward`): ``(cells, storage)``, the tensors that
        :meth:`attend` reads for ``layers`` and that change from one step to the next (``cells``: what this forward
        attends to; ``storage``: the layers' keys and values, which attend replaces), in a fixed order. ``None``
        (this default) where this forward cannot run so: then a trace of attend would hold numbers of this step
        (a batch of several tokens, cells that are not one run, a quantized cache, a layer not stored yet or whose
        storage must grow first). Otherwise every layer's :meth:`attend` takes its fused path with these tensors
        alone, so one trace serves every such step given them (:meth:`load_step_tensors`)."""

    @abc.abstractmethod
    def load_step_tensors(self, cells: Sequence[Tensor], storage: Sequence[Tensor]) -> None:
        """Use ``cells`` and ``storage`` (shaped as :meth:`step_tensors` gave them: a compiled step's placeholders,
        then its outputs) from now on. Raises ``CacheError`` where :meth:`step_tensors` gives None."""



class Checkpoints(abc.ABC):
    """An optional capability of a :class:`Cache` (checked with ``isinstance``): recurrent state that rolls back only
    to checkpoints the runner asks for (a hybrid model's :class:`~mlx_engine.kvcache.RecurrentCache`), and the state
    tensors each forward pass writes. A KV cache can resume anywhere and needs none of it."""

    #: Whether the cache keeps checkpoints, so that the runner should ask for them (False: none configured).
    keeps_checkpoints = True

    @abc.abstractmethod
    def state_tensors(self) -> list[Tensor]:
        """Tensors the current forward pass wrote that its logits do not depend on (a recurrent cache's new states),
        to evaluate with them."""

    @abc.abstractmethod
    def checkpoint_grid(self, start: int, end: int) -> list[int]:
        """Positions in ``start .. end - 1`` where a forward pass should end so that the cache keeps a checkpoint
        there."""

    @abc.abstractmethod
    def request_checkpoint(self, seq: int) -> None:
        """Ask for a restore point after the next forward pass of ``seq``."""



class EncoderInputs(abc.ABC):
    """An optional capability of a :class:`Cache` (checked with ``isinstance``): the encoder inputs (an image's rows)
    whose keys a cross-attention layer's ``get`` returns."""

    @abc.abstractmethod
    def encoder_inputs(self) -> list[tuple[int, int, int]]:
        """``(sequence, position, rows)`` of the encoder inputs whose keys the current layer's :meth:`get` returns,
        in order (an :class:`~mlx_engine.kvcache.EncoderCache`, for cross-attention; a wrapper: ``[]`` for a layer
        of the batch's own tokens)."""
