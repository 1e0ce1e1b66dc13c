"""Agreement with independent implementations of the same GGUF, teacher-forced: our float32 CPU path is fed
llama.cpp's own 48-token greedy continuation of 16 varied prompts (fixture made by tests/fixtures/make_reference.py
with llama-cpp-python and transformers) and must pick the same next token at every position, or a near-tie.

Targets (issue 2): >= 95% top-1 agreement with llama.cpp with every disagreement a near-tie (our top-1 logit minus our
logit of llama.cpp's token <= 1.0); >= 99% against transformers fp32 (same dequantized weights); logits within a
stated tolerance of transformers'. Calibration in the fixture: transformers vs llama.cpp agree on 97.4%."""

import gzip
import json
import os

import numpy as np
import pytest

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "reference_smollm2.json.gz")
NEAR_TIE = 1.0
LOGIT_ATOL = 1e-3  # max |ours - transformers| over transformers' top-20 logits at every position


@pytest.fixture(scope="module")
def ref():
    with gzip.open(FIXTURE, "rt") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def ours(smol, ref):
    """Our logits at the 48 predicted positions of each prompt (one teacher-forced prefill per prompt)."""
    eng = smol.engine
    out = []
    for p in ref["prompts"]:
        seq = p["prompt_ids"] + p["llamacpp_greedy"]
        cache = eng.new_cache(1, eng.cache_len_for(len(seq)))
        _, per_pos, _ = eng.prefill(cache, [seq], all_logits=True)
        n = len(p["prompt_ids"])
        out.append(per_pos[0][n - 1: n - 1 + len(p["llamacpp_greedy"])])
    return out


def test_prompt_ids_match_llamacpp(smol, ref):
    tok = smol.get_tokenizer()
    for p in ref["prompts"]:
        assert tok.encode(p["text"]) == p["prompt_ids"], p["text"][:40]


def test_agreement_with_llamacpp(ref, ours):
    agree, total, worst = 0, 0, 0.0
    for p, lg in zip(ref["prompts"], ours):
        for j, t in enumerate(p["llamacpp_greedy"]):
            total += 1
            top = int(np.argmax(lg[j]))
            if top == t:
                agree += 1
            else:
                worst = max(worst, float(lg[j][top] - lg[j][t]))
    rate = agree / total
    print(f"llama.cpp agreement {agree}/{total} = {rate:.3f}, worst disagreement margin {worst:.3f}")
    assert total == 16 * 48
    assert rate >= 0.95
    assert worst <= NEAR_TIE


def test_agreement_with_transformers_fp32(ref, ours):
    agree, total, max_diff = 0, 0, 0.0
    for p, lg in zip(ref["prompts"], ours):
        hf = p["transformers"]
        for j in range(len(p["llamacpp_greedy"])):
            total += 1
            agree += int(np.argmax(lg[j])) == hf["argmax"][j]
            ids = np.asarray(hf["top20_ids"][j])
            max_diff = max(max_diff, float(np.max(np.abs(lg[j][ids] - np.asarray(hf["top20_logits"][j])))))
    rate = agree / total
    print(f"transformers agreement {agree}/{total} = {rate:.4f}, max |logit diff| on its top-20 {max_diff:.4f}")
    assert rate >= 0.99
    assert max_diff <= LOGIT_ATOL
