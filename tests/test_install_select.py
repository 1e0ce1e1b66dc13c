"""What scripts/setup.sh detects: the JAX wheel for the machine (CUDA 13 / 12 plugin from nvidia-smi's driver CUDA
version, CPU otherwise or with LUCEBOX_CPU=1), run as setup runs it, with a fake `nvidia-smi` on PATH."""

import os
import subprocess
import sys

import pytest

from lucebox_jax import install_select as sel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "lucebox_jax", "install_select.py")


def smi_header(cuda: str) -> str:
    return ("+-----------------------------------------------------------------------------------------+\n"
            f"| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: {cuda}     |\n"
            "|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |\n")


@pytest.mark.parametrize("cuda,extra", [("13.0", "cuda13"), ("12.4", "cuda12"), ("12.9", "cuda12"),
                                        ("14.1", "cuda13"), ("11.8", None)])
def test_extra_from_driver_cuda_version(cuda, extra):
    got, why = sel.select_extra({}, smi_header(cuda), "linux")
    assert got == extra and cuda in why


@pytest.mark.parametrize("env,smi,platform", [({"LUCEBOX_CPU": "1"}, smi_header("13.0"), "linux"),
                                              ({}, None, "linux"), ({}, "garbage", "linux"),
                                              ({}, smi_header("13.0"), "darwin")])
def test_cpu_wheel(env, smi, platform):
    assert sel.select_extra(env, smi, platform)[0] is None
    assert sel.requirement(env, smi, ">=0.11,<0.12", platform)[0] == "jax>=0.11,<0.12"


def test_lucebox_cpu_zero_does_not_force():
    assert sel.select_extra({"LUCEBOX_CPU": "0"}, smi_header("12.2"), "linux")[0] == "cuda12"


def test_version_spec_follows_pyproject(tmp_path):
    assert sel.jax_version_spec(os.path.join(ROOT, "pyproject.toml")) == ">=0.11,<0.12"
    p = tmp_path / "pyproject.toml"
    p.write_text('[project]\ndependencies = ["numpy", "jax >= 0.12, < 0.13"]\n')
    assert sel.jax_version_spec(str(p)) == ">=0.12,<0.13"
    assert sel.jax_version_spec(str(tmp_path / "missing.toml")) == sel.DEFAULT_VERSION_SPEC


def run_script(tmp_path, smi_body: str | None, **env_extra) -> subprocess.CompletedProcess:
    """The script as setup.sh runs it, with PATH holding only a fake nvidia-smi (or none; shell builtins only)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if smi_body is not None:
        smi = bindir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + smi_body)
        smi.chmod(0o755)
    env = {"PATH": str(bindir), "HOME": str(tmp_path), **env_extra}
    return subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CUDA wheels are Linux-only")
def test_script_with_fake_nvidia_smi(tmp_path):
    r = run_script(tmp_path, f"echo '{smi_header('13.0')}'\n")
    assert r.returncode == 0 and r.stdout.strip() == "jax[cuda13]>=0.11,<0.12", (r.stdout, r.stderr)
    assert "CUDA 13.0" in r.stderr
    r = run_script(tmp_path, f"echo '{smi_header('13.0')}'\n", LUCEBOX_CPU="1")
    assert r.stdout.strip() == "jax>=0.11,<0.12" and "LUCEBOX_CPU" in r.stderr


def test_script_without_gpu(tmp_path):
    r = run_script(tmp_path, None)  # no nvidia-smi at all (CI)
    assert r.returncode == 0 and r.stdout.strip() == "jax>=0.11,<0.12"
    r = run_script(tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n")
    assert r.returncode == 0 and r.stdout.strip() == "jax>=0.11,<0.12" and "no working nvidia-smi" in r.stderr


def test_setup_uses_the_selector():
    text = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    assert "lucebox_jax/install_select.py" in text and '"$JAX_REQ"' in text
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "setup.sh")]).returncode == 0
