"""Kernel registry: every op the model needs (`qmatmul`, `qmatmul8`, `attention_prefill`, `attention_decode`) is
looked up by name, so research code swaps kernels without touching the model (the vLLM attention-backend pattern).

    from lucebox_jax import ops

    @ops.register("qmatmul", "my_gemv")
    def my_gemv(x, w):            # x [M, K], w: QuantArray [K, N] -> [M, N] in x.dtype
        ...

and then `run.py --kernels qmatmul=my_gemv --kernels-module mypackage.mykernels`, or
`LLM(kernels="qmatmul=my_gemv")`. Signatures of each op are in `OP_SIGNATURES` below and in
`pallas_kernels/README.md`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import jax

from .errors import UnknownKernelError

OPS = ("qmatmul", "qmatmul8", "attention_prefill", "attention_decode")

OP_SIGNATURES = {
    "qmatmul": "fn(x [M, K], w: QuantArray [K, N]) -> [M, N] (x.dtype)",
    "qmatmul8": "fn(x [M, K], w: Int8Array [K, N]) -> [M, N] (x.dtype); int8 weights, e.g. a Q8_0 LM head",
    "attention_prefill": (
        "fn(q [B, T, Hq, D], k [B, Hkv, S, D], v [B, Hkv, S, D], start [B] int32, *, scale) -> [B, T, Hq, D]; "
        "query t of row b sits at absolute position start[b] + t and sees cache positions <= that; "
        "window=W (a static int, passed only for sliding-window layers) keeps the last W of them"
    ),
    "attention_decode": (
        "fn(q [B, Hq, D], k [B, Hkv, S, D], v [B, Hkv, S, D], lengths [B] int32, *, scale) -> [B, Hq, D]; "
        "row b sees cache positions < lengths[b]; window=W (static, only for sliding-window layers) keeps the "
        "last W of them"
    ),
}

_REGISTRY: dict[str, dict[str, Callable]] = {op: {} for op in OPS}
_DEFAULTS: dict[str, dict[str, str]] = {"cpu": {op: "xla" for op in OPS}, "gpu": {op: "xla" for op in OPS}}
_BUILTIN_MODULES = ("lucebox_jax.kernels_xla", "lucebox_jax.kernels_pallas")
_loaded = False


def register(op: str, name: str, *, default_on: tuple[str, ...] = ()):
    """Decorator: register `fn` as implementation `name` of `op`; `default_on` lists backends where it is default."""
    if op not in _REGISTRY:
        raise UnknownKernelError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")

    def deco(fn):
        _REGISTRY[op][name] = fn
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


def default_name(op: str, backend: str | None = None) -> str:
    _load_builtins()
    backend = backend or jax.default_backend()
    return _DEFAULTS.get(backend, _DEFAULTS["cpu"]).get(op, "xla")


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


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """Which implementation each op uses; hashable, so it is a static argument of the jitted steps."""

    qmatmul: str = "xla"
    qmatmul8: str = "xla"
    attention_prefill: str = "xla"
    attention_decode: str = "xla"

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
