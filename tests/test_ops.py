"""The kernel registry: names resolve, unknown ones fail listing the valid ones, and a researcher's kernel registered
with the decorator is selected by name and actually runs in the model."""

import jax
import jax.numpy as jnp
import pytest

from lucebox_jax import ops
from lucebox_jax.errors import UnknownKernelError
from lucebox_jax.kernels_xla import qmatmul_xla
from lucebox_jax.model import forward, init_cache
from lucebox_jax.ops import KernelSet
from lucebox_jax.synthetic import PRESETS, random_weights


def test_defaults_and_parse():
    ks = KernelSet.resolve("qmatmul=xla", backend="cpu")
    assert ks == KernelSet("xla", "xla", "xla", "xla")
    assert ops.parse_spec(" qmatmul=a , attention_decode=b") == {"qmatmul": "a", "attention_decode": "b"}
    assert "xla" in ops.available("attention_prefill")


@pytest.mark.parametrize("spec,msg", [("qmatmul=nope", "unknown kernel 'nope' for op 'qmatmul'; valid: .*xla"),
                                      ("matmul=xla", "unknown op 'matmul'; valid ops: qmatmul"),
                                      ("qmatmul", "expected op=name")])
def test_unknown_names(spec, msg):
    with pytest.raises(UnknownKernelError, match=msg):
        KernelSet.resolve(spec)


def test_registered_kernel_is_used():
    calls = []

    @ops.register("qmatmul", "counting_test_kernel")
    def counting(x, w):
        calls.append(x.shape)
        return qmatmul_xla(x, w)

    cfg = PRESETS["tiny"]
    w = random_weights(cfg, jax.random.key(0), group_size=32)
    ks = KernelSet.resolve("qmatmul=counting_test_kernel")
    cache = init_cache(cfg, 1, 16)
    ref, _ = forward(cfg, KernelSet(), w, cache, jnp.arange(4)[None], jnp.zeros((1,), jnp.int32))
    got, _ = forward(cfg, ks, w, cache, jnp.arange(4)[None], jnp.zeros((1,), jnp.int32))
    assert len(calls) == 4 * cfg.n_layers  # qkv, o, gate|up, down per layer (the int8 head: op qmatmul8)
    assert jnp.allclose(ref, got)
