"""How the peers' files are named in messages and saved results, and written in place."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def shown(path: Path) -> str:
    """`path` relative to the working directory where it lies below it: results that are
    saved and shared should not carry the paths of the machine they ran on."""
    resolved = Path(path).resolve()
    cwd = Path.cwd()
    return str(resolved.relative_to(cwd)) if resolved.is_relative_to(cwd) else str(path)


@contextlib.contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A new directory beside `target` to write into; once the block ends without an
    error it replaces `target` whole, so that a reader never finds it half written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        staging.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
