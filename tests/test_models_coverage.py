"""Every architecture the registry runs has a row in docs/models-coverage.md (issue 60): a user reading the page sees
what is proven for the model they have, and a new architecture cannot land without saying so."""

from __future__ import annotations

import re
from pathlib import Path

from mlx_engine.models.registry import ARCHITECTURES

PAGE = Path(__file__).resolve().parents[1] / "docs" / "models-coverage.md"


def _rows() -> dict[str, list[str]]:
    """The table's rows by each architecture name in their first cell (backquoted): the row's cells."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 5:
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells
    return rows


def test_every_architecture_has_a_row_that_says_how_it_is_proven():
    rows = _rows()
    missing = sorted(set(ARCHITECTURES) - set(rows))
    assert not missing, f"architectures without a row in {PAGE.name}: {missing}"
    for name in ARCHITECTURES:
        formats, proof = rows[name][1], rows[name][2]
        assert formats and re.search(r"tests/test_\w+\.py", proof), f"{name}'s row names no formats or no test"
        for test in re.findall(r"tests/test_\w+\.py", proof):
            assert (PAGE.parents[1] / test).is_file(), f"{name}'s row names {test}, which does not exist"


def test_each_architecture_has_one_row():
    names = [n for line in PAGE.read_text().splitlines() if line.startswith("| `")
             for n in re.findall(r"`([^`]+)`", line.split("|")[1])]
    assert len(names) == len(set(names)), f"architectures with more than one row: {names}"
