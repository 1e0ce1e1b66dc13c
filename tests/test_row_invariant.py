"""LUCEBOX_ROW_INVARIANT: a row's result does not depend on how many rows share the call, so a decode step rounds
exactly like a speculative verify of K + 1 rows and, in bfloat16, speculative greedy output equals plain greedy
output (without it, bfloat16 greedy tokens flip: README, "Speculative decoding").

- CPU, `xla` kernels (quant.linear): a one-row matmul is computed as two (XLA's matrix-vector path rounds otherwise).
- Pallas kernels (the GPU defaults; interpreted here, `gpu`-marked tests on the device): one configuration for every
  M (16-row tiles, a fixed split-K, partials summed in order); the decode attention kernel with a split count fixed by
  the cache and an ordered merge; a verify runs each position as a decode row of its own (`model.forward(verify=)`).
"""

import dataclasses
import os
import subprocess
import sys

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


# ------------------------------------------------------------------------------------------------ Pallas kernels
def _kernel_rows_equal(dtype, interpret):
    from pallas_kernels.int4_matmul import qmatmul_pallas
    from pallas_kernels.int8_matmul import qmatmul8_pallas

    rng = np.random.default_rng(1)
    k, n = 1024, 704
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    x = jnp.asarray(rng.standard_normal((40, k)), dtype)
    cases = [(qmatmul_pallas, quantize_int4(w, 32)), (qmatmul_pallas, quantize_int4(w, 128, symmetric=True)),
             (qmatmul8_pallas, quantize_int8(w, 32))]
    for fn, weight in cases:
        call = jax.jit(lambda x, fn=fn, weight=weight: fn(x, weight, interpret=interpret, row_invariant=True))
        ref = np.asarray(call(x[:1])[0], np.float32)
        for m in (2, 5, 17, 40):
            got = np.asarray(call(x[:m])[0], np.float32)
            assert np.array_equal(got, ref), (fn.__name__, weight.group_size, m)


def _attention_rows_equal(interpret):
    """A verify's B * T query rows, each reading its own prefix of a shared cache row, equal one decode call per
    position (bit for bit), and the reference."""
    from pallas_kernels.attention_decode import attention_decode_pallas, attention_decode_reference

    rng = np.random.default_rng(2)
    b, t, hkv, g, s, d = 2, 5, 2, 3, 2048, 64  # without row invariance: 16 splits for 10 rows, 32 for 2
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, t, hkv * g, d)), jnp.bfloat16)
    start = jnp.asarray([37, 1500], jnp.int32)
    lens = (start[:, None] + jnp.arange(1, t + 1)[None, :]).reshape(-1)
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    fn = jax.jit(lambda q, lens, rows: attention_decode_pallas(q, k, v, lens, rows, scale=0.125, interpret=interpret,
                                                               row_invariant=True))
    many = np.asarray(fn(q.reshape(b * t, hkv * g, d), lens, rows), np.float32).reshape(b, t, hkv * g, d)
    for j in range(t):  # a decode step at batch b for position start + j
        one = np.asarray(fn(q[:, j], start + j + 1, jnp.arange(b, dtype=jnp.int32)), np.float32)
        assert np.array_equal(many[:, j], one), j
    ref = attention_decode_reference(q.reshape(b * t, hkv * g, d), k, v, lens, rows, scale=0.125)
    np.testing.assert_allclose(many.reshape(b * t, hkv * g, d), np.asarray(ref, np.float32), atol=2e-2)


def _prefill_rows_equal(interpret):
    """A query's prefill attention does not depend on the window length or the batch it was prefilled in."""
    from pallas_kernels.attention_prefill import attention_prefill_pallas

    rng = np.random.default_rng(5)
    hkv, g, s, d = 3, 3, 256, 64  # queries at 100.. span two 64-key tiles and one 128-key tile
    k = jnp.asarray(rng.standard_normal((2, hkv, s, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, hkv, s, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 40, hkv * g, d)), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v, st: attention_prefill_pallas(q, k, v, st, scale=0.125, interpret=interpret,
                                                              row_invariant=True))
    ref = np.asarray(fn(q[:1, :5], k[:1], v[:1], jnp.asarray([100], jnp.int32)), np.float32)
    for t in (12, 40):
        got = np.asarray(fn(q[:, :t], k, v, jnp.asarray([100, 50], jnp.int32)), np.float32)
        assert np.array_equal(got[:1, :5], ref), t


