"""The Python API on the embedded SmolLM2 model: sensible answers, vLLM-shaped outputs (logprobs, prompt logprobs,
finish reasons), stop strings, seeds, batching, streaming, the naive-reference exact match and typed errors."""

import math

import pytest

from lucebox_jax import (EmptyPromptError, InvalidRequestError, InvalidSamplingParamsError, PromptTooLongError,
                         SamplingParams, UnknownKernelError)
from lucebox_jax.reference import naive_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_generate_raw_prompt(smol):
    out = smol.generate("The capital of France is", GREEDY)
    assert len(out) == 1
    c = out[0].outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason in ("length", "stop") and 0 < len(c.token_ids) <= 12
    assert out[0].prompt_token_ids == smol.get_tokenizer().encode("The capital of France is")


def test_chat_answers(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=16))
    c = out[0].outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop" and c.token_ids[-1] in smol.get_tokenizer().eot_ids
    assert "<|im_end|>" not in c.text


def test_matches_naive_reference(smol):
    ids = smol.get_tokenizer().encode("def fibonacci(n):")
    got = smol.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    e = smol.engine
    assert got[0].outputs[0].token_ids == naive_greedy(e.cfg, e.kernels, e.weights, ids, 10)


def test_batch_equals_one_at_a_time(smol):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a small village"]
    batched = [o.outputs[0].token_ids for o in smol.generate(prompts, GREEDY)]
    single = [smol.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert batched == single


def test_logprobs_like_vllm(smol):
    out = smol.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, logprobs=3,
                                                                     prompt_logprobs=2))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tok, d in zip(c.token_ids, c.logprobs):
        assert tok in d and 3 <= len(d) <= 4
        assert d[tok].rank == 1  # greedy: the chosen token is the top one
        assert all(v.logprob <= 0 for v in d.values())
        assert math.isclose(max(v.logprob for v in d.values()), d[tok].logprob)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(out.prompt_token_ids)
    for tok, d in zip(out.prompt_token_ids[1:], plp[1:]):
        assert tok in d and 2 <= len(d) <= 3


def test_stop_strings_and_max_tokens(smol):
    free = smol.generate("1, 2, 3, 4,", GREEDY)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    assert " 6" in free.text
    cut = smol.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 6"
    assert cut.text == free.text[: free.text.index(" 6")]
    assert len(cut.token_ids) < 12


def test_seeded_sampling_reproducible(smol):
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234)
    a = smol.generate("Once upon a time", p)[0].outputs[0].token_ids
    b = smol.generate("Once upon a time", p)[0].outputs[0].token_ids
    assert a == b
    others = {tuple(smol.generate("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12,
                                                                      seed=s))[0].outputs[0].token_ids)
              for s in (1, 2, 3)}
    assert len(others | {tuple(a)}) > 1


def test_stream_equals_generate(smol):
    prompt = "Ceci n'est pas une pipe. En français, «"
    p = SamplingParams(temperature=0, max_tokens=12)
    pieces = list(smol.stream(prompt, p))
    stats = smol.last_stats
    assert stats["completion_tokens"] == len(stats["token_ids"]) > 0 and stats["decode_tok_s"] > 0
    out = smol.generate(prompt, p)[0].outputs[0]
    assert "".join(pieces) == out.text and stats["token_ids"] == out.token_ids
    assert all("\ufffd" not in x for x in pieces)


def test_special_tokens_encode_as_one(smol):
    tok = smol.get_tokenizer()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")


def test_errors(smol):
    with pytest.raises(EmptyPromptError):
        smol.generate("", GREEDY)
    with pytest.raises(PromptTooLongError, match=f"context limit is {smol.config.max_context}"):
        smol.generate({"prompt_token_ids": [1] * smol.config.max_context}, GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        smol.generate({"prompt_token_ids": [10**9]}, GREEDY)
    with pytest.raises(InvalidSamplingParamsError, match="top_p"):
        SamplingParams(top_p=0)


def test_unknown_kernel_lists_valid():
    from lucebox_jax import LLM

    with pytest.raises(UnknownKernelError, match="valid: .*xla"):
        LLM(kernels="qmatmul=nope")
