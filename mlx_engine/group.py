"""The processes of one distributed run as the models see them (:class:`Group`; ``mlx_engine/mlx/distributed.py``
implements it on ``mx.distributed``)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from mlx_engine.ml import DType, Tensor


class Group(abc.ABC):
    """The processes of one distributed run (``mlx.launch``), as a model shard sees them.

    Collective operations are lazy, like every other operation: they run when a tensor that depends on them is
    evaluated, and every rank must evaluate the same collectives in the same order. A peer that is gone makes the
    evaluation raise ``RuntimeError`` (the transport's message), never hang on a closed connection.
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank, ``0 .. size - 1``; rank 0 talks to the user."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """How many processes there are."""

    @abc.abstractmethod
    def all_sum(self, x: Tensor) -> Tensor:
        """The elementwise sum of ``x`` over every rank (every rank passes the same shape and dtype)."""

    @abc.abstractmethod
    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` concatenated along axis 0 in rank order: ``[size * n, ...]`` for ``x [n, ...]``."""

    @abc.abstractmethod
    def send(self, x: Tensor, dst: int) -> Tensor:
        """Send ``x`` to rank ``dst``; returns ``x``, which performs the send when evaluated."""

    @abc.abstractmethod
    def recv(self, shape: Sequence[int], dtype: DType, src: int) -> Tensor:
        """The tensor of ``shape`` and ``dtype`` that rank ``src`` sends."""

    @abc.abstractmethod
    def depends(self, x: Tensor, *deps: Tensor) -> Tensor:
        """``x``, computed only after ``deps`` (so that evaluating ``x`` also performs a send among them)."""

    @abc.abstractmethod
    def exchange(self, data: bytes, capacity: int = 1024) -> list[bytes]:
        """Every rank's ``data`` (at most ``capacity`` bytes), in rank order, on every rank, now (evaluated).
        Raises ``ValueError`` for more than ``capacity`` bytes, ``RuntimeError`` when a peer is gone."""

    @abc.abstractmethod
    def broadcast_bytes(self, data: "bytes | None", capacity: int = 4096) -> bytes:
        """Rank 0's ``data`` on every rank, now (evaluated): rank 0 passes the bytes, the others None.

        One collective of ``capacity`` bytes when the message fits it (a 4-byte length, then the payload), a second
        one for the rest otherwise. Raises ``RuntimeError`` when a peer is gone.
        """
