#!/usr/bin/env bash
# Check the layers with import-linter (contracts: pyproject.toml, [tool.importlinter]).
# The folders install as mlx_trio.{actors,engine,api} through a package-dir mapping, which
# import-linter cannot walk, so it reads them through a temporary mlx_trio/ of links instead.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/mlx_trio"
for folder in actors engine api; do ln -s "$root/$folder" "$tree/mlx_trio/$folder"; done
cd "$tree"
PYTHONPATH="$tree" "$root/.venv/bin/lint-imports" --no-cache --no-logo "$root/pyproject.toml"
