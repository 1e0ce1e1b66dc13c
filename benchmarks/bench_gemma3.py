"""Gemma 3 270M decode speed, ours against Hugging Face transformers, at the same shapes in one call (issue 14).

Both run random weights at the real shapes (the 253 MB GGUF does not travel to the GPU machine; speed does not depend
on weight values), greedy, a prompt of P = 128 tokens then N = 256 new ones, batch 1 and 32:

* ours: `bench_decode.py --models gemma3_270m --ctx 128 --tokens 256` (the on-device generation loop, default GPU
  kernels, int8 g32 linear layers as the Q4_K_M file imports, int8 embedding and head);
* transformers: `Gemma3ForCausalLM` from a `Gemma3TextConfig` at 270M shapes, bf16, `generate` with
  `cache_implementation="static"` (transformers compiles the decode step itself), decode tok/s =
  B * (N - 1) / (t(generate N) - t(generate 1)), medians of 3, as benchmarks/bench_batch.py's peer does.

Each side runs in its own subprocess with a time cap. Writes $OUT/bench_gemma3.json and $OUT/bench_gemma3.md.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_gemma3.py            # H200, ~3-4 minutes
    python benchmarks/bench_gemma3.py --small                         # CPU smoke run (tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
P, N = 128, 256
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                   query_pre_attn_scalar=256, max_position_embeddings=32768, tie_word_embeddings=True)
SMALL = dict(GEMMA3_270M, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             head_dim=16, sliding_window=8)


def hf_worker(batches: list[int], small: bool, path: str) -> None:
    """Writes `path` after each batch, so a time cap loses only the batch it cut."""
    import torch
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p, n = (8, 6) if small else (P, N)
    cfg = Gemma3TextConfig(**(SMALL if small else GEMMA3_270M), bos_token_id=None, eos_token_id=None,
                           pad_token_id=None)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).to(device=dev, dtype=torch.bfloat16).eval()
    gc = model.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id, gc.do_sample = None, None, 0, False
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "device": dev,
           "n_params": sum(x.numel() for x in model.parameters()),
           "layer_types": list(getattr(cfg, "layer_types", []) or []), "runs": {}}

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, p), device=dev)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, cache_implementation="static")

        def gen(k):
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                o = model.generate(ids, max_new_tokens=k, **kw)
            sync()
            return time.perf_counter() - t, o

        try:
            warm = [round(gen(n)[0], 2) for _ in range(2)]  # the first call compiles
            t1 = statistics.median(gen(1)[0] for _ in range(3))
            runs = [gen(n) for _ in range(3)]
            tn = statistics.median(t for t, _ in runs)
            assert runs[-1][1].shape[1] == p + n
            out["runs"][str(b)] = dict(batch=b, warmup_s=warm, generate_1_s=t1, generate_n_s=tn,
                                       decode_tok_s=b * (n - 1) / (tn - t1), ms_per_step=(tn - t1) / (n - 1) * 1e3)
        except Exception as e:  # noqa: BLE001 - keep the other batch
            out["runs"][str(b)] = {"batch": b, "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(out["runs"][str(b)]), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def run_capped(cmd: list[str], cap: int, env: dict) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=cap, env=env)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {cap} s\n{(e.stdout or b'')[-2000:]!r}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--cap", default="120,120", help="seconds allowed to ours, transformers")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_gemma3_")
    if args.hf_worker:
        hf_worker(batches, args.small, os.path.join(out_dir, "hf_gemma3.json"))
        return
    env = dict(os.environ, OUT=out_dir)
    ours_cmd = [sys.executable, os.path.join(HERE, "bench_decode.py")] + (
        ["--small"] if args.small else
        ["--models", "gemma3_270m", "--batches", args.batches, "--ctx", str(P), "--tokens", str(N), "--reps", "3",
         "--linear-bits", "8", "--kernel-sets", "qmatmul=pallas"])
    t0 = time.time()
    cap_ours, cap_hf = (int(x) for x in args.cap.split(","))
    rc_ours, log_ours = run_capped(ours_cmd, cap_ours, env)
    print(log_ours[-3000:], flush=True)
    rc_hf, log_hf = run_capped([sys.executable, __file__, "--hf-worker", "--batches", args.batches]
                               + (["--small"] if args.small else []), cap_hf, env)
    print(log_hf[-3000:], flush=True)

    def load(name):
        try:
            with open(os.path.join(out_dir, name)) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return {}

    ours, hf = load("bench_decode.json"), load("hf_gemma3.json")
    result = {"shapes": {"prompt": P, "new_tokens": N, "small": args.small}, "ours": ours, "transformers": hf,
              "rc": {"ours": rc_ours, "transformers": rc_hf}, "wall_s": round(time.time() - t0, 1)}
    with open(os.path.join(out_dir, "bench_gemma3.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"Gemma 3 270M decode (random weights, prompt {P}, {N} new tokens), {ours.get('device', '?')}", "",
             "| batch | lucebox_jax tok/s | transformers static+compile tok/s | ratio |", "| --- | --- | --- | --- |"]
    for b in batches:
        mine = next((r.get("tok_s") for r in ours.get("rows", []) if r.get("batch") == b and "tok_s" in r), None)
        peer = hf.get("runs", {}).get(str(b), {}).get("decode_tok_s")
        ratio = f"{mine / peer:.2f}x" if mine and peer else "-"
        lines.append(f"| {b} | {mine and round(mine)} | {peer and round(peer)} | {ratio} |")
    md = "\n".join(lines)
    with open(os.path.join(out_dir, "bench_gemma3.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    print(f"results: {out_dir}/bench_gemma3.json")


if __name__ == "__main__":
    main()