def _model(preset):
    from lucebox_jax.synthetic import PRESETS, random_weights

    if preset == "tiny":
        cfg = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16", dim=128, ffn_dim=256, head_dim=32)
    else:  # the embedded model's shapes (9 query / 3 kv heads, dim 576), random weights
        cfg = dataclasses.replace(PRESETS[preset], dtype="bfloat16", max_context=1024)
    return cfg, random_weights(cfg, jax.random.key(7), group_size=32, asymmetric=True)


def _verify_equals_decode_steps(kernels, preset="tiny", b=2, last_only=False):
    """model.forward(verify=True) over T tokens gives, bit for bit, the logits of T decode steps over them (on a
    difference: the first layer whose residual stream differs, to say where). last_only: the decode steps take
    the scheduler's last-position path (a gather before the final norm)."""
    from lucebox_jax.model import forward, init_cache

    _flag_is_on()

    cfg, w = _model(preset)
    t, n = 5, 9
    layers = tuple(range(cfg.n_layers))
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (b, n)), jnp.int32)
    toks = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "kernels", "verify", "hidden_layers"))
    _, cache, _ = fwd(cfg, kernels, w, init_cache(cfg, b, 256), prompt, jnp.zeros((b,), jnp.int32),
                      hidden_layers=layers)
    start = jnp.full((b,), n, jnp.int32)
    many, _, h_many = fwd(cfg, kernels, w, cache, toks, start, verify=True, hidden_layers=layers)
    for j in range(t):
        one, cache, h_one = fwd(cfg, kernels, w, cache, toks[:, j:j + 1], start + j, hidden_layers=layers,
                                last_only=jnp.zeros((b,), jnp.int32) if last_only else None)
        one = one if last_only else one[:, 0]
        if not np.array_equal(np.asarray(one), np.asarray(many[:, j])):
            d = cfg.dim
            diff = [i for i in layers if not np.array_equal(np.asarray(h_one[:, 0, i * d:(i + 1) * d]),
                                                            np.asarray(h_many[:, j, i * d:(i + 1) * d]))]
            raise AssertionError(f"position {j}: logits differ; layers whose output differs: {diff[:8]}")


def _tree_equals_decode_steps(kernels, preset="tiny", b=2):
    """model.forward(tree=...) under the mode: every node's logits equal, bit for bit, those of the decode steps
    along its root-to-node path (on a difference: the node and the first layers that differ)."""
    from lucebox_jax.model import forward, init_cache
    from lucebox_jax.tree import ancestors

    _flag_is_on()
    cfg, w = _model(preset)
    layers, d, n = tuple(range(cfg.n_layers)), cfg.dim, 9
    parent = jnp.asarray([[0, 0, 1, 1, 3, 4]] * b, jnp.int32)  # window indices; depths 1 1 2 2 3 3
    depths = jnp.asarray([[1, 1, 2, 2, 3, 3]] * b, jnp.int32)
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, n)), jnp.int32)
    win = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 7)), jnp.int32)  # root + 6 nodes
    fwd = jax.jit(forward, static_argnames=("cfg", "kernels", "verify", "hidden_layers"))
    _, cache = fwd(cfg, kernels, w, init_cache(cfg, b, 256), prompt, jnp.zeros((b,), jnp.int32))
    start = jnp.full((b,), n, jnp.int32)
    dep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depths], axis=1)
    tl, _, th = fwd(cfg, kernels, w, cache, win, start, tree=(dep, ancestors(parent, 3)), hidden_layers=layers)
    par = [0, 0, 0, 1, 1, 3, 4]
    for node in (5, 6, 4, 2):
        path = [node]
        while path[-1]:
            path.append(par[path[-1]])
        c = cache
        for j, i in enumerate(reversed(path)):  # root first; window index i sits at position start + j
            one, c, h = fwd(cfg, kernels, w, c, win[:, i:i + 1], start + j, hidden_layers=layers,
                            last_only=jnp.zeros((b,), jnp.int32))
            if not np.array_equal(np.asarray(one), np.asarray(tl[:, i])):
                diff = [k for k in layers if not np.array_equal(np.asarray(h[:, 0, k * d:(k + 1) * d]),
                                                                np.asarray(th[:, i, k * d:(k + 1) * d]))]
                raise AssertionError(f"tree node {i} (depth {j}): logits differ; layers: {diff[:8]}")


