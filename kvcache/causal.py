"""Causal caches: the plain causal cache, sliding window (with or without extra memory), and chunked attention.

One class, :class:`CausalCache`, does all four (as ollama's ``kvcache.Causal``); the other names
(:mod:`mlx_engine.kvcache.windowed`) are constructors that fix its window, memory and chunk.

Layout. The cache is a pool of ``cells``; each cell holds one position and the set of sequences that own it (a bool
matrix ``owners [cells, max_sequences]`` on the host). The storage of each layer is ``[1, H_kv, cells, D]`` on the
device, allocated on the layer's first ``put`` and grown ``config.step`` cells at a time (or all at once by
``reserve``). Cells are handed out first-fit from the lowest free index, so a single sequence fills ``0, 1, 2, ...``:

- ``put`` writes with one slice update when the batch's cells are consecutive (always, for one sequence that was never
  trimmed in the middle) and with one scatter otherwise;
- ``get`` returns ``storage[:, :, :S]``, a slice of the contiguous storage (never a gather over the history), with
  ``S`` = highest used cell + 1 (rounded up to ``config.padding``);
- ``attend`` does ``put``, ``get`` and attention (with RoPE) as one backend operation where the backend has one
  (``Context.cached_attention``: our CPU kernel, float storage, the batch's cells in one run), and otherwise steps
  aside for the caller to do them apart;
- the mask is built on the host with NumPy once per ``start_forward``, uploaded once, and shared by every layer; it is
  ``None`` when nothing in ``0 .. S-1`` is hidden from any token, which a single-sequence decode step of a causal cache
  decides in O(1) from per-sequence counters.

Sliding window and chunks. At ``start_forward`` a sequence with lowest batch position ``L`` gives up its cells of
positions ``< L - M`` (window ``W``, memory ``M >= W``; ``M = W`` without extra memory) or ``< floor(L / C) * C``
(chunk ``C``); a sequence absent from the batch trims as if its next token came (``L = last + 1``; for chunks, keeping
the chunk of its last token). Freed cells are reused, a ring, so storage stays at most ``(M + max_batch)`` (or
``C + max_batch``) cells per sequence, however long the sequence runs. With more than one sequence the memory is at
least ``W + 1``, so that a sequence can still resume one token back (the stop token) after other sequences ran (as
ollama). A memory of at least the capacity means nothing is ever trimmed.

Storage (``kv_bits``): float in the compute dtype, 16-bit floats or affine-quantized, kept by
:class:`mlx_engine.kvcache.storage.KVStorage`; ``get`` returns keys and values in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

from mlx_engine.kvcache.base import Cache, FusedSteps, LayerShape, ShiftFn
from mlx_engine.batch import Batch
from mlx_engine.errors import CacheError, CacheFullError
from mlx_engine.ml import Backend, CacheConfig, Context, DType, RopeAngles, Tensor
from mlx_engine.kvcache.forward import Forward
from mlx_engine.kvcache.storage import KVStorage, LayerStorage, round_up as _round_up


class CausalCache(Cache, FusedSteps):
    """A causal KV cache: each token sees the earlier positions of its own sequence (and itself).

    Args:
        shift_fn: re-rotates keys when :meth:`remove` renumbers positions (see
            :data:`mlx_engine.kvcache.base.ShiftFn`); without it such a ``remove`` raises ``CacheError``.
        kv_bits: store keys and values quantized to this many bits (4 or 8; MLX also allows 2, 3, 5, 6), as 16-bit
            floats (16), or ``None`` for the init dtype.
        kv_group_size: elements per quantization group (32, 64 or 128).
        window: sliding window ``W`` (the token at ``p`` sees ``p - W .. p``), or ``None``.
        memory: positions kept before the lowest batch position of a sequence (``>= window``); default ``window``.
        chunk: chunked attention ``C`` (the token at ``p`` sees ``floor(p / C) * C .. p``), or ``None``.
        values_in_keys: ``Dv``: the values are the keys' last ``Dv`` features and are not stored apart (multi-head
            latent attention: :class:`~mlx_engine.kvcache.LatentCache`); ``put`` then takes ``value=None``.

    Raises ``ValueError`` for an invalid combination (memory without window, window and chunk together, ...).
    """

    def __init__(self, shift_fn: Optional[ShiftFn] = None, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 *, window: Optional[int] = None, memory: Optional[int] = None, chunk: Optional[int] = None,
                 values_in_keys: Optional[int] = None):
        if values_in_keys is not None and values_in_keys < 1:
            raise ValueError(f"values_in_keys must be >= 1, not {values_in_keys}")
        self.values_in_keys = values_in_keys
        # raises for a kv_bits or group size it cannot keep
        self._kv = KVStorage(kv_bits, kv_group_size, shared_values=values_in_keys is not None)
        if window is not None and window < 0:
            raise ValueError(f"window must be >= 0, not {window}")
        if memory is not None:
            if window is None:
                raise ValueError("memory is only meaningful with a sliding window")
            if memory < window:
                raise ValueError(f"memory ({memory}) must be at least the window ({window})")
        if chunk is not None:
            if chunk < 1:
                raise ValueError(f"chunk must be >= 1, not {chunk}")
            if window is not None:
                raise ValueError("a cache has either a sliding window or chunked attention, not both")
        self.shift_fn = shift_fn
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.window = window
        self.memory = (window if memory is None else memory) if window is not None else None
        self.chunk = chunk
        self._config: Optional[CacheConfig] = None
        self._config_set = False
        self._backend: Optional[Backend] = None
        self._layer = 0
        self._fwd: Optional[Forward] = None
        self._step_layers: list[LayerStorage] = []  # the layers of the last step_tensors, in its order

    # ---- set-up ----------------------------------------------------------------------------------------------------
    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        if max_sequences < 1 or capacity < 1 or max_batch < 1:
            raise ValueError(f"max_sequences ({max_sequences}), capacity ({capacity}) and max_batch ({max_batch}) "
                             "must all be >= 1")
        self._kv.configure(dtype)
        self._backend = backend
        self.dtype = dtype
        self.max_sequences = max_sequences
        self.capacity = capacity
        self.max_batch = max_batch
        if not self._config_set:
            self._config = backend.cache_config()
        self._layout()

    def _layout(self) -> None:
        """Number of cells, trimming threshold, host bookkeeping (all empty)."""
        s, cap = self.max_sequences, self.capacity
        mem: Optional[int] = None  # positions kept before the lowest batch position; None = never trim
        if self.window is not None:
            mem = self.memory if s == 1 else max(self.memory, self.window + 1)
            if mem >= cap:
                mem = None
        elif self.chunk is not None and self.chunk < cap:
            mem = self.chunk
        self._mem = mem
        per_seq = cap if mem is None else min(cap, mem + self.max_batch)
        self.num_cells = _round_up(s * per_seq, max(1, self._config.padding))
        c = self.num_cells
        self._pos = np.full(c, -1, np.int64)             # position held by each cell (-1: free)
        self._owners = np.zeros((c, s), np.bool_)         # owners[cell, seq]
        self._nown = np.zeros(c, np.int32)               # number of owners of each cell
        self._hi = 0                                      # highest used cell + 1
        self._n_used = 0                                  # cells with at least one owner
        self._seq_count = np.zeros(s, np.int64)           # cells owned by each sequence
        self._seq_min = np.zeros(s, np.int64)             # lowest / highest position held (valid when count > 0)
        self._seq_max = np.full(s, -1, np.int64)
        self._kv.layers = {}
        self._fwd = None
        self._step_layers = []

    def set_config(self, config: CacheConfig) -> None:
        if self._backend is not None and self._config != config:
            if self._n_used or self._kv.layers:
                raise CacheError("set_config after the cache stored data would change its layout; call it before "
                                 "the first start_forward")
            self._config, self._config_set = config, True
            self._layout()
            return
        self._config, self._config_set = config, True

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def close(self) -> None:
        self._kv.layers = {}
        self._fwd = None
        self._step_layers = []
        self._backend = None

    def _check(self) -> None:
        if self._backend is None:
            raise CacheError("the KV cache is not initialized (call init) or was closed")

    # ---- introspection ---------------------------------------------------------------------------------------------
    def positions(self, seq: int) -> np.ndarray:
        """The positions ``seq`` holds, ascending (int64 ``[k]``)."""
        self._check()
        h = self._hi
        return np.sort(self._pos[:h][self._owners[:h, seq]])

    def cells_in_use(self) -> int:
        """Cells owned by at least one sequence."""
        return self._n_used

    def cells_below(self, lengths: Sequence[int]) -> int:
        """Cells owned by some sequence ``s`` at a position below ``lengths[s]`` (``lengths``: ``[max_sequences]``
        ints). Given each sequence's recorded token count, the cells those tokens hold: :meth:`cells_in_use` minus
        this is the number of cells that no record accounts for (leaked)."""
        self._check()
        h, lim = self._hi, np.asarray(lengths, np.int64)
        return int((self._owners[:h] & (self._pos[:h, None] < lim[None, :])).any(axis=1).sum())

    def allocated_cells(self) -> int:
        """The largest number of cells any layer's storage has allocated (0 before the first ``put``)."""
        return self._kv.allocated_cells()

    def nbytes(self) -> int:
        return self._kv.nbytes()

    @property
    def store_dtype(self) -> DType:
        """What keys and values are kept as (a quantized cache: the dtype of its scales and biases)."""
        return self._kv.store_dtype

    # ---- forward ---------------------------------------------------------------------------------------------------
    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare_forward(ctx, batch, reserve)()

    def prepare_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> Callable[[], None]:
        self._check()
        pos = np.asarray(batch.positions, np.int64)
        seqs = np.asarray(batch.sequences, np.int64)
        n = len(pos)
        if n == 0:
            raise CacheError("start_forward with an empty batch")
        if n > self.max_batch:
            raise CacheError(f"a batch of {n} tokens is larger than the max_batch ({self.max_batch}) the cache was "
                             "initialized with")
        if n == 1:
            s0, lo0 = int(seqs[0]), int(pos[0])
            if not 0 <= s0 < self.max_sequences:
                raise CacheError(f"sequence id {s0} out of range 0..{self.max_sequences - 1}")
            if lo0 < 0:
                raise CacheError(f"negative position {lo0}")
            uniq, lowest = [s0], {s0: lo0}
        else:
            if seqs.min() < 0 or seqs.max() >= self.max_sequences:
                raise CacheError(f"sequence ids {np.unique(seqs).tolist()} out of range 0..{self.max_sequences - 1}")
            if pos.min() < 0:
                raise CacheError(f"negative position {int(pos.min())} in the batch")
            uniq = np.unique(seqs).tolist()
            lowest = {}
            for s in uniq:
                p = pos[seqs == s]
                if len(np.unique(p)) != len(p):
                    raise CacheError(f"the batch holds a position of sequence {s} twice")
                lowest[s] = int(p.min())
        if reserve:
            c = self.num_cells

            def commit_reserve() -> None:
                self._fwd = Forward(n, None, None, c, ctx.zeros((n, c), self._config.mask_dtype), True)
            return commit_reserve

        for s in uniq:
            if self._seq_count[s] and lowest[s] <= self._seq_max[s]:
                raise CacheError(f"sequence {s} already holds positions up to {int(self._seq_max[s])}; the batch "
                                 f"starts it at {lowest[s]}. Remove them first (remove({s}, {lowest[s]}, None))")

        # cells that trimming (window, memory, chunk) gives up; computed, not yet applied
        h = self._hi
        drop = None
        if self._mem is not None and self._n_used:
            thr = np.full(self.max_sequences, np.iinfo(np.int64).min, np.int64)
            for s in range(self.max_sequences):
                if s in lowest:
                    low = lowest[s]
                elif self._seq_count[s]:
                    low = int(self._seq_max[s]) + (1 if self.window is not None else 0)
                else:
                    continue
                thr[s] = low - self._mem if self.window is not None else (low // self.chunk) * self.chunk
            d = self._owners[:h] & (self._pos[:h, None] < thr[None, :])
            if d.any():
                drop = d

        # first-fit free cells
        if drop is None and self._n_used == h:  # no holes below the used range: the next cells in order
            if h + n > self.num_cells:
                self._raise_full(n, self.num_cells - h)
            locs = np.arange(h, h + n)
        else:
            nown = self._nown[:h] if drop is None else self._nown[:h] - drop.sum(axis=1)
            holes = np.flatnonzero(nown == 0)
            if len(holes) >= n:
                locs = holes[:n]
            else:
                k = n - len(holes)
                if h + k > self.num_cells:
                    self._raise_full(n, len(holes) + self.num_cells - h)
                locs = np.concatenate([holes, np.arange(h, h + k)])

        def commit() -> None:
            self._commit(ctx, pos, seqs, uniq, locs, drop)
        return commit

    def _raise_full(self, n: int, free: int) -> None:
        what = (f"capacity {self.capacity} tokens per sequence x {self.max_sequences} sequence(s)"
                if self._mem is None else
                f"capacity {self.capacity} tokens per sequence; {self.num_cells} cells in the ring")
        raise CacheFullError(f"KV cache full: a batch of {n} token(s) needs {n} free cell(s) but only {free} of "
                             f"{self.num_cells} are free ({what}). Remove tokens of a sequence, or use a larger "
                             "context length (capacity)")

    def _commit(self, ctx: Context, pos: np.ndarray, seqs: np.ndarray, uniq: list[int], locs: np.ndarray,
                drop: Optional[np.ndarray]) -> None:
        n = len(pos)
        h = self._hi
        if drop is not None:
            self._owners[:h][drop] = False
            self._nown[:h] -= drop.sum(axis=1, dtype=np.int32)
            self._pos[:h][self._nown[:h] == 0] = -1
        self._pos[locs] = pos
        self._owners[locs, seqs] = True
        self._nown[locs] = 1
        if drop is not None:
            self._refresh(range(self.max_sequences))
        else:
            self._n_used += n
            self._hi = max(h, int(locs[-1]) + 1 if n == 1 else int(locs.max()) + 1)
            for s in uniq:
                if n == 1:
                    p_lo = p_hi = int(pos[0])
                    cnt = 1
                else:
                    p = pos[seqs == s]
                    p_lo, p_hi, cnt = int(p.min()), int(p.max()), len(p)
                if self._seq_count[s]:
                    self._seq_min[s] = min(int(self._seq_min[s]), p_lo)
                    self._seq_max[s] = max(int(self._seq_max[s]), p_hi)
                else:
                    self._seq_min[s], self._seq_max[s] = p_lo, p_hi
                self._seq_count[s] += cnt

        used = min(_round_up(self._hi, max(1, self._config.padding)), self.num_cells)
        span = (int(locs[0]), int(locs[0]) + n) if int(locs[-1]) - int(locs[0]) == n - 1 else None
        mask, runs = self._build_mask(ctx, pos, seqs, used)
        self._fwd = Forward(n, locs, span, used, mask, False, pos, seqs, runs)

    def _refresh(self, seqs: Sequence[int]) -> None:
        """Recompute the used range, the count of used cells and the per-sequence counters after cells were freed."""
        nz = np.flatnonzero(self._nown)
        self._hi = int(nz[-1]) + 1 if len(nz) else 0
        self._n_used = len(nz)
        h = self._hi
        for s in seqs:
            p = self._pos[:h][self._owners[:h, s]]
            self._seq_count[s] = len(p)
            if len(p):
                self._seq_min[s], self._seq_max[s] = int(p.min()), int(p.max())
            else:
                self._seq_min[s], self._seq_max[s] = 0, -1

    def _build_mask(self, ctx: Context, pos: np.ndarray, seqs: np.ndarray, used: int,
                    both_ways: Sequence[tuple[int, int]] = (), window_both_ways: bool = False
                    ) -> tuple[Optional[Tensor], Optional[list[tuple[int, int]]]]:
        """The mask over cells ``[0, used)`` (None: every cell visible to every token) and, for one token, the runs
        ``(lo, hi)`` of cells it sees where they are one or two (a sliding window, before and after its ring wraps)."""
        n = len(pos)
        if n == 1 and not both_ways:
            # O(1) test: one sequence owns every cell of the used range and the token sees all of them
            s, p = int(seqs[0]), int(pos[0])
            cnt = int(self._seq_count[s])
            start = self._sees_from(p)
            if cnt == used and p >= self._seq_max[s] and (start is None or start <= self._seq_min[s]):
                return None, None
        cp = self._pos[:used]
        visible = self._owners[:used][:, seqs].T                     # [N, used]: cells of the token's sequence
        ahead = cp[None, :] <= pos[:, None]                          # causal
        for a, b in both_ways:  # a range of the batch sees itself both ways (set_causal)
            ahead[a:b, self._fwd.locs[a:b]] = True
        visible &= ahead
        start = self._sees_from(pos)
        if start is not None:
            visible &= cp[None, :] >= np.asarray(start)[:, None]    # window / chunk start
        if both_ways and window_both_ways:
            end = self._sees_to(pos)
            if end is not None:
                visible &= cp[None, :] <= end[:, None]               # a two-way window's far end
        if visible.all():
            return None, None
        runs = None
        if n == 1:
            edges = np.flatnonzero(np.diff(np.concatenate(([False], visible[0], [False])).astype(np.int8)))
            if 0 < len(edges) <= 4:
                runs = [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]
        return ctx.attention_mask(visible, self._config.mask_dtype), runs

    def set_causal(self, ctx: Context, both_ways: Sequence[tuple[int, int]], window_both_ways: bool = False) -> None:
        """Let the tokens of each ``[begin, end)`` range of the current batch see each other both ways (the rest of
        the mask stays as it is: other sequences hidden); the next :meth:`start_forward` is causal again. With
        ``window_both_ways`` a sliding window becomes two-way: the token at ``p`` sees ``p - W .. p + W``
        (transformers' Gemma 3 with ``use_bidirectional_attention``, ``_bidirectional_window_overlay``; llama.cpp's
        ``LLAMA_SWA_TYPE_SYMMETRIC``): an embedder trained both ways attends so over each input. Without it nothing
        bounds a range ahead: Gemma 3's image tokens attend to their whole image (the seed's
        ``SetCausal(ctx, CausalOptions{Except: ...})``).

        Raises:
            CacheError: before a forward pass, or a range outside the batch or spanning several sequences.
        """
        self._check()
        fwd = self._fwd
        if fwd is None:
            raise CacheError("set_causal before start_forward")
        if fwd.reserve or not both_ways:
            return
        for a, b in both_ways:
            if not 0 <= a < b <= fwd.n or len(np.unique(fwd.seqs[a:b])) != 1:
                raise CacheError(f"set_causal range {a}..{b} is not a run of one sequence in the batch of {fwd.n}")
        # rebuilt from the positions that start_forward recorded (cells may have been reused since: same cells)
        fwd.mask, fwd.runs = self._build_mask(ctx, fwd.pos, fwd.seqs, fwd.used, both_ways, window_both_ways)
        fwd.cells = None

    def _sees_to(self, p: np.ndarray) -> Optional[np.ndarray]:
        """The highest positions the tokens at ``p`` (int64 ``[N]``) see when they attend both ways (set_causal): a
        sliding window reaches as far ahead as behind (``p + W``); ``None``: no bound."""
        return None if self.window is None else p + self.window

    def _sees_from(self, p):
        """The lowest position the token at ``p`` sees (int or array), ``None`` for a plain causal cache."""
        if self.window is not None:
            return p - self.window
        if self.chunk is not None:
            return (p // self.chunk) * self.chunk
        return None

    # ---- put / get -------------------------------------------------------------------------------------------------
    def _layer_storage(self, ctx: Context, shape: tuple[int, int, int], need: int) -> LayerStorage:
        """The current layer's storage, allocated or grown to at least ``need`` cells."""
        return self._kv.layer(ctx, self._layer, shape, need, self.num_cells, self._config.step)

    def put(self, ctx: Context, key: Tensor, value: Optional[Tensor]) -> None:
        fwd = self._fwd
        if fwd is None:
            raise CacheError("put before start_forward")
        ks = key.shape
        if self.values_in_keys is not None:
            if value is not None or len(ks) != 4 or ks[0] != 1 or ks[2] != fwd.n or ks[3] < self.values_in_keys:
                raise ValueError(f"put expects key [1, H_kv, {fwd.n}, Dk >= {self.values_in_keys}] and no value (the "
                                 f"values are the keys' last {self.values_in_keys} features), got {list(ks)} and "
                                 f"{None if value is None else list(value.shape)}")
            vs = (1, ks[1], fwd.n, self.values_in_keys)
        else:
            vs = value.shape
        if len(ks) != 4 or len(vs) != 4 or ks[0] != 1 or vs[0] != 1 or ks[1] != vs[1] or ks[2] != fwd.n \
                or vs[2] != fwd.n:
            raise ValueError(f"put expects key [1, H_kv, {fwd.n}, Dk] and value [1, H_kv, {fwd.n}, Dv] for a batch of "
                             f"{fwd.n} tokens, got {list(ks)} and {list(vs)}")
        if fwd.reserve:
            st = self._layer_storage(ctx, (ks[1], ks[3], vs[3]), self.num_cells)
            ctx.evaluate(*st.tensors())
            return
        st = self._layer_storage(ctx, (ks[1], ks[3], vs[3]), fwd.used)
        if fwd.span is None and fwd.loc_tensor is None:
            fwd.loc_tensor = ctx.from_numpy(fwd.locs.astype(np.int32), DType.INT32)
        self._kv.write(ctx, st, key, value, lambda dst, src: self._write(fwd, dst, src))

    def attend(self, ctx: Context, q: Tensor, key: Tensor, value: Tensor, scale: float, angles: Optional[RopeAngles],
               dims: int, traditional: bool) -> Optional[Tensor]:
        fwd = self._fwd
        if fwd is None:
            raise CacheError("attend before start_forward")
        if self.values_in_keys is not None:
            return None  # the fused kernel writes values apart
        ks, vs = key.shape, value.shape
        # float storage, the batch's cells in one run, inputs in the cache's dtype; anything else goes apart
        if (fwd.reserve or fwd.span is None or self._kv.quantized or key.dtype != self.dtype
                or value.dtype != self.dtype or len(ks) != 4 or len(vs) != 4 or ks[0] != 1 or vs[0] != 1
                or ks[1] != vs[1] or ks[2] != fwd.n or vs[2] != fwd.n):
            return None
        st = self._layer_storage(ctx, (ks[1], ks[3], vs[3]), fwd.used)
        got = ctx.cached_attention(q, key, value, st.k[0], st.v[0], fwd.cells_tensor(ctx), scale, fwd.attended()[1],
                                   angles, dims, traditional)
        if got is None:
            return None
        o, st.k[0], st.v[0] = got
        return o

    def step_tensors(self, ctx: Context, layers: Sequence[int]) -> Optional[tuple[list[Tensor], list[Tensor]]]:
        fwd = self._fwd
        if (fwd is None or fwd.reserve or fwd.n != 1 or fwd.span is None or self._kv.quantized
                or self.values_in_keys is not None):
            return None
        stored = [self._kv.layers.get(i) for i in layers]
        if fwd.attended()[1] is not None or any(st is None or st.size < fwd.used for st in stored):
            return None
        self._step_layers = stored
        return [fwd.cells_tensor(ctx)], [t for st in stored for t in (st.k[0], st.v[0])]

    def load_step_tensors(self, cells: Sequence[Tensor], storage: Sequence[Tensor]) -> None:
        stored = self._step_layers
        if self._fwd is None or len(cells) != 1 or len(storage) != 2 * len(stored):
            raise CacheError(f"load_step_tensors takes the {len(stored)} layers' tensors of step_tensors, after it")
        self._fwd.cells, = cells
        for i, st in enumerate(stored):
            st.k[0], st.v[0] = storage[2 * i], storage[2 * i + 1]

    def _write(self, fwd: Forward, dst: Tensor, src: Tensor) -> None:
        if fwd.span is not None:
            dst[:, :, fwd.span[0]:fwd.span[1], :] = src
        else:
            dst[:, :, fwd.loc_tensor, :] = src

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        fwd = self._fwd
        if fwd is None:
            raise CacheError("get before start_forward")
        st = self._kv.layers.get(self._layer)
        if st is None:
            raise CacheError(f"get before put for layer {self._layer}")
        k, v = self._kv.read(ctx, st, fwd.used)
        return k, v, fwd.mask

    def reserve(self, ctx: Context, layer_shapes: Sequence[LayerShape]) -> None:
        self._check()
        saved = self._layer
        try:
            for layer, shape in enumerate(layer_shapes):
                if shape is None:
                    continue
                self._layer = layer
                st = self._layer_storage(ctx, tuple(int(x) for x in shape), self.num_cells)
                ctx.evaluate(*st.tensors())
        finally:
            self._layer = saved

    # ---- sequence management ---------------------------------------------------------------------------------------
    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.max_sequences:
            raise CacheError(f"sequence id {seq} out of range 0..{self.max_sequences - 1}")

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        self._check()
        self._check_seq(src_seq)
        self._check_seq(dst_seq)
        h = self._hi
        src = self._owners[:h, src_seq] & (self._pos[:h] < length)
        dst = self._owners[:h, dst_seq].copy()
        self._owners[:h, dst_seq] = src
        self._nown[:h] += src.astype(np.int32) - dst.astype(np.int32)
        self._pos[:h][self._nown[:h] == 0] = -1
        self._refresh([dst_seq])

    def can_resume(self, seq: int, pos: int) -> bool:
        """Causal cache: ``pos <= next position`` of ``seq`` (``pos == 0`` for an empty sequence). Windowed or
        chunked cache: additionally the positions ``pos - W .. pos - 1`` (or the chunk start .. ``pos - 1``) are all
        held, and nothing before that start was given up (ollama's rule: a sequence that lost its position 0 cannot
        resume at 0 either; the runner then clears and re-processes it)."""
        self._check()
        self._check_seq(seq)
        if not self._seq_count[seq]:
            return pos == 0
        if pos < 0 or pos > self._seq_max[seq] + 1:
            return False
        start = self._sees_from(pos)
        if start is None:
            return True
        start = max(0, start)
        if self._seq_min[seq] > start:
            return False
        h = self._hi
        p = self._pos[:h][self._owners[:h, seq]]
        return int(np.count_nonzero((p >= start) & (p < pos))) == pos - start

    def remove(self, seq: int, begin: int, end: Optional[int]) -> None:
        self.prepare_remove(seq, begin, end)()

    def prepare_remove(self, seq: int, begin: int, end: Optional[int]) -> Callable[[], None]:
        self._check()
        self._check_seq(seq)
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"remove needs 0 <= begin <= end, got begin={begin} end={end}")
        h = self._hi
        mine = self._owners[:h, seq]
        cp = self._pos[:h]
        gone = mine & (cp >= begin)
        if end is not None:
            gone &= cp < end
        moved = (mine & (cp >= end)) if end is not None and end > begin else None
        if moved is not None and moved.any():
            shared = moved & (self._nown[:h] > 1)
            if shared.any():
                others = sorted({int(s) for s in np.flatnonzero(self._owners[:h][shared].any(axis=0)) if s != seq})
                raise CacheError(f"cannot remove positions {begin}..{end - 1} of sequence {seq}: later positions "
                                 f"{np.sort(cp[shared]).tolist()} would be renumbered, but their cells are shared with "
                                 f"sequence(s) {others} (copy_prefix); remove the whole sequence instead")
            if self.shift_fn is None:
                raise CacheError(f"cannot remove positions {begin}..{end - 1} of sequence {seq} from the middle: the "
                                 "later positions would need their keys re-rotated and this cache has no shift "
                                 "function (not supported by the model)")
        else:
            moved = None
        gone_idx = np.flatnonzero(gone)
        moved_idx = None if moved is None else np.flatnonzero(moved)

        def commit() -> None:
            self._owners[gone_idx, seq] = False
            self._nown[gone_idx] -= 1
            freed = gone_idx[self._nown[gone_idx] == 0]
            self._pos[freed] = -1
            if moved_idx is not None:
                self._pos[moved_idx] -= end - begin
                self._shift(moved_idx, -(end - begin))
            self._refresh([seq])
        return commit

    def _shift(self, idx: np.ndarray, delta: int) -> None:
        """Re-rotate the keys of cells ``idx`` (ascending) by ``delta`` positions in every stored layer."""
        if not self._kv.layers:
            return
        ctx = self._backend.new_context()
        try:
            self._kv.shift_keys(ctx, idx, delta, self.shift_fn)
        finally:
            ctx.close()
