"""The int8 copy of a Llama/Qwen2 decoder's weights: per-output-channel int8 linear layers
(q, k, v fused; gate and up fused), per-row int8 embedding rows, float32 norms and RoPE tables.

Owns quantizing a transformers model into that form (:func:`quantized_state`, a plain dict that
``torch.save`` can cache) and prepacking it for the kernel (:class:`Int8Weights`). The forward
pass is :class:`verispec.runners.cpu.int8.Int8Runner`'s. Knows nothing about caches or decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError
from verispec.models.architectures import INT8_MODEL_TYPES
from verispec.runners.cpu.gguf_arch import Architecture
from verispec.runners.cpu.int8_ops import Int8Weight, quantize_weight_rows

SUPPORTED_MODEL_TYPES = INT8_MODEL_TYPES  # the one table's rows the int8 runner converts
DEFAULT_MAX_CONTEXT = 4096


@dataclass
class Int8Layer:
    input_norm: Tensor  # [hidden] float32
    qkv: Int8Weight  # [hidden] -> [(heads + 2 kv_heads) * head_dim]
    o: Int8Weight  # [heads * head_dim] -> [hidden]
    post_norm: Tensor  # [hidden] float32
    gate_up: Int8Weight  # [hidden] -> [2 * intermediate]
    down: Int8Weight  # [intermediate] -> [hidden]
    q_norm: Tensor | None = None  # [head_dim] float32: per-head RMSNorm of q before RoPE (Qwen3, Gemma 3)
    k_norm: Tensor | None = None  # [head_dim] float32
    attn_post_norm: Tensor | None = None  # [hidden] float32: RMSNorm of the attention output (Gemma 3)
    ffn_post_norm: Tensor | None = None  # [hidden] float32: RMSNorm of the MLP output (Gemma 3)


@dataclass
class Int8Weights:
    """A Llama/Qwen2 decoder in int8 (linear layers, embedding rows) plus float32 norms and RoPE.

    ``cos``/``sin``: ``[max_positions, head_dim]`` float32 rotary tables (any RoPE scaling the
    source model applies is baked in). ``embed_int8`` ``[vocab, hidden]`` with ``embed_scales``
    ``[vocab, 1]``: embedding rows in per-row int8.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    embed_int8: Tensor
    embed_scales: Tensor
    layers: list[Int8Layer]
    final_norm: Tensor
    lm_head: Int8Weight
    cos: Tensor
    sin: Tensor
    head_token_ids: Tensor | None = None  # [kept] int64: rows of a reduced LM head (FR-Spec)
    context_head: None = None  # no per-sequence head rows on int8 weights (gguf only: context_head.py)
    arch: Architecture = field(default_factory=Architecture)
    local_cos: Tensor | None = None  # local layers' RoPE tables (never for a transformers module)
    local_sin: Tensor | None = None

    @property
    def vocab_size(self) -> int:
        """Width of the logits rows: the full vocabulary, also with a reduced head."""
        return self.embed_int8.shape[0] if self.head_token_ids is not None else self.lm_head.out_features

    def embed(self, ids: Tensor) -> Tensor:
        """float32 ``[len(ids), hidden]`` embedding rows of token ids ``ids`` ``[n]`` int64."""
        return self.embed_int8[ids].float() * self.embed_scales[ids]

    def nbytes(self) -> int:
        """Bytes held by the weights (int8 matrices, scales, norms, RoPE tables)."""
        return self.embed_int8.numel() + self.embed_scales.numel() * 4 + decoder_nbytes(self)

    @classmethod
    def from_module(
        cls, model: torch.nn.Module, max_positions: int, *, kernel: str = "auto", head_token_ids: Tensor | None = None
    ) -> Int8Weights:
        """Quantize a transformers ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` (any float dtype).

        Reads the model, never modifies it. Raises InvalidParameterError for other
        architectures, sliding-window attention or a non-SiLU MLP.
        """
        return cls.from_state(quantized_state(model, max_positions), kernel=kernel, head_token_ids=head_token_ids)

    @classmethod
    def from_state(cls, state: dict, *, kernel: str = "auto", head_token_ids: Tensor | None = None) -> Int8Weights:
        """Build from :func:`quantized_state`'s dict (prepacks the int8 matrices for the kernel).

        ``head_token_ids`` ``[kept]``: keep only these rows of the LM head (a reduced-vocabulary
        draft head, see :mod:`verispec.runners.cpu.reduced_vocab`); logits elsewhere are -inf.
        """

        def linear(prefix: str, rows: Tensor | None = None) -> Int8Weight:
            int8, scales, bias = state[f"{prefix}.int8"], state[f"{prefix}.scales"], state.get(f"{prefix}.bias")
            if rows is not None:
                int8, scales = int8[rows].contiguous(), scales[rows].contiguous()
                bias = None if bias is None else bias[rows].contiguous()
            return Int8Weight.from_int8(int8, scales, bias, kernel=kernel)

        config = state["config"]
        layers = [
            Int8Layer(
                input_norm=state[f"layers.{i}.input_norm"],
                qkv=linear(f"layers.{i}.qkv"),
                o=linear(f"layers.{i}.o"),
                post_norm=state[f"layers.{i}.post_norm"],
                gate_up=linear(f"layers.{i}.gate_up"),
                down=linear(f"layers.{i}.down"),
            )
            for i in range(config["num_layers"])
        ]
        return cls(
            num_heads=config["num_heads"],
            num_kv_heads=config["num_kv_heads"],
            head_dim=config["head_dim"],
            rms_norm_eps=config["rms_norm_eps"],
            embed_int8=state["embed.int8"],
            embed_scales=state["embed.scales"][:, None].contiguous(),
            layers=layers,
            final_norm=state["final_norm"],
            lm_head=linear("lm_head" if "lm_head.int8" in state else "embed", head_token_ids),
            cos=state["cos"],
            sin=state["sin"],
            head_token_ids=None if head_token_ids is None else head_token_ids.long(),
        )


