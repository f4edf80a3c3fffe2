"""How the peers' files are named in messages and saved results."""

from __future__ import annotations

from pathlib import Path


def shown(path: Path) -> str:
    """`path` relative to the working directory where it lies below it: results that are
    saved and shared should not carry the paths of the machine they ran on."""
    resolved = Path(path).resolve()
    cwd = Path.cwd()
    return str(resolved.relative_to(cwd)) if resolved.is_relative_to(cwd) else str(path)
