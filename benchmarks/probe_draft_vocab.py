#!/usr/bin/env python3
"""What a draft vocabulary costs in acceptance, and the command that makes one (`draft_vocab.npy` beside a head).

EAGLE-3 drafts over a reduced vocabulary so that each draft step's LM head reads a fraction of the matrix (the
embedded model's int8 head is 576 x 49,152, ~28 MB a draft step). The target continues the first --prompts training
chat prompts (`train_draft.build_prompts`, never the held-out ones) at temperatures 0 and 0.7, --tokens each; the
tokens it writes, by frequency, then the rest by token id (BPE merge order), make the draft vocabulary of the first V.
Each V's held-out acceptance (`train_draft.heldout_acceptance`, the same prompts and figures as `--eval`) runs
through the drafter's own draft vocabulary, against the whole vocabulary (V = 0).

Usage: python benchmarks/probe_draft_vocab.py [--vocab 0,4096,8192,16384] [--prompts 200] [--k 5] [--tree 15]
       python benchmarks/probe_draft_vocab.py --vocab 16384 --write checkpoints/SmolLM2-135M-Instruct.Q4_1-eagle
Output: one JSON line per V; the frequency table is $OUT/draft_vocab_freq.json ($OUT default /tmp), made once and
reused while it exists; --write FOLDER writes the first V's list there instead of measuring.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lucebox_jax import LLM, SamplingParams  # noqa: E402
from lucebox_jax.drafters.eagle import VOCAB_FILE, load_head, shipped_head_dir  # noqa: E402
from lucebox_jax.train_draft import build_prompts, heldout_acceptance  # noqa: E402


def frequencies(llm, n_prompts: int, tokens: int, path: str) -> list[int]:
    """Token ids by how often the target writes them (made once into `path`, then read from it)."""
    if not os.path.exists(path):
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
    with open(path) as f:
        return [t for t, _ in json.load(f)]


def draft_vocab(freq: list[int], vocab_size: int, n: int) -> np.ndarray:
    """The n most frequent ids, then the rest by id, sorted (the file's format)."""
    return np.asarray(sorted(list(dict.fromkeys(freq + list(range(vocab_size))))[:n]), np.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="0,4096,8192,16384", help="draft vocabulary sizes (0: the whole vocabulary)")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tree", type=int, default=15)
    ap.add_argument("--write", default=None, metavar="FOLDER",
                    help=f"write the first --vocab size's list as FOLDER/{VOCAB_FILE}")
    args = ap.parse_args()
    llm = LLM()
    freq = frequencies(llm, args.prompts, args.tokens, os.path.join(os.environ.get("OUT", "/tmp"),
                                                                    "draft_vocab_freq.json"))
    sizes = [int(x) for x in args.vocab.split(",")]
    vocab_size = llm.engine.cfg.vocab_size
    if args.write:
        np.save(os.path.join(args.write, VOCAB_FILE), draft_vocab(freq, vocab_size, sizes[0]))
        return 0
    hc, head, _ = load_head(shipped_head_dir(llm.engine.model_name))
    _, held = build_prompts(llm.tokenizer, 640, 24)
    for v in sizes:
        ids = draft_vocab(freq, vocab_size, v) if v else None
        row = {"vocab": v or vocab_size}
        for name, tree in (("chain", None), ("tree", args.tree)):
            row[name] = heldout_acceptance(llm.engine, hc, head, held[:24], 96, k=args.k, tree=tree, draft_vocab=ids)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
