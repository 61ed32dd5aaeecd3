"""Disk space for pulls: the check before a download, and the error when the disk fills up during one.

Both say the same thing in the user's terms (how much is free where, how much the pull needs), so a full disk is
never reported as a network problem.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from mlx_engine.errors import StoreError
from mlx_engine.store.format import format_bytes


def free_bytes(folder: Path) -> int:
    """Bytes free to this user on the file system of ``folder`` (or of its nearest existing parent)."""
    folder = Path(folder)
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def disk_full(folder: Path, need: int, what: str) -> StoreError:
    """The error for a pull of ``what`` that needs ``need`` bytes in ``folder`` and does not (or no longer) fit."""
    return StoreError(f"the disk is full: {format_bytes(free_bytes(folder))} free in {folder}, {what} needs "
                      f"{format_bytes(need)}. Free some space (or set MLX_ENGINE_HOME to a folder on a disk with "
                      "room) and pull again.")


def require(folder: Path, need: int, what: str) -> None:
    """Check before a download that ``need`` bytes fit in ``folder``.

    Raises:
        StoreError: less is free (the message gives both numbers and the folder).
    """
    if free_bytes(folder) < need:
        raise disk_full(folder, need, what)


@contextlib.contextmanager
def reported(folder: Path, need: int, what: str) -> Iterator[None]:
    """Turn an ``OSError`` with ``errno.ENOSPC`` raised inside into :func:`disk_full`'s error."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise disk_full(folder, need, what) from None
        raise
