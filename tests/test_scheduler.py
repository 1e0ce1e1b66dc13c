"""Continuous batching (scheduler.py) on the tiny random GGUF model: with fewer slots than requests (so finished
slots are refilled), greedy results equal one-request-at-a-time `LLM.generate`, seeded sampling does not depend on
the slot or the batch, stop ids and host-side stops retire rows without disturbing the others."""

import dataclasses

import numpy as np
import pytest

from lucebox_jax import SamplingParams
from lucebox_jax.scheduler import Scheduler, SlotRequest, generate_ids

SLOTS, STEPS, MAX_LEN = 2, 4, 256  # shared with test_jobs.py so the compiled programs are reused


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    lens = [3, 14, 9, 16, 1, 12, 7][:n]  # one prefill bucket: few shapes to compile
    return [[int(x) for x in rng.integers(0, 256, size=k)] for k in lens]


def _single(llm, ids, params):
    return llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids


def _req(key, ids, params, llm, max_new=None):
    return SlotRequest(key, ids, params, frozenset(llm.stop_ids_for(params)), max_new or params.max_tokens)


@pytest.fixture(scope="module")
def greedy_case(tiny_llm):
    prompts = _prompts(7)
    maxes = [5, 12, 16, 1, 9, 16, 3]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in maxes]
    ref = [_single(tiny_llm, p, sp) for p, sp in zip(prompts, params)]
    return prompts, params, ref


def test_greedy_batch_equals_one_at_a_time(tiny_llm, greedy_case):
    prompts, params, ref = greedy_case
    reqs = [_req(i, p, dataclasses.replace(sp, seed=0), tiny_llm) for i, (p, sp) in
            enumerate(zip(prompts, params))]
    sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2)
    got, rounds = {}, 0
    for batch in sched.run(reqs):
        rounds += 1
        for f in batch:
            got[f.request.key] = f
    assert [got[i].token_ids for i in range(len(prompts))] == ref
    assert all(got[i].finish_reason == "length" for i in range(len(prompts)))
    assert sched.stats["prefill_rows"] == len(prompts) and rounds > 2  # refills happened
    assert sched.stats["completion_tokens"] == sum(len(r) for r in ref)


def test_stop_token_ids_cut_like_generate(tiny_llm, greedy_case):
    prompts, params, ref = greedy_case
    # stop on a token the greedy completion of prompt 2 produces at step 4: the same cut as LLM.generate's
    stop_tok = ref[2][3]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_tok], seed=0)
    want = _single(tiny_llm, prompts[2], p)
    assert want[-1] == stop_tok and len(want) <= 4
    reqs = [_req("stop", prompts[2], p, tiny_llm)] + [
        _req(i, prompts[i], dataclasses.replace(params[i], seed=0), tiny_llm) for i in (3, 5)]
    out = generate_ids(tiny_llm.engine, reqs, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS,
                       max_prefill_batch=2)
    assert out["stop"].token_ids == want and out["stop"].finish_reason == "stop"
    assert out[3].token_ids == ref[3] and out[5].token_ids == ref[5]  # neighbours undisturbed


def test_seeded_sampling_independent_of_slot_and_batch(tiny_llm):
    prompts = _prompts(5, seed=1)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, max_tokens=12, seed=1234,
                       ignore_eos=True)
    alone = generate_ids(tiny_llm.engine, [_req("x", prompts[0], p, tiny_llm)], slots=SLOTS, max_len=MAX_LEN,
                         steps_per_call=STEPS, max_prefill_batch=2)["x"].token_ids
    # the same request third in line (another slot, other neighbours, admitted later)
    others = [_req(i, prompts[i], SamplingParams(temperature=0.7, max_tokens=6 + i, seed=i, ignore_eos=True),
                   tiny_llm) for i in (1, 2)]
    mixed = generate_ids(tiny_llm.engine, others + [_req("x", prompts[0], p, tiny_llm)], slots=SLOTS,
                         max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2)["x"].token_ids
    assert alone == mixed
    assert alone == _single(tiny_llm, prompts[0], p)  # same seed, same draws as the LLM API
    other_seed = generate_ids(tiny_llm.engine, [_req("x", prompts[0], dataclasses.replace(p, seed=99),
                                                      tiny_llm)],
                              slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2)["x"].token_ids
    assert other_seed != alone


