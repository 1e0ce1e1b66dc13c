"""Train an EAGLE-style draft head (drafters/eagle.py) by self-distillation:

    python -m lucebox_jax.train_draft --model X.gguf --out checkpoints/X-eagle

1. The target writes its own training data: continuations (greedy and sampled) of built-in chat and raw prompts
   (train_prompts.py), then one forward per batch for the hidden states of the head's feature layers.
2. The head trains with optax (AdamW, warmup + cosine) on a soft cross-entropy against the target's own next-token
   distribution (recomputed from the last layer's feature through the target's final norm and LM head), unrolled
   `--unroll` steps: step s feeds the head's own output of step s - 1 back, with the attention mask it will see when
   drafting (keys of true features up to the chain's start, then one key per earlier draft step), as EAGLE-3's
   training-time test does.
3. A resumable training state (`train_state.msgpack`) is saved every `--save-every` steps and at the end, beside
   the generated tokens (`train_data.npz`, reused by a resumed run with the same data settings); the head
   itself goes to `--out` (eagle.json + head.msgpack) with a held-out figure: mean accepted drafts per step of real
   greedy speculative decoding (K = 4) on prompts never trained on, and whether its output equals plain greedy.

`--time-budget` stops training early (the head is still saved) so one run fits a fixed slot on a GPU.
`--eval HEAD [HEAD ...]` trains nothing: it prints each existing head's held-out figure (JSON lines), so heads
trained in different runs compare on the same prompts (acceptance depends on the weights, not the device).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from .drafters.eagle import (USE_DRAFT_VOCAB, EagleConfig, EagleDrafter, HeadWeights, fuse_features, head_out,
                             head_qkv, init_head, load_draft_vocab, load_head, save_head)
from .engine import Engine, bucket
from .model import forward, init_cache, rms_norm
from .quant import dequantize
from .sampling import RowParams, SamplingParams

STATE_FILE = "train_state.msgpack"
DATA_FILE = "train_data.npz"  # the target's tokens, kept so a resumed run skips writing them again


# ---------------------------------------------------------------------------------------------------- data
def build_prompts(tokenizer, n_chat: int, n_raw: int, holdout_every: int = 10):
    """-> (train token lists, held-out chat token lists). Every `holdout_every`-th chat prompt is held out."""
    from .train_prompts import RAW_OPENINGS, chat_prompts

    chats = chat_prompts()
    if tokenizer.chat_template:
        render = lambda p: tokenizer.apply_chat_template([{"role": "user", "content": p}])  # noqa: E731
    else:
        render = lambda p: p  # noqa: E731
    held = [tokenizer.encode(render(p)) for i, p in enumerate(chats) if i % holdout_every == holdout_every - 1]
    train = [tokenizer.encode(render(p)) for i, p in enumerate(chats) if i % holdout_every != holdout_every - 1]
    raw = [tokenizer.encode(p) for p in RAW_OPENINGS]
    return train[:n_chat] + raw[:n_raw], held


def generate(engine: Engine, prompts, gen_len: int, seq_len: int, temps, batch: int, seed: int, progress=None):
    """The target's continuations: each prompt once per temperature. -> tokens [N, seq_len], valid mask [N, seq_len]
    (prompt + continuation, truncated to seq_len, right-padded)."""
    jobs = [(p, t, seed + i * len(temps) + j) for i, p in enumerate(prompts) for j, t in enumerate(temps)]
    toks = np.zeros((len(jobs), seq_len), np.int32)
    mask = np.zeros((len(jobs), seq_len), bool)
    for b0 in range(0, len(jobs), batch):
        chunk = jobs[b0: b0 + batch]
        chunk = chunk + [chunk[-1]] * (batch - len(chunk))  # one compiled shape
        ps = [p[: seq_len // 2] for p, _, _ in chunk]
        rp = RowParams.from_params([SamplingParams(temperature=t, seed=s) for _, t, s in chunk])
        cache = engine.new_cache(batch, engine.cache_len_for(max(map(len, ps)) + gen_len))
        last, _, cache = engine.prefill(cache, ps)
        seen = engine.new_seen(ps)
        first, seen = engine.first_token(last, rp, [len(p) for p in ps], seen)
        bufs, count, _, _ = engine.loop(cache, first, rp, seen, set(), np.full(batch, gen_len))
        out, count = np.asarray(bufs.tokens), np.asarray(count)
        for r in range(min(batch, len(jobs) - b0)):
            seq = (ps[r] + [int(t) for t in out[r, : count[r]]])[:seq_len]
            toks[b0 + r, : len(seq)] = seq
            mask[b0 + r, : len(seq)] = True
        if progress is not None:
            progress.update(min(batch, len(jobs) - b0))
    return toks, mask


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "layers"))
def _features(cfg, kernels, weights, toks, layers):
    b, t = toks.shape
    _, _, hidden = forward(cfg, kernels, weights, init_cache(cfg, b, t), toks, jnp.zeros((b,), jnp.int32),
                           last_only=jnp.zeros((b,), jnp.int32), hidden_layers=layers)
    return hidden.astype(jnp.bfloat16)


def features(engine: Engine, hc: EagleConfig, toks, batch: int):
    """Target hidden states of the feature layers for every sequence: [N, T, F * D] bfloat16 on device."""
    out = [_features(engine.cfg, engine.kernels, engine.weights, jnp.asarray(toks[i: i + batch]), hc.feature_layers)
           for i in range(0, len(toks), batch)]
    return jnp.concatenate(out, axis=0)


# ---------------------------------------------------------------------------------------------------- the loss
def _shift(x, n: int):
    """x [B, T, ...] -> x[:, t - n] at t (zeros for t < n)."""
    if n == 0:
        return x
    return jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))[:, : x.shape[1]]


def _unrolled_attention(hc: EagleConfig, q, keys, values, s: int):
    """Step s (0-based) query at position p: step-0 keys at positions <= p - s, and for each later step r = 1..s the
    one key step r computed at position p - (s - r) (the chain of draft steps leading to this one)."""
    b, t, hq, hd = q.shape
    hkv = hc.n_kv_heads
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, hd).astype(jnp.float32)
    scale = 1.0 / math.sqrt(hd)
    base = jnp.einsum("bthgd,bjhd->bhgtj", qg, keys[0].astype(jnp.float32)) * scale
    pos = jnp.arange(t)
    base = jnp.where((pos[None, :] <= pos[:, None] - s)[None, None, None], base, -1e30)
    diag = [jnp.einsum("bthgd,bthd->bhgt", qg, _shift(keys[r], s - r).astype(jnp.float32)) * scale
            for r in range(1, s + 1)]
    scores = jnp.concatenate([base] + [d[..., None] for d in diag], axis=-1)
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhgtj,bjhd->bthgd", p[..., :t], values[0].astype(jnp.float32))
    for r in range(1, s + 1):
        o = o + p[..., t + r - 1].transpose(0, 3, 1, 2)[..., None] * _shift(values[r], s - r).astype(
            jnp.float32)[:, :, :, None, :]
    return o.reshape(b, t, hq * hd).astype(q.dtype)


def unrolled_logits(hc: EagleConfig, head: HeadWeights, feats, toks, emb_table, lm_head, final_norm, unroll: int):
    """-> (target logits [B, T, V] at each position, [head logits of step s [B, T, V] for s in 0..unroll-1]).

    Step s at position p reads token toks[p + 1] and predicts the token at p + 2 (the target's distribution at
    position p + 1)."""
    d = hc.dim
    dt = lm_head.dtype
    nxt = jnp.concatenate([toks[:, 1:], toks[:, :1]], axis=1)
    emb = emb_table.lookup(nxt, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
    feats = feats.astype(jnp.float32)
    logits_of = lambda x: jnp.dot(x.astype(dt), lm_head, preferred_element_type=jnp.float32)  # noqa: E731
    target = logits_of(rms_norm(feats[..., -d:], final_norm, hc.rms_eps))
    g = fuse_features(hc, head, feats)
    keys, values, outs = [], [], []
    for s in range(unroll):
        q, k, v = head_qkv(hc, head, g, emb, positions)
        keys.append(k)
        values.append(v)
        h = head_out(hc, head, g, _unrolled_attention(hc, q, keys, values, s))
        outs.append(logits_of(rms_norm(h, head.out_norm, hc.rms_eps)))
        g = _shift(h, 1)
    return target, outs


def loss_fn(head, hc, feats, toks, mask, emb_table, lm_head, final_norm, unroll: int):
    """Mean over steps of the soft cross-entropy against the target; also top-1 agreement per step."""
    target, outs = unrolled_logits(hc, head, feats, toks, emb_table, lm_head, final_norm, unroll)
    p_t = jax.nn.softmax(_shift_left(target), axis=-1)  # target's distribution for the token at p + 2
    arg_t = jnp.argmax(_shift_left(target), axis=-1)
    t = toks.shape[1]
    pos = jnp.arange(t)[None, :]
    valid_next = _shift_left(mask.astype(jnp.float32)) * (pos < t - 1)  # position p + 1 is real
    total, accs = 0.0, []
    for s, lg in enumerate(outs):
        w = valid_next * (pos >= s)  # the chain starts at p - s >= 0
        ce = -jnp.sum(p_t * jax.nn.log_softmax(lg, axis=-1), axis=-1)
        total = total + jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
        accs.append(jnp.sum((jnp.argmax(lg, axis=-1) == arg_t) * w) / jnp.maximum(jnp.sum(w), 1.0))
    return total / len(outs), jnp.stack(accs)


def _shift_left(x):
    """x[:, p + 1] at p (the last position repeats; it is masked)."""
    return jnp.concatenate([x[:, 1:], x[:, -1:]], axis=1)


# ---------------------------------------------------------------------------------------------------- training
def make_optimizer(lr: float, steps: int, warmup: int):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1), lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))


def train(engine: Engine, hc: EagleConfig, feats, toks, mask, *, steps: int, batch: int, lr: float, unroll: int,
          seed: int = 0, out: str | None = None, save_every: int = 200, time_budget: float | None = None,
          head: HeadWeights | None = None, log=print):
    """Train a head; resumes from `out`/train_state.msgpack when present (out: the state folder). feats None: each
    step runs the target over its own batch for the features (`--stream-features`: memory does not grow with the
    data). -> (head, summary dict)."""
    import optax
    from tqdm import tqdm

    w = engine.weights
    dt = jnp.dtype(engine.cfg.dtype)
    lm_head = dequantize(w.head, dt)  # dense: the loss needs gradients through it (w.r.t. its input)
    opt = make_optimizer(lr, steps, min(100, steps // 10))
    head = head if head is not None else init_head(hc, jax.random.key(seed))
    state = {"head": head, "opt": opt.init(head), "step": 0}
    path = os.path.join(out, STATE_FILE) if out else None
    if path and os.path.isfile(path):
        with open(path, "rb") as f:
            state = serialization.from_bytes(state, f.read())
        log(f"resuming from {path} at step {int(state['step'])}")
    start_step = int(state["step"])

    @jax.jit
    def step_fn(head, opt_state, feats, toks_d, mask_d, idx, embed, lm_head, final_norm, weights):  # arrays as
        tb = toks_d[idx]  # arguments: never baked in as constants
        fb = feats[idx] if feats is not None else _features(engine.cfg, engine.kernels, weights, tb,
                                                             hc.feature_layers)
        (loss, accs), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            head, hc, fb, tb, mask_d[idx], embed, lm_head, final_norm, unroll)
        upd, opt_state = opt.update(grads, opt_state, head)
        return optax.apply_updates(head, upd), opt_state, loss, accs

    toks_d, mask_d = jnp.asarray(toks), jnp.asarray(mask)
    rng = np.random.default_rng(seed + 1)
    for _ in range(start_step):  # the same batches as an uninterrupted run
        rng.integers(0, len(toks), batch)
    head, opt_state = state["head"], state["opt"]
    t0 = time.perf_counter()
    bar = tqdm(range(start_step, steps), desc="train draft head", initial=start_step, total=steps, file=sys.stderr)
    loss = accs = None
    step = start_step
    for step in bar:
        idx = jnp.asarray(rng.integers(0, len(toks), batch))
        head, opt_state, loss, accs = step_fn(head, opt_state, feats, toks_d, mask_d, idx, w.embed, lm_head,
                                               w.final_norm, None if feats is not None else w)
        if step % 20 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{float(loss):.3f}", top1=" ".join(f"{float(a):.2f}" for a in accs))
        if path and (step + 1) % save_every == 0:
            _save_state(path, head, opt_state, step + 1)
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            log(f"time budget of {time_budget:.0f} s reached at step {step + 1} of {steps}")
            break
    bar.close()
    done = step + 1 if steps > start_step else start_step
    if path:
        _save_state(path, head, opt_state, done)
    summary = {"steps": done, "final_loss": None if loss is None else round(float(loss), 4),
               "train_top1_per_step": None if accs is None else [round(float(a), 3) for a in accs],
               "train_seconds": round(time.perf_counter() - t0, 1)}
    return head, summary


def save_data(path, key: str, toks, mask):
    tmp = path + ".tmp.npz"
    np.savez(tmp, toks=toks, mask=mask, key=np.array(key))
    os.replace(tmp, path)


def load_data(path, key: str):
    """The saved tokens if they were written with the same settings (`key`), else (None, None)."""
    if not os.path.isfile(path):
        return None, None
    with np.load(path) as d:
        if str(d["key"]) != key:
            return None, None
        return d["toks"], d["mask"]


def _save_state(path, head, opt_state, step):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(serialization.to_bytes({"head": head, "opt": opt_state, "step": step}))
    os.replace(tmp, path)


def heldout_acceptance(engine: Engine, hc: EagleConfig, head: HeadWeights, prompts, max_new: int, k: int = 4,
                       batch: int = 8, tree: int | None = None, tree_beam: int | None = None,
                       temperature: float = 0.0, draft_vocab=None) -> dict:
    """Speculative decoding with the head (a chain of k, or a tree of `tree` nodes) on held-out prompts: mean
    accepted drafts per step, and (greedy) whether the output equals plain greedy decoding token for token.
    temperature > 0 samples (row r seeded r) and skips the plain run."""
    from .speculative import SpeculativeDecoder

    spec = SpeculativeDecoder(engine, EagleDrafter(hc, head, engine, draft_vocab=draft_vocab), k, tree=tree,
                              tree_beam=tree_beam)
    hist, same, rows = None, 0, 0
    for i in range(0, len(prompts), batch):
        ps = prompts[i: i + batch]
        real = len(ps)
        ps = ps + [ps[-1]] * (batch - len(ps))  # one compiled shape; the padding rows are not counted
        rp = RowParams.from_params([SamplingParams(temperature=temperature, seed=i + r) for r in range(batch)])
        need = max(map(len, ps)) + max_new
        outs = []
        for s in (None, spec) if temperature == 0 else (spec,):
            cache = engine.new_cache(batch, s.cache_len(need) if s else engine.cache_len_for(need))
            last, _, cache = engine.prefill(cache, ps)
            seen = engine.new_seen(ps)
            first, seen = engine.first_token(last, rp, [len(p) for p in ps], seen)
            if s is None:
                bufs, count, _, _ = engine.loop(cache, first, rp, seen, set(), np.full(batch, max_new))
            else:
                bufs, count, _ = s.loop(cache, ps, first, rp, seen, set(), np.full(batch, max_new))
            outs.append(np.asarray(bufs.tokens)[:, :max_new])
        if temperature == 0:
            same += int(np.sum(np.all(outs[0][:real] == outs[1][:real], axis=1)))
        rows += real
        h = np.asarray(spec.last_stats["acceptance_histogram"])
        hist = h if hist is None else hist + h
    mean = float(np.dot(np.arange(len(hist)), hist) / max(1, hist.sum()))
    return {"k": k, "tree": tree, "tree_beam": spec.tree_width or None, "prompts": len(prompts),
            "mean_accepted": round(mean, 3),
            "tokens_per_step": round(mean + 1, 3),
            "histogram": hist.tolist(), "temperature": temperature,
            "greedy_equal_rows": f"{same}/{rows}" if temperature == 0 else None}


# ---------------------------------------------------------------------------------------------------- command
def evaluate_heads(engine: Engine, tokenizer, args, log) -> int:
    """`--eval`: each head's held-out figures on the same held-out prompts, one JSON line per head."""
    import json

    from .errors import LuceboxError

    _, held = build_prompts(tokenizer, args.chat_prompts, args.raw_prompts)
    held = held[: args.holdout]
    for folder in args.eval:
        try:
            hc, head, _ = load_head(folder)
        except LuceboxError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        t = args.eval_temperature
        dv = load_draft_vocab(folder, hc.vocab_size) if USE_DRAFT_VOCAB else None  # (as the `eagle` drafter reads it)
        row = {"head": folder, "chain": heldout_acceptance(engine, hc, head, held, args.holdout_tokens, k=args.k,
                                                           temperature=t, draft_vocab=dv)}
        if args.tree:
            row["tree"] = heldout_acceptance(engine, hc, head, held, args.holdout_tokens, k=args.k, tree=args.tree,
                                             tree_beam=args.tree_beam, temperature=t, draft_vocab=dv)
        row["draft_vocab"] = None if dv is None else len(dv)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        log(f"{folder}: {row['chain']['mean_accepted']} accepted drafts/step (chain)"
            + (f", {row['tree']['mean_accepted']} (tree of {args.tree})" if args.tree else ""))
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="python -m lucebox_jax.train_draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", default=None, help="target .gguf or checkpoint folder (default: embedded model)")
    p.add_argument("--out", default=None, help="folder for the head (eagle.json, head.msgpack) and train state")
    p.add_argument("--eval", nargs="+", default=None, metavar="HEAD",
                   help="train nothing: held-out acceptance of these head folders (a chain of --k drafts, and --tree)")
    p.add_argument("--eval-temperature", type=float, default=0.0, metavar="T",
                   help="--eval samples at temperature T (row r seeded r; no comparison with plain decoding)")
    p.add_argument("--k", type=int, default=4, help="drafts per step of the held-out figures (the tree's depth)")
    p.add_argument("--chat-prompts", type=int, default=640, help="built-in chat prompts to use (most 691)")
    p.add_argument("--raw-prompts", type=int, default=24)
    p.add_argument("--temps", default="0,0.7,1.0", help="each prompt is continued once per temperature")
    p.add_argument("--gen-len", type=int, default=224, help="tokens the target writes per prompt")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--stream-features", action="store_true",
                   help="run the target over each training batch for its features instead of keeping every "
                        "sequence's features on the device (sequences x seq-len x 3 x width x 2 bytes: 7 GB for 8,000 "
                        "sequences of the embedded model), so the data can grow past the device's memory")
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=40000,
                   help="training steps at most (default 40000: --time-budget usually ends it first)")
    p.add_argument("--batch", type=int, default=16, help="sequences per training step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--unroll", type=int, default=4,
                   help="draft steps unrolled in training; draft with K <= this (a later step is untrained)")
    p.add_argument("--ffn-mult", type=float, default=2.0, help="head MLP width / model width")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--state-dir", default=None, help="folder of the resumable train_state.msgpack (default: --out)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds of training at most")
    p.add_argument("--holdout", type=int, default=24, help="held-out chat prompts for the acceptance figure")
    p.add_argument("--holdout-tokens", type=int, default=96)
    p.add_argument("--tree", type=int, default=32, help="also measure held-out acceptance with a tree of N nodes "
                                                          "(0: chain only)")
    p.add_argument("--tree-beam", type=int, default=None, metavar="W",
                   help="the tree's beam width (default N // K): the tree is the N best of what it drafts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", default=None)
    return p


