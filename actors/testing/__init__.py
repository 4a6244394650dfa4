"""Test doubles and fault hooks, apart from the runtime (as ``trio.testing`` is from Trio): the
scripted engine (``scripted``, ``script``), a fast engine with the real port's surface and no
model, and the fault-injecting engine (``faulty``) that the chaos harness and the tests put
between the runtime and an engine. The serving path never imports this package (an
import-linter contract in pyproject.toml)."""
