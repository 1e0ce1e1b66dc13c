"""Degenerate model metadata (issue 12) is refused as UnsupportedModelError, never a ZeroDivisionError or a shape
error inside jit: zero or non-dividing heads, odd head sizes, non-numeric fields, tensors whose shapes disagree."""

import pytest

from gguf_factory import write_tiny_gguf
from lucebox_jax.errors import UnsupportedModelError
from lucebox_jax.gguf_loader import check_shapes, config_from_metadata, open_reader, read_metadata

BASE = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.block_count": 2, "llama.feed_forward_length": 128,
        "llama.context_length": 256, "llama.vocab_size": 259}


def test_valid_metadata_passes():
    cfg = config_from_metadata(dict(BASE))
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 2, 16)


@pytest.mark.parametrize("change, msg", [
    ({"llama.attention.head_count": 0}, "attention heads"),
    ({"llama.attention.head_count_kv": 0}, "head_count_kv"),
    ({"llama.attention.head_count_kv": 3}, "do not divide"),
    ({"llama.embedding_length": 66}, "not a multiple"),
    ({"llama.block_count": 0}, "block_count"),
    ({"llama.feed_forward_length": -5}, "feed_forward_length"),
    ({"llama.context_length": 1}, "context_length"),
    ({"llama.attention.key_length": 15}, "odd"),
    ({"llama.attention.head_count": "four"}, "not a number"),
    ({"llama.block_count": 2.5}, "not a number"),
    ({"llama.rope.freq_base": -1.0}, "freq_base"),
    ({"llama.vocab_size": 0, "tokenizer.ggml.tokens": []}, "vocabulary"),
])
def test_degenerate_metadata_refused(change, msg):
    with pytest.raises(UnsupportedModelError, match=msg):
        config_from_metadata({**BASE, **change})


def test_tensor_shapes_must_match_the_metadata(tmp_path):
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path)
    r = open_reader(str(path))
    cfg = config_from_metadata(read_metadata(r))
    tensors = {t.name: t for t in r.tensors}
    check_shapes(cfg, tensors)
    with pytest.raises(UnsupportedModelError, match="attn_k.weight has shape"):
        check_shapes(cfg.replace(n_kv_heads=4), tensors)
    with pytest.raises(UnsupportedModelError, match="ffn_gate.weight has shape"):
        check_shapes(cfg.replace(ffn_dim=96), tensors)