def test_host_stop_check_retires_row(tiny_llm, greedy_case):
    prompts, params, ref = greedy_case
    reqs = [_req(i, prompts[i], dataclasses.replace(params[i], seed=0), tiny_llm) for i in (2, 1, 5)]
    sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2,
                      stop_check=lambda r, ids: r.key == 2 and len(ids) >= 2)
    got = {f.request.key: f for batch in sched.run(reqs) for f in batch}
    assert got[2].finish_reason == "check" and got[2].token_ids == ref[2][: len(got[2].token_ids)]
    assert 2 <= len(got[2].token_ids) < 16
    assert got[1].token_ids == ref[1] and got[5].token_ids == ref[5]


def test_hooks_run_while_the_next_call_is_in_flight(tiny_llm, greedy_case):
    """The slow host work of a round (stop_check: a server's streaming) runs after the next decode call has been
    dispatched, so the device is not left idle for it; the tokens and the finish are unchanged."""
    prompts, params, ref = greedy_case
    seen = []
    sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2,
                      stop_check=lambda r, ids: seen.append((len(ids), sched.stats["decode_calls"])) or False)
    got = {f.request.key: f for batch in sched.run([_req(2, prompts[2], dataclasses.replace(params[2], seed=0),
                                                         tiny_llm)]) for f in batch}
    assert got[2].token_ids == ref[2] and got[2].finish_reason == "length"
    # the hook seeing the first token (admission) or call N's tokens runs after call N + 1 was dispatched
    assert seen and seen == [(n, (n - 1) // STEPS + 1) for n, _ in seen]
    assert [n for n, _ in seen] == list(range(1, len(ref[2]), STEPS))


def test_admission_does_not_wait_for_the_device(tiny_llm, greedy_case, monkeypatch):
    """An admission (prefill, first token, insert) only dispatches: it reads no device array back (jax's transfer
    guard does not fire on the CPU backend, so the scheduler's numpy is watched instead). A row whose first token is
    a stop id is marked done on the device at its insert, finishes with that one token, and leaves the row beside it
    as it was."""
    import jax

    from lucebox_jax import scheduler

    class NoPull:  # the scheduler's numpy, refusing device arrays
        def __getattr__(self, name):
            return getattr(np, name)

        def asarray(self, a, *args, **kw):
            assert not isinstance(a, jax.Array), "the admission read a device array back"
            return np.asarray(a, *args, **kw)

        array = asarray

    prompts, params, ref = greedy_case
    stop_first = dataclasses.replace(params[1], seed=0, stop_token_ids=[ref[1][0]])
    reqs = [_req(1, prompts[1], stop_first, tiny_llm), _req(2, prompts[2], dataclasses.replace(params[2], seed=0),
                                                                tiny_llm)]
    sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2)
    sched._admit(reqs[:1], [0])  # compiles outside the guard
    with monkeypatch.context() as m:
        m.setattr(scheduler, "np", NoPull())
        firsts = sched._admit(reqs, [0, 1])
    assert list(np.asarray(sched.state.done)) == [True, False]  # the stop at the first token, known on the device
    assert int(np.asarray(firsts)[0]) == ref[1][0]
    got = {f.request.key: f for batch in Scheduler(
        tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2).run(reqs)
        for f in batch}
    assert got[1].token_ids == [ref[1][0]] and got[1].finish_reason == "stop"
    assert got[2].token_ids == ref[2] and got[2].finish_reason == "length"


def test_rejects_requests_that_do_not_fit(tiny_llm):
    sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=32, steps_per_call=STEPS)
    with pytest.raises(ValueError, match="does not fit"):
        list(sched.run([SlotRequest("a", [1] * 30, SamplingParams(seed=0), frozenset(), 5)]))


def test_llm_generate_many_prompts_uses_continuous_batching(tiny_llm):
    """More prompts than max_batch go through the scheduler and give the same greedy results as static batches."""
    prompts = ["hello", "a longer prompt about cats and dogs", "x", "the quick brown fox", "12345 678"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 3, 9, 5, 7)]
    static = [o.outputs[0] for o in tiny_llm.generate(prompts, params)]  # 5 <= max_batch: static batch
    old = tiny_llm.max_batch
    tiny_llm.max_batch = 2
    try:
        cont = [o.outputs[0] for o in tiny_llm.generate(prompts, params)]
    finally:
        tiny_llm.max_batch = old
    assert [c.token_ids for c in cont] == [c.token_ids for c in static]
    assert [c.text for c in cont] == [c.text for c in static]
    assert [c.finish_reason for c in cont] == [c.finish_reason for c in static]


