"""Which JAX wheel `scripts/setup.sh` installs: `jax[cuda13]` or `jax[cuda12]` when `nvidia-smi` reports a driver
of that CUDA major version (CUDA 14 and later drivers run the cuda13 wheel too), plain CPU `jax` otherwise, or
whenever `LUCEBOX_CPU=1` is set. Standard library only: setup runs it as a script before the package is installed.

    python lucebox_jax/install_select.py      # prints e.g. "jax[cuda13]>=0.11,<0.12" (the reason on stderr)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

CPU_ENV = "LUCEBOX_CPU"
CUDA_MAJORS = (12, 13)  # the jax[cudaNN] extras JAX publishes
DEFAULT_VERSION_SPEC = ">=0.11,<0.12"
_CUDA_RE = re.compile(r"CUDA Version:\s*(\d+)\.(\d+)")


def cuda_version(smi_output: str) -> tuple[int, int] | None:
    """The driver's CUDA version from `nvidia-smi`'s header ("... CUDA Version: 13.0 |"), or None."""
    m = _CUDA_RE.search(smi_output)
    return (int(m.group(1)), int(m.group(2))) if m else None


def run_nvidia_smi(timeout: float = 20.0) -> str | None:
    """`nvidia-smi`'s output, or None when it is missing, fails (no driver, no device) or hangs."""
    try:
        res = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def cpu_forced(env: dict) -> bool:
    return env.get(CPU_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def select_extra(env: dict, smi_output: str | None, platform: str = sys.platform) -> tuple[str | None, str]:
    """(jax extra or None for the CPU wheel, the reason in words)."""
    if cpu_forced(env):
        return None, f"{CPU_ENV} is set: CPU-only jax"
    if not platform.startswith("linux"):
        return None, f"JAX publishes CUDA wheels for Linux only (this is {platform}): CPU-only jax"
    if smi_output is None:
        return None, "no working nvidia-smi (no NVIDIA GPU or driver): CPU-only jax"
    ver = cuda_version(smi_output)
    if ver is None:
        return None, "nvidia-smi reports no CUDA version: CPU-only jax"
    major = min(ver[0], max(CUDA_MAJORS))
    if major not in CUDA_MAJORS:
        return None, (f"the NVIDIA driver supports CUDA {ver[0]}.{ver[1]}, JAX needs CUDA 12 or 13: CPU-only jax "
                      "(update the driver for GPU support)")
    return f"cuda{major}", f"NVIDIA driver with CUDA {ver[0]}.{ver[1]}: jax[cuda{major}]"


def jax_version_spec(pyproject: str) -> str:
    """The version range of the `jax` dependency in pyproject.toml (so the CUDA wheel matches the CPU pin)."""
    try:
        import tomllib

        with open(pyproject, "rb") as f:
            deps = tomllib.load(f)["project"]["dependencies"]
    except (OSError, KeyError, ValueError):
        return DEFAULT_VERSION_SPEC
    for d in deps:
        m = re.fullmatch(r"jax\s*(\[[^\]]*\])?\s*([<>=!~].*)?", d.strip())
        if m:
            return (m.group(2) or "").replace(" ", "")
    return DEFAULT_VERSION_SPEC


def requirement(env: dict, smi_output: str | None, spec: str, platform: str = sys.platform) -> tuple[str, str]:
    extra, why = select_extra(env, smi_output, platform)
    return f"jax[{extra}]{spec}" if extra else f"jax{spec}", why


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    smi = None if cpu_forced(env) else run_nvidia_smi()
    req, why = requirement(env, smi, jax_version_spec(os.path.join(root, "pyproject.toml")))
    print(req)
    print(f"setup: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
