"""benchmarks/bench_decode.py runs its CPU smoke configuration with each step variant: the engine's step (sampling
branch fixed on the host, one-row norms after the matmul) and the old ways it is timed against, which must decode the
same tokens where the math is the same."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_bench_decode_variants_small(tmp_path, monkeypatch):
    import bench_decode

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.delenv("LUCEBOX_ATTN_DECODE", raising=False)
    bench_decode.main(["--small", "--batches", "1", "--variants",
                       "engine,dynamic_sampling,norm_first,check4,xla_prologue,attn=n_split=2+num_stages=1"])
    rows = json.loads((tmp_path / "bench_decode.json").read_text())["rows"]
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"engine", "dynamic_sampling", "norm_first", "check4", "xla_prologue",
                       "attn=n_split=2+num_stages=1"}
    assert all("tok_s" in r for r in rows)
    assert "LUCEBOX_ATTN_DECODE" not in os.environ  # the attn= variant's knobs are taken back
    # greedy chosen on the host or on the device, the condition read every step or every 4: the same tokens
    assert by["engine"]["tokens_sha"] == by["dynamic_sampling"]["tokens_sha"] == by["check4"]["tokens_sha"]
    from lucebox_jax import model

    assert model.DEFER_ONE_ROW_NORM is True and model.QKV_PROLOGUE is True  # the variants' switches are put back


def test_bench_decode_unknown_variant_lists_the_valid_ones(capsys):
    import bench_decode

    with pytest.raises(SystemExit):
        bench_decode.main(["--small", "--variants", "engine,nope"])
    err = capsys.readouterr().err
    assert "nope" in err and "dynamic_sampling" in err and "norm_first" in err
