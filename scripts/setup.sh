#!/usr/bin/env bash
# Set up mlx-trio in ./.venv: the system runtime OpenBLAS needs, then the package.
#   scripts/setup.sh          the runtime
#   scripts/setup.sh --test   the runtime and the test tools
set -euo pipefail
cd "$(dirname "$0")/.."

# cmeel-openblas's libopenblas.so.0 links libgfortran.so.5 (design/001-openblas.md).
if [[ "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]] && ! ldconfig -p | grep -q 'libgfortran\.so\.5 '; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: installing libgfortran5 (needed by OpenBLAS)" >&2
        apt-get install -y -q libgfortran5 >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q libgfortran5 >/dev/null; }
    else
        echo "setup: libgfortran5 is missing; install it (e.g. 'sudo apt-get install libgfortran5')" \
            "or MLX's CPU matmuls run ~40x slower" >&2
    fi
fi

PYTHON="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
extra=""
[[ "${1:-}" == "--test" ]] && extra="[test]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extra}"
