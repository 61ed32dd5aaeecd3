"""The fenced examples of the user documentation: ``README.md`` and every Markdown page under ``docs/``.

A fenced block is an example when its language is ``sh`` (split into commands) or ``python`` (taken whole); an
unlabelled or ``text`` block is sample output. Any other language is refused by :func:`unknown_fences`, so that an
example cannot escape its test by being labelled ``bash`` or ``console``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_LANGUAGES = ("sh", "python")
OUTPUT_LANGUAGES = ("", "text")


def doc_files() -> list[Path]:
    """The README, then every ``docs/**/*.md`` in path order."""
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository, e.g. "docs/server.md"
    heading: str  # the nearest heading above the block, without its #s
    lang: str
    text: str


def blocks(lang: str | None = None) -> list[Block]:
    """Every fenced block of the documentation (of ``lang`` only, when given), in file order."""
    out = []
    for path in doc_files():
        doc = path.read_text(encoding="utf-8")
        for mo in re.finditer(r"^```(\w*)\n(.*?)^```", doc, re.S | re.M):
            if lang is None or mo.group(1) == lang:
                headings = re.findall(r"^#+ (.*)$", doc[:mo.start()], re.M)
                out.append(Block(str(path.relative_to(REPO)), headings[-1] if headings else "", mo.group(1),
                                 mo.group(2)))
    return out


def unknown_fences() -> list[str]:
    """``file: language`` of each fenced block that is neither an example nor sample output."""
    return [f"{b.file}: ```{b.lang}" for b in blocks() if b.lang not in EXAMPLE_LANGUAGES + OUTPUT_LANGUAGES]


def commands(block: str) -> list[str]:
    """The commands of an ``sh`` block: continuation lines joined, trailing comments (two spaces, then ``#``)
    dropped."""
    lines = block.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+", " ", re.split(r"\s{2,}#", line)[0]).strip() for line in lines
            if line.strip() and not line.lstrip().startswith("#")]


def examples() -> list[tuple[str, str]]:
    """``(file, example)`` for every command of an ``sh`` block and every ``python`` block, in file order."""
    return ([(b.file, c) for b in blocks("sh") for c in commands(b.text)]
            + [(b.file, b.text) for b in blocks("python")])


def distinct(items: list[str]) -> list[str]:
    """``items`` without repeats, in first-seen order: the README repeats some examples of the docs pages."""
    return list(dict.fromkeys(items))