@pytest.mark.parametrize("names", ["xla", "pallas"])
def test_tree_equals_decode_steps(names):
    _in_process_with_flag(f"_tree_equals_decode_steps({KERNEL_SETS[names]})")


@pytest.mark.gpu
@pytest.mark.parametrize("preset,b", [("tiny", 2), ("smollm2-135m", 4)])
def test_gpu_tree_equals_decode_steps(preset, b):
    _in_process_with_flag(f"_tree_equals_decode_steps(KernelSet.resolve(), {preset!r}, {b})")


def test_pallas_kernels_rows_invariant_interpreted():
    _kernel_rows_equal(jnp.bfloat16, interpret=True)


def test_decode_attention_rows_interpreted():
    _attention_rows_equal(interpret=True)


def test_prefill_attention_rows_interpreted():
    _prefill_rows_equal(interpret=True)


# the kernel sets of the CPU model-level checks, as source for `_in_process_with_flag`
KERNEL_SETS = {"xla": "KernelSet()",
               "pallas": 'KernelSet(qmatmul="pallas", qmatmul8="pallas", attention_decode="pallas")'}


def _in_process_with_flag(call: str):
    """Run `call` (a function of this module with arguments, as source) in a fresh process with
    LUCEBOX_ROW_INVARIANT=1, which also turns off XLA's excess precision before the first compile (quant.py): the
    model-level checks need that, and this process's XLA flags are fixed already."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, LUCEBOX_ROW_INVARIANT="1")
    code = f"import sys; sys.path.insert(0, 'tests'); import test_row_invariant as t; from lucebox_jax.ops import KernelSet; t.{call}"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]


def _flag_is_on():
    assert quant.ROW_INVARIANT and "--xla_allow_excess_precision=false" in os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize("names", ["xla", "pallas"])
def test_verify_equals_decode_steps(names):
    _in_process_with_flag(f"_verify_equals_decode_steps({KERNEL_SETS[names]}, last_only=True)")


@pytest.mark.gpu
def test_gpu_pallas_kernels_rows_invariant():
    _kernel_rows_equal(jnp.bfloat16, interpret=False)


@pytest.mark.gpu
def test_gpu_decode_attention_rows():
    _attention_rows_equal(interpret=False)


@pytest.mark.gpu
def test_gpu_prefill_attention_rows():
    _prefill_rows_equal(interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,b", [("tiny", 2), ("smollm2-135m", 8)])
def test_gpu_verify_equals_decode_steps(preset, b):
    _in_process_with_flag(f"_verify_equals_decode_steps(KernelSet.resolve(), {preset!r}, {b}, last_only=True)")


def _width_invariant(kernels, preset="tiny"):
    """A row's prefill and decode steps give the same logits (and residual streams) alone and among other rows (of
    other lengths); on a difference, says which phase, row, step and layers, and which single op differs at one row
    against three."""
    from lucebox_jax.model import KVCache, forward, init_cache, rms_norm
    from lucebox_jax.quant import linear

    _flag_is_on()
    cfg, w = _model(preset)
    layers, d, lens = tuple(range(cfg.n_layers)), cfg.dim, (9, 14, 3)
    b = len(lens)
    fwd = jax.jit(forward, static_argnames=("cfg", "kernels", "verify", "hidden_layers"))
    rng = np.random.default_rng(3)
    prompts = [jnp.asarray(rng.integers(0, cfg.vocab_size, (1, n)), jnp.int32) for n in lens]
    col = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731

    def where(h1, h3, r, j1, j3):
        return [i for i in layers if not np.array_equal(np.asarray(h1[0, j1, i * d:(i + 1) * d]),
                                                        np.asarray(h3[r, j3, i * d:(i + 1) * d]))][:6]

    problems = []
    # prefill: row 0 alone against the same prompt three times
    l1, _, h1 = fwd(cfg, kernels, w, init_cache(cfg, 1, 64), prompts[0], col([0]), hidden_layers=layers)
    rep = jnp.concatenate([prompts[0]] * b)
    l3, _, h3 = fwd(cfg, kernels, w, init_cache(cfg, b, 64), rep, col([0] * b), hidden_layers=layers)
    if not np.array_equal(np.asarray(l1[0]), np.asarray(l3[0])):
        problems.append(f"prefill: layers {where(h1, h3, 0, lens[0] - 1, lens[0] - 1)}")
    # decode: rows of three lengths, each prefilled alone, stepped alone and together
    alone, toks = [], []
    for p in prompts:
        lg, c = fwd(cfg, kernels, w, init_cache(cfg, 1, 64), p, col([0]), last_only=col([p.shape[1] - 1]))
        alone.append(c)
        toks.append(int(jnp.argmax(lg[0])))
    big = KVCache(k=tuple(jnp.concatenate([c.k[i] for c in alone]) for i in layers),
                  v=tuple(jnp.concatenate([c.v[i] for c in alone]) for i in layers), lengths=col(lens))
    for j in range(3):
        l3, big, h3 = fwd(cfg, kernels, w, big, col(toks)[:, None], col(lens) + j, hidden_layers=layers,
                          last_only=col([0] * b))
        for r in range(b):
            l1, alone[r], h1 = fwd(cfg, kernels, w, alone[r], col([[toks[r]]]), col([lens[r] + j]),
                                   hidden_layers=layers, last_only=col([0]))
            if not np.array_equal(np.asarray(l1[0]), np.asarray(l3[r])):
                problems.append(f"decode row {r} step {j}: layers {where(h1, h3, r, 0, 0)}")
        toks = [int(t) for t in jnp.argmax(l3, axis=-1)]
    if problems:  # single ops at 1 row against 3
        x = jnp.asarray(np.random.default_rng(8).standard_normal((b, 1, d)), jnp.bfloat16)
        lw = w.layers[0]
        ops_ = {"rms_norm": lambda x: rms_norm(x, lw.attn_norm, cfg.rms_eps)}
        for name in ("wqkv", "wo", "w_gate_up"):
            ops_[name] = lambda x, m=getattr(lw, name): linear(x[..., :m.shape[0]], m, kernels=kernels)
        ops_["head"] = lambda x: linear(x, w.head, kernels=kernels)
        bad = [k for k, f in ops_.items() if not np.array_equal(np.asarray(jax.jit(f)(x[:1])[0]),
                                                                np.asarray(jax.jit(f)(x)[0]))]
        problems.append(f"single ops differing: {bad}")
    assert not problems, "; ".join(problems)


def _xla_attention_rows_equal():
    """XLA's attention (the CPU default): a row among rows of other lengths equals the row alone."""
    from lucebox_jax.kernels_xla import attention_decode_xla

    _flag_is_on()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, 9, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((3, 3, 256, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((3, 3, 256, 64)), jnp.bfloat16)
    f = jax.jit(lambda q, k, v, n: attention_decode_xla(q, k, v, n, scale=0.125))
    for _ in range(20):
        n = jnp.asarray(rng.integers(1, 200, 3), jnp.int32)
        many = np.asarray(f(q, k, v, n), np.float32)
        for r in range(3):
            assert np.array_equal(np.asarray(f(q[r:r + 1], k[r:r + 1], v[r:r + 1], n[r:r + 1]), np.float32)[0],
                                  many[r]), (r, n)


def _batch_jobs_equal(kernels, preset="tiny"):
    """A batch job with speculation gives the greedy tokens of the plain job, and of the plain job at another slot
    count (rows meet other neighbours, other row counts, other prefill groups)."""
    from lucebox_jax import SamplingParams
    from lucebox_jax.drafters import build
    from lucebox_jax.engine import Engine
    from lucebox_jax.scheduler import Scheduler, SlotRequest
    from lucebox_jax.spec_batch import BatchSpec

    _flag_is_on()
    cfg, w = _model(preset)
    eng = Engine(cfg, w, kernels)
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (3, 14, 9, 16, 1, 12)]
    prompts[1] = [5, 6, 7, 8] * 3 + [5, 6]
    maxes = [5, 40, 16, 30, 9, 24]

    def job(slots, spec=None):
        reqs = [SlotRequest(i, p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, seed=i), frozenset(),
                            m) for i, (p, m) in enumerate(zip(prompts, maxes))]
        sched = Scheduler(eng, slots=slots, max_len=256, steps_per_call=4, max_prefill_batch=2, spec=spec)
        return {f.request.key: f.token_ids for batch in sched.run(reqs) for f in batch}

    plain = job(3)
    assert job(1) == plain, "plain job, 1 slot against 3"
    for d in ("ngram", "layers:1"):
        assert job(3, BatchSpec(build(d, eng), 4, min_accept=0.0)) == plain, d


