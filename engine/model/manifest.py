"""A model directory's manifest: every file's size and SHA-256, and the source file's SHA-256.

The importer writes ``mlx-trio-manifest.json`` last, so a directory without one was never
finished. Checking it in full costs about 0.1 s per 100 MB here.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

MANIFEST_NAME = "mlx-trio-manifest.json"
REQUIRED_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json"})


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file, read in chunks."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(model_dir: Path, *, source_sha256: str) -> None:
    """Write the manifest listing every file in ``model_dir`` with its size and SHA-256."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"source_sha256": source_sha256, "files": files}
    write_file_atomically(model_dir / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")


def write_file_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a file beside ``path`` and rename it over ``path``: a reader sees the
    old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def manifest_problem(model_dir: Path, *, source_sha256: str | None = None) -> str | None:
    """Why ``model_dir`` does not match its manifest, or None when every file matches.

    Checks sizes and full SHA-256 hashes (about 0.1 s per 100 MB here) and, when given,
    that the directory was built from ``source_sha256``.
    """
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "the manifest is missing or unreadable"
    if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
        return "the manifest is malformed"
    if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
        return "the manifest names a different source file"
    if not files.keys() >= REQUIRED_FILES:
        return "the manifest does not list the model files"
    for name, entry in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return f"{name} is missing or has the wrong size"
        if sha256_file(path) != entry.get("sha256"):
            return f"{name} does not match its SHA-256"
    return None
