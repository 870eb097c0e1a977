"""docs/design.md's contract tables list exactly the hooks and flags of ``Algorithm``."""

from __future__ import annotations

import re
from pathlib import Path

from fedskew.algorithms.base import Algorithm

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _table(header: str) -> list[str]:
    text = DESIGN.read_text()
    start = text.index(header)
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    return [r.split("|")[1] for r in rows]


def test_the_hook_table_lists_every_hook() -> None:
    documented = {m for cell in _table("| hook | side |") for m in re.findall(r"`(\w+)\(", cell)}
    code = {k for k, v in vars(Algorithm).items() if callable(v) and not k.startswith("_") and k != "Params"}
    assert documented == code


def test_the_flag_table_lists_every_flag() -> None:
    documented = {m for cell in _table("| class attribute |") for m in re.findall(r"`(\w+)`", cell)}
    flags = (bool, frozenset, str)  # a str flag is a level (federation_counts); ``name`` is no flag
    public = {k: v for k, v in vars(Algorithm).items() if k != "name" and not k.startswith("_")}
    code = {k for k, v in public.items() if isinstance(v, flags)} | {"Params"}
    assert documented == code