def test_live_feed_with_gaps_joins_the_running_batch(tiny_llm, greedy_case):
    """A live feed (serve/) yields None while nothing is new: the batch keeps decoding, later requests join it, and
    every result equals the one-at-a-time reference."""
    prompts, params, ref = greedy_case
    sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2)
    progress = []

    def feed():
        yield _req(2, prompts[2], dataclasses.replace(params[2], seed=0), tiny_llm)
        for _ in range(2):  # two rounds with nothing new: request 2 decodes alone meanwhile
            progress.append(sched.stats["decode_calls"])
            yield None
        for i in (1, 5):
            yield _req(i, prompts[i], dataclasses.replace(params[i], seed=0), tiny_llm)

    got = {f.request.key: f for batch in sched.run(feed()) for f in batch}
    assert progress == [0, 1]  # the scheduler decoded between the feed's empty answers
    assert {k: f.token_ids for k, f in got.items()} == {i: ref[i] for i in (2, 1, 5)}


def test_warmup_compiles_every_shape_live_traffic_needs(tiny_llm):
    """After `warmup`, a workload of mixed prompt lengths and group sizes compiles nothing more (a server's
    requests never wait on a compile)."""
    eng = tiny_llm.engine
    sched = Scheduler(eng, slots=4, max_len=128, steps_per_call=STEPS, max_prefill_batch=4)
    assert sched.prompt_length_classes(100) == [1, 17, 33, 65]
    runs = sched.warmup(100)
    assert runs == len(sched.prompt_length_classes(100)) * 3  # group sizes 1, 2, 4
    before = set(eng._seen_shapes)
    rng = np.random.default_rng(5)
    lens = [1, 90, 17, 40, 5, 64, 33, 100, 2]
    reqs = [SlotRequest(i, [int(x) for x in rng.integers(0, 256, size=n)],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, seed=0), frozenset(), 6)
            for i, n in enumerate(lens)]
    done = [f for batch in sched.run(reqs) for f in batch]
    assert sorted(f.request.key for f in done) == list(range(len(lens)))
    assert set(eng._seen_shapes) == before, set(eng._seen_shapes) - before


@pytest.mark.parametrize("exit_on_finish", [False, True])
def test_exit_on_finish_ends_the_call_when_a_row_finishes(tiny_llm, greedy_case, exit_on_finish):
    """A live feed with nothing waiting: by default a call runs its STEPS whatever finishes; with exit_on_finish it
    returns as soon as a row finishes, so the finished request is handed back sooner. Results are unchanged."""
    prompts, params, ref = greedy_case
    sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2,
                      exit_on_finish=exit_on_finish)

    def feed():  # request 6 (3 tokens: 2 decode steps) and request 2 (16: 15 steps) together, then nothing new
        for i in (6, 2):
            yield _req(i, prompts[i], dataclasses.replace(params[i], seed=0), tiny_llm)
        while sched.stats["requests"] < 2:
            yield None

    got = {f.request.key: f.token_ids for batch in sched.run(feed()) for f in batch}
    assert got == {6: ref[6], 2: ref[2]}
    # default: 15 steps of request 2 in calls of 4, 4, 4, 3 (request 6 rides in the first); exit_on_finish: the
    # first call ends after 2 steps, when request 6 finishes, then 13 steps take 4 more calls
    assert sched.stats["decode_calls"] == (5 if exit_on_finish else 4)


