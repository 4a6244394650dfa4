"""The harness's load generator from the command line: ``load.run_load`` against one server.

Usage: ``python -m mlx_trio.api.bench.http_load --url http://127.0.0.1:8000 --clients 8
--max-tokens 64`` (``python -m bench.http_load`` in a checkout). Only loopback URLs are
accepted. The GPU run's HTTP waves run it in a process of their own, with ``--json``, so that
the clients do not share the server's GIL.
"""

from __future__ import annotations

import argparse
import json
import logging
from functools import partial

import trio

from .load import DEFAULT_REQUEST_TIMEOUT_S, check_loopback, run_load
from .load_result import format_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="loopback base URL")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="default: first id of GET /v1/models")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="default: greedy")
    parser.add_argument(
        "--prompt-offset", type=int, default=0, help="first prompt's index (another run's: unseen)"
    )
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S)
    parser.add_argument("--run-timeout", type=float, default=None)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        check_loopback(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    load = partial(
        run_load,
        args.url,
        clients=args.clients,
        max_tokens=args.max_tokens,
        model=args.model,
        requests_per_client=args.requests_per_client,
        api_key=args.api_key,
        temperature=args.temperature,
        prompt_offset=args.prompt_offset,
        request_timeout_s=args.request_timeout,
        run_timeout_s=args.run_timeout,
    )
    try:
        result = trio.run(load)
    except* (RuntimeError, ValueError) as group:
        parser.exit(1, f"http_load: error: {group.exceptions[0]}\n")
    except* KeyboardInterrupt:
        parser.exit(130, "http_load: interrupted\n")
    print(json.dumps(result.summary(), indent=2) if args.json else format_result(result))


if __name__ == "__main__":
    main()
