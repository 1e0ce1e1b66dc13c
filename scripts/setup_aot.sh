#!/usr/bin/env bash
# A venv for compile-only GPU work on a machine without a GPU (benchmarks/kernel_count.py): .venv-aot sees the
# project's .venv (run scripts/setup.sh first) and adds jax's CUDA plugin and CUDA libraries (~4 GB) of the same
# jax version. Nothing in .venv changes, so the tests and the CLI keep the CPU backend. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "setup_aot: run scripts/setup.sh first" >&2; exit 1; }
JAX_VERSION="$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
CUDA_MAJOR="${CUDA_MAJOR:-13}"
if [ ! -x .venv-aot/bin/python ]; then
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv .venv-aot
fi
SITE="$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')"
AOT_SITE="$(.venv-aot/bin/python -c 'import site; print(site.getsitepackages()[0])')"
echo "$SITE" > "$AOT_SITE/zz_project_venv.pth"  # after .venv-aot's own packages: the plugin comes from here
.venv-aot/bin/python -m pip -q --disable-pip-version-check install \
  "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" "jax-cuda${CUDA_MAJOR}-plugin[with-cuda]==$JAX_VERSION" \
  "nvidia-cuda-nvdisasm==${CUDA_MAJOR}.*"  # (SASS for benchmarks/mgpu_ptx.py --sass)
echo "setup_aot: ready; run e.g.  .venv-aot/bin/python benchmarks/kernel_count.py" >&2
