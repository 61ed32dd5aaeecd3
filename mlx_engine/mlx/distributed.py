"""``mx.distributed`` behind the ``Group`` interface: the ring (TCP), JACCL (RDMA over Thunderbolt), MPI and NCCL
backends that ``mlx.launch`` starts, as one :class:`MLXGroup`."""

from __future__ import annotations

import numpy as np

from mlx_engine.errors import InvalidRequestError
from mlx_engine.group import Group
from mlx_engine.mlx.runtime import mx
from mlx_engine.mlx.tensor import TO_MX, MLXTensor

__all__ = ["MLXGroup", "init_group"]

BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")


class MLXGroup(Group):
    """An ``mx.distributed.Group`` (see ``mlx_engine.ml.Group``)."""

    def __init__(self, group: "mx.distributed.Group"):
        self.g = group

    @property
    def rank(self) -> int:
        return self.g.rank()

    @property
    def size(self) -> int:
        return self.g.size()

    def all_sum(self, x):
        return MLXTensor(mx.distributed.all_sum(x.a, group=self.g))

    def all_gather(self, x):
        return MLXTensor(mx.distributed.all_gather(x.a, group=self.g))

    def send(self, x, dst):
        return MLXTensor(mx.distributed.send(x.a, dst, group=self.g))

    def recv(self, shape, dtype, src):
        return MLXTensor(mx.distributed.recv(tuple(shape), TO_MX[dtype], src, group=self.g))

    def depends(self, x, *deps):
        return MLXTensor(mx.depends(x.a, [d.a for d in deps]))

    def exchange(self, data, capacity=1024):
        if len(data) > capacity - 4:
            raise ValueError(f"{len(data)} bytes do not fit an exchange of {capacity}")
        buf = np.zeros(capacity, np.uint8)
        buf[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
        buf[4:4 + len(data)] = np.frombuffer(data, np.uint8)
        got = mx.distributed.all_gather(mx.array(buf), group=self.g)
        mx.eval(got)
        rows = np.array(got).reshape(self.size, capacity)
        return [r[4:4 + int(r[:4].view(np.uint32)[0])].tobytes() for r in rows]

    def broadcast_bytes(self, data, capacity=4096):
        head = np.zeros(capacity, np.uint8)
        if self.rank == 0:
            if data is None:
                raise ValueError("rank 0 must give the bytes to broadcast")
            head[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
            first = data[:capacity - 4]
            head[4:4 + len(first)] = np.frombuffer(first, np.uint8)
        got = mx.distributed.all_sum(mx.array(head), group=self.g)
        mx.eval(got)
        got = np.array(got)
        n = int(got[:4].view(np.uint32)[0])
        out = got[4:4 + min(n, capacity - 4)].tobytes()
        rest = n - len(out)
        if rest > 0:
            tail = np.zeros(rest, np.uint8)
            if self.rank == 0:
                tail[:] = np.frombuffer(data[capacity - 4:], np.uint8)
            more = mx.distributed.all_sum(mx.array(tail), group=self.g)
            mx.eval(more)
            out += np.array(more).tobytes()
        return out


def init_group(backend: str = "any") -> MLXGroup:
    """The group of the processes that ``mlx.launch`` started (this process alone when it was not launched).

    Args:
        backend: ``any`` (the first that works), ``ring``, ``jaccl``, ``mpi`` or ``nccl``.

    Raises:
        InvalidRequestError: an unknown backend name, or one that cannot start here (the message says why).
    """
    if backend not in BACKENDS:
        raise InvalidRequestError(f"unknown distributed backend {backend!r}; use one of {', '.join(BACKENDS)}")
    try:
        g = mx.distributed.init(strict=backend != "any", backend=backend)
    except RuntimeError as e:
        raise InvalidRequestError(f"the {backend} distributed backend cannot start: {e}; start the ranks with "
                                  "mlx.launch (see docs/distributed.md)") from None
    return MLXGroup(g)
