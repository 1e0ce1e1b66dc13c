"""The model's static configuration: a frozen, hashable dataclass passed into jit as a static argument."""

from __future__ import annotations

import dataclasses
import json

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_context: int = 2048
    tied_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    rope_interleaved: bool = True  # GGUF llama: adjacent pairs (llama.cpp ROPE_TYPE_NORM); qwen: halves (NEOX)
    dtype: str = "float32"  # activation dtype: float32 on the CPU, bfloat16 on a GPU

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
