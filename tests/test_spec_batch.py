"""Speculation inside continuous batching (spec_batch.py): greedy results of the scheduler with a drafter equal the
plain scheduler's token for token (ngram, an untrained eagle head, layer skip) at several slot counts, with stop ids,
per-row budgets and host-side stops, while rows finish at different times and slots are refilled; the policy (slot
limit, per-slot acceptance floor) and seeded sampling independent of the neighbours."""

import dataclasses

import jax
import numpy as np
import pytest

from lucebox_jax import SamplingParams
from lucebox_jax.drafters import EagleDrafter, build
from lucebox_jax.drafters.eagle import EagleConfig, init_head
from lucebox_jax.scheduler import Scheduler, SlotRequest
from lucebox_jax.spec_batch import BatchSpec, break_even_acceptance

MAX_LEN, STEPS = 256, 4


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    lens = [3, 14, 9, 16, 1, 12, 7, 10][:n]
    ps = [[int(x) for x in rng.integers(0, 256, size=k)] for k in lens]
    ps[1] = [5, 6, 7, 8] * 3 + [5, 6]  # something for the n-gram drafter to find
    return ps


def _requests(llm, prompts, maxes, stops=None, temp=0.0):
    out = []
    for i, (p, m) in enumerate(zip(prompts, maxes)):
        sp = SamplingParams(temperature=temp, max_tokens=m, ignore_eos=True, seed=100 + i,
                            stop_token_ids=list((stops or {}).get(i, [])))
        out.append(SlotRequest(i, p, sp, frozenset(llm.stop_ids_for(sp)), m))
    return out


def _run(llm, reqs, slots, spec=None, stop_check=None):
    sched = Scheduler(llm.engine, slots=slots, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2,
                      spec=spec, stop_check=stop_check)
    got = {f.request.key: f for batch in sched.run(reqs) for f in batch}
    return {k: (f.token_ids, f.finish_reason) for k, f in got.items()}, sched


def _drafter(llm, name):
    if name == "eagle":
        hc = EagleConfig.for_target(llm.engine.cfg)
        return EagleDrafter(hc, init_head(hc, jax.random.key(1)), llm.engine)
    return build(name, llm.engine)


@pytest.fixture(scope="module")
def case(tiny_llm):
    prompts = _prompts(8)
    maxes = [5, 40, 16, 1, 9, 30, 3, 12]
    plain, _ = _run(tiny_llm, _requests(tiny_llm, prompts, maxes), 3)
    return prompts, maxes, plain


@pytest.mark.parametrize("name,k,slots", [("ngram", 4, 3), ("ngram", 2, 1), ("eagle", 3, 3), ("layers:1", 2, 2)])
def test_greedy_equals_plain_scheduler(tiny_llm, case, name, k, slots):
    prompts, maxes, plain = case
    spec = BatchSpec(_drafter(tiny_llm, name), k, min_accept=0.0)  # keep speculating: exercise the verify path
    got, sched = _run(tiny_llm, _requests(tiny_llm, prompts, maxes), slots, spec)
    assert got == plain
    st = sched.spec_stats()
    assert st["row_steps"] > 0 and sched.stats["spec_calls"] > 0
    assert sched.stats["prefill_rows"] == len(prompts)
    if name == "ngram":  # the repeating prompt makes the lookup right at least sometimes
        assert st["mean_accepted"] > 0


def test_stop_ids_and_host_stops_per_row(tiny_llm, case):
    prompts, maxes, plain = case
    # stop row 1 at the token its plain completion makes 6th, row 5 by a host-side check after 4 tokens
    stops = {1: [plain[1][0][5]]}
    check = lambda r, ids: r.key == 5 and len(ids) >= 4  # noqa: E731
    want, _ = _run(tiny_llm, _requests(tiny_llm, prompts, maxes, stops), 3, stop_check=check)
    assert want[1][1] == "stop" and want[5][1] == "check"
    spec = BatchSpec(build("ngram", tiny_llm.engine), 4, min_accept=0.0)
    got, _ = _run(tiny_llm, _requests(tiny_llm, prompts, maxes, stops), 3, spec, stop_check=check)
    # a host-side check sees each round's tokens, and a round holds more of them with drafts: the same prefix, cut
    # later (jobs cut stop strings in the text, see test_job_with_draft_equals_plain_job)
    assert got[5][1] == "check" and got[5][0][:5] == want[5][0]
    assert {i: g for i, g in got.items() if i != 5} == {i: w for i, w in want.items() if i != 5}


