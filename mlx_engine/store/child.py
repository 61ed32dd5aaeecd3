"""Child processes of a pull (pip) that die with the pull, even when it is killed with ``kill -9``.

A SIGKILL gives a process no chance to clean up, so the child must notice by itself. On Linux the kernel does it:
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (prctl(2)), set between fork and exec, kills the child when the thread that
started it ends. Elsewhere (macOS has no such call) the command runs under a small Python watcher that holds the read
end of a pipe whose write end only we hold: when we die the kernel closes it, the watcher reads end-of-file and kills
the command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# the watcher: argv = [fd, command...]; kills the command when the pipe at fd reaches end-of-file
_WATCHER = """
import os, subprocess, sys, threading
fd = int(sys.argv[1])
proc = subprocess.Popen(sys.argv[2:])
def watch():
    while os.read(fd, 1):
        pass
    proc.kill()
    os._exit(1)
threading.Thread(target=watch, daemon=True).start()
sys.exit(proc.wait())
"""


def _die_with_parent():
    """A ``preexec_fn`` that sets PDEATHSIG; built before the fork, so the child only makes one C call."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@contextlib.contextmanager
def guarded(cmd: list[str], *, watcher: bool | None = None, **kw) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(cmd, **kw)`` whose process dies when this process dies, however it dies; killed and
    reaped when the ``with`` block is left by an exception (Ctrl-C included).

    Args:
        cmd: the command.
        watcher: use the pipe watcher (the default off Linux); True on Linux only to test that path.

    Raises:
        OSError: the command cannot be started.
    """
    if watcher is None:
        watcher = not sys.platform.startswith("linux")
    write_end = None
    if watcher:
        read_end, write_end = os.pipe()  # not inherited by other children: only the watcher gets read_end
        try:
            proc = subprocess.Popen([sys.executable, "-c", _WATCHER, str(read_end), *cmd], pass_fds=(read_end,),
                                    **kw)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
    else:
        proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent(), **kw)  # noqa: PLW1509 -- one C call, no locks
    try:
        yield proc
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if write_end is not None:
            os.close(write_end)
