"""benchmarks/kernel_count.py: counting the kernels of a compiled HLO module (loops by trip count, conditionals by
branch, kernels by source call path). The counting runs on the CPU backend's HLO here; the deviceless GPU compile
itself needs jax's CUDA plugin (scripts/setup_aot.sh), which CI does not install."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import kernel_count as kc  # noqa: E402


def _hlo(n: int) -> str:
    def inner_step(i, x):
        return jnp.sin(x) * 2 + jnp.cos(x).sum()

    def f(x):
        return jnp.tanh(jax.lax.fori_loop(0, n, inner_step, x)).sum()

    return jax.jit(f).lower(jnp.ones(64)).compile().as_text()


def test_a_loop_counts_once_per_trip():
    totals = [kc.total(kc.count_kernels(_hlo(n))) for n in (5, 10, 15)]
    per_trip = (totals[1] - totals[0]) / 5
    assert per_trip >= 1 and totals[2] - totals[1] == totals[1] - totals[0]
    assert kc.count_kernels(_hlo(5))["loops (trip 5)"] == 1


def test_kernels_by_source_name_the_function():
    where = kc.collections.Counter()
    c = kc.count_kernels(_hlo(5), where)
    hlo = _hlo(5)
    assert kc.jitted_name(hlo) == "f"
    by = kc.by_call_path(where, depth=20, root="f")
    assert sum(by.values()) == kc.total(c)
    assert any("inner_step" in k for k in by), by


_COND = """HloModule m, is_scheduled=true

%fused_a (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%p)
}

%big (t: (f32[8])) -> (f32[8]) {
  %t = (f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%t), index=0
  %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_a
  %c = f32[8]{0} custom-call(%b), custom_call_target="my_kernel"
  ROOT %r = (f32[8]{0}) tuple(%c)
}

%small (t: (f32[8])) -> (f32[8]) {
  %t = (f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%t), index=0
  %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_a
  ROOT %r = (f32[8]{0}) tuple(%a)
}

ENTRY %main (i: s32[], x: f32[8]) -> (f32[8]) {
  %i = s32[] parameter(0)
  %x = f32[8]{0} parameter(1)
  %t = (f32[8]{0}) tuple(%x)
  %k = f32[8]{0} copy(%x)
  ROOT %c = (f32[8]{0}) conditional(%i, %t, %t), branch_computations={%big, %small}
}
"""


def test_a_conditional_counts_the_chosen_branch():
    large = kc.count_kernels(_COND, branch="largest")
    small = kc.count_kernels(_COND, branch="smallest")
    assert kc.total(large) == 4 and large["custom-call:my_kernel"] == 1 and large["copy"] == 1
    assert kc.total(small) == 2 and small["fusion:kLoop"] == 1
    assert large["conditionals"] == small["conditionals"] == 1


def test_compare_reports_what_changed():
    before = {"depth": 3, "configs": {"decode": {"kernels": 10, "by_kind": {"fusion:kLoop": 6, "copy": 4},
                                                 "by_source": {"f > g": 10}}}}
    after = {"depth": 3, "configs": {"decode": {"kernels": 8, "by_kind": {"fusion:kLoop": 6, "copy": 2},
                                                "by_source": {"f > g": 8}}}}
    lines = kc.compare(before, after)
    assert any("10 -> 8 kernels (-2)" in x for x in lines)
    assert "| kind | copy | 4 | 2 |" in lines and "| source | f > g | 10 | 8 |" in lines
    assert not any("kLoop" in x for x in lines)  # unchanged rows are left out
    after["depth"] = 4
    assert not any(x.startswith("| source") for x in kc.compare(before, after))
