"""The repository explains itself: code cites docs/architecture.md by section, and every
section it cites exists; every document it names is in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SOURCES = ("service", "kernels", "operator", "tests", "benchmarks", "charts", "scripts")
CITATION = re.compile(r"docs/architecture\.md,?\s+section\s+(\d+)")


def repository_files() -> list[Path]:
    """The files git tracks or would track: not the ignored ones (virtual environments,
    caches, peers installed beside the benchmarks), whose documents are not ours."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def source_texts() -> dict[Path, str]:
    files = [p for p in repository_files() if p.relative_to(ROOT).parts[0] in SOURCES]
    files += [ROOT / "README.md", ROOT / "Dockerfile"]
    texts = {}
    for path in files:
        if (
            path.suffix in (".py", ".md", ".yaml", ".yml", ".tpl", ".sh", "")
            or path.name == "Dockerfile"
        ):
            try:
                texts[path] = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
    return texts


def test_every_cited_section_exists() -> None:
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", DOC.read_text(), re.MULTILINE)}
    assert sections == set(range(1, len(sections) + 1))
    cited = {
        (path.relative_to(ROOT), int(n))
        for path, text in source_texts().items()
        for n in CITATION.findall(text)
    }
    assert cited, "no code cites the architecture document"
    assert {(path, n) for path, n in cited if n not in sections} == set()


def test_every_markdown_document_cited_is_in_the_repository() -> None:
    """A reader has only the repository: a `.md` file named in the sources must be one
    of its own."""
    present = {path.name for path in repository_files() if path.suffix == ".md"}
    cited = {
        (path.relative_to(ROOT), name)
        for path, text in source_texts().items()
        if not any(part.startswith("vendor") for part in path.parts)  # others' files
        for name in re.findall(r"\b([A-Za-z0-9_-]+\.md)\b", text)
    }
    assert {(path, name) for path, name in cited if name not in present} == set()
