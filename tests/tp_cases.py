"""Tensor-parallel cases on 8 simulated CPU devices. Not collected by the suite directly: `test_parallel.py` runs this
file in its own pytest process with XLA_FLAGS=--xla_force_host_platform_device_count=8 (jax reads the flag once, at
start-up). The reference of every comparison is one device running the same weights without any mesh.

Activations are float32 (the CPU default), where the split sums round differently from one device's only in the last
bits; greedy tokens are compared exactly."""

import collections
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lucebox_jax import LLM, SamplingParams
from lucebox_jax.engine import Engine, decode_step
from lucebox_jax.errors import ParallelismError
from lucebox_jax.model import EmbedTable
from lucebox_jax.ops import KernelSet
from lucebox_jax.quant import Int8Array
from lucebox_jax.sampling import RowParams
from lucebox_jax.scheduler import SlotRequest, generate_ids
from lucebox_jax.speculative import SpeculativeDecoder
from lucebox_jax.synthetic import PRESETS, random_weights

if jax.device_count() < 8:
    pytest.skip("run by test_parallel.py with 8 simulated devices", allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, seed=0)
TINY = PRESETS["tiny"]  # 4 query heads, 2 KV heads: split at N = 2, replicated attention at N = 4


def greedy_ids(eng: Engine, prompts, n_new: int, spec=None) -> np.ndarray:
    """Greedy completions [B, n_new] through the engine's prefill, first-token sampling and decode loop (a draft
    head starting from the prefill's hidden states, as LLM does)."""
    b = len(prompts)
    need = max(map(len, prompts)) + n_new
    cache = eng.new_cache(b, spec.cache_len(need) if spec else eng.cache_len_for(need))
    rp = RowParams.from_params([GREEDY] * b)
    last, _, cache, *hidden = eng.prefill(cache, prompts, hidden_layers=spec and spec.drafter.hidden_layers)
    seen = eng.new_seen(prompts)
    first, seen = eng.first_token(last, rp, [len(p) for p in prompts], seen)
    row_max = np.full((b,), n_new, np.int32)
    if spec is not None:
        bufs, count, _ = spec.loop(cache, prompts, first, rp, seen, [set()] * b, row_max,
                                   hidden=hidden[0] if hidden else None)
    else:
        bufs, count, _, _ = eng.loop(cache, first, rp, seen, [set()] * b, row_max)
    assert (np.asarray(count) == n_new).all()
    return np.asarray(bufs.tokens)[:, :n_new]


@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(TINY, jax.random.key(3), group_size=32)


@pytest.fixture(scope="module")
def smol_ref(smol):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    return prompts, [o.outputs[0].token_ids for o in smol.generate(prompts, GREEDY)]


@pytest.mark.parametrize("n", [2, 8])  # (4 lies between: the same replicated attention, the MLP split as at 2 and 8)
def test_embedded_model_greedy_equals_one_device(smol_ref, n):
    prompts, ref = smol_ref
    llm = LLM(tensor_parallel=n)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == ref
    # 3 KV heads do not split over 2, 4 or 8: attention and its cache replicated, MLP split (parallel.py says why)
    w = llm.engine.weights.layers[0]
    assert w.w_down.w.codes.sharding.spec == P("tp", None) and w.wo.split == "replicated"
    assert w.w_down.w.codes.addressable_shards[0].data.shape[0] == llm.config.ffn_dim // 2 // n
    assert llm.engine.weights.embed.table.addressable_shards[0].data.shape[0] == llm.config.vocab_size // n


