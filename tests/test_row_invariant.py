"""LUCEBOX_ROW_INVARIANT (quant.linear): a one-row matmul on the CPU gives, bit for bit, the first row of the same
matmul over more rows, so a batch-1 decode step rounds exactly like a speculative verify of K + 1 rows; in bfloat16
speculative greedy output then equals plain greedy output (without it, XLA's matrix-vector path for one row rounds
differently and bfloat16 greedy tokens flip on the embedded model: README, "Speculative decoding")."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax import quant
from lucebox_jax.quant import linear, quantize_int4, quantize_int8


@pytest.fixture
def invariant(monkeypatch):
    monkeypatch.setattr(quant, "ROW_INVARIANT", True)  # read when a function is traced: fresh jits below


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_row_equals_first_row_of_many(invariant, dtype):
    rng = np.random.default_rng(0)
    k, n = 576, 704
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    x = jnp.asarray(rng.standard_normal((5, k)), dtype)
    for weight in (quantize_int4(w, 32), quantize_int8(w, 32), jnp.asarray(w, dtype)):
        one = jax.jit(lambda x, weight=weight: linear(x, weight))(x[:1])
        many = jax.jit(lambda x, weight=weight: linear(x, weight))(x)
        assert one.shape == (1, n)
        assert np.array_equal(np.asarray(one[0], np.float32), np.asarray(many[0], np.float32)), type(weight)


def test_bf16_speculative_greedy_equals_plain(invariant):
    from lucebox_jax.drafters import build
    from lucebox_jax.engine import Engine
    from lucebox_jax.ops import KernelSet
    from lucebox_jax.speculative import SpeculativeDecoder
    from lucebox_jax.synthetic import PRESETS, random_weights
    from test_speculative import run, tiny_prompts

    cfg = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16", dim=128, ffn_dim=256)  # shapes no other test uses
    eng = Engine(cfg, random_weights(cfg, jax.random.key(5), group_size=32, asymmetric=True), KernelSet())
    ps = tiny_prompts([10, 7], seed=4)
    ref = [run(eng, None, [p], 24)[0] for p in ps]
    for d in ("ngram", "layers:1"):
        spec = SpeculativeDecoder(eng, build(d, eng), 4)
        assert [run(eng, spec, [p], 24)[0] for p in ps] == ref, d
