"""``fedskew init``: a commented starter config and a method skeleton, written into the user's folder.

The templates ship as package data beside this module (pyproject's ``[tool.setuptools.package-data]``):
``fedskew.yaml`` runs as is on digits in seconds; ``my_method.py`` (stored as ``my_method.py.tmpl`` so that
it is neither imported nor registered as part of fedskew) is a minimal :class:`~fedskew.algorithms.base.
Algorithm` subclass. Existing files are never overwritten without ``force``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fedskew.errors import FedskewError

__all__ = ["STARTER_FILES", "write_starter"]

#: file written into the user's folder -> its template in this package
STARTER_FILES = {"fedskew.yaml": "fedskew.yaml", "my_method.py": "my_method.py.tmpl"}


def template_text(name: str) -> str:
    """The text of the starter file ``name`` (a key of :data:`STARTER_FILES`)."""
    return resources.files(__name__).joinpath(STARTER_FILES[name]).read_text(encoding="utf-8")


def write_starter(folder: Path, force: bool = False) -> list[Path]:
    """Write every starter file into ``folder`` (created) and return their paths; refused as a whole, with
    one line naming the files, when any exists and ``force`` is not given."""
    if folder.exists() and not folder.is_dir():
        raise FedskewError(f"fedskew init: '{folder}' is a file; expected a folder to write the starter into")
    targets = {folder / name: template_text(name) for name in STARTER_FILES}
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise FedskewError(
            f"fedskew init: will not overwrite {', '.join(repr(p) for p in existing)}; pass --force to "
            "overwrite, or choose another folder"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in targets.items():
        path.write_text(text, encoding="utf-8")
    return list(targets)