def llama3_8b_shaped(layers: int):
    """Random Llama-3-8B-shaped weights of `layers` layers: `random_weights` for the layers, the 128256-row int8
    embedding and head drawn with NumPy (jax.random takes a minute for their 10^9 codes on two CPU cores)."""
    cfg = PRESETS["llama3-8b"].replace(n_layers=layers, max_context=256)
    w = random_weights(cfg.replace(vocab_size=256), jax.random.key(1), group_size=128, asymmetric=True)
    rng = np.random.default_rng(0)
    v, d = cfg.vocab_size, cfg.dim

    def codes(shape):
        return jnp.asarray(np.frombuffer(rng.bytes(int(np.prod(shape))), np.int8).reshape(shape))

    embed = EmbedTable(codes((v, d)), jnp.full((v, d // 32), 0.02 / 64, jnp.float16), 32)
    head = Int8Array(codes((d, v)), jnp.asarray(rng.uniform(0.5, 1.5, (d // 32, v)) * d ** -0.5 / 64, jnp.float16))
    return cfg, w.replace(embed=embed, head=head)


def test_llama3_8b_shaped_greedy_equals_one_device():
    """Llama-3-8B shapes (vocabulary, width, heads, FFN) at depth 1: 8 KV heads split at N = 2 (4 a shard) and 8 (one
    a shard; N = 4 runs in the all-reduce test, on tiny shapes)."""
    cfg, w = llama3_8b_shaped(1)
    prompts = [[128000, 791, 6864, 315, 9822, 374]]
    ref = greedy_ids(Engine(cfg, w, KernelSet.resolve()), prompts, 3)
    assert len(set(ref[0].tolist())) > 1  # not a degenerate repeat
    for n in (2, 8):
        eng = Engine(cfg, w, KernelSet.resolve(), tensor_parallel=n)
        assert eng.parallel.heads_split
        cache = eng.new_cache(1, 256)
        assert cache.k[0].addressable_shards[0].data.shape[1] == cfg.n_kv_heads // n
        np.testing.assert_array_equal(greedy_ids(eng, prompts, 3), ref, err_msg=f"tensor_parallel={n}")


def _collectives(cfg, w, n) -> collections.Counter:
    eng = Engine(cfg, w, KernelSet.resolve(), tensor_parallel=n)
    rp = RowParams.from_params([GREEDY])
    hlo = decode_step.lower(cfg, eng.kernels, eng.weights, eng.new_cache(1, 256), jnp.zeros((1,), jnp.int32), rp,
                            jnp.zeros((1, cfg.vocab_size), bool)).compile().as_text()
    return collections.Counter(re.findall(
        r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(", hlo))


@pytest.mark.parametrize("n, per_layer", [(2, 2), (4, 1)])
def test_all_reduces_per_layer_in_compiled_decode_step(n, per_layer):
    """Megatron: one all-reduce after wo and one after w_down per layer (only w_down's when the attention is
    replicated); read from the compiled HLO as the difference between 4 and 2 layers, so the embedding lookup's and
    the sampler's fixed collectives cancel out. No other collective may grow with depth."""
    counts = {}
    for layers in (2, 4):
        cfg = TINY.replace(n_layers=layers)
        counts[layers] = _collectives(cfg, random_weights(cfg, group_size=32), n)
    grown = counts[4] - counts[2]
    assert dict(grown) == {"all-reduce": 2 * per_layer}, counts


def test_scheduler_with_two_devices_equals_one(tiny_weights):
    reqs = [SlotRequest(i, p, GREEDY, frozenset(), m)
            for i, (p, m) in enumerate(zip([[5, 6, 7], [9] * 12, [1, 2], [200, 3, 4, 5]], [6, 3, 8, 5]))]

    def run(n):
        done = generate_ids(Engine(TINY, tiny_weights, KernelSet.resolve(), tensor_parallel=n), reqs, slots=2,
                            max_len=256, steps_per_call=4)
        return {k: f.token_ids for k, f in done.items()}

    assert run(2) == run(1)


def test_speculative_with_two_devices_equals_plain_greedy(tiny_weights):
    prompts = [[5, 6, 7, 8], [40, 41]]
    ref = greedy_ids(Engine(TINY, tiny_weights, KernelSet.resolve()), prompts, 10)
    eng = Engine(TINY, tiny_weights, KernelSet.resolve(), tensor_parallel=2)
    spec = SpeculativeDecoder.create(eng, "layers:1", 3)
    np.testing.assert_array_equal(greedy_ids(eng, prompts, 10, spec), ref)


def test_eagle_head_from_prefill_features_with_two_devices(tiny_weights):
    """An (untrained) eagle head started from the sharded prefill's hidden states: greedy equals plain greedy, at
    batch 2 through the loop and in a batch job's admissions."""
    from lucebox_jax.drafters import EagleDrafter
    from lucebox_jax.drafters.eagle import EagleConfig, init_head
    from lucebox_jax.spec_batch import BatchSpec

    prompts = [[5, 6, 7, 8], [40, 41]]
    ref = greedy_ids(Engine(TINY, tiny_weights, KernelSet.resolve()), prompts, 10)
    eng = Engine(TINY, tiny_weights, KernelSet.resolve(), tensor_parallel=2)
    hc = EagleConfig.for_target(TINY)
    d = EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng)
    np.testing.assert_array_equal(greedy_ids(eng, prompts, 10, SpeculativeDecoder(eng, d, 3)), ref)
    reqs = [SlotRequest(i, p, GREEDY, frozenset(), 10) for i, p in enumerate(prompts)]
    done = generate_ids(eng, reqs, slots=2, max_len=256, steps_per_call=4, spec=BatchSpec(d, 3, max_slots=2,
                                                                                         warmup=10 ** 6))
    assert [done[i].token_ids for i in range(len(prompts))] == ref.tolist()


def test_pallas_kernels_run_per_shard_under_shard_map(tiny_weights):
    """Pallas kernels (interpret mode on the CPU) inside shard_map: the attention as `pallas@tp2`, the int4/int8
    matmuls inside each ShardedLinear; tokens equal the one-device xla ones."""
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    ref = greedy_ids(Engine(TINY, tiny_weights, KernelSet.resolve()), prompts, 4)
    eng = Engine(TINY, tiny_weights, KernelSet.resolve("qmatmul=pallas,qmatmul8=pallas,attention_decode=pallas,"
                                                       "attention_prefill=pallas"), tensor_parallel=2)
    assert eng.kernels.attention_decode == "pallas@tp2" and eng.kernels.qmatmul == "pallas"
    np.testing.assert_array_equal(greedy_ids(eng, prompts, 4), ref)


def test_sizes_that_do_not_divide_are_refused(tiny_weights):
    with pytest.raises(ParallelismError, match="needs 16 devices but 8"):
        Engine(TINY, tiny_weights, KernelSet.resolve(), tensor_parallel=16)
    with pytest.raises(ParallelismError, match="vocabulary size"):
        Engine(TINY.replace(vocab_size=258), tiny_weights, KernelSet.resolve(), tensor_parallel=4)
    with pytest.raises(ParallelismError, match="128 input rows of layer 0 w_down into whole quantization groups"):
        Engine(TINY, tiny_weights, KernelSet.resolve(), tensor_parallel=8)


def test_bench_tp_runs_on_simulated_devices(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_tp

    rows = bench_tp.main(["--tiny", "--cases", "70b,job", "--out", str(tmp_path), "--gpus", "2"])
    assert (tmp_path / "bench_tp.json").exists()
    assert "| decode | tiny-as-70b | 2 |" in (tmp_path / "bench_tp.md").read_text()
    assert [(r["case"], r["gpus"]) for r in rows] == [("decode", 2), ("batch_job", 2)], rows
    assert all(r["tok_s"] > 0 for r in rows) and 0 < rows[0]["share_of_bound"] and rows[1]["completion_tokens"] == 36


def test_pallas_tree_attention_runs_per_shard(tiny_weights):
    """A tree verify's forward with `attention_tree=pallas` at tensor_parallel=2 (as `pallas@tp2`, per shard under
    shard_map) gives the one-device XLA logits."""
    from lucebox_jax.model import forward
    from lucebox_jax.tree import ancestors

    fwd = jax.jit(forward, static_argnums=(0, 1))
    parent = jnp.asarray([[0, 0, 1, 1, 2], [0, 1, 2, 3, 4]], jnp.int32)
    anc = ancestors(parent, 5)
    depth = jnp.sum(anc, axis=-1).astype(jnp.int32) - 1
    prompt = jnp.asarray([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45]], jnp.int32)
    toks = jnp.asarray([[11, 12, 13, 14, 15, 16], [46, 47, 48, 49, 50, 51]], jnp.int32)
    out = []
    for eng in (Engine(TINY, tiny_weights, KernelSet.resolve()),
                Engine(TINY, tiny_weights, KernelSet.resolve("attention_tree=pallas"), tensor_parallel=2)):
        _, cache = fwd(TINY, eng.kernels, eng.weights, eng.new_cache(2, 64), prompt, jnp.zeros((2,), jnp.int32))
        logits, _ = fwd(TINY, eng.kernels, eng.weights, cache, toks, jnp.asarray([6, 4], jnp.int32),
                        tree=(depth, anc))
        out.append(np.asarray(logits))
    assert eng.kernels.attention_tree == "pallas@tp2"
    np.testing.assert_allclose(out[1], out[0], rtol=2e-4, atol=2e-4)


def test_pallas_decode_verify_and_tree_rows_run_per_shard(tiny_weights):
    """With `attention_decode=pallas` at tensor_parallel=2 a chain verify (decode rows writing their window) and a
    short tree (decode rows with their ancestors' bits) run per shard and give the one-device XLA logits and cache."""
    from lucebox_jax.model import forward
    from lucebox_jax.tree import ancestors

    fwd = jax.jit(forward, static_argnums=(0, 1), static_argnames=("verify",))
    parent = jnp.asarray([[0, 0, 1, 1, 2], [0, 1, 2, 3, 4]], jnp.int32)
    anc = ancestors(parent, 5)
    depth = jnp.sum(anc, axis=-1).astype(jnp.int32) - 1
    prompt = jnp.asarray([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45]], jnp.int32)
    toks = jnp.asarray([[11, 12, 13, 14, 15, 16], [46, 47, 48, 49, 50, 51]], jnp.int32)
    start = jnp.asarray([6, 4], jnp.int32)
    out = []
    for eng in (Engine(TINY, tiny_weights, KernelSet.resolve()),
                Engine(TINY, tiny_weights, KernelSet.resolve("attention_decode=pallas"), tensor_parallel=2)):
        _, cache = fwd(TINY, eng.kernels, eng.weights, eng.new_cache(2, 64), prompt, jnp.zeros((2,), jnp.int32))
        chain, cc = fwd(TINY, eng.kernels, eng.weights, cache, toks, start, verify=True)
        tree, tc = fwd(TINY, eng.kernels, eng.weights, cache, toks, start, tree=(depth, anc))
        out.append([np.asarray(x) for x in (chain, tree, cc.k[1], tc.v[1])])
    assert eng.kernels.attention_decode == "pallas@tp2"
    for got, want in zip(out[1], out[0]):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_padded_rows_reach_the_per_shard_attention(tiny_weights):
    """A qmatmul kernel that runs its rows padded (`rows=`, as mgpu past 8 rows) makes the model hand the decode
    attention `out_rows`: at tensor_parallel=2 the per-shard wrapper takes it too (it pads after the shard_map), and a
    verify of 2 x 6 positions (12 -> 16 rows) gives the one-device logits and cache."""
    from lucebox_jax import ops
    from lucebox_jax.kernels_xla import qmatmul_xla
    from lucebox_jax.model import forward

    ops.register("qmatmul", "padded_tp_test_kernel", rows=lambda m: -(-m // 8) * 8)(qmatmul_xla)
    fwd = jax.jit(forward, static_argnums=(0, 1), static_argnames=("verify",))
    prompt = jnp.asarray([[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45]], jnp.int32)
    toks = jnp.asarray([[11, 12, 13, 14, 15, 16], [46, 47, 48, 49, 50, 51]], jnp.int32)
    start = jnp.asarray([6, 4], jnp.int32)
    out = []
    for eng in (Engine(TINY, tiny_weights, KernelSet.resolve()),
                Engine(TINY, tiny_weights, KernelSet.resolve("attention_decode=pallas,qmatmul=padded_tp_test_kernel"),
                       tensor_parallel=2)):
        _, cache = fwd(TINY, eng.kernels, eng.weights, eng.new_cache(2, 64), prompt, jnp.zeros((2,), jnp.int32))
        chain, cc = fwd(TINY, eng.kernels, eng.weights, cache, toks, start, verify=True)
        out.append([np.asarray(x) for x in (chain, cc.k[1], cc.v[0])])
    assert ops.accepts("attention_decode", eng.kernels.attention_decode, "out_rows")
    for got, want in zip(out[1], out[0]):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_pallas_kv_move_runs_per_shard(tiny_weights):
    """`kv_move=pallas` at tensor_parallel=2 (as `pallas@tp2`: each device moves its own KV heads) moves a tree's
    path as the one-device XLA move does, bit for bit, on a cache split by heads."""
    from lucebox_jax.tree import move_path_kv

    eng = Engine(TINY, tiny_weights, KernelSet.resolve("kv_move=pallas"), tensor_parallel=2)
    assert eng.kernels.kv_move == "pallas@tp2"
    cache = eng.new_cache(2, 64)
    keys = jax.random.split(jax.random.key(5), 2 * len(cache.k))
    cache = cache.replace(k=tuple(c + jax.random.normal(kk, c.shape, c.dtype) for c, kk in zip(cache.k, keys)),
                          v=tuple(c - jax.random.normal(kk, c.shape, c.dtype) for c, kk in zip(cache.v, keys[::-1])))
    start, path = jnp.asarray([6, 20], jnp.int32), jnp.asarray([[2, 4, 7], [1, 0, 0]], jnp.int32)
    got = jax.jit(lambda c: move_path_kv(c, start, path, 3, eng.kernels))(cache)
    want = move_path_kv(jax.device_get(cache), start, path, 3)
    for a, b in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
