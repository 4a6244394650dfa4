#!/usr/bin/env bash
# Set up mlx-trio in ./.venv, with the MLX backend this machine can run.
#   scripts/setup.sh            the runtime
#   scripts/setup.sh --test     the runtime and the test tools
#   scripts/setup.sh --dry-run  print the commands instead of running them (combines with --test)
# The backend is CUDA where `nvidia-smi -L` lists a GPU, else the CPU; MLX_TRIO_BACKEND=cpu|cuda
# decides instead. Nothing needs root: OpenBLAS's Fortran runtime comes from the wheels
# (design/001-openblas.md).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=() dry_run=""
for arg in "$@"; do
    case "$arg" in
        --test) extras+=(test) ;;
        --dry-run) dry_run=1 ;;
        *) echo "setup: unknown argument $arg (--test, --dry-run)" >&2; exit 2 ;;
    esac
done

if [[ "$(uname -s)" != Linux ]]; then
    MLX_TRIO_BACKEND=native  # macOS: the mlx wheel carries Metal and the CPU itself
elif [[ -z "${MLX_TRIO_BACKEND:-}" ]]; then
    MLX_TRIO_BACKEND=cpu
    if nvidia-smi -L >/dev/null 2>&1; then MLX_TRIO_BACKEND=cuda; fi
fi
# MLX's Linux backends are separate wheels that both ship mlx/lib/libmlx.so: the one installed
# last wins, and uninstalling the other one deletes it. So the unwanted one goes, and the wanted
# one is unpacked again.
case "$MLX_TRIO_BACKEND" in
    native) wheel="" other="" ;;
    cpu) wheel=mlx-cpu other=mlx-cuda-13 ;;
    cuda) wheel=mlx-cuda-13 other=mlx-cpu extras+=(cuda) ;;
    *) echo "setup: MLX_TRIO_BACKEND must be cpu or cuda, not '$MLX_TRIO_BACKEND'" >&2; exit 2 ;;
esac
echo "setup: MLX backend $MLX_TRIO_BACKEND" >&2

run() {
    if [[ -n "$dry_run" ]]; then echo "+ $*"; else "$@"; fi
}

installed() {
    [[ -x .venv/bin/python ]] && .venv/bin/python -m pip show -q "$1" >/dev/null 2>&1
}

mlx_version() {
    if [[ -n "$dry_run" ]]; then echo "<installed mlx version>"; return; fi
    .venv/bin/python -c 'import importlib.metadata as m; print(m.version("mlx"))'
}

MLX_VLM_VERSION=0.7.10
PYTHON="${PYTHON:-python3}"
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)
[[ -x .venv/bin/python ]] || run "$PYTHON" -m venv .venv
spec="."
if (( ${#extras[@]} )); then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
run "${pip[@]}" install -e "$spec"
# Vision-language models (design/031-images.md): mlx-vlm pinned, without its declared
# dependencies (datasets, opencv-python, mlx-audio, fastapi, ...), which the parts used here do
# not import; Pillow and requests, which they do, are mlx-trio's own dependencies.
run "${pip[@]}" install --no-deps "mlx-vlm==$MLX_VLM_VERSION"
# The base dependencies pull mlx-cpu on Linux (mlx alone has no libmlx.so there), so a CUDA
# install always has the CPU wheel to remove.
if [[ "$MLX_TRIO_BACKEND" == cuda ]] || { [[ -n "$other" ]] && installed "$other"; }; then
    run "${pip[@]}" uninstall -y "$other"
    run "${pip[@]}" install --force-reinstall --no-deps "$wheel==$(mlx_version)"
fi
