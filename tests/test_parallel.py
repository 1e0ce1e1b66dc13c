"""Tensor parallelism (parallel.py): the cases of `tp_cases.py` on 8 simulated CPU devices, in their own pytest
process (XLA_FLAGS must be set before jax starts, and this process's jax already runs on one device); and the
errors that need no second device."""

import os
import subprocess
import sys

import pytest

from lucebox_jax import LLM
from lucebox_jax.cli import main
from lucebox_jax.errors import ParallelismError

TESTS = os.path.dirname(__file__)


def test_tensor_parallel_cases_on_8_simulated_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           os.path.join(TESTS, "tp_cases.py")], cwd=os.path.dirname(TESTS), env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_more_devices_than_exist_is_refused_before_loading():
    with pytest.raises(ParallelismError, match="tensor_parallel=2 needs 2 devices but 1 cpu device"):
        LLM(model="/no/such/model.gguf", tensor_parallel=2)  # the device check comes first: no file error
    with pytest.raises(ParallelismError, match="integer >= 1"):
        LLM(tensor_parallel=0)


def test_cli_tensor_parallel_error_is_one_line(capsys):
    assert main(["--prompt", "hi", "--tensor-parallel", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tensor_parallel=4 needs 4 devices") and "\n" not in err


def test_int4_row_shards_are_self_contained():
    """A row split of half-split int4 codes is re-packed so that shard j alone decodes rows j*K/N .. (j+1)*K/N - 1:
    checked against the unsplit weight's values (NumPy)."""
    import numpy as np

    from lucebox_jax.parallel import _repack_rows
    from lucebox_jax.quant import QuantArray, dequantize_np, quantize_int4

    w = quantize_int4(np.random.default_rng(0).normal(size=(512, 24)).astype(np.float32), group_size=32)
    full, r, n = dequantize_np(w), _repack_rows(w, 4), 4
    rows, groups = 512 // n, 512 // n // 32
    for j in range(n):
        g = slice(j * groups, (j + 1) * groups)
        shard = QuantArray(codes=r.codes[j * rows // 2:(j + 1) * rows // 2], scales=r.scales[g], mins=r.mins[g],
                           group_size=32)
        np.testing.assert_array_equal(dequantize_np(shard), full[j * rows:(j + 1) * rows])
    assert not np.array_equal(np.asarray(r.codes), np.asarray(w.codes))  # a plain row split would be wrong
