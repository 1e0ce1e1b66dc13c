"""Kernel registry: every op the model needs (`qmatmul`, `qmatmul8`, `attention_prefill`, `attention_decode`,
`attention_tree`, `kv_move`) is looked up by name, so research code swaps kernels without touching the model (the
vLLM attention-backend pattern).

    from lucebox_jax import ops

    @ops.register("qmatmul", "my_gemv")
    def my_gemv(x, w):            # x [M, K], w: QuantArray [K, N] -> [M, N] in x.dtype
        ...

and then `run.py --kernels qmatmul=my_gemv --kernels-module mypackage.mykernels`, or
`LLM(kernels="qmatmul=my_gemv")`. Signatures of each op are in `OP_SIGNATURES` below and in
`pallas_kernels/README.md`.

A matmul kernel may also register `prepare(w) -> w'`, run once per weight when an engine is built
(`prepare_weights`), to repack weights into a layout of its own (e.g. `mgpu`); a prepared weight names its op
(`matmul_op`) and kernel (`prepared_by`) so `quant.linear` dispatches it back there. `usable(backend) -> reason or
None` marks kernels that run only on some hardware: choosing one elsewhere is refused with the list of those that
can run. `rows(m)` tells how many rows a matmul kernel runs m rows as (`padded_rows`): the model then keeps its
activations padded so, and no pad kernel runs before each call.
Defaults may be refined per GPU generation (`"gpu:sm90"` is consulted before `"gpu"` on Hopper).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable

import jax

from .errors import UnknownKernelError

OPS = ("qmatmul", "qmatmul8", "attention_prefill", "attention_decode", "attention_tree", "kv_move")

OP_SIGNATURES = {
    "qmatmul": "fn(x [M, K], w: QuantArray [K, N]) -> [M, N] (x.dtype); optional parts=True: a tuple of arrays "
               "[P, R >= M, N] whose sum over every P is the product (split-K partials as written; "
               "quant.linear_parts); optional x_pending=: x is None and this (pending_inputs.AttentionSplits or GatedInput, .shape [M, K]) "
               "is the input, to be finished on the kernel's loads or by its merged()",
    "qmatmul8": "fn(x [M, K], w: Int8Array [K, N]) -> [M, N] (x.dtype); int8 weights, e.g. a Q8_0 LM head; optional "
                "parts=True as qmatmul's",
    "attention_prefill": (
        "fn(q [B, T, Hq, D], k [B, Hkv, S, D], v [B, Hkv, S, D], start [B] int32, *, scale) -> [B, T, Hq, D]; "
        "query t of row b sits at absolute position start[b] + t and sees cache positions <= that; "
        "window=W (a static int, passed only for sliding-window layers) keeps the last W of them"
    ),
    "attention_decode": (
        "fn(q [B, Hq, D], k [B, Hkv, S, D], v [B, Hkv, S, D], lengths [B] int32, *, scale) -> [B, Hq, D]; "
        "row b sees cache positions < lengths[b]; window=W (static, only for sliding-window layers) keeps the "
        "last W of them; optional rows [B] int32 after lengths (a short speculative verify, its positions as decode "
        "rows; a kernel without it sends verifies to attention_prefill): query row b reads cache row rows[b]; "
        "optional append=True (q [B, Hq + 2 Hkv, D] also holds the step's own keys and values, which the kernel "
        "writes at lengths[b] - 1, returning (out, k, v)) and, with rows, window_rows=T (the rows are windows of T "
        "positions, written by the kernel; pallas_kernels/README.md) and window_anc [B, T] bool (the windows are "
        "token trees: row t sees the window keys j where window_anc[row, j], not 0..t); optional out_rows=R with "
        "append: the output padded with zero rows to R rows; optional prologue=QKVPrologue with append in a decode "
        "step: q is then the qkv matmul's partial sums (a tuple, quant.linear_parts) that the kernel sums, norms and "
        "rotates itself (lucebox_jax/qkv_prologue.py); optional split_out=True in a decode step: the splits may "
        "come back unmerged (pending_inputs.AttentionSplits) for an o matmul that takes x_pending"
    ),
    "attention_tree": (
        "fn(q [B, T, Hq, D], k [B, Hkv, S, D], v [B, Hkv, S, D], n_visible [B] int32, k_win [B, T2, Hkv, D], "
        "v_win [B, T2, Hkv, D], anc [B, T, T2] bool, *, scale, positions=None, window=None) -> [B, T, Hq, D]; "
        "a speculative tree's nodes: node t sees cache slots < n_visible[b] and window keys j where anc[b, t, j]; "
        "with window=W (sliding-window layers) a node at positions[b, t] sees only cache slots > positions - W; "
        "optional in_cache=True (the model's tree verify): the window's keys also sit in the cache at slots "
        "n_visible[b] + j, where a kernel may read them"
    ),
    "kv_move": (
        "fn(caches: tuple of [B, Hkv, S, D], src [B, n] int32, dst [B] int32) -> the caches with slots src[b, j] "
        "copied to dst[b] + j, all sources read before any write (a speculative tree's accepted path moved into "
        "place); dst is placed as a dynamic-update-slice places an n-slot block"
    ),
}

_REGISTRY: dict[str, dict[str, Callable]] = {op: {} for op in OPS}
_PREPARE: dict[tuple[str, str], Callable] = {}
_USABLE: dict[tuple[str, str], Callable[[], str | None]] = {}
_ROWS: dict[tuple[str, str], Callable[[int], int]] = {}
_DEFAULTS: dict[str, dict[str, str]] = {"cpu": {op: "xla" for op in OPS}, "gpu": {op: "xla" for op in OPS}}
_BUILTIN_MODULES = ("lucebox_jax.kernels_xla", "lucebox_jax.kernels_pallas", "lucebox_jax.kernels_mgpu")
_loaded = False


def register(op: str, name: str, *, default_on: tuple[str, ...] = (), prepare: Callable | None = None,
             usable: Callable[[], str | None] | None = None, rows: Callable[[int], int] | None = None):
    """Decorator: register `fn` as implementation `name` of `op`; `default_on` lists backends where it is default,
    `prepare` repacks a weight once at engine build, `usable()` says why it cannot run here (None if it can),
    `rows(m)` how many rows a matmul kernel runs m rows as (`padded_rows`)."""
    if op not in _REGISTRY:
        raise UnknownKernelError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")

    def deco(fn):
        _REGISTRY[op][name] = fn
        if prepare is not None:
            _PREPARE[(op, name)] = prepare
        if usable is not None:
            _USABLE[(op, name)] = usable
        if rows is not None:
            _ROWS[(op, name)] = rows
        for backend in default_on:
            _DEFAULTS.setdefault(backend, {})[op] = name
        return fn

    return deco


def _load_builtins():
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _BUILTIN_MODULES:
            importlib.import_module(mod)


def import_kernel_module(module: str):
    """Import a user module whose `@register` calls add kernels (the CLI's --kernels-module)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise UnknownKernelError(f"cannot import kernel module {module!r}: {e}") from e


def available(op: str) -> list[str]:
    _load_builtins()
    if op not in _REGISTRY:
        raise UnknownKernelError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
    return sorted(_REGISTRY[op])


def backend_keys(backend: str | None = None) -> list[str]:
    """The default tables to consult, most specific first: e.g. ["gpu:sm90", "gpu"] on a Hopper GPU."""
    backend = backend or jax.default_backend()
    keys = [backend]
    if backend == jax.default_backend() == "gpu":
        cc = str(getattr(jax.devices()[0], "compute_capability", "") or "")
        if cc:
            keys.insert(0, f"gpu:sm{cc.replace('.', '')}")
    return keys


def default_name(op: str, backend: str | None = None) -> str:
    _load_builtins()
    for key in backend_keys(backend):
        name = _DEFAULTS.get(key, {}).get(op)
        if name is not None and (backend not in (None, jax.default_backend()) or unusable_reason(op, name) is None):
            return name
    return _DEFAULTS["cpu"].get(op, "xla")


def unusable_reason(op: str, name: str) -> str | None:
    """Why kernel `name` of `op` cannot run on this machine, or None."""
    check = _USABLE.get((op, name))
    return check() if check is not None else None


def usable(op: str) -> list[str]:
    """The registered implementations of `op` that can run here."""
    return [n for n in available(op) if unusable_reason(op, n) is None]


def prepare_weights(weights, kernels: "KernelSet"):
    """Repack the linear weights (`weights.layers`, `weights.head`) for kernels that registered `prepare`: once, when
    an engine is built. Returns `weights` itself when no chosen kernel prepares anything."""
    from .quant import Int8Array, QuantArray

    _load_builtins()
    preps = {QuantArray: _PREPARE.get(("qmatmul", kernels.qmatmul)),
             Int8Array: _PREPARE.get(("qmatmul8", kernels.qmatmul8))}
    if not any(preps.values()):
        return weights

    def one(leaf):
        fn = preps.get(type(leaf))
        return fn(leaf) if fn is not None else leaf

    is_w = lambda t: isinstance(t, (QuantArray, Int8Array))  # noqa: E731
    layers = jax.tree_util.tree_map(one, weights.layers, is_leaf=is_w)
    return weights.replace(layers=layers, head=one(weights.head) if is_w(weights.head) else weights.head)


def get(op: str, name: str | None = None) -> Callable:
    """The implementation `name` of `op` (the backend's default when name is None)."""
    _load_builtins()
    if op not in _REGISTRY:
        raise UnknownKernelError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
    name = name or default_name(op)
    try:
        return _REGISTRY[op][name]
    except KeyError:
        raise UnknownKernelError(
            f"unknown kernel {name!r} for op {op!r}; valid: {', '.join(sorted(_REGISTRY[op]))}"
        ) from None


def padded_rows(op: str, name: str, m: int, w=None) -> int:
    """How many rows implementation `name` of `op` runs an [m, K] input as: more than m where the kernel pads its
    input itself (a kernel of its own). A caller that keeps its activations at that many rows saves those pads.
    With the weight `w`: a weight prepared by a kernel answers for that kernel, and a kernel that prepares its weights
    (`mgpu`, `best`) pads none it left unprepared (those run its fallback)."""
    _load_builtins()
    if w is not None and hasattr(w, "prepared_by"):
        op, name = w.matmul_op, w.prepared_by
    elif w is not None and (op, name) in _PREPARE:
        return m
    fn = _ROWS.get((op, name))
    return max(m, fn(m)) if fn is not None else m


def accepts(op: str, name: str, param: str) -> bool:
    """Whether implementation `name` of `op` takes the optional parameter `param` (e.g. attention_decode's `rows`)."""
    return takes(get(op, name), param)


def takes(fn: Callable, param: str) -> bool:
    """Whether the kernel function `fn` takes the optional parameter `param`."""
    try:
        return param in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a readable signature: assume the op's base signature
        return False


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """Which implementation each op uses; hashable, so it is a static argument of the jitted steps."""

    qmatmul: str = "xla"
    qmatmul8: str = "xla"
    attention_prefill: str = "xla"
    attention_decode: str = "xla"
    attention_tree: str = "xla"
    kv_move: str = "xla"

    @classmethod
    def resolve(cls, spec: "str | dict | KernelSet | None" = None, backend: str | None = None) -> "KernelSet":
        """Defaults for the backend, overridden by `spec` ("op=name,op=name" or a dict); every name is checked."""
        if isinstance(spec, KernelSet):
            chosen = dataclasses.asdict(spec)
        else:
            chosen = {op: default_name(op, backend) for op in OPS}
            chosen.update(parse_spec(spec) if isinstance(spec, (str, type(None))) else dict(spec))
        for op, name in chosen.items():
            get(op, name)  # raises UnknownKernelError listing valid names
            if (backend is None or backend == jax.default_backend()) and (why := unusable_reason(op, name)):
                raise UnknownKernelError(f"kernel {name!r} for op {op!r} cannot run here: {why}; "
                                         f"usable here: {', '.join(usable(op))}")
        return cls(**chosen)

    def describe(self) -> str:
        return ",".join(f"{op}={getattr(self, op)}" for op in OPS)


def parse_spec(spec: str | None) -> dict[str, str]:
    """"qmatmul=pallas,attention_decode=xla" -> dict; unknown ops and malformed items raise."""
    out: dict[str, str] = {}
    if not spec:
        return out
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise UnknownKernelError(f"bad kernel choice {item!r}: expected op=name with op in {', '.join(OPS)}")
        op, name = (s.strip() for s in item.split("=", 1))
        if op not in OPS:
            raise UnknownKernelError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
        out[op] = name
    return out