def test_policy_slot_limit_and_acceptance_floor(tiny_llm, case):
    prompts, maxes, plain = case
    d = _drafter(tiny_llm, "eagle")
    off, sched = _run(tiny_llm, _requests(tiny_llm, prompts, maxes), 3, BatchSpec(d, 3, max_slots=2))
    assert off == plain and sched.spec is None and "3 slots > 2" in sched.spec_stats()["off"]
    # an untrained head is almost never right: every slot stops speculating after its warm-up, then plain decoding
    got, sched = _run(tiny_llm, _requests(tiny_llm, prompts, maxes), 3, BatchSpec(d, 3, min_accept=0.5, warmup=3))
    assert got == plain
    st = sched.spec_stats()
    assert st["plain_calls"] > 0 and st["spec_calls"] > 0
    # realised break-even: 1 + accepted tokens a step against 1 + K * cost steps, i.e. accepted / drafted >= cost
    assert break_even_acceptance(0.2) == 0.2 and break_even_acceptance(1.5) > 1
    assert BatchSpec(d, 4, verify_cost=0.03).min_accept == pytest.approx(d.cost_ratio + 0.03)


def test_switched_off_greedy_slot_takes_drafts_while_others_speculate(tiny_llm):
    """In a speculative call, a greedy slot that stopped speculating still takes its accepted drafts (the verify covers
    it anyway): with the same prompt as a speculating greedy slot it makes the same tokens, as many; a sampled slot
    that stopped makes one token a step; the switched-off slots' own acceptance counts do not move."""
    import jax.numpy as jnp

    p = _prompts(2)[1]
    reqs = _requests(tiny_llm, [p, p], [200, 200]) + _requests(tiny_llm, [p], [200], temp=0.8)
    sched = Scheduler(tiny_llm.engine, slots=3, max_len=MAX_LEN, steps_per_call=16, max_prefill_batch=4,
                      spec=BatchSpec(build("ngram", tiny_llm.engine), 3, min_accept=0.0))
    sched._admit([dataclasses.replace(r, key=i) for i, r in enumerate(reqs)], [0, 1, 2])
    on = jnp.asarray([True, False, False])
    sched.state = sched.state.replace(spec=sched.state.spec.replace(on=on))
    sched._spec_on = np.asarray(on)
    buf = np.asarray(sched._decode(np.zeros(3, bool), 4, active=(0, 1, 2)))
    toks = [[int(t) for t in row if t >= 0] for row in buf]
    assert sched.stats["spec_calls"] == 1
    assert len(toks[0]) > 16, "the speculating slot accepted nothing: the test would show nothing"
    assert toks[1] == toks[0]
    assert len(toks[2]) == 16
    assert [int(x) for x in sched.state.spec.drafted] == [16 * 3, 0, 0]


def test_speculative_call_is_not_read_back_at_dispatch(tiny_llm, case):
    """A speculative call's per-slot switches are read in the next round, not when it is dispatched (that read waited
    for the whole call before the round's hooks could run); they are read before anything donates that state."""
    prompts, maxes, _ = case
    sched = Scheduler(tiny_llm.engine, slots=3, max_len=MAX_LEN, steps_per_call=STEPS, max_prefill_batch=2,
                      spec=BatchSpec(build("ngram", tiny_llm.engine), 2, min_accept=0.0))
    reqs = _requests(tiny_llm, prompts[:2], maxes[1:3])
    sched._admit(reqs, [0, 1])
    sched._decode(np.zeros(3, bool), 4, active=(0, 1))
    assert sched.stats["spec_calls"] == 1 and sched._spec_on_dev is not None  # not read yet
    pending = sched._spec_on_dev
    sched._admit(_requests(tiny_llm, prompts[2:3], maxes[3:4]), [2])  # an insert: the flags are read before it
    assert sched._spec_on_dev is None and list(sched._spec_flags()) == [True, True, True]
    assert pending.is_deleted()  # (that state went to the insert)


def test_seeded_sampling_independent_of_neighbours(tiny_llm):
    prompts = _prompts(5, seed=2)
    spec = BatchSpec(build("ngram", tiny_llm.engine), 3, min_accept=0.0)
    reqs = _requests(tiny_llm, prompts, [12] * 5, temp=0.8)
    alone, _ = _run(tiny_llm, [reqs[1]], 2, spec)
    mixed, _ = _run(tiny_llm, [reqs[0], reqs[2], reqs[1], reqs[3]], 2, spec)
    assert alone[1] == mixed[1]
    other = dataclasses.replace(reqs[1], params=dataclasses.replace(reqs[1].params, seed=7))
    assert _run(tiny_llm, [other], 2, spec)[0][1] != alone[1]


