"""The EAGLE-style draft head (drafters/eagle.py): greedy output equal to plain greedy (an untrained head), its files
(save / load / bad input), and the target's hidden states it reads. Training: test_train_draft.py."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lucebox_jax.drafters import DraftError, EagleDrafter, build
from lucebox_jax.drafters.eagle import EagleConfig, init_head, load_head, save_head
from lucebox_jax.engine import Engine, enable_compilation_cache
from lucebox_jax.model import forward, init_cache
from lucebox_jax.ops import KernelSet
from lucebox_jax.speculative import SpeculativeDecoder
from lucebox_jax.synthetic import PRESETS, random_weights
from test_speculative import run, tiny_prompts

CFG = PRESETS["tiny"]
KS = KernelSet()


@pytest.fixture(scope="module")
def eng():
    enable_compilation_cache()
    return Engine(CFG, random_weights(CFG, jax.random.key(3), group_size=32, asymmetric=True), KS)


def test_forward_hidden_layers_are_the_residual_stream(eng):
    """hidden_layers=(last,) through the final norm and head gives the same logits forward returns."""
    toks = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    cache = init_cache(CFG, 1, 16)
    logits, _ = forward(CFG, KS, eng.weights, cache, toks, jnp.zeros((1,), jnp.int32))
    lg2, _, hid = forward(CFG, KS, eng.weights, cache, toks, jnp.zeros((1,), jnp.int32), hidden_layers=(0, 1))
    assert hid.shape == (1, 5, 2 * CFG.dim) and np.allclose(logits, lg2)
    from lucebox_jax.model import rms_norm
    from lucebox_jax.quant import linear

    again = linear(rms_norm(hid[..., CFG.dim:], eng.weights.final_norm, CFG.rms_eps), eng.weights.head)
    assert np.allclose(np.asarray(again), np.asarray(logits), atol=1e-4)


@pytest.mark.parametrize("k", [1, 4])
def test_untrained_head_greedy_equal(eng, k):
    hc = EagleConfig.for_target(CFG)
    d = EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng)
    ps = tiny_prompts([10, 17, 5], seed=3)
    ref = run(eng, None, ps, 20)
    spec = SpeculativeDecoder(eng, d, k)
    assert run(eng, spec, ps, 20) == ref
    assert run(eng, spec, ps[:1], 20) == ref[:1]
    assert spec.last_stats["row_steps"] > 0


def test_head_starts_from_the_prefills_features(eng, monkeypatch):
    """The prefill's hidden states (Engine.prefill(hidden_layers=), chunked here) start the head as its own forward
    over the prompts does: same cache at every prompt position and same output at the last; greedy tokens equal."""
    import lucebox_jax.engine as engine_mod

    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 16)  # three chunks for the longest prompt
    hc = EagleConfig.for_target(CFG)
    d = EagleDrafter(hc, init_head(hc, jax.random.key(1)), eng)
    ps = tiny_prompts([10, 40, 23], seed=5)
    cache = eng.new_cache(len(ps), 128)
    last, _, cache, hidden = eng.prefill(cache, ps, hidden_layers=d.hidden_layers)
    assert hidden.shape[:2] == (3, 48) and hidden.shape[2] == len(d.hidden_layers) * CFG.dim
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    own, fed = d.init_state(ps, 128, first=first), d.init_state(ps, 128, first=first, hidden=hidden)
    assert np.allclose(np.asarray(own.h_last), np.asarray(fed.h_last), atol=1e-5)
    for r, p in enumerate(ps):
        for a, b in ((own.k, fed.k), (own.v, fed.v)):
            assert np.allclose(np.asarray(a[r, :, : len(p)]), np.asarray(b[r, :, : len(p)]), atol=1e-5)
    assert run(eng, SpeculativeDecoder(eng, d, 3), ps, 12, features=True) == run(eng, None, ps, 12)


def test_draft_steps_append_through_the_decode_kernel(eng):
    """With an appending `attention_decode` (pallas, interpreted on the CPU) a draft step writes its K/V and attends
    in that one kernel, and the catch-up on a verify's features runs as decode rows writing their window: the same
    drafts, draft distributions, head cache and hidden state as XLA's cache writes and attention."""
    from lucebox_jax.drafters.eagle import appending_decode
    from lucebox_jax.sampling import RowParams, SamplingParams

    ks = KernelSet.resolve("attention_decode=pallas")
    assert appending_decode(ks) == "pallas" and appending_decode(KS) is None and appending_decode(None) is None
    hc = EagleConfig.for_target(CFG)
    head = init_head(hc, jax.random.key(2))
    ps = tiny_prompts([10, 17, 5], seed=4)
    first = jnp.asarray([3, 9, 200], jnp.int32)
    start = jnp.asarray([len(p) for p in ps], jnp.int32)
    rp = RowParams.from_params([SamplingParams(temperature=0)] * 3)
    got = []
    for e in (eng, Engine(CFG, eng.weights, ks)):
        d = EagleDrafter(hc, head, e)
        st = d.init_state(ps, 64, first=first)
        drafts, q, st2 = jax.jit(lambda st, d=d: d.propose(d.params, st, first, first, start, rp, 4))(st)
        hidden = jax.random.normal(jax.random.key(9), (3, 5, len(d.hidden_layers) * CFG.dim), jnp.float32)
        toks = jnp.concatenate([first[:, None], drafts], axis=1)
        n = jnp.asarray([0, 2, 4], jnp.int32)
        caught = jax.jit(lambda st, d=d: d.absorb(d.params, st, hidden, toks, n, start))(st2)
        got.append((drafts, q, st2, caught))
    (d0, q0, s0, c0), (d1, q1, s1, c1) = got
    assert np.array_equal(np.asarray(d0), np.asarray(d1))
    assert np.allclose(np.asarray(q0), np.asarray(q1), atol=1e-5)
    for a, b in ((s0.k, s1.k), (s0.v, s1.v), (c0.k, c1.k), (c0.v, c1.v), (c0.h_last, c1.h_last)):
        assert np.allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_inference_layout_matches_the_training_layout():
    """The drafter holds the head's matrices [N, K] (`for_inference`, so a one-row product is one fused reduction on
    the GPU); the layer then computes what training's [K, N] arrays compute, for one row and for several."""
    from lucebox_jax.drafters.eagle import OutIn, _cached_layer, for_inference, fuse_features

    hc = EagleConfig.for_target(CFG)
    head = init_head(hc, jax.random.key(5))
    head = head.replace(wo=head.wo * 5.0, w_down=head.w_down * 5.0)  # (init scales them down: make them count)
    inf = for_inference(head, jnp.float32)
    assert isinstance(inf.wo, OutIn) and inf.wo.t.shape == head.wo.shape[::-1] and inf.ffn_norm.shape == (hc.dim,)
    rng = np.random.default_rng(1)
    for t in (1, 3):
        feats = jnp.asarray(rng.standard_normal((2, t, len(hc.feature_layers) * hc.dim)), jnp.float32)
        emb = jnp.asarray(rng.standard_normal((2, t, hc.dim)), jnp.float32)
        cache = tuple(jnp.asarray(rng.standard_normal((2, hc.n_kv_heads, 16, hc.head_dim)), jnp.float32)
                      for _ in range(2))
        start = jnp.asarray([4, 9], jnp.int32)
        outs = [_cached_layer(hc, w, cache, fuse_features(hc, w, feats), emb, start) for w in (head, inf)]
        (h0, (k0, v0)), (h1, (k1, v1)) = outs
        for a, b in ((h0, h1), (k0, k1), (v0, v1)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # the square wo left untransposed is a different layer (the check above can tell)
    bad = inf.replace(wo=OutIn(head.wo))
    h_bad, _ = _cached_layer(hc, bad, cache, fuse_features(hc, bad, feats), emb, start)
    assert not np.allclose(np.asarray(h_bad), np.asarray(h0), atol=1e-3)


def test_head_files_round_trip_and_bad_input(eng, tmp_path):
    hc = EagleConfig.for_target(CFG)
    h = init_head(hc, jax.random.key(2))
    save_head(str(tmp_path / "h"), hc, h, {"acceptance": 0.5})
    hc2, h2, meta = load_head(str(tmp_path / "h"))
    assert hc2 == hc and meta["acceptance"] == 0.5
    for a, b in zip(jax.tree.leaves(h), jax.tree.leaves(h2)):
        assert np.allclose(np.asarray(a), np.asarray(b), atol=2e-3 * float(np.abs(np.asarray(a)).max()) + 1e-3)
    d = build(f"eagle:{tmp_path / 'h'}", eng)
    assert d.name == "eagle:h" and d.hidden_layers == hc.feature_layers
    with pytest.raises(DraftError, match="no draft head"):
        build(f"eagle:{tmp_path / 'none'}", eng)
    (tmp_path / "h" / "head.msgpack").write_bytes(b"garbage")
    with pytest.raises(DraftError, match="cannot read"):
        build(f"eagle:{tmp_path / 'h'}", eng)
    save_head(str(tmp_path / "w"), EagleConfig.from_dict({**hc.to_dict(), "vocab_size": 999}), h)
    with pytest.raises(DraftError, match="vocabulary 999"):
        build(f"eagle:{tmp_path / 'w'}", eng)
    meta = json.loads((tmp_path / "w" / "eagle.json").read_text())
    meta["format"] = "other"
    (tmp_path / "w" / "eagle.json").write_text(json.dumps(meta))
    with pytest.raises(DraftError, match="format"):
        build(f"eagle:{tmp_path / 'w'}", eng)
    with pytest.raises(DraftError, match="model's name"):
        build("eagle", eng)


@pytest.mark.slow
def test_embedded_greedy_equal_with_a_head(smol, tmp_path):
    """`eagle:PATH` on SmolLM2-135M (real weights, an untrained head saved and loaded from its files): greedy output
    equals plain greedy output at batch 1 and 2, with a chain and with a tree."""
    hc = EagleConfig.for_target(smol.engine.cfg)
    save_head(str(tmp_path / "h"), hc, init_head(hc, jax.random.key(4)))
    from lucebox_jax import SamplingParams

    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    smol.spec = None
    ref = [o.outputs[0].token_ids for o in smol.generate(prompts, sp)]
    smol.spec = SpeculativeDecoder.create(smol.engine, f"eagle:{tmp_path / 'h'}", 4)
    try:
        assert [o.outputs[0].token_ids for o in smol.generate(prompts, sp)] == ref
        assert [o.outputs[0].token_ids for o in smol.generate(prompts[:1], sp)] == ref[:1]
        smol.spec = SpeculativeDecoder.create(smol.engine, f"eagle:{tmp_path / 'h'}", 4, tree=16)
        assert [o.outputs[0].token_ids for o in smol.generate(prompts, sp)] == ref
    finally:
        smol.spec = None


@pytest.mark.slow
def test_shipped_head_through_llm_with_phases(smol):
    """The shipped head through `LLM.generate` and `LLM.stream` (both start it from the prefill's hidden states):
    greedy tokens equal plain greedy; with time_phases the prefill, head-start and loop seconds are reported."""
    from lucebox_jax import SamplingParams

    prompt = smol.get_tokenizer().apply_chat_template([{"role": "user", "content": "Name three colours."}])
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    smol.spec = None
    ref = smol.generate(prompt, sp)[0].outputs[0].token_ids
    smol.spec = SpeculativeDecoder.create(smol.engine, "eagle", 4)
    smol.time_phases = smol.spec.time_phases = True
    try:
        assert smol.generate(prompt, sp)[0].outputs[0].token_ids == ref
        smol.generate(prompt, sp)  # (the first call's compiles land in the drafter's phase seconds)
        st = smol.last_stats
        sp_st = st["speculative"]
        assert 0 < st["prefill_seconds"] < st["seconds"] and sp_st["init_seconds"] > 0 and sp_st["loop_seconds"] > 0
        assert st["prefill_seconds"] + sp_st["init_seconds"] + sp_st["loop_seconds"] <= st["seconds"] + 1e-3
        assert sp_st["mean_accepted"] > 0  # the trained head: something is accepted on a chat prompt
        "".join(smol.stream(prompt, sp))
        assert smol.last_stats["token_ids"] == ref
    finally:
        smol.spec, smol.time_phases = None, False


def test_draft_vocabulary(eng, tmp_path):
    """A draft vocabulary (EAGLE-3's): the head's drafts come from its LM head's columns of those ids only. The whole
    vocabulary as one drafts what no vocabulary does; half of it drafts only its own ids (greedy and sampled, chain and
    tree; q is zero elsewhere) and stays lossless; the file is checked on load."""
    from lucebox_jax.drafters.eagle import VOCAB_FILE, load_draft_vocab
    from lucebox_jax.sampling import RowParams, SamplingParams

    hc = EagleConfig.for_target(CFG)
    head = init_head(hc, jax.random.key(5))
    ps = tiny_prompts([10, 17, 5], seed=6)
    first = jnp.asarray([3, 9, 200], jnp.int32)
    start = jnp.asarray([len(p) for p in ps], jnp.int32)
    half = np.sort(np.random.default_rng(0).choice(CFG.vocab_size, CFG.vocab_size // 2, replace=False)).astype(np.int32)
    rps = [RowParams.from_params([SamplingParams(temperature=t, seed=r) for r in range(3)]) for t in (0.0, 1.0)]
    out = {}
    for name, vocab in (("none", None), ("all", np.arange(CFG.vocab_size, dtype=np.int32)), ("half", half)):
        d = EagleDrafter(hc, head, eng, draft_vocab=vocab)
        assert d.draft_vocab_size == (None if vocab is None else len(vocab))
        st = d.init_state(ps, 64, first=first)
        out[name] = [jax.jit(lambda st, rp, d=d: d.propose(d.params, st, first, first, start, rp, 4))(st, rp)[:2]
                     for rp in rps]
        toks, *_ = jax.jit(lambda st, d=d: d.propose_tree(d.params, st, first, start, 3, 3))(st)
        out[name].append(toks)
    for (dn, qn), (da, qa) in zip(out["none"][:2], out["all"][:2]):
        assert np.array_equal(np.asarray(dn), np.asarray(da)) and np.allclose(np.asarray(qn), np.asarray(qa), atol=1e-5)
    assert np.array_equal(np.asarray(out["none"][2]), np.asarray(out["all"][2]))
    outside = np.ones(CFG.vocab_size, bool)
    outside[half] = False
    for drafts in (out["half"][0][0], out["half"][1][0], out["half"][2]):
        assert not outside[np.asarray(drafts)].any()
    assert not np.asarray(out["half"][1][1])[..., outside].any()  # the sampled drafts' q: zero outside the vocabulary
    assert not np.array_equal(np.asarray(out["none"][0][0]), np.asarray(out["half"][0][0]))  # it drafted otherwise
    d = EagleDrafter(hc, head, eng, draft_vocab=half)
    ref = run(eng, None, ps, 16)
    assert run(eng, SpeculativeDecoder(eng, d, 3), ps, 16) == ref
    assert run(eng, SpeculativeDecoder(eng, d, 3, tree=6), ps, 16) == ref
    assert load_draft_vocab(str(tmp_path), CFG.vocab_size) is None
    for bad in (half[::-1], np.asarray([0, CFG.vocab_size]), np.asarray([[1, 2]]), np.zeros(0, np.int32)):
        np.save(os.path.join(tmp_path, VOCAB_FILE), bad)
        with pytest.raises(DraftError, match="draft vocabulary|sorted distinct"):
            load_draft_vocab(str(tmp_path), CFG.vocab_size)
    np.save(os.path.join(tmp_path, VOCAB_FILE), half)
    assert np.array_equal(load_draft_vocab(str(tmp_path), CFG.vocab_size), half)
