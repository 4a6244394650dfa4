"""Every HTTP request is logged once, with its outcome, refusals included (issue 34: a 400 or a
404 was not logged at all, a completed request twice); and a path with an encoded ``/`` is no
route (a proxy's path rule would not see the route it reaches)."""

from __future__ import annotations

import logging

import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api.http_state import HttpSettings
from tests.server_thread import model_id, scripted_server


@pytest.fixture(scope="module")
def server():
    with scripted_server(RuntimeConfig(max_batch=4), HttpSettings()) as running:
        yield running


def request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "status=" in r.getMessage()]


def test_a_completed_request_is_one_line(server, client, caplog):
    caplog.set_level(logging.INFO)
    chat = {"model": model_id(server), "messages": [{"role": "user", "content": "hi"}]}
    caplog.clear()
    reply = client.post("/v1/chat/completions", json={**chat, "max_tokens": 3})
    assert reply.status_code == 200
    request_id = reply.json()["id"]
    lines = [m for m in (r.getMessage() for r in caplog.records) if request_id in m]
    assert len(lines) == 1 and "status=200 outcome=completed" in lines[0]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "expect"),
    [
        ("POST", "/v1/chat/completions", {"model": "x"}, 400, "param=messages"),
        ("GET", "/v1/nope", None, 404, "outcome=refused"),
        ("POST", "/v1%2Fchat%2Fcompletions", {}, 404, "code=not_found"),
        ("POST", "/v1/chat%2Fcompletions", {}, 404, "code=not_found"),
    ],
)
def test_a_refused_request_is_one_line(client, caplog, method, path, body, status, expect):
    caplog.set_level(logging.INFO)
    caplog.clear()
    reply = client.request(method, path, json=body)
    assert reply.status_code == status
    assert reply.json()["error"]["type"] == "invalid_request_error"
    (line,) = request_lines(caplog)
    assert f"status={status} outcome=refused" in line and expect in line
