"""Tensor parallelism (Megatron style) over a 1-D mesh of N devices with `jax.sharding`: the weights and the KV cache
are placed sharded, and XLA's SPMD partitioner inserts every collective. There is no communication code here and no
tensor-parallel branch in the model: the forward sees the same pytrees, whose linear layers are `ShardedLinear`.

    tp = TensorParallel.create(cfg, 4)          # the first 4 devices (after jax.distributed.initialize: of all hosts)
    weights, kernels = tp.shard_weights(weights), tp.wrap_kernels(kernels)
    cache = tp.new_cache(cfg, batch, max_len)

Layout on the mesh axis "tp":
- wqkv and w_gate_up: split by output columns, regrouped so device j holds [q_j | k_j | v_j] (the heads of KV-head
  block j and their query heads) and [gate_j | up_j] (`LayerWeights.qkv_groups` / `gate_up_groups` = N tell the
  forward the layout); their activations stay on their device.
- wo and w_down: split by input rows; each device's partial product is summed across the mesh: one all-reduce each,
  so two per layer.
- int4 codes, scales and mins of a weight are sharded together along the same axis. Row shards of int4 codes are
  re-packed so that each device holds a self-contained half-split QuantArray of K / N rows (the packed layout pairs
  row i with row i + K / 2, which a plain row split would tear apart); a `ShardedLinear` is therefore only
  meaningful through `quant.linear`, which runs the registered kernel once per shard under `shard_map`.
- embedding table and LM head: split by vocabulary (the lookup's gather and the sampler's reductions are partitioned
  by XLA).
- KV cache [B, Hkv, S, D]: split by KV heads when N divides them; otherwise the attention (its weights, the cache and
  the compute) is replicated and only the MLP, embedding and head are split. Why not pad: N = 8 with 3 KV heads (the
  embedded SmolLM2) would hold 5 zero heads per layer in the cache and 8/3 the attention work; splitting a head's
  query group over its replicas needs N a multiple of the KV heads and the group a multiple of N / Hkv, which 3 heads
  with groups of 3 do not give at 2, 4 or 8. The large models this is for (Llama-3 8B/70B, Qwen3-32B: 8 KV heads;
  Gemma-2/3 27B: 16) divide 2, 4 and 8 evenly, so the replicated attention only serves small models.
- Pallas (any non-`xla`) attention kernels run per shard under `shard_map` (`wrap_kernels`); the `xla` attention is
  left to the SPMD partitioner.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import ops
from .config import ModelConfig
from .errors import ParallelismError
from .kernels_xla import pad_rows
from .model import KVCache, Weights, init_cache
from .ops import KernelSet
from .quant import Int8Array, QuantArray, unpack_int4

AXIS = "tp"
_SPECS = {"columns": P(None, AXIS), "rows": P(AXIS, None), "replicated": P()}


@struct.dataclass
class ShardedLinear:
    """A [K, N] weight (QuantArray, Int8Array or dense) whose arrays are split over the mesh: by output columns, by
    input rows (int4 codes re-packed per shard) or replicated. `quant.linear` calls `apply_linear`."""

    w: object
    split: str = struct.field(pytree_node=False)
    mesh: Mesh = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    def apply_linear(self, x, kernels):
        """x [M, K] -> [M, N]: the usual dispatch on each device's shard; row shards' partial products are summed
        outside the shard_map, which XLA lowers to one all-reduce."""
        from .quant import linear

        wspec = jax.tree.map(lambda _: _SPECS[self.split], self.w)
        if self.split == "rows":
            def part(xl, wl):  # float32 partials: the sum across devices keeps the single device's precision
                return linear(xl, wl, kernels=kernels).astype(jnp.float32)[None]

            y = jax.shard_map(part, mesh=self.mesh, in_specs=(P(None, AXIS), wspec), out_specs=P(AXIS),
                              check_vma=False)(x, self.w)
            return y.sum(axis=0).astype(x.dtype)
        out = _SPECS[self.split]
        return jax.shard_map(lambda xl, wl: linear(xl, wl, kernels=kernels), mesh=self.mesh,
                             in_specs=(P(), wspec), out_specs=out, check_vma=False)(x, self.w)


def _take_columns(w, idx):
    """The weight with its output columns reordered by `idx` (codes, scales and mins together)."""
    if isinstance(w, (QuantArray, Int8Array)):
        return w.replace(codes=w.codes[:, idx], scales=w.scales[:, idx],
                         mins=None if w.mins is None else w.mins[:, idx])
    return jnp.asarray(w)[:, idx]


def _repack_rows(w, n: int):
    """int4 codes re-packed half-split within each of n row blocks, on the device (other formats: unchanged)."""
    if not isinstance(w, QuantArray):
        return w
    q = unpack_int4(jnp.asarray(w.codes))  # [K, N] codes
    k, cols = q.shape
    blocks = q.reshape(n, 2, k // (2 * n), cols)  # block j's first and second half
    return w.replace(codes=(blocks[:, 0] | (blocks[:, 1] << 4)).reshape(k // 2, cols))


def _block_order(sizes: tuple[int, ...], n: int) -> np.ndarray:
    """Column order that turns the concatenation of parts `sizes` into n blocks of 1/n of every part."""
    offs = np.cumsum((0,) + sizes)
    return np.concatenate([np.arange(offs[i] + j * s // n, offs[i] + (j + 1) * s // n)
                           for j in range(n) for i, s in enumerate(sizes)])


def check_devices(n) -> list:
    """The first n devices; ParallelismError when n is not a positive integer or exceeds the devices there are."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ParallelismError(f"tensor_parallel must be an integer >= 1, got {n!r}")
    devices = jax.devices()
    if n > len(devices):
        raise ParallelismError(f"tensor_parallel={n} needs {n} devices but {len(devices)} "
                               f"{devices[0].platform} device(s) are available")
    return devices[:n]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """N devices on a 1-D mesh and how a model is split over them (hashable)."""

    mesh: Mesh
    heads_split: bool  # attention split by KV heads (else replicated; see the module docstring)

    @property
    def size(self) -> int:
        return self.mesh.size

    @classmethod
    def create(cls, cfg: ModelConfig, n: int) -> "TensorParallel":
        """Check that `n` devices exist and divide what must be divided; ParallelismError names what does not."""
        devices = check_devices(n)
        bad = [f"{name} ({v})" for name, v in (("vocabulary size", cfg.vocab_size), ("FFN size", cfg.ffn_dim))
               if v % n]
        if bad:
            raise ParallelismError(f"tensor_parallel={n} must divide the {' and the '.join(bad)}")
        return cls(Mesh(np.array(devices), (AXIS,)), heads_split=cfg.n_kv_heads % n == 0)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def _put(self, tree, spec: P):
        return jax.tree.map(lambda a: jax.device_put(a, self.sharding(spec)), tree)

    def _linear(self, w, split: str, name: str) -> ShardedLinear:
        n = self.size
        k, cols = w.shape
        if split == "columns" and cols % n:
            raise ParallelismError(f"tensor_parallel={n} must divide the {cols} output columns of {name}")
        if split == "rows":
            g = w.group_size if isinstance(w, (QuantArray, Int8Array)) else 1
            even = 2 if isinstance(w, QuantArray) else 1
            if k % n or (k // n) % g or (k // n) % even:
                raise ParallelismError(f"tensor_parallel={n} must split the {k} input rows of {name} into whole "
                                       f"quantization groups of {g} rows" + (" (an even count for int4)" if even > 1
                                                                             else ""))
            w = _repack_rows(w, n)
        return ShardedLinear(self._put(w, _SPECS[split]), split, self.mesh)

    def shard_weights(self, cfg: ModelConfig, w: Weights) -> Weights:
        """The model's weights placed on the mesh (see the module docstring for the layout)."""
        n = self.size
        rep = P()
        qkv_order = _block_order((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), n)
        gu_order = _block_order((cfg.ffn_dim, cfg.ffn_dim), n)
        layers = []
        for i, lw in enumerate(w.layers):
            small = {f.name: self._put(getattr(lw, f.name), rep) for f in dataclasses.fields(lw)
                     if f.name not in ("wqkv", "wo", "w_gate_up", "w_down", "bqkv", "qkv_groups", "gate_up_groups")}
            if self.heads_split:
                attn = dict(wqkv=self._linear(_take_columns(lw.wqkv, qkv_order), "columns", f"layer {i} wqkv"),
                            wo=self._linear(lw.wo, "rows", f"layer {i} wo"), qkv_groups=n,
                            bqkv=None if lw.bqkv is None else self._put(lw.bqkv[qkv_order], P(AXIS)))
            else:
                attn = dict(wqkv=self._linear(lw.wqkv, "replicated", ""), wo=self._linear(lw.wo, "replicated", ""),
                            bqkv=self._put(lw.bqkv, rep), qkv_groups=1)
            layers.append(lw.replace(**small, **attn, gate_up_groups=n,
                                     w_gate_up=self._linear(_take_columns(lw.w_gate_up, gu_order), "columns",
                                                            f"layer {i} w_gate_up"),
                                     w_down=self._linear(lw.w_down, "rows", f"layer {i} w_down")))
        return Weights(embed=self._put(w.embed, P(AXIS, None)), layers=tuple(layers),
                       final_norm=self._put(w.final_norm, rep), head=self._linear(w.head, "columns", "the LM head"))

    def cache_spec(self) -> P:
        return P(None, AXIS, None, None) if self.heads_split else P()

    def new_cache(self, cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
        """A zero KV cache created directly in its shards (no device ever holds the whole of a split cache)."""
        return _sharded_init(self)(cfg, batch, max_len)

    def wrap_kernels(self, kernels: KernelSet) -> KernelSet:
        """The kernel set with every non-`xla` attention kernel (trees included) and KV move run per shard under
        shard_map, registered as `NAME@tpN` (the qmatmul kernels already run per shard inside `ShardedLinear`)."""
        per_shard = {  # op -> fn -> the same kernel run on each device's heads
            "attention_decode": lambda fn: _per_shard_attention(fn, self.mesh, self.heads_split, decode=True),
            "attention_prefill": lambda fn: _per_shard_attention(fn, self.mesh, self.heads_split, decode=False),
            "attention_tree": lambda fn: _per_shard_tree(fn, self.mesh, self.heads_split),
            "kv_move": lambda fn: _per_shard_kv_move(fn, self.mesh, self.heads_split),
        }
        chosen = {}
        for op, wrap in per_shard.items():
            name = getattr(kernels, op)
            if name == "xla" or "@tp" in name:
                continue
            wrapped = f"{name}@tp{self.size}" + ("" if self.heads_split else "r")
            ops.register(op, wrapped)(wrap(ops.get(op, name)))
            chosen[op] = wrapped
        return dataclasses.replace(kernels, **chosen)


@functools.lru_cache(maxsize=None)
def _sharded_init(tp: TensorParallel):
    kv = tp.sharding(tp.cache_spec())
    return jax.jit(init_cache, static_argnums=(0, 1, 2), out_shardings=KVCache(k=kv, v=kv, lengths=tp.sharding(P())))


def _per_shard_tree(fn, mesh: Mesh, heads_split: bool):
    """`fn` (a tree attention kernel) run on each device's KV heads, their query heads and the window's keys."""
    h4 = P(None, None, AXIS, None) if heads_split else P()  # q [B, T, Hq, D] and the window's [B, T2, Hkv, D]
    kv_spec = P(None, AXIS, None, None) if heads_split else P()

    @functools.wraps(fn)
    def run(q, k, v, n_visible, k_win, v_win, anc, *, scale, positions=None, window=None, **extra):
        def body(*a):  # positions (sliding-window layers only) ride along as an argument, replicated
            return fn(*a[:7], scale=scale, positions=a[7] if len(a) > 7 else None, window=window, **extra)

        args = (q, k, v, n_visible, k_win, v_win, anc) + (() if positions is None else (positions,))
        if heads_split and k.shape[1] % mesh.size:
            return body(*args)
        return jax.shard_map(body, mesh=mesh, in_specs=(h4, kv_spec, kv_spec, P(), h4, h4) + (P(),) * (len(args) - 6),
                             out_specs=h4, check_vma=False)(*args)

    return run


def _per_shard_kv_move(fn, mesh: Mesh, heads_split: bool):
    """`fn` (a kv_move kernel) run on each device's KV heads of every cache."""
    kv_spec = P(None, AXIS, None, None) if heads_split else P()

    @functools.wraps(fn)
    def run(caches, src, dst):
        caches = tuple(caches)
        if heads_split and caches[0].shape[1] % mesh.size:
            return fn(caches, src, dst)
        specs = (kv_spec,) * len(caches)
        return jax.shard_map(lambda c, s, d: tuple(fn(c, s, d)), mesh=mesh, in_specs=(specs, P(), P()),
                             out_specs=specs, check_vma=False)(caches, src, dst)

    return run


def _per_shard_attention(fn, mesh: Mesh, heads_split: bool, decode: bool):
    """`fn` (an attention kernel) run on each device's KV heads and their query heads."""
    q_spec = (P(None, AXIS, None) if decode else P(None, None, AXIS, None)) if heads_split else P()
    kv_spec = P(None, AXIS, None, None) if heads_split else P()

    @functools.wraps(fn)  # (its signature is fn's, so the model hands it what fn takes: handle each here)
    def run(q, k, v, pos, rows=None, *, scale, window=None, append=False, window_rows=0, window_anc=None,
            out_rows=0):
        out = sharded(q, k, v, pos, rows, scale=scale, window=window, append=append, window_rows=window_rows,
                      window_anc=window_anc)
        if out_rows <= q.shape[0]:
            return out
        return (pad_rows(out[0], out_rows), *out[1:]) if append else pad_rows(out, out_rows)  # (a pad kernel here)

    def sharded(q, k, v, pos, rows=None, *, scale, window=None, append=False, window_rows=0, window_anc=None):
        extra = {} if window is None else {"window": window}
        if window_rows:  # a verify's windows of decode rows (rows, pos and window_anc: replicated)
            extra["window_rows"] = window_rows
        body = functools.partial(fn, scale=scale, **extra)
        args = (q, k, v, pos) + (() if rows is None else (rows,))  # rows: a verify's positions (model.forward)
        anc = {} if window_anc is None else {"window_anc": window_anc}
        if heads_split and k.shape[1] % mesh.size:  # another model's cache (a draft model's): not split by heads
            return body(*args, **({"append": True} if append else {}), **anc)
        if append:  # q [B, Hq + 2 Hkv, D]: its three parts split by heads apart, then packed again on each device
            hkv = k.shape[1]
            parts = (q[:, :-2 * hkv], q[:, -2 * hkv:-hkv], q[:, -hkv:])
            more = (() if rows is None else (rows,)) + (() if window_anc is None else (window_anc,))

            def packed(ql, kn, vn, kc, vc, p, *rest):
                r = rest[0] if rows is not None else None
                a = {} if window_anc is None else {"window_anc": rest[-1]}
                return body(jnp.concatenate([ql, kn, vn], axis=1), kc, vc, p, r, append=True, **a)

            specs = (q_spec,) * 3 + (kv_spec, kv_spec) + (P(),) * (1 + len(more))
            return jax.shard_map(packed, mesh=mesh, in_specs=specs, out_specs=(q_spec, kv_spec, kv_spec),
                                 check_vma=False)(*parts, k, v, pos, *more)
        return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec) + (P(),) * (len(args) - 3),
                             out_specs=q_spec, check_vma=False)(*args)

    return run
