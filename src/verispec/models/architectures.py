"""The one table of model architectures verispec runs (:data:`ARCHITECTURES`): per architecture
name (the GGUF ``general.architecture``, the transformers ``model_type``), what the name implies
beyond a file's header (as llama.cpp's ``llm_load_hparams`` sets it) and which runners and heads
support it. Knows nothing about loading or running a model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One architecture's row.

    Attributes:
        activation: ``"swiglu"`` (silu(gate) * up) or ``"gelu_tanh"`` (gelu_tanh(gate) * up).
        scaled_embedding: embeddings times sqrt(hidden) (Gemma).
        global_every: with a sliding window, every n-th layer is global, the others local (0: all local).
        local_rope_base: local layers' RoPE base when the header names none.
        permuted_qk: the GGUF converter interleaved q/k rows for llama.cpp's "normal" RoPE.
        gguf: the gguf runner reads its GGUF files (:mod:`verispec.runners.cpu.gguf_arch`).
        int8_from_transformers: the int8 runner converts its transformers model
            (:mod:`verispec.runners.cpu.int8_weights`).
        eagle_heads: EAGLE-3 heads are trained and loaded for it (decoder-only, RMSNorm, SwiGLU:
            :mod:`verispec.runners.eagle.shape`).
    """

    activation: str = "swiglu"
    scaled_embedding: bool = False
    global_every: int = 0
    local_rope_base: float | None = None
    permuted_qk: bool = False
    gguf: bool = True
    int8_from_transformers: bool = False
    eagle_heads: bool = False


ARCHITECTURES = {
    "llama": Family(permuted_qk=True, int8_from_transformers=True, eagle_heads=True),
    "qwen2": Family(int8_from_transformers=True, eagle_heads=True),
    "qwen3": Family(eagle_heads=True),
    "gemma3": Family(activation="gelu_tanh", scaled_embedding=True, global_every=6, local_rope_base=10000.0),
    "phi3": Family(),
    "mistral": Family(gguf=False, eagle_heads=True),  # its GGUF files name "llama"
}
GGUF_ARCHITECTURES = tuple(name for name, f in ARCHITECTURES.items() if f.gguf)
INT8_MODEL_TYPES = tuple(name for name, f in ARCHITECTURES.items() if f.int8_from_transformers)
EAGLE_MODEL_TYPES = tuple(name for name, f in ARCHITECTURES.items() if f.eagle_heads)
