"""The model's static configuration: a frozen, hashable dataclass passed into jit as a static argument."""

from __future__ import annotations

import dataclasses
import json

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


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
    rope_interleaved: bool = True  # GGUF llama: adjacent pairs (llama.cpp ROPE_TYPE_NORM); qwen, gemma: halves (NEOX)
    # Gemma 3: GeGLU, embeddings scaled by sqrt(dim), its own attention scale, sliding-window ("local") layers with
    # their own RoPE base; every `sliding_window_pattern`-th layer is global. Sandwich norms are weights (model.py).
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation as ggml_gelu)
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    sliding_window: int = 0  # 0: every layer global
    sliding_window_pattern: int = 0  # layer i is global when (i + 1) % pattern == 0; 0: all local if windowed
    rope_theta_local: float = 10000.0
    rope_scale: float = 1.0  # linear RoPE scaling factor of the global layers (positions / factor)
    final_softcap: float = 0.0  # logits = c * tanh(logits / c) when > 0
    dtype: str = "float32"  # activation dtype: float32 on the CPU, bfloat16 on a GPU

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_window(self, i: int) -> int | None:
        """Keys a query of layer i sees (itself included), or None for full causal attention."""
        if not self.sliding_window:
            return None
        if self.sliding_window_pattern and (i + 1) % self.sliding_window_pattern == 0:
            return None
        return self.sliding_window

    def layer_rope(self, i: int) -> tuple[float, float]:
        """(RoPE base, position scale) of layer i: local layers use their own base and no scaling."""
        if self.layer_window(i) is not None:
            return self.rope_theta_local, 1.0
        return self.rope_theta, 1.0 / self.rope_scale

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
