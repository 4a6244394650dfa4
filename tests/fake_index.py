"""A package index on a loopback port, for the model store's fetch: nothing leaves the machine.

``FakeIndex`` serves the simple repository API as PyPI does: ``/simple/<project>/`` in JSON
(PEP 691) to a client that asks for it and in HTML (PEP 503) otherwise, or in HTML only
(``json=False``), and each file at ``/files/<name>``; a project or file it does not have is a
404. ``status`` answers one path with another status instead.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

JSON_TYPE = "application/vnd.pypi.simple.v1+json"


class FakeIndex:
    """Files of projects, served at ``url`` (``/simple``) while the context is open."""

    def __init__(self, *, json: bool = True) -> None:
        self.serve_json = json
        self.projects: dict[str, list[tuple[str, str | None]]] = {}  # name -> [(file, sha256)]
        self.files: dict[str, bytes] = {}
        self.status: dict[str, int] = {}  # path -> status to answer instead
        self.requests: list[str] = []
        self._server: ThreadingHTTPServer | None = None

    def add(self, project: str, path: Path, *, sha256: str | None = "real") -> None:
        """List ``path`` under ``project``; ``sha256``: the hash the page gives ("real": the
        file's, None: none)."""
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest() if sha256 == "real" else sha256
        self.projects.setdefault(project, []).append((path.name, digest))
        self.files[path.name] = data

    @property
    def base(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        return f"{self.base}/simple"

    def _page(self, project: str, as_json: bool) -> tuple[bytes, str]:
        entries = self.projects[project]
        if as_json:
            files = [
                {"filename": f, "url": f"../../files/{f}", "hashes": {"sha256": h} if h else {}}
                for f, h in entries
            ]
            return json.dumps({"name": project, "files": files}).encode(), JSON_TYPE
        links = "".join(
            f'<a href="/files/{f}{f"#sha256={h}" if h else ""}">{f}</a><br/>\n' for f, h in entries
        )
        return f"<html><body>\n{links}</body></html>".encode(), "text/html"

    @contextmanager
    def serving(self) -> Iterator[FakeIndex]:
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                index.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                if self.path in index.status:
                    self._answer(index.status[self.path], b"no", "text/plain")
                elif parts[0] == "simple" and len(parts) == 2 and parts[1] in index.projects:
                    as_json = index.serve_json and JSON_TYPE in self.headers.get("Accept", "")
                    self._answer(200, *index._page(parts[1], as_json))
                elif parts[0] == "files" and len(parts) == 2 and parts[1] in index.files:
                    self._answer(200, index.files[parts[1]], "application/octet-stream")
                else:
                    self._answer(404, b"not found", "text/plain")

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join()
