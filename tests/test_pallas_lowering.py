"""Every Pallas-Triton kernel lowered for a CUDA target on the CPU, for an abstract H200 (no GPU needed).

Interpret mode runs any block shape; the Triton lowering does not (e.g. non-power-of-two tiles). Lowering the
GPU configurations the engine would pick (the tuned table and heuristics, asm decode included) at the model shapes
we ship or benchmark makes such errors fail in CI instead of on the GPU. Compilation to PTX needs the device and is
left to the `gpu`-marked tests.
"""

from __future__ import annotations

import contextlib

import pytest

import jax
import jax.numpy as jnp

from lucebox_jax.quant import Int8Array, QuantArray
from pallas_kernels.attention_decode import attention_decode_pallas
from pallas_kernels.attention_prefill import attention_prefill_pallas
from pallas_kernels.attention_tree import attention_tree
from pallas_kernels.int4_gemv import gemv_default_config, int4_gemv
from pallas_kernels.int4_matmul import int4_matmul, qmatmul_pallas
from pallas_kernels.int8_matmul import int8_matmul, qmatmul8_pallas

SDS = jax.ShapeDtypeStruct


@contextlib.contextmanager
def abstract_h200():
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
        yield


def lower_cuda(fn, *args) -> str:
    with abstract_h200():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _quant(k, n, g, sym):
    return QuantArray(codes=SDS((k // 2, n), jnp.uint8), scales=SDS((k // g, n), jnp.float16),
                      mins=None if sym else SDS((k // g, n), jnp.float16), group_size=g)


# (K, N): SmolLM2-135M (the embedded model) and Llama-3-8B layer shapes
INT4_SHAPES = [(576, 1728), (576, 576), (576, 3072), (1536, 576), (4096, 6144), (4096, 4096), (4096, 28672),
               (14336, 4096)]


@pytest.mark.parametrize("m", [1, 4, 16, 40])
@pytest.mark.parametrize("g,sym", [(32, False), (128, True)])
@pytest.mark.parametrize("k,n", INT4_SHAPES)
def test_int4_default_configs_lower(k, n, g, sym, m):
    if (k // 2) % g:
        pytest.skip("group does not divide K/2 (the registry sends this to XLA)")
    w = _quant(k, n, g, sym)
    txt = lower_cuda(lambda x, w: qmatmul_pallas(x, w, interpret=False), SDS((m, k), jnp.bfloat16), w)
    assert "xla.gpu.triton" in txt


@pytest.mark.parametrize("kw", [dict(mode="fma", decode="f32"), dict(mode="fma_r", block_k=64),
                                dict(mode="dot_t", block_k=128, block_n=64), dict(reduce="atomic", block_k=64),
                                dict(block_k=128, block_n=64, scales_mode="gather"),
                                dict(mode="fma", block_k=128, block_n=64, split_k=1 << 12),
                                dict(mode="fma", block_k=128, block_n=32, num_warps=2),
                                dict(block_k=256, block_n=32, num_stages=3),
                                dict(mode="fma", decode="asm_fma", block_k=128, block_n=64),
                                dict(mode="fma", decode="asm_fma", block_k=32, block_n=128, split_k=1 << 12)])
def test_int4_variants_lower(kw):
    k, n, g = 1024, 1000, 32
    args = (SDS((1, k), jnp.bfloat16), SDS((k // 2, n), jnp.uint8), SDS((k // g, n), jnp.float16),
            SDS((k // g, n), jnp.float16))
    kw = dict(dict(decode="asm"), **kw)
    txt = lower_cuda(lambda x, c, s, mn: int4_matmul(x, c, s, mn, group_size=g, **kw), *args)
    assert "xla.gpu.triton" in txt


@pytest.mark.parametrize("kw", [{}, dict(prefetch=False), dict(xsum="inside"), dict(scales_nk=True),
                                dict(block_n=256, num_warps=4, groups_per_step=4)])
@pytest.mark.parametrize("m,g,sym", [(1, 32, False), (1, 128, True), (3, 32, True)])
@pytest.mark.parametrize("k,n", [(576, 1728), (4096, 28672), (14336, 4096)])
def test_int4_gemv_lowers(k, n, m, g, sym, kw):
    """The K-major GEMV (asm decode + FMA) at the benchmarked shapes, default knobs and each code-path knob."""
    if k % g:
        pytest.skip("group does not divide K")
    cfg = dict(gemv_default_config(m, k, n, g), **kw)
    nk = cfg.get("scales_nk", False)
    sshape = (n, k // g) if nk else (k // g, n)
    args = (SDS((m, k), jnp.bfloat16), SDS((n, k // 2), jnp.uint8), SDS(sshape, jnp.float16),
            None if sym else SDS(sshape, jnp.float16))
    txt = lower_cuda(lambda x, c, s, mn: int4_gemv(x, c, s, mn, group_size=g, **cfg), *args)
    assert "xla.gpu.triton" in txt


@pytest.mark.parametrize("m,k,n", [(1, 576, 49152), (8, 4096, 128256), (16, 1536, 1000)])
def test_int8_default_config_lowers(m, k, n):
    w = Int8Array(codes=SDS((k, n), jnp.int8), scales=SDS((k // 32, n), jnp.float16), group_size=32)
    txt = lower_cuda(lambda x, w: qmatmul8_pallas(x, w, interpret=False), SDS((m, k), jnp.bfloat16), w)
    assert "xla.gpu.triton" in txt


# the formats exact GGUF imports produce (gguf_quants.py) at Gemma 3 270M's shapes: group 16 (Q6_K/Q2_K/Q3_K),
# float32 scales (K-quants), int8 with mins (Q5_K/Q5_1: kernel + mins_term)
@pytest.mark.parametrize("m", [1, 4, 40])
@pytest.mark.parametrize("g,sym", [(32, False), (16, True), (16, False)])
@pytest.mark.parametrize("k,n", [(1024, 640), (2048, 640)])
def test_int4_gguf_formats_lower(k, n, g, sym, m):
    w = QuantArray(codes=SDS((k // 2, n), jnp.uint8), scales=SDS((k // g, n), jnp.float32),
                   mins=None if sym else SDS((k // g, n), jnp.float32), group_size=g)
    txt = lower_cuda(lambda x, w: qmatmul_pallas(x, w, interpret=False), SDS((m, k), jnp.bfloat16), w)
    assert "xla.gpu.triton" in txt


@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.parametrize("k,n,g,sdt,mins", [(2048, 640, 16, jnp.float32, False), (1024, 640, 32, jnp.float32, True),
                                             (640, 1536, 32, jnp.float16, False), (640, 262144, 32, jnp.float16,
                                                                                   False)])
def test_int8_gguf_formats_lower(k, n, g, sdt, mins, m):
    w = Int8Array(codes=SDS((k, n), jnp.int8), scales=SDS((k // g, n), sdt),
                  mins=SDS((k // g, n), sdt) if mins else None, group_size=g)
    txt = lower_cuda(lambda x, w: qmatmul8_pallas(x, w, interpret=False), SDS((m, k), jnp.bfloat16), w)
    assert "xla.gpu.triton" in txt


def test_lowering_catches_a_bad_tile():
    """The reason this file exists: a non-power-of-two tile runs in interpret mode but cannot lower."""
    args = (SDS((1, 256), jnp.bfloat16), SDS((256, 300), jnp.int8), SDS((8, 300), jnp.float16))
    with pytest.raises(ValueError, match="power of 2"):
        lower_cuda(lambda x, c, s: int8_matmul(x, c, s, group_size=32, block_n=96), *args)


@pytest.mark.parametrize("b,hq,hkv,s,d", [(1, 9, 3, 8192, 64), (8, 32, 8, 4096, 128), (3, 32, 8, 32768, 128)])
@pytest.mark.parametrize("combine", ["xla", "kernel"])
def test_attention_decode_lowers(b, hq, hkv, s, d, combine):
    args = (SDS((b, hq, d), jnp.bfloat16), SDS((b, hkv, s, d), jnp.bfloat16), SDS((b, hkv, s, d), jnp.bfloat16),
            SDS((b,), jnp.int32))
    txt = lower_cuda(lambda q, k, v, n: attention_decode_pallas(q, k, v, n, scale=d ** -0.5, interpret=False,
                                                                combine=combine), *args)
    assert txt.count("xla.gpu.triton") == (2 if combine == "kernel" else 1)  # the combine: a second kernel


@pytest.mark.parametrize("b,hq,hkv,s,d,parts,inter", [
    (1, 9, 3, 8192, 64, (9,), True), (8, 32, 8, 4096, 128, (6,), False), (1, 4, 1, 1024, 256, (4, 1), False)])
def test_attention_decode_with_the_qkv_prologue_lowers(b, hq, hkv, s, d, parts, inter):
    """The kernel summing qkv partials, norming and rotating on its loads (`prologue`; its partner columns a
    gathered load): one Triton kernel and the split merge, the caches aliased through."""
    ps = [SDS((p, b, hq + 2 * hkv, d), jnp.float32) for p in parts]
    args = (*ps, SDS((b, hkv, s, d), jnp.bfloat16), SDS((b, hkv, s, d), jnp.bfloat16), SDS((b,), jnp.int32),
            SDS((b,), jnp.float32), SDS((b, d), jnp.float32), SDS((b, d), jnp.float32), SDS((d,), jnp.float32),
            SDS((d,), jnp.float32))

    def fn(*a):
        *ps, k, v, n, ss, cos, sin, qn, kn = a
        pro = dict(parts=tuple(ps[1:]), row_sumsq=ss, cos=cos, sin=sin, q_norm=qn, k_norm=kn)
        return attention_decode_pallas(ps[0], k, v, n, scale=d ** -0.5, interpret=False, append=True, prologue=pro,
                                       prologue_eps=1e-6, prologue_dim=2048, rope_interleaved=inter)
    assert lower_cuda(fn, *args).count("xla.gpu.triton") == 2


@pytest.mark.parametrize("in_cache", [False, True])
@pytest.mark.parametrize("b,t,hq,hkv,s,d", [(1, 33, 9, 3, 2048, 64), (1, 33, 32, 8, 2048, 128),
                                            (4, 9, 32, 8, 4096, 128), (1, 17, 9, 3, 512, 64)])
def test_attention_tree_lowers(b, t, hq, hkv, s, d, in_cache):
    """in_cache: the window read from the cache with each node's ancestors as mask bits (one word up to 32 window
    slots, two up to 64): one Triton kernel and its split merge, no window einsum."""
    args = (SDS((b, t, hq, d), jnp.bfloat16), SDS((b, hkv, s, d), jnp.bfloat16), SDS((b, hkv, s, d), jnp.bfloat16),
            SDS((b,), jnp.int32), SDS((b, t, hkv, d), jnp.bfloat16), SDS((b, t, hkv, d), jnp.bfloat16),
            SDS((b, t, t), jnp.bool_))
    txt = lower_cuda(lambda *a: attention_tree(*a, scale=d ** -0.5, in_cache=in_cache), *args)
    assert "xla.gpu.triton" in txt


@pytest.mark.parametrize("b,t,hq,hkv,s,d", [(1, 512, 9, 3, 8192, 64), (8, 5, 32, 8, 4096, 128),
                                            (4, 17, 32, 8, 4096, 128), (1, 100, 4, 4, 1000, 128)])
def test_attention_prefill_lowers(b, t, hq, hkv, s, d):
    args = (SDS((b, t, hq, d), jnp.bfloat16), SDS((b, hkv, s, d), jnp.bfloat16), SDS((b, hkv, s, d), jnp.bfloat16),
            SDS((b,), jnp.int32))
    txt = lower_cuda(lambda q, k, v, st: attention_prefill_pallas(q, k, v, st, scale=d ** -0.5, interpret=False),
                     *args)
    assert "xla.gpu.triton" in txt


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("kind", ["splits", "gated"])
def test_int4_matmul_finishing_a_pending_input_lowers(kind, m, monkeypatch):
    """The int4 matmul finishing its input on its loads (`lucebox_jax/pending_inputs.py`) at the embedded model's `o`
    and `down` shapes, in the GPU's small-weight configuration: one Triton kernel, nothing finished before it."""
    from lucebox_jax.pending_inputs import AttentionSplits, GatedInput
    from pallas_kernels import int4_matmul as im

    seen, real = [], im._pending_static
    monkeypatch.setattr(im, "_pending_static", lambda p: seen.append(p.kind) or real(p))

    if kind == "splits":
        ns = 64 if m == 1 else 16
        pend = AttentionSplits(SDS((m, 3, ns, 3, 64), jnp.float32), SDS((m, 3, ns, 3), jnp.float32),
                               SDS((m, 3, ns, 3), jnp.float32))
        w = _quant(576, 576, 32, False)
    else:
        pend = GatedInput((SDS((9, m, 3072), jnp.float32),), SDS((m,), jnp.float32) if m == 1 else None, rows=m,
                          ffn=1536, width=576)
        w = _quant(1536, 576, 32, False)
    txt = lower_cuda(lambda p, w: qmatmul_pallas(None, w, interpret=False, x_pending=p), pend, w)
    assert txt.count("xla.gpu.triton") == 1 and seen == [kind]
