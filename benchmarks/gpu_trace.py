"""GPU kernel events of a piece of code, from the JAX profiler: what the benchmarks time with (kernel time, not wall
time) and what `bench_decode.py --profile` breaks down by kernel name."""

from __future__ import annotations

import tempfile

import jax


def trace_gpu_events(run):
    """Run `run()` under the JAX profiler; [(name, start_ns, duration_ns)] of the GPU stream events, or None."""
    from jax._src import profiler as jprof

    jax.profiler.start_trace(tempfile.mkdtemp())
    try:
        run()
    finally:
        with jprof._profile_state.lock:
            xs = jprof._profile_state.profile_session.stop()
            jprof._profile_state.reset()
    pd = jax.profiler.ProfileData.from_serialized_xspace(xs)
    evs = [(ev.name, ev.start_ns, ev.duration_ns) for plane in pd.planes if plane.name.startswith("/device:GPU")
           for line in plane.lines if line.name.startswith("Stream") for ev in line.events]
    return evs or None


def busy_and_span_ns(events):
    """(sum of kernel durations, last end - first start) in ns, or (None, None) for no events."""
    if not events:
        return None, None
    busy = sum(d for _, _, d in events)
    return busy, max(s + d for _, s, d in events) - min(s for _, s, _ in events)


def per_name_ns(events) -> dict:
    """{kernel name: summed duration ns} over the events, largest first; {} for none."""
    out: dict = {}
    for name, _, d in events or ():
        out[name] = out.get(name, 0) + d
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
