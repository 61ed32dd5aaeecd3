"""Numbers as ``list`` and ``show`` print them (decimal units, as ollama prints), and text from model files made safe
to print on a terminal."""

from __future__ import annotations

import re


def format_count(n: int | None) -> str:
    """``134515008`` -> ``135M``; None -> ``?``."""
    if n is None:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v >= 10 else f"{v:.1f}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    """``98362432`` -> ``98.4 MB`` (decimal units)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_count(s: str) -> int | None:
    """``135M`` -> ``135000000``; None when ``s`` is not a count."""
    mo = re.fullmatch(r"\s*([\d.]+)\s*([KMBT]?)\s*", str(s), re.I)
    if not mo:
        return None
    return int(float(mo.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[mo.group(2).upper()])


# ESC sequences (CSI, OSC ending in BEL or ST, and two-byte ones), then any other C0/C1 control but tab and newline
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str | None) -> str | None:
    """``text`` (from a model file's metadata: a license, a description, a template) without terminal escape
    sequences or control characters other than tab and newline, so that printing it cannot move the cursor, retitle
    the window or hide text. None stays None."""
    if text is None:
        return None
    return _CONTROLS.sub("", _ESCAPES.sub("", str(text)))
