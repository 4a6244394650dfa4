"""What handing tokens out costs the server's event loop, per SSE chunk and per token (issue 39).

The real HTTP server (Hypercorn, the runtime, the sessions) runs in a child process over the
scripted engine, whose steps are sleeps on the loop: every CPU second the child spends is the
loop's own work (admission, fan-out, sessions, SSE). Streaming clients in this process read
``--streams`` chat completions of ``--max-tokens`` each; the child's CPU time over the chunks the
clients got is the loop's cost per chunk. Run with one step a call (a chunk a token, as the
engine process's hand-out does) and with several (a chunk of that many tokens, as paced calls
do). Usage::

    python -m bench.handout_cost [--streams 64,128] [--max-tokens 64] [--steps-per-call 1,8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
from multiprocessing.connection import Connection

import trio

from mlx_trio.api.bench.load import run_load


def _serve(connection: Connection, max_batch: int, steps_per_call: int) -> None:
    """The child: the server over the scripted engine; sends its URL, then its CPU seconds when
    told to."""
    from mlx_trio.actors.config import RuntimeConfig
    from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
    from mlx_trio.api.server import ServeOptions
    from tests.server_thread import ServerThread

    runtime = RuntimeConfig(
        max_batch=max_batch, max_live=max_batch, max_queued=4 * max_batch,
        steps_per_call=steps_per_call,
    )  # fmt: skip
    options = ServeOptions(runtime=runtime)
    with ServerThread(options, engine=ScriptedEngine(Script(step_s=0.005))) as server:
        connection.send(server.url)
        while connection.recv() is not None:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            connection.send(usage.ru_utime + usage.ru_stime)


def measure(streams: int, max_tokens: int, steps_per_call: int) -> tuple[float, float, int]:
    """The child's CPU microseconds per chunk and per token, and the chunks."""
    parent, child = multiprocessing.Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(child, streams, steps_per_call), daemon=True
    )
    process.start()
    try:
        url = parent.recv()
        trio.run(lambda: run_load(url, clients=4, max_tokens=8))  # warm the paths up
        parent.send(True)
        before = parent.recv()
        result = trio.run(lambda: run_load(url, clients=streams, max_tokens=max_tokens))
        parent.send(True)
        cpu = parent.recv() - before
        parent.send(None)
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    chunks = sum(len(r.inter_token_s) + 1 for r in result.requests)
    tokens = sum(r.completion_tokens for r in result.requests)
    return cpu / chunks * 1e6, cpu / max(tokens, 1) * 1e6, chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="64,128")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps-per-call", default="1,8")
    args = parser.parse_args()
    print("| streams | steps a call | chunks | loop CPU us a chunk | loop CPU us a token |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for streams in (int(s) for s in args.streams.split(",")):
        for steps in (int(s) for s in args.steps_per_call.split(",")):
            per_chunk, per_token, chunks = measure(streams, args.max_tokens, steps)
            print(f"| {streams} | {steps} | {chunks} | {per_chunk:.0f} | {per_token:.0f} |")


if __name__ == "__main__":
    main()