def test_lookahead_dispatches_ahead_with_the_same_results(tiny_llm, greedy_case):
    """`lookahead=True`: each decode call is dispatched before the last one's tokens are read (the hook that sees
    call N's tokens runs with call N + 1 already dispatched), and with refills, stop ids, a row retired by the host
    and seeded sampling the results are those without it (rows admitted after a call went out skip its tokens)."""
    prompts, params, ref = greedy_case
    kw = dict(slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2)
    stop_tok = ref[2][3]
    reqs = ([_req(i, p, dataclasses.replace(sp, seed=0), tiny_llm) for i, (p, sp) in enumerate(zip(prompts, params))]
            + [_req("stop", prompts[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, seed=0,
                                                       stop_token_ids=[stop_tok]), tiny_llm)]
            + [_req(f"t{i}", prompts[i], SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=i),
                    tiny_llm) for i in (1, 3)])
    check = lambda r, ids: r.key == 5 and len(ids) >= 6  # noqa: E731 - a host-side stop
    runs = {}
    for look in (False, True):
        sched = Scheduler(tiny_llm.engine, stop_check=check, lookahead=look, **kw)
        runs[look] = {f.request.key: (f.token_ids, f.finish_reason) for batch in sched.run(reqs) for f in batch}
    assert runs[True] == runs[False]
    assert [runs[True][i][0] for i in (0, 1, 2, 3, 4, 6)] == [ref[i] for i in (0, 1, 2, 3, 4, 6)]
    assert runs[True]["stop"][1] == "stop" and runs[True]["stop"][0][-1] == stop_tok
    assert runs[True][5][1] == "check" and runs[True][5][0] == ref[5][: len(runs[True][5][0])]
    for look in (False, True):  # the order of dispatches and reads of the calls' tokens
        events = []
        sched = Scheduler(tiny_llm.engine, lookahead=look, **kw)
        inner = sched._decode

        class Tokens:  # a call's token buffer that logs when the host reads it
            def __init__(self, buf, n):
                self.buf, self.n = buf, n

            def __array__(self, dtype=None, copy=None):
                events.append(("read", self.n))
                return np.asarray(self.buf)

        numbers = iter(range(10_000))

        def decode(*a, **k):  # (on the scheduler's decode thread without lookahead: numbered here, not by stats)
            n = next(numbers)
            events.append(("dispatch", n))
            return Tokens(inner(*a, **k), n)

        sched._decode = decode
        got = {f.request.key: f for batch in sched.run([_req(2, prompts[2], dataclasses.replace(params[2], seed=0),
                                                             tiny_llm)]) for f in batch}
        assert got[2].token_ids == ref[2]
        n = sum(e[0] == "dispatch" for e in events)
        assert n >= 3
        if look:  # call k + 1 goes out before call k's tokens are read
            assert events[:5] == [("dispatch", 0), ("dispatch", 1), ("read", 0), ("dispatch", 2), ("read", 1)]
        else:
            assert events[:4] == [("dispatch", 0), ("read", 0), ("dispatch", 1), ("read", 1)]


@pytest.mark.parametrize("mix", ["greedy", "sampled"])
def test_fixed_sampling_mode_gives_the_same_tokens(tiny_llm, greedy_case, mix):
    """`Scheduler(sampling=...)` (a batch job or LLM.generate knows every request): the decode calls compile one
    sampling branch instead of the on-device switch, and every row decodes exactly as with the switch; a request
    needing more than the fixed mode is refused, not silently mis-sampled."""
    from lucebox_jax.sampling import static_sampling

    prompts, params, _ = greedy_case
    if mix == "sampled":  # greedy rows beside temperature-only and top-p rows
        params = [dataclasses.replace(p, temperature=[0, 0.8, 1.1][i % 3], top_p=0.9 if i == 4 else 1.0)
                  for i, p in enumerate(params)]
    reqs = [_req(i, p, dataclasses.replace(sp, seed=i), tiny_llm) for i, (p, sp) in enumerate(zip(prompts, params))]
    fixed = static_sampling([r.params for r in reqs])
    assert fixed == ((0, False) if mix == "greedy" else (2, False))
    runs = {}
    for sampling in (None, fixed):
        sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2,
                          sampling=sampling)
        runs[sampling] = {f.request.key: f.token_ids for batch in sched.run(reqs) for f in batch}
        assert sched.state.rp.mode == (None if sampling is None else fixed[0])
    assert runs[None] == runs[fixed]
    if mix == "greedy":
        sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, sampling=fixed)
        hot = _req(0, prompts[0], SamplingParams(temperature=0.7, max_tokens=2, seed=1), tiny_llm)
        with pytest.raises(ValueError, match="beyond the fixed"):
            for _ in sched.run([hot]):
                pass


def test_round_host_work_runs_beside_a_blocking_decode_call(tiny_llm, greedy_case, monkeypatch):
    """A decode call holds the thread that runs it until it ends (an XLA while loop on the GPU; here a sleep stands in
    for it): the scheduler runs it on its decode thread, so the round's hooks run while it is still running; with
    LUCEBOX_DECODE_THREAD=0 (DECODE_THREAD off) they wait for it. Tokens are the same either way."""
    import threading
    import time as _time

    from lucebox_jax import scheduler as sch

    prompts, params, ref = greedy_case
    got = {}
    for threaded in (True, False):
        monkeypatch.setattr(sch, "DECODE_THREAD", threaded)
        running, overlapped = threading.Event(), []
        sched = Scheduler(tiny_llm.engine, slots=SLOTS, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2,
                          stop_check=lambda r, ids: overlapped.append(running.is_set()) or False)
        inner = sched._decode

        def blocking(*a, _inner=inner, **k):
            running.set()
            try:
                out = _inner(*a, **k)
                np.asarray(out)
                _time.sleep(0.15)  # the call's device time, holding this thread
                return out
            finally:
                running.clear()

        sched._decode = blocking
        reqs = [_req(2, prompts[2], dataclasses.replace(params[2], seed=0), tiny_llm)]
        got[threaded] = [f.token_ids for batch in sched.run(reqs) for f in batch]
        assert got[threaded] == [ref[2]]
        assert any(overlapped) == threaded and len(overlapped) >= 3
    assert got[True] == got[False]