def test_job_with_draft_equals_plain_job(tmp_path, tiny_llm):
    """A JSONL job with a drafter: the same results as without (stop strings and stop ids per row included)."""
    from test_jobs import job, read_out

    plain_out = [o.outputs[0] for o in tiny_llm.generate(["x 1"], SamplingParams(temperature=0, max_tokens=12))]
    stop_text = plain_out[0].text[3:6] or None
    rows = [{"id": f"r{i}", "prompt": w, "max_tokens": m} for i, (w, m) in
            enumerate(zip(["alpha", "x 1", "the quick brown fox", "a b a b a b", "zeta"], [9, 12, 1, 20, 6]))]
    rows[1]["stop"] = [stop_text] if stop_text else []
    rows[4]["stop_token_ids"] = [int(plain_out[0].token_ids[0])]
    _, summ, _ = job(tmp_path, tiny_llm, rows, out="plain.jsonl", token_ids=True)
    old, tiny_llm.spec = tiny_llm.spec, _decoder(tiny_llm, "ngram", 3)
    try:
        _, summ2, logs = job(tmp_path, tiny_llm, rows, out="spec.jsonl", token_ids=True, spec_min_accept=0.0)
    finally:
        tiny_llm.spec = old
    key = lambda r: (r["id"], r["text"], r["finish_reason"], r["token_ids"])  # noqa: E731
    assert sorted(map(key, read_out(tmp_path / "spec.jsonl"))) == sorted(map(key, read_out(tmp_path / "plain.jsonl")))
    assert summ2.speculative["row_steps"] > 0 and summ.speculative is None
    assert any("speculative" in x for x in logs)


def test_llm_generate_many_prompts_speculates(tiny_llm):
    prompts = ["hello", "a b a b a b a b", "x", "the quick brown fox", "12345 678"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 14, 9, 5, 7)]
    static = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
    old = tiny_llm.max_batch, tiny_llm.spec
    tiny_llm.max_batch, tiny_llm.spec = 2, _decoder(tiny_llm, "ngram", 4)
    try:
        cont = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
        st = tiny_llm.last_stats["speculative"]
    finally:
        tiny_llm.max_batch, tiny_llm.spec = old
    assert cont == static and st["drafter"].startswith("ngram") and st["num_draft"] == 4


def _decoder(llm, name, k):
    from lucebox_jax.speculative import SpeculativeDecoder

    return SpeculativeDecoder(llm.engine, _drafter(llm, name), k)


def test_batch_benchmark_runs_tiny(tmp_path, monkeypatch):
    """benchmarks/bench_spec_batch.py in its CPU configuration: a result per configuration, greedy outputs equal."""
    import os
    import sys

    monkeypatch.setenv("OUT", str(tmp_path))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import bench_spec_batch
    finally:
        sys.path.pop(0)
    res = bench_spec_batch.main(["--tiny", "--slots", "2", "--drafters", "ngram,eagle", "--max-tokens", "8"])
    runs = res["runs"]
    assert [r["drafter"] for r in runs] == ["plain", "ngram", "eagle"]
    assert all(r["greedy_equal"] == r["requests"] for r in runs[1:]) and all(r["tok_s"] > 0 for r in runs)
    assert (tmp_path / "bench_spec_batch.json").exists()


def test_cli_job_with_draft(tiny_gguf, tmp_path):
    """`run.py --input ... --draft ngram`: the same results file as without --draft; --tree / auto K refused."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": 10}) + "\n"
                           for i, p in enumerate(["abcabcabc", "hello there", "x y x y x y"])))

    def job(out, *extra):
        return subprocess.run([sys.executable, os.path.join(root, "run.py"), "--model", tiny_gguf, "--input",
                               str(inp), "--output", str(tmp_path / out), "--batch-size", "2", "--token-ids",
                               "--ordered", *extra], capture_output=True, text=True, timeout=600, cwd=root,
                              env=dict(os.environ, LUCEBOX_CHECKPOINTS=str(tmp_path / "ckpt")))

    r = job("plain.jsonl")
    assert r.returncode == 0, r.stderr
    r = job("spec.jsonl", "--draft", "ngram", "--num-draft", "3")
    assert r.returncode == 0, r.stderr
    assert "speculative" in r.stderr and "mean accepted" in r.stderr
    assert (tmp_path / "spec.jsonl").read_text() == (tmp_path / "plain.jsonl").read_text()
    for extra in (["--tree", "8"], ["--num-draft", "auto"]):
        r = job("bad.jsonl", "--draft", "ngram", *extra)
        assert r.returncode == 2 and "fixed --num-draft K and no --tree" in r.stderr, r.stderr
    assert not (tmp_path / "bad.jsonl").exists()


def test_draft_model_in_the_scheduler(tiny_llm, tiny_gguf, case):
    """A separate draft model (here the target's own GGUF: every draft right) keeps its own cache per slot."""
    prompts, maxes, plain = case
    spec = BatchSpec(build(tiny_gguf, tiny_llm.engine), 3, min_accept=0.0)
    got, sched = _run(tiny_llm, _requests(tiny_llm, prompts, maxes), 2, spec)
    assert got == plain
    st = sched.spec_stats()
    assert st["mean_accepted"] > 2.5  # identical model: nearly all of K = 3 accepted (budgets cut the rest)