def main(argv=None) -> int:
    from tqdm import tqdm

    from .errors import LuceboxError
    from .loader import load_model, model_name
    from .ops import KernelSet
    from .tokenizer import Tokenizer

    args = build_parser().parse_args(argv)
    t_all = time.perf_counter()
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    try:
        cfg, weights, tok_meta, source = load_model(args.model)
        temps = [float(t) for t in args.temps.split(",")]
    except (LuceboxError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_gguf_metadata(tok_meta)
    engine = Engine(cfg, weights, KernelSet.resolve(args.kernels))
    if args.eval:
        return evaluate_heads(engine, tokenizer, args, log)
    if not args.out:
        print("error: --out FOLDER is needed to train (or --eval HEAD ... to evaluate heads)", file=sys.stderr)
        return 2
    hc = EagleConfig.for_target(cfg, args.ffn_mult)
    log(f"target {source}: {cfg.n_layers} layers, width {cfg.dim}; head features from layers {hc.feature_layers}")
    train_ps, held = build_prompts(tokenizer, args.chat_prompts, args.raw_prompts)
    held = held[: args.holdout]
    t0 = time.perf_counter()
    folder = args.state_dir or args.out
    os.makedirs(folder, exist_ok=True)
    data_key = repr((model_name(args.model), len(train_ps), temps, args.gen_len, args.seq_len, args.gen_batch,
                     args.seed, args.chat_prompts, args.raw_prompts, args.kernels))
    toks, mask = load_data(os.path.join(folder, DATA_FILE), data_key)
    if toks is None:
        with tqdm(total=len(train_ps) * len(temps), desc="target writes data", file=sys.stderr) as bar:
            toks, mask = generate(engine, train_ps, args.gen_len, args.seq_len, temps, args.gen_batch, args.seed,
                                  bar)
        save_data(os.path.join(folder, DATA_FILE), data_key, toks, mask)
    else:
        log(f"data: reused from {os.path.join(folder, DATA_FILE)} (same settings)")
    feats = None if args.stream_features else features(
        engine, hc, toks, max(1, min(args.gen_batch, 4096 // bucket(args.seq_len, (16, 64, 256, 1024)))))
    gen_s = time.perf_counter() - t0
    log(f"data: {len(toks)} sequences, {int(mask.sum())} tokens, features "
        f"{'computed per training step' if feats is None else tuple(feats.shape)} in {gen_s:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    head, summary = train(engine, hc, feats, toks, mask, steps=args.steps, batch=args.batch, lr=args.lr,
                          unroll=args.unroll, seed=args.seed, out=folder,
                          save_every=args.save_every,
                          time_budget=args.time_budget, log=log)
    del feats
    info = {"target": model_name(args.model), "target_source": source, "data_sequences": len(toks),
            "data_tokens": int(mask.sum()), "data_seconds": round(gen_s, 1), "unroll": args.unroll,
            "training": summary}
    save_head(args.out, hc, head, info)  # first without the held-out figures: a cut evaluation loses no head
    acc = heldout_acceptance(engine, hc, head, held, args.holdout_tokens, k=args.k) if held else {}
    acc_tree = heldout_acceptance(engine, hc, head, held, args.holdout_tokens, k=args.k, tree=args.tree) if (
        held and args.tree) else {}
    info.update(heldout=acc, heldout_tree=acc_tree)
    save_head(args.out, hc, head, info)
    log(f"head saved to {args.out} ({sum(int(np.prod(x.shape)) for x in jax.tree.leaves(head)) / 1e6:.2f} M "
        f"parameters); training {summary}")
    if acc:
        log(f"held-out ({acc['prompts']} chat prompts, greedy, K={acc['k']}): mean accepted "
            f"{acc['mean_accepted']:.2f} drafts/step, {acc['tokens_per_step']:.2f} tokens/step, histogram "
            f"{acc['histogram']}, output equal to plain greedy in {acc['greedy_equal_rows']} rows")
    if acc_tree:
        log(f"held-out with a tree of {args.tree} nodes: mean accepted {acc_tree['mean_accepted']:.2f} drafts/step, "
            f"histogram {acc_tree['histogram']}, equal to plain greedy in {acc_tree['greedy_equal_rows']} rows")
    log(f"total {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
