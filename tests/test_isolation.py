"""Per-request state stays per request in batched execution (issue 12): stop ids, ignore_eos, seeds, penalties and
max_tokens of one row never change another row's output, in `LLM.generate` static batches, the continuous-batching
path and speculative generation. Reference: each request generated alone."""

import dataclasses

import pytest

from lucebox_jax import LLM, SamplingParams

PROMPTS = [[65, 66, 67, 44, 32, 100], [120, 121, 32, 122], [40, 41, 42, 43, 44, 45, 46, 47], [50, 51]]


def alone(llm, ids, p):
    return llm.generate({"prompt_token_ids": ids}, p)[0].outputs[0]


def batched(llm, params):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)]


def mixed_params(llm):
    """Row 0 plain; row 1 stops on a token that row 0 generates; row 2 ignores eos; row 3 sampled with a penalty."""
    plain = SamplingParams(temperature=0, max_tokens=12)
    ref0 = alone(llm, PROMPTS[0], plain).token_ids
    return [plain, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref0[2]]),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=7, seed=5, repetition_penalty=1.3)], ref0


@pytest.fixture(scope="module")
def eos_llm(tiny_llm):
    """The tiny model with an end-of-turn set holding tokens it actually generates (its real eos rarely comes)."""
    ref2 = alone(tiny_llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).token_ids
    tok = tiny_llm.tokenizer
    old = tok.eot_ids
    tok.eot_ids = frozenset(old | {ref2[3]})
    yield tiny_llm
    tok.eot_ids = old


def check_rows(llm, outs, params):
    for ids, p, o in zip(PROMPTS, params, outs):
        ref = alone(llm, ids, p)
        assert (o.token_ids, o.finish_reason) == (ref.token_ids, ref.finish_reason), p


def test_static_batch_rows_keep_their_own_stops(eos_llm):
    params, ref0 = mixed_params(eos_llm)
    outs = batched(eos_llm, params)
    assert outs[0].token_ids == ref0  # not cut at row 1's stop id
    assert len(outs[2].token_ids) == 24  # ignore_eos: the other rows' end-of-turn ids do not stop it
    check_rows(eos_llm, outs, params)


def test_continuous_batch_rows_keep_their_own_stops(eos_llm):
    params, _ = mixed_params(eos_llm)
    old = eos_llm.max_batch
    eos_llm.max_batch = 2  # 4 prompts > max_batch: the scheduler path
    try:
        outs = batched(eos_llm, params)
    finally:
        eos_llm.max_batch = old
    assert len(outs[2].token_ids) == 24
    check_rows(eos_llm, outs, params)


def test_speculative_rows_keep_their_own_stops(eos_llm, tiny_gguf):
    params, _ = mixed_params(eos_llm)
    spec = LLM(tiny_gguf, draft="ngram", num_draft=2, use_checkpoint=False)
    spec.tokenizer.eot_ids = eos_llm.tokenizer.eot_ids
    params = [dataclasses.replace(p, temperature=0.0) for p in params]  # greedy: lossless, equals plain
    outs = batched(spec, params)
    assert len(outs[2].token_ids) == 24
    check_rows(eos_llm, outs, params)
