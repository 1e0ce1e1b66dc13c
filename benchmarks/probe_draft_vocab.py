#!/usr/bin/env python3
"""What a draft vocabulary would cost in acceptance: the eagle head's drafts restricted to the V most frequent tokens.

EAGLE-3 drafts over a reduced vocabulary so that each draft step's LM head reads a fraction of the matrix (the
embedded model's int8 head is 576 x 49,152, ~28 MB a draft step). Before building that, this measures its price on
the CPU: the target continues the first --prompts training chat prompts (`train_draft.build_prompts`, never the
held-out ones) at temperatures 0 and 0.7, --tokens each; the tokens it writes, by frequency, then the rest by token
id (BPE merge order), make the draft vocabulary of the first V; then `train_draft --eval` runs with the head's logits
masked outside it (one process per V, each its own compile), against the unmasked head.

Usage: python benchmarks/probe_draft_vocab.py [--vocab 4096,8192,16384] [--prompts 200] [--k 5] [--tree 15]
Output: one JSON line per V (the --eval line, with "vocab"); the frequency table is $OUT/draft_vocab_freq.json
($OUT default /tmp), made once and reused while it exists.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def frequencies(n_prompts: int, tokens: int, path: str):
    from lucebox_jax import LLM, SamplingParams
    from lucebox_jax.train_draft import build_prompts

    llm = LLM()
    train, _ = build_prompts(llm.tokenizer, 640, 24)
    count = collections.Counter()
    for temp in (0.0, 0.7):
        outs = llm.generate([llm.tokenizer.decode(p) for p in train[:n_prompts]],
                            SamplingParams(temperature=temp, max_tokens=tokens, seed=1))
        for o in outs:
            count.update(o.outputs[0].token_ids)
    with open(path, "w") as f:
        json.dump(count.most_common(), f)
    print(f"{sum(count.values())} tokens, {len(count)} distinct", file=sys.stderr)


def eval_masked(vocab: int, freq_path: str, k: int, tree: int):
    """In a child process: `train_draft --eval` with head_logits masked to the first `vocab` tokens."""
    import jax.numpy as jnp
    import numpy as np

    import lucebox_jax.drafters.eagle as eagle
    from lucebox_jax.train_draft import main

    if vocab > 0:
        with open(freq_path) as f:
            freq = [t for t, _ in json.load(f)]
        size = eagle.load_head(eagle.shipped_head_dir("SmolLM2-135M-Instruct.Q4_1"))[0].vocab_size
        keep = list(dict.fromkeys(freq + list(range(size))))[:vocab]
        mask = np.full(size, -1e30, np.float32)
        mask[keep] = 0.0
        full = eagle.head_logits

        def head_logits(hc, hw, h, lm_head, kernels=None):
            return full(hc, hw, h, lm_head, kernels) + jnp.asarray(mask)

        eagle.head_logits = head_logits  # (looked up at call time by the drafter's steps)
    return main(["--eval", eagle.shipped_head_dir("SmolLM2-135M-Instruct.Q4_1"), "--k", str(k), "--tree", str(tree)])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="4096,8192,16384", help="draft vocabulary sizes (0: the whole vocabulary)")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tree", type=int, default=15)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    freq_path = os.path.join(os.environ.get("OUT", "/tmp"), "draft_vocab_freq.json")
    if args.child is not None:
        return eval_masked(args.child, freq_path, args.k, args.tree)
    if not os.path.exists(freq_path):
        frequencies(args.prompts, args.tokens, freq_path)
    for v in (int(x) for x in args.vocab.split(",")):
        out = subprocess.run([sys.executable, __file__, "--child", str(v), "--k", str(args.k), "--tree",
                              str(args.tree)], capture_output=True, text=True, check=True,
                             env={**os.environ, "LUCEBOX_DRAFT_VOCAB": "0"}).stdout  # the mask alone
        for line in out.splitlines():
            if line.startswith("{"):
                print(json.dumps({"vocab": v, **json.loads(line)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