def test_insert_rows_scatters_every_row_at_once():
    """insert_rows writes each prefilled row (cache positions below the prefill's length, per-row values) into its
    slot and leaves the other slots alone, with a padded group's repeated last row and slot; it has no loop (a while
    loop on the GPU brings its predicate to the host every trip)."""
    import jax
    import jax.numpy as jnp

    from lucebox_jax.model import KVCache
    from lucebox_jax.sampling import RowParams
    from lucebox_jax.scheduler import SlotState, insert_rows

    b, h, s, d, p, sp, v = 5, 2, 16, 4, 4, 8, 11
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    big = KVCache(k=(arr(b, h, s, d), arr(b, h, s, d)), v=(arr(b, h, s, d), arr(b, h, s, d)),
                  lengths=jnp.arange(b, dtype=jnp.int32))
    small = KVCache(k=(arr(p, h, sp, d), arr(p, h, sp, d)), v=(arr(p, h, sp, d), arr(p, h, sp, d)),
                    lengths=jnp.asarray([3, 7, 5, 5], jnp.int32))
    small = small.replace(k=tuple(x.at[3].set(x[2]) for x in small.k), v=tuple(x.at[3].set(x[2]) for x in small.v))
    slots = jnp.asarray([4, 0, 2, 2], jnp.int32)  # the last row repeats the third, as a padded group does
    rp_big = RowParams.from_params([SamplingParams(temperature=0.0, seed=i) for i in range(b)])
    rp_new = RowParams.from_params([SamplingParams(temperature=0.5, seed=10 + i) for i in (0, 1, 2, 2)])
    state = SlotState(cache=big, tokens=jnp.full((b,), 9, jnp.int32), seen=jnp.zeros((b, v), bool), rp=rp_big,
                      done=jnp.ones((b,), bool), count=jnp.zeros((b,), jnp.int32), row_max=jnp.zeros((b,), jnp.int32),
                      stop_ids=jnp.full((b, 2), -1, jnp.int32))
    first = jnp.asarray([1, 6, 3, 3], jnp.int32)
    seen = jnp.asarray(rng.random((p, v)) < 0.3).at[3].set(False)
    seen = seen.at[3].set(seen[2])
    row_max = jnp.asarray([5, 1, 7, 7], jnp.int32)
    stop = jnp.asarray([[6, -1], [6, -1], [2, -1], [2, -1]], jnp.int32)
    args = (small, slots, first, seen, rp_new, row_max, stop)
    assert "while" not in str(jax.make_jaxpr(insert_rows)(state, *args))
    want = jax.tree.map(np.asarray, state)
    out = insert_rows(state, *args)
    for row, slot in enumerate([4, 0, 2]):
        for layer in range(2):
            for got_kv, big_kv, small_kv in ((out.cache.k, want.cache.k, small.k),
                                             (out.cache.v, want.cache.v, small.v)):
                np.testing.assert_array_equal(np.asarray(got_kv[layer])[slot, :, :sp], np.asarray(small_kv[layer])[row])
                np.testing.assert_array_equal(np.asarray(got_kv[layer])[slot, :, sp:], big_kv[layer][slot, :, sp:])
        assert int(out.cache.lengths[slot]) == int(small.lengths[row]) and int(out.tokens[slot]) == int(first[row])
        assert np.array_equal(np.asarray(out.seen[slot]), np.asarray(seen[row]))
        assert float(out.rp.temperature[slot]) == 0.5 and np.array_equal(np.asarray(out.rp.keys[slot]),
                                                                          np.asarray(rp_new.keys[row]))
        assert int(out.count[slot]) == 1 and int(out.row_max[slot]) == int(row_max[row])
        assert list(np.asarray(out.stop_ids[slot])) == list(np.asarray(stop[row]))
    assert list(np.asarray(out.done)) == [True, True, False, True, False]  # slot 0: its row stops at its first token
    for slot in (1, 3):  # untouched slots
        np.testing.assert_array_equal(np.asarray(out.cache.k[0])[slot], want.cache.k[0][slot])
        assert int(out.tokens[slot]) == 9 and int(out.cache.lengths[slot]) == slot
