#!/usr/bin/env python3
"""What one host-to-device transfer and one tiny jitted call cost on this device (median ms, the host's wait):
`jnp.asarray` of small numpy arrays, one `jax.device_put` of several, a no-op jit with 1 and 400 array arguments."""

import time

import jax
import jax.numpy as jnp
import numpy as np


def ms(fn, reps=50):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main():
    small = np.arange(8, dtype=np.int32)
    seen = np.zeros((1, 49152), bool)
    print(f"device {jax.devices()[0]}")
    print(f"asarray int32[8]: {ms(lambda: jnp.asarray(small)):.4f} ms")
    print(f"asarray bool[1, 49152]: {ms(lambda: jnp.asarray(seen)):.4f} ms")
    print(f"device_put of 4 int32[8] at once: {ms(lambda: jax.device_put((small, small, small, small))):.4f} ms")
    f = jax.jit(lambda a: a + 1)
    x = jnp.ones(8)
    print(f"tiny jit, 1 argument: {ms(lambda: f(x)):.4f} ms")
    xs = [jnp.ones(8) + i for i in range(400)]
    g = jax.jit(lambda *a: sum(a))
    print(f"tiny jit, 400 arguments: {ms(lambda: g(*xs)):.4f} ms")


if __name__ == "__main__":
    main()
