"""The harness's load generator on its own, kept as ``python -m bench.http_load``.

It is ``python -m mlx_trio.api.bench.http_load``: ``--url http://127.0.0.1:8000 --clients 8
--max-tokens 64``; only loopback URLs are accepted.
"""

from mlx_trio.api.bench.http_load import main

if __name__ == "__main__":
    main()
