"""The decision log and the per-method decision pages (docs/decisions.md, docs/methods/): every relative
link resolves to a file and, with an anchor, to one of its headings; every method page's heading is in the
index (source comments name headings as `docs/decisions.md, "FedEnt: ..."`, so the index must list them)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def headings(path: Path, level: str = "#") -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith(level)]


def broken_links(path: Path) -> list[str]:
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in map(slug, headings(dest))):
            out.append(f"{path.name}: {target}")
    return out


def test_decision_links_resolve_and_the_index_names_every_method_heading():
    pages = sorted((DOCS / "methods").glob("*.md"))
    assert pages, "docs/methods/ has no decision pages"
    broken = [b for p in [DOCS / "decisions.md", *pages] for b in broken_links(p)]
    assert not broken, broken
    index = (DOCS / "decisions.md").read_text()
    missing = [
        f"{p.name}: {h}"
        for p in pages
        for h in headings(p, "### ")
        if f"](methods/{p.name}#{slug(h)})" not in index
    ]
    assert not missing, missing


def test_a_link_to_a_heading_that_moved_is_reported(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n### FedEnt: initial rate η_i(−1)\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#fedent-initial-rate-η_i1) [moved](a.md#fedent-the-old-name) [gone](c.md)\n"
    )
    assert broken_links(tmp_path / "b.md") == ["b.md: a.md#fedent-the-old-name", "b.md: c.md"]
