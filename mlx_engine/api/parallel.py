"""Loading one model over the ranks that ``mlx.launch`` started: each rank reads its share of the file, the ranks
check that they opened the same file, and every rank but 0 then serves rank 0 until it stops.

``load(..., parallel="pipeline" | "tensor")`` calls :func:`load_sharded`; see :mod:`mlx_engine.models.layers.sharding` for
who holds what and :mod:`mlx_engine.models.layers.parallel` for how the ranks keep in step.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from mlx_engine.errors import InvalidRequestError, WeightsError
from mlx_engine.group import Group
from mlx_engine.mlx.distributed import init_group
from mlx_engine.models.layers.parallel import DistributedModel, PeerLostError, follow, peer_lost
from mlx_engine.models.registry import TextCheckpoint, file_config, load_text_checkpoint
from mlx_engine.models.layers.sharding import MODES, plan

__all__ = ["MODES", "load_sharded", "launched_rank", "PeerLostError", "peer_lost", "serving_peer_lost"]


#: seconds for every rank to connect and agree on the model (``MLX_ENGINE_RANK_TIMEOUT``); the ring transport's
#: listening side would otherwise wait for a rank that never starts for ever
START_TIMEOUT = 120.0
#: seconds rank 0 waits for the other ranks to take a control message (``MLX_ENGINE_PEER_TIMEOUT``); they wait for
#: it between passes, so only a rank that is gone or stuck takes longer
PEER_TIMEOUT = 60.0


class _Watch:
    """Ends this process with ``message`` once an armed stretch lasts more than ``seconds``. What it watches (the
    transport's connect; a collective to a peer that is gone, which the ring transport never completes once it has
    failed that peer's transfers) is a blocking call that holds the interpreter, so no Python thread or signal handler
    would run: the watch is a small child process, told over a pipe when a stretch starts (:meth:`arm`) and ends
    (:meth:`disarm`), a byte each way (a few microseconds). It ends with this process (its pipe closes), or at
    :meth:`close`."""

    _CODE = ("import os, select, signal, sys, time\n"
             "pid, seconds, message, fd = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.stdin.fileno()\n"
             "deadline = None\n"
             "while True:\n"
             "    wait = None if deadline is None else max(0.0, deadline - time.monotonic())\n"
             "    if not select.select([fd], [], [], wait)[0]:\n"
             "        sys.stderr.write(message); sys.stderr.flush(); os.kill(pid, signal.SIGKILL); sys.exit(0)\n"
             "    data = os.read(fd, 4096)\n"
             "    if not data:\n"
             "        sys.exit(0)\n"
             "    deadline = time.monotonic() + seconds if data[-1:] == b'a' else None\n")

    def __init__(self, seconds: float, message: str):
        self.child = subprocess.Popen([sys.executable, "-c", self._CODE, str(os.getpid()), str(seconds), message],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self._fd = self.child.stdin.fileno()

    def arm(self) -> None:
        os.write(self._fd, b"a")

    def disarm(self) -> None:
        os.write(self._fd, b"d")

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.kill()
            self.child.wait()
        self.child.stdin.close()


def _start_watch(seconds: float) -> _Watch:
    """Armed now: the ranks must connect and agree on the model within ``seconds``."""
    watch = _Watch(seconds, f"Error: the ranks of the distributed run did not all connect and agree on the model "
                            f"within {seconds:g} s (MLX_ENGINE_RANK_TIMEOUT); is every rank started, and can each "
                            "reach the others' addresses? Stopping.\n")
    watch.arm()
    return watch


def _peer_watch(seconds: float) -> _Watch:
    """Rank 0's, armed over each control message (``DistributedModel.watch``)."""
    return _Watch(seconds, f"Error: rank 0: the other ranks of the distributed run did not take a control message "
                           f"within {seconds:g} s (MLX_ENGINE_PEER_TIMEOUT): one of them is gone or stuck. Stopping; "
                           "start every rank again (mlx.launch restarts them all).\n")


def launched_rank() -> int:
    """This process's rank as ``mlx.launch`` (or MPI) set it in the environment; 0 when it was not launched."""
    for key in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _handshake(group: Group, wf: Any, settings: dict[str, Any]) -> None:
    """Every rank tells the others what it opened and how it loads it; all of them refuse to go on (each raising
    the same error) when any rank differs from rank 0."""
    mine = json.dumps({"fingerprint": wf.fingerprint(), **settings}).encode()
    theirs = [json.loads(b) for b in group.exchange(mine)]
    for rank, other in enumerate(theirs[1:], start=1):
        if other != theirs[0]:
            what = ", ".join(f"{k} {other.get(k)!r} (rank 0: {theirs[0].get(k)!r})" for k in theirs[0]
                             if other.get(k) != theirs[0].get(k))
            raise WeightsError(f"rank {rank} of the distributed run differs from rank 0: {what}; every rank must "
                               f"load the same model file with the same settings")


def load_sharded(path: Path, make_backend: Callable[..., Any], parallel: str, transport: str = "any",
                 settings: dict[str, Any] | None = None) -> tuple[TextCheckpoint, DistributedModel]:
    """This rank's share of the model at ``path``, on rank 0; on the other ranks, serve rank 0 and exit.

    Args:
        make_backend: ``make_backend(path, shard=...)`` (the API's ``MLXBackend`` with its device and dtype).
        parallel: ``pipeline`` or ``tensor``. transport: ``mx.distributed``'s backend (``any``, ``ring``, ``jaccl``,
            ``mpi``, ``nccl``). settings: what every rank must agree on besides the file (dtype, requantize...).

    Returns (rank 0): the checkpoint (this rank's backend, shard and the tokenizer) and the distributed model.

    Raises:
        InvalidRequestError: an unknown mode, or a process that ``mlx.launch`` did not start with other ranks.
        WeightsError: a rank opened another file, or loads it differently. UnsupportedError: a model the mode
            cannot split over this many ranks. PeerLostError: a rank went away.
        SystemExit: on ranks other than 0, when rank 0 stops (status 0).
    """
    if parallel not in MODES:
        raise InvalidRequestError(f"unknown parallel mode {parallel!r}; use {' or '.join(MODES)}")
    watchdog = _start_watch(float(os.environ.get("MLX_ENGINE_RANK_TIMEOUT", START_TIMEOUT)))
    try:
        group = init_group(transport)
    except BaseException:
        watchdog.close()
        raise
    if group.size < 2:
        watchdog.close()
        raise InvalidRequestError(
            f"parallel={parallel!r} needs several ranks, but this process runs alone; start it with mlx.launch, "
            "e.g. mlx.launch -n 2 --backend ring -- mlx-engine run MODEL PROMPT --parallel pipeline")
    holder: dict[str, Any] = {}

    def shard(wf: Any) -> dict[str, Any]:
        try:
            _handshake(group, wf, {"parallel": parallel, "size": group.size, **(settings or {})})
        finally:
            watchdog.close()
        holder["config"] = file_config(wf)
        holder["plan"] = plan(wf, holder["config"], parallel, group.rank, group.size)
        return holder["plan"].tensors(wf)

    def part(config: Any) -> Any:
        return holder["plan"].part(config, group.all_sum if parallel == "tensor" else None)

    try:
        text = load_text_checkpoint(path, lambda p: make_backend(p, shard=shard), part=part)
        model = DistributedModel(text.model, holder["config"], group, holder["plan"])
        model.ranks = model._exchange_stats()
    except RuntimeError as e:  # the transport: a rank that failed to load has gone
        raise peer_lost(group.rank, e) from None
    finally:
        watchdog.close()
    if group.rank == 0:
        model.watch = _peer_watch(float(os.environ.get("MLX_ENGINE_PEER_TIMEOUT", PEER_TIMEOUT)))
        atexit.register(model.stop)
        return text, model
    follow(model)
    sys.exit(0)


def serving_peer_lost(e: BaseException, grace: float = 1.0) -> PeerLostError:
    """A server whose model is split over ranks has lost one: the error to fail the running requests with; the
    process ends (status 1) ``grace`` seconds later, once those errors have gone out, since the model cannot run
    again without every rank."""
    err = peer_lost(0, e)

    def stop() -> None:
        sys.stderr.write(f"Error: {err}\n")
        sys.stderr.flush()
        os._exit(1)

    threading.Timer(grace, stop).start()
    return err