def test_width_invariant():
    _in_process_with_flag("_width_invariant(KernelSet())")


def test_xla_attention_rows_invariant():
    _in_process_with_flag("_xla_attention_rows_equal()")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m"])
def test_gpu_width_invariant(preset):
    _in_process_with_flag(f"_width_invariant(KernelSet.resolve(), {preset!r})")


def test_bf16_speculative_batch_job_equals_plain():
    _in_process_with_flag("_batch_jobs_equal(KernelSet())")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m"])
def test_gpu_bf16_speculative_batch_job_equals_plain(preset):
    """On the GPU (bfloat16, default kernels)."""
    _in_process_with_flag(f"_batch_jobs_equal(KernelSet.resolve(), {preset!r})")


@pytest.mark.parametrize("d", [576, 64, 7])
def test_ordered_row_sum(d):
    """The fixed-order sum: the same bits for a row whatever the leading shape, and the sum up to rounding."""
    from lucebox_jax.model import ordered_row_sum

    x = jnp.asarray(np.random.default_rng(d).standard_normal((7, 3, d)), jnp.float32)
    f = jax.jit(ordered_row_sum)
    many = np.asarray(f(x))
    assert many.shape == (7, 3, 1)
    assert np.array_equal(np.asarray(f(x[2, 1][None]))[0], many[2, 1])
    assert np.array_equal(np.asarray(f(x[:, 1]))[4], many[4, 1])
    np.testing.assert_allclose(many[..., 0], np.asarray(x, np.float64).sum(-1), rtol=1e-5, atol=1e-5)