def decoder_nbytes(weights) -> int:
    """Bytes of everything but the embedding: linear layers (their ``nbytes()``), the LM head,
    float32 norms and RoPE tables. Shared by :class:`Int8Weights` and the gguf runner's weights."""
    total = weights.lm_head.nbytes() + (weights.final_norm.numel() + weights.cos.numel() + weights.sin.numel()) * 4
    if weights.local_cos is not None:
        total += (weights.local_cos.numel() + weights.local_sin.numel()) * 4
    for layer in weights.layers:
        total += sum(w.nbytes() for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        norms = (
            layer.input_norm,
            layer.post_norm,
            layer.q_norm,
            layer.k_norm,
            layer.attn_post_norm,
            layer.ffn_post_norm,
        )
        total += sum(norm.numel() for norm in norms if norm is not None) * 4
    return total


@torch.inference_mode()
def quantized_state(model: torch.nn.Module, max_positions: int) -> dict:
    """The int8 state of a transformers Qwen2/Llama causal LM: plain tensors, ``torch.save``-able.

    Keys: ``config`` (head counts, head_dim, eps, layer count), ``{name}.int8`` / ``.scales`` /
    ``.bias`` per linear layer (q, k, v fused as ``qkv``; gate and up as ``gate_up``), norms,
    ``embed.*`` (an untied ``lm_head.*`` only when the head is not the embedding), ``cos``/``sin``
    ``[max_positions, head_dim]``. Raises InvalidParameterError for unsupported architectures.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidParameterError(
            f"the int8 runner supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}: "
            "use --runner torch"
        )
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        raise InvalidParameterError("the int8 runner does not support sliding-window attention: use --runner torch")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise InvalidParameterError(f"the int8 runner needs a SiLU MLP, not {config.hidden_act!r}")
    decoder = model.model
    num_heads = int(config.num_attention_heads)
    state: dict = {
        "config": {
            "num_layers": len(decoder.layers),
            "num_heads": num_heads,
            "num_kv_heads": int(config.num_key_value_heads),
            "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
            "rms_norm_eps": float(config.rms_norm_eps),
        }
    }

    def put(prefix: str, weight: Tensor, bias: Tensor | None = None) -> None:
        state[f"{prefix}.int8"], state[f"{prefix}.scales"] = quantize_weight_rows(weight)
        if bias is not None:
            state[f"{prefix}.bias"] = bias.detach().float().clone()

    for i, block in enumerate(decoder.layers):
        attn, mlp = block.self_attn, block.mlp
        qkv_bias = None
        if attn.q_proj.bias is not None:
            qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        put(f"layers.{i}.qkv", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv_bias)
        put(f"layers.{i}.o", attn.o_proj.weight, attn.o_proj.bias)
        put(f"layers.{i}.gate_up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        put(f"layers.{i}.down", mlp.down_proj.weight)
        state[f"layers.{i}.input_norm"] = block.input_layernorm.weight.detach().float().clone()
        state[f"layers.{i}.post_norm"] = block.post_attention_layernorm.weight.detach().float().clone()
    put("embed", decoder.embed_tokens.weight)
    head = model.get_output_embeddings()
    if head.weight is not decoder.embed_tokens.weight:  # tied heads reuse the embedding's int8 rows
        put("lm_head", head.weight, getattr(head, "bias", None))
    state["final_norm"] = decoder.norm.weight.detach().float().clone()
    cos, sin = decoder.rotary_emb(torch.zeros(1), torch.arange(max_positions)[None, :])
    state["cos"], state["sin"] = cos[0].float().contiguous(), sin[0].float().contiguous()
    return state
