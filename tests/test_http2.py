"""Cleartext HTTP/2 is not served (issue 34): Hypercorn never timed out an idle HTTP/2
connection, so the slowloris defence of HTTP/1.1 (closed after 5 s idle) did not cover it."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import h2.config
import h2.connection
import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api.http_state import HttpSettings
from tests.server_thread import scripted_server

CLOSED_WITHIN_S = 15.0  # HTTP/1.1's keep-alive is 5 s; HTTP/2 stayed open 150 s and more


@pytest.fixture(scope="module")
def server():
    with scripted_server(RuntimeConfig(max_batch=2), HttpSettings()) as running:
        yield running


def connect(server) -> socket.socket:
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=CLOSED_WITHIN_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; fails past ``CLOSED_WITHIN_S``."""
    received = b""
    deadline = time.monotonic() + CLOSED_WITHIN_S
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return received
        received += chunk
    pytest.fail(f"the connection was still open after {CLOSED_WITHIN_S} s: {received[:200]!r}")


def test_an_idle_http2_prior_knowledge_connection_is_closed(server):
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with connect(server) as sock:
        sock.sendall(conn.data_to_send())  # the preface and SETTINGS, then nothing
        answer = read_until_closed(sock)
    assert not answer.startswith(b"\x00")  # no HTTP/2 frame came back: it was not served


def test_half_a_headers_frame_is_closed(server):
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1, [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", "x")]
    )
    data = conn.data_to_send()
    with connect(server) as sock:
        sock.sendall(data[:-3])  # HEADERS without its end
        read_until_closed(sock)


def test_an_h2c_upgrade_is_answered_in_http11(server):
    with connect(server) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
