"""Writes tiny random GGUF models with the `gguf` library: a byte-level GPT-2-style tokenizer (256 byte tokens + a
few ChatML specials, no merges), a chat template, and tensors of whatever GGUF types a test asks for. Used to test
the importer (every type, every architecture) and to run the engine end to end on a mock model."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokens() -> list[str]:
    """The 256 byte-level tokens of GPT-2 BPE, in byte order."""
    from lucebox_jax.tokenizer import _bytes_to_unicode

    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


# byte offsets of the float16 super-block scales in the block types gguf can only dequantize
F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
              "IQ4_XS": (0,)}


def quantized_bytes(arr: np.ndarray, kind: str, rng) -> np.ndarray:
    """Raw GGUF blocks [out, bytes] of type `kind` for a float32 [out, in] array: gguf.quants.quantize where gguf
    implements it, else random bytes (every bit pattern is a valid block) with sane random float16 scales scaled to
    `arr`'s magnitude, so gguf.quants.dequantize is the reference either way."""
    qt = T[kind]
    try:
        return gguf.quants.quantize(arr, qt)
    except NotImplementedError:
        pass
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    out, n_in = arr.shape
    raw = rng.integers(0, 256, (out, n_in // block, nbytes), dtype=np.uint8)
    amp = float(np.abs(arr).max()) / 64
    for off in F16_FIELDS[kind]:
        d = (rng.uniform(0.25, 1.0, raw.shape[:2]) * amp).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(out, -1)


def fake_tensor(kind: str, out: int = 48, n_in: int = 512, seed: int = 0):
    """A GGUFReader-like tensor of type `kind` (name, tensor_type, data, shape) for an [out, in] weight, built by
    `quantized_bytes`, and its reference values float32 [out, in] from gguf.quants.dequantize."""
    import types

    rng = np.random.default_rng(seed)
    arr = (rng.standard_normal((out, n_in)) * n_in ** -0.5).astype(np.float32)
    raw = quantized_bytes(arr, kind, rng)
    t = types.SimpleNamespace(name=f"blk.0.test_{kind}.weight", tensor_type=T[kind], data=raw, shape=(n_in, out))
    return t, gguf.quants.dequantize(raw, T[kind])


def write_tiny_gguf(path, arch: str = "llama", types: dict | None = None, tied: bool = True, seed: int = 0,
                    dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv: int = 2, ffn: int = 128,
                    default_type: str = "Q4_1", emb_type: str = "Q8_0", context: int = 256) -> dict:
    """Write a tiny model; `types` maps a tensor-name suffix (e.g. "attn_q") to a GGUF type name.
    Returns {tensor name: float32 array [out, in] as written (before quantization)}."""
    rng = np.random.default_rng(seed)
    types = types or {}
    tokens = byte_tokens() + SPECIALS
    vocab = len(tokens)
    hd = dim // n_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(256 + SPECIALS.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    written = {}

    def add(name, shape_out_in, kind):
        arr = (rng.standard_normal(shape_out_in) * (shape_out_in[-1] ** -0.5)).astype(np.float32)
        qt = T[kind]
        if kind == "F32":
            w.add_tensor(name, arr)
        elif kind == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            q = quantized_bytes(arr, kind, rng)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
            arr = gguf.quants.dequantize(q, qt)
        written[name] = arr

    def norm(name, n):
        arr = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, arr)
        written[name] = arr

    add("token_embd.weight", (vocab, dim), emb_type)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", dim)
        norm(p + "ffn_norm.weight", dim)
        for n, shape in (("attn_q", (n_heads * hd, dim)), ("attn_k", (n_kv * hd, dim)), ("attn_v", (n_kv * hd, dim)),
                         ("attn_output", (dim, n_heads * hd)), ("ffn_gate", (ffn, dim)), ("ffn_up", (ffn, dim)),
                         ("ffn_down", (dim, ffn))):
            add(p + n + ".weight", shape, types.get(n, default_type))
        if arch == "qwen2":
            for n, size in (("attn_q", n_heads * hd), ("attn_k", n_kv * hd), ("attn_v", n_kv * hd)):
                arr = (0.1 * rng.standard_normal(size)).astype(np.float32)
                w.add_tensor(p + n + ".bias", arr)
                written[p + n + ".bias"] = arr
        if arch == "qwen3":
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
    norm("output_norm.weight", dim)
    if not tied:
        add("output.weight", (vocab, dim), types.get("output", default_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
