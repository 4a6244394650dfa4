"""Images beside text (issue 41's goals, design/031-images.md), on the tiny random vision model.

(a) 16 streaming text chats, and once each has streamed a few tokens, one image request: the
    text streams' gaps between tokens (p50, p99) while the image waits for the drain and
    prefills, against their gaps before it came; and how long the image waited.
(b) ``/health``'s latency, polled every 10 ms while a 4096 x 4096 PNG decodes and resizes
    (off the event loop), against its latency at rest.

The server is ``mlx-trio serve`` in a process of its own, the clients httpx in this one.
Usage: ``python -m bench.images [--streams 16] [--max-tokens 96] [--image-tokens 256]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import trio
from PIL import Image

from mlx_trio.engine.model.random_vlm import save_random_vlm

MODEL = "tiny-vlm"
HEALTH_EVERY_S = 0.01


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_url(width: int, height: int, *, noise: bool) -> str:
    """A data URL of a PNG: random colours, or a pattern that compresses (a big image whose
    body still fits a request)."""
    if noise:
        pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack([(x ^ y) & 255, (x + y) & 255, (x * 3) & 255], -1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def image_body(url: str, max_tokens: int, stream: bool = False) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def text_stream(
    client: httpx.AsyncClient, i: int, max_tokens: int, times: list[float], warm: trio.Event
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Stream {i}, please."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": False},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                times.append(time.perf_counter())
                if len(times) == 4:
                    warm.set()


def gaps(times: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times) if start <= b <= end]


async def beside_text(client: httpx.AsyncClient, streams: int, max_tokens: int) -> dict:
    times: list[list[float]] = [[] for _ in range(streams)]
    warms = [trio.Event() for _ in range(streams)]
    image = png_url(640, 480, noise=True)
    marks: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(text_stream, client, i, max_tokens, times[i], warms[i])
        for warm in warms:
            await warm.wait()
        marks["sent"] = time.perf_counter()
        reply = await client.post("/v1/chat/completions", json=image_body(image, 8))
        marks["answered"] = time.perf_counter()
        assert reply.status_code == 200, reply.text
    before = [g for t in times for g in gaps(t, 0.0, marks["sent"])]
    during = [g for t in times for g in gaps(t, marks["sent"], marks["answered"])]
    p50 = statistics.median(before)
    return {
        "streams": streams,
        "gap_p50_before_ms": 1000 * p50,
        "gap_p99_before_ms": 1000 * quantile(before, 0.99),
        "gap_p50_during_ms": 1000 * statistics.median(during),
        "gap_p99_during_ms": 1000 * quantile(during, 0.99),
        "gap_max_during_ms": 1000 * max(during),
        "p99_during_over_p50_before": quantile(during, 0.99) / p50,
        "gaps_during": len(during),
        "image_request_s": marks["answered"] - marks["sent"],
    }


async def health_while_decoding(client: httpx.AsyncClient) -> dict:
    image = png_url(4096, 4096, noise=False)
    latencies: list[float] = []
    done = trio.Event()
    result: dict = {"png_base64_bytes": len(image)}

    async def poll() -> None:
        while not done.is_set():
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            await trio.sleep(HEALTH_EVERY_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.sleep(0.5)
        rest = list(latencies)
        start = time.perf_counter()
        reply = await client.post("/v1/chat/completions", json=image_body(image, 4))
        result["image_request_s"] = time.perf_counter() - start
        assert reply.status_code == 200, reply.text
        during = latencies[len(rest) :]
        done.set()
    result |= {
        "health_p50_rest_ms": 1000 * statistics.median(rest),
        "health_p50_during_ms": 1000 * statistics.median(during),
        "health_p99_during_ms": 1000 * quantile(during, 0.99),
        "health_max_during_ms": 1000 * max(during),
        "health_polls_during": len(during),
    }
    return result


async def measure(url: str, streams: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return {
            "beside_text": await beside_text(client, streams, max_tokens),
            "health_while_decoding": await health_while_decoding(client),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--image-tokens", type=int, default=256, help="the processor's cap")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_vlm(Path(tmp) / MODEL, max_pixels=28 * 28 * args.image_tokens)
        port = free_port()
        argv = [
            sys.executable, "-m", "mlx_trio.api.cli", "serve", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--max-batch", "32",
            "--max-body-bytes", str(64 << 20), "--max-image-bytes", str(64 << 20),
        ]  # fmt: skip
        server = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and server.poll() is None, "no server"
                time.sleep(0.2)
            result = trio.run(measure, url, args.streams, args.max_tokens)
        finally:
            server.terminate()
            server.wait(30)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
