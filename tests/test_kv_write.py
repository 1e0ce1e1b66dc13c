"""The KV-cache write: one row goes through a plain dynamic-update-slice (no scatter, so XLA on the GPU does not read
the slot's old value in a kernel of its own), and writes exactly what the batched, vmapped write does for that row,
including starts that clamp at the cache's end and negative ones."""

import jax
import jax.numpy as jnp
import pytest

from lucebox_jax.model import _write_kv


def _vmapped(cache, new, start):
    new = new.transpose(0, 2, 1, 3).astype(cache.dtype)
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0)))(cache, new, start)


@pytest.mark.parametrize("start", [0, 5, 13, 14, 20, -1])
def test_one_row_write_equals_batched_write(start):
    cache = jnp.arange(2 * 2 * 16 * 4, dtype=jnp.float32).reshape(2, 2, 16, 4).astype(jnp.bfloat16)
    new = -jnp.arange(2 * 3 * 2 * 4, dtype=jnp.float32).reshape(2, 3, 2, 4) - 1
    starts = jnp.array([start, 2], jnp.int32)
    both = _write_kv(cache, new, starts)  # two rows: the vmapped scatter
    assert (both == _vmapped(cache, new, starts)).all()
    one = _write_kv(cache[:1], new[:1], starts[:1])
    assert (one == both[:1]).all()
    assert not (one == cache[:1]).all()  # something was written


def test_one_row_write_is_not_a_scatter():
    cache, new = jnp.zeros((1, 2, 16, 4), jnp.bfloat16), jnp.ones((1, 1, 2, 4), jnp.bfloat16)
    hlo = jax.jit(_write_kv).lower(cache, new, jnp.array([3], jnp.int32)).as_text()
    assert "dynamic_update_slice" in hlo and "scatter" not in hlo
    hlo2 = jax.jit(_write_kv).lower(jnp.zeros((2, 2, 16, 4)), jnp.ones((2, 1, 2, 4)), jnp.array([3, 4])).as_text()
    assert "scatter" in hlo2  # (rows of their own starts: the batched form stays)


def test_tree_path_move_is_the_batched_move_and_no_scatter_for_one_row():
    """tree.move_path_kv (the accepted path's KV copied into place) goes through the same write: for one row a plain
    dynamic-update-slice, with the result of the batched form."""
    from lucebox_jax.model import KVCache
    from lucebox_jax.tree import move_path_kv

    c = jnp.arange(2 * 2 * 16 * 4, dtype=jnp.float32).reshape(2, 2, 16, 4)
    cache = KVCache(k=(c,), v=(-c,), lengths=jnp.array([3, 5], jnp.int32))
    start, path = jnp.array([3, 5], jnp.int32), jnp.array([[2, 4], [1, 0]], jnp.int32)
    got = move_path_kv(cache, start, path, 2)
    src = start[:, None] + path
    moved = jnp.take_along_axis(c, src[:, None, :, None], axis=2).transpose(0, 2, 1, 3)
    assert (got.k[0] == _vmapped(c, moved, start + 1)).all() and (got.v[0] == -got.k[0]).all()
    one = move_path_kv(KVCache(k=(c[:1],), v=(-c[:1],), lengths=start[:1]), start[:1], path[:1], 2)
    assert (one.k[0] == got.k[0][:1]).all()
    hlo = jax.jit(lambda k, s, p: move_path_kv(KVCache(k=(k,), v=(k,), lengths=s), s, p, 2).k[0]).lower(
        c[:1], start[:1], path[:1]).as_text()
    assert "scatter" not in hlo