def test_plain_and_speculative_caches_have_one_length(invariant):
    """Attention's splits and sums depend on the cache length, and a speculative job's cache holds the verify's extra
    positions: in this mode plain and speculative runs take the same length (the margin), batch jobs and batch 1."""
    from lucebox_jax.drafters import build
    from lucebox_jax.engine import Engine
    from lucebox_jax.ops import KernelSet
    from lucebox_jax.scheduler import Scheduler
    from lucebox_jax.spec_batch import BatchSpec
    from lucebox_jax.speculative import SpeculativeDecoder

    cfg, w = _model("tiny")
    eng = Engine(cfg, w, KernelSet())
    cap = eng.cache_len_for(10 ** 6)
    for k in (2, 4, 8):
        spec = BatchSpec(build("ngram", eng), k)
        assert Scheduler(eng, slots=2, max_len=200, spec=spec).cache_len == Scheduler(eng, 2, 200).cache_len
        for need in (10, 240, 250, 480, cap - 20):  # (the last: the plain length is capped at the context)
            assert SpeculativeDecoder(eng, build("ngram", eng), k).cache_len(need) == eng.cache_len_for(need)
    # a tree's window (33 slots and the next token) is wider than the margin: still the plain length where it fits,
    # also where the plain length is capped at the model's context
    from lucebox_jax.drafters.eagle import EagleConfig, EagleDrafter, init_head

    hc = EagleConfig.for_target(cfg)
    tree = SpeculativeDecoder(eng, EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng), 4, tree=32)
    for need in (10, 200, cap - 40):
        assert tree.cache_len(need) == eng.cache_len_for(need) >= need + tree.span + 1, need
