"""An EAGLE-3 draft head: one decoder layer over the target's own features (Li et al. 2025,
"EAGLE-3", arXiv 2503.01840, §3; EAGLE-1/2: arXiv 2401.15077, 2406.16858).

Owns the head's weights, its reduced draft vocabulary (``d2t``) and its own KV cache. The
target's token embedding is borrowed (a reference, frozen, never in the state dict). Knows
nothing about drafting policy, verification or training (``verispec.training.loop``).

Alignment (EAGLE §3): a row pairs the target's feature of the token at position ``p`` with the
embedding of the token at ``p + 1`` and predicts the token at ``p + 2``; the row sits at position
``p`` in the head's cache. The next draft step feeds the row's output ``hidden`` in place of the
fused feature, at position ``p + 1``. Several sequences of one head draft in one pass through
:func:`verispec.runners.eagle.passes.forward_heads`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.errors import InvalidParameterError, ModelIntegrityError, ModelNotFoundError, one_line
from verispec.runners.cpu.reduced_vocab import choose_draft_vocabulary  # noqa: F401  (the head's vocabulary, re-exported)
from verispec.runners.eagle.file import is_gguf, read_head_gguf, write_head_gguf
from verispec.runners.eagle.passes import HeadCall, forward_heads
from verispec.runners.eagle.published import converted_head
from verispec.runners.eagle.shape import SUPPORTED_MODEL_TYPES, HeadShape, rope_inv_freq  # noqa: F401  (re-exported)
from verispec.runners.eagle.target import HeadTarget, final_norm, norm_digest
from verispec.runners.features import default_feature_layers


def _checked_d2t(d2t: Sequence[int] | Tensor, vocab_size: int) -> Tensor:
    d2t = torch.as_tensor(d2t, dtype=torch.long).reshape(-1)
    if d2t.numel() == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size:
        raise InvalidParameterError(f"draft token ids must be one or more ids in [0, {vocab_size})")
    return d2t


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False)  # initialised by the head


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class EagleHead(nn.Module):
    """EAGLE-3 head (§3): ``fc`` fuses the target's features, one decoder layer attends over the
    head's own cache, ``lm_head`` scores the draft vocabulary.

    Args:
        shape: dimensions (:meth:`HeadShape.of_target`).
        embed_tokens: the target's input embedding module (``[ids] -> [ids, hidden]``), borrowed.
        d2t: int64 ``[draft_vocab_size]`` target token id of each draft row.
        lm_head_weight: ``[draft_vocab_size, hidden]`` initial rows (the target's, of ``d2t``);
            None: random.
        seed: seeds the random initialisation (an own ``torch.Generator``; global RNG untouched).
    Raises:
        InvalidParameterError: the embedding's width or vocabulary is not the shape's, or ``d2t``
            has the wrong length or ids outside the vocabulary.
    """

    def __init__(
        self,
        shape: HeadShape,
        embed_tokens: nn.Module,
        d2t: Tensor,
        lm_head_weight: Tensor | None = None,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__()
        hidden, heads, head_dim = shape.hidden_size, shape.num_attention_heads, shape.head_dim
        kv_heads = shape.num_key_value_heads
        embedding_device = getattr(getattr(embed_tokens, "weight", None), "device", "cpu")  # a target on --device
        width = embed_tokens(torch.zeros(1, dtype=torch.long, device=embedding_device)).shape[-1]
        rows = getattr(embed_tokens, "num_embeddings", shape.vocab_size)  # a lookup function: checked by the caller
        if width != hidden or rows != shape.vocab_size:
            raise InvalidParameterError(
                f"the head expects a target of hidden size {hidden} and vocabulary {shape.vocab_size}; "
                f"this target has {width} and {rows}"
            )
        d2t = _checked_d2t(d2t, shape.vocab_size)
        if d2t.numel() != shape.draft_vocab_size:
            raise InvalidParameterError(f"d2t holds {d2t.numel()} ids, the head {shape.draft_vocab_size} rows")
        self.shape = shape
        self.__dict__["embed_tokens"] = embed_tokens  # a reference: no parameter, not in the state dict
        self.fc = _linear(len(shape.feature_layers) * hidden, hidden)
        self.input_norm = nn.RMSNorm(hidden, eps=shape.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=shape.rms_norm_eps)
        self.q_proj = _linear(2 * hidden, heads * head_dim)
        self.k_proj = _linear(2 * hidden, kv_heads * head_dim)
        self.v_proj = _linear(2 * hidden, kv_heads * head_dim)
        self.o_proj = _linear(heads * head_dim, hidden)
        self.post_attention_norm = nn.RMSNorm(hidden, eps=shape.rms_norm_eps)
        self.gate_proj = _linear(hidden, shape.intermediate_size)
        self.up_proj = _linear(hidden, shape.intermediate_size)
        self.down_proj = _linear(shape.intermediate_size, hidden)
        self.norm = nn.RMSNorm(hidden, eps=shape.rms_norm_eps)
        self.lm_head = _linear(hidden, shape.draft_vocab_size)
        if shape.lm_head_from_target:  # EAGLE-1's shared, frozen LM head (rows of d2t)
            self.lm_head.weight.requires_grad_(False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("inv_freq", rope_inv_freq(shape), persistent=False)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.02, generator=generator)  # transformers' initializer_range
            if lm_head_weight is not None:
                self.lm_head.weight.copy_(lm_head_weight)
        self._keys = self._values = torch.zeros(kv_heads, 0, head_dim)  # [kv_heads, cached, head_dim]
        self.training_record: dict = {}

    @classmethod
    def from_target(
        cls,
        model: nn.Module,
        feature_layers: Sequence[int] | None = None,
        draft_token_ids: Tensor | None = None,
        *,
        seed: int = 0,
        intermediate_size: int | None = None,
        lm_head_from_target: bool = False,
    ) -> EagleHead:
        """A fresh head for a transformers Qwen2/Llama-family causal LM.

        Args:
            feature_layers: hidden-state indices fused by ``fc`` (None: :func:`default_feature_layers`).
            draft_token_ids: ``[draft_vocab_size]`` target ids the head can propose (None: all;
                :func:`choose_draft_vocabulary` picks them); ``lm_head`` starts from their rows.
            intermediate_size: the width of the head's MLP (None: the target's). A narrower MLP
                makes each drafted token and each training step cheaper (the target's 8960 is
                half of a 1.5B target's head at 16k draft rows).
            lm_head_from_target: keep ``lm_head`` at the target's rows, frozen (EAGLE, Li et al.
                2024, arXiv 2401.15077, §4.1: the draft shares the target's LM head), with ``norm``
                starting from the target's final norm: fewer weights to learn from little data,
                a cheaper training step, and a file without the rows (the target lends them when
                the head loads). False: EAGLE-3's own head, trained from those rows.
        Raises:
            InvalidParameterError: an unsupported architecture, a bad layer or token id, or an
                ``intermediate_size`` below 1.
        """
        config = model.config
        layers = default_feature_layers(int(config.num_hidden_layers)) if feature_layers is None else feature_layers
        target_rows = model.get_output_embeddings().weight.detach()
        vocab = target_rows.shape[0]
        d2t = _checked_d2t(torch.arange(vocab) if draft_token_ids is None else draft_token_ids, vocab)
        shape = HeadShape.of_target(config, layers, d2t.numel())
        if intermediate_size is not None:
            if intermediate_size < 1:
                raise InvalidParameterError(f"the head's MLP width must be >= 1, not {intermediate_size}")
            shape = replace(shape, intermediate_size=int(intermediate_size))
        norm = final_norm(model)
        if norm is not None:
            shape = replace(shape, target_norm_sha256=norm_digest(norm))
        shape = replace(shape, lm_head_from_target=bool(lm_head_from_target))
        head = cls(shape, model.get_input_embeddings(), d2t, target_rows[d2t].float(), seed=seed)
        if lm_head_from_target and norm is not None:
            with torch.no_grad():
                head.norm.weight.copy_(norm.detach().float())
        return head

    @property
    def config(self) -> dict:
        """What storing the head needs besides its state dict: :class:`HeadShape` as a dict."""
        return {"architecture": "eagle3", **asdict(self.shape), "feature_layers": list(self.shape.feature_layers)}

    def stored_state(self) -> dict[str, Tensor]:
        """The state dict a file holds: without ``lm_head.weight`` when it is the target's."""
        state = self.state_dict()
        if self.shape.lm_head_from_target:
            state.pop("lm_head.weight")
        return state

    def save(self, path: str | Path, weights: str = "f32") -> None:
        """Write the head (no embedding, no KV cache) with :attr:`training_record` (how it was
        trained: command, seed, data manifest), atomically (a temporary file beside ``path``,
        then a rename), so a crash mid-write leaves the previous file whole. A ``.gguf`` path
        gets GGUF (:mod:`verispec.runners.eagle.file`), any other ``torch.save`` of
        ``{"config", "state_dict", "training"}``.

        ``weights``: the GGUF file's matrices as ``"f32"``, ``"f16"`` or ``"q8_0"``
        (:func:`~verispec.runners.eagle.file.write_head_gguf`); a torch file is always float32.

        Raises:
            InvalidParameterError: the head was quantized for inference (its float weights are
                gone), or an unknown ``weights``.
        """
        if getattr(self, "quantization", None):
            raise InvalidParameterError(
                f"this head was quantized to {self.quantization} for inference; save the float head"
            )
        path = Path(path)
        if path.suffix == ".gguf":
            write_head_gguf(path, self.config, self.stored_state(), self.training_record, weights)
            return
        partial = path.with_name(path.name + ".partial")
        torch.save(
            {"config": self.config, "state_dict": self.stored_state(), "training": self.training_record}, partial
        )
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | Path, target: object) -> EagleHead:
        """The head written by :meth:`save`, or a folder in the published EAGLE-3 layout
        (:func:`~verispec.runners.eagle.published.converted_head`), borrowing the embedding of
        ``target``: a transformers model or a runner that runs it (:class:`HeadTarget`).

        Raises:
            ModelNotFoundError: no file at ``path`` (a folder: no config.json or no weights).
            ModelIntegrityError: the file is not a head written by :meth:`save` (truncated, corrupt).
            InvalidParameterError: the head was trained for a target of another architecture,
                hidden size, vocabulary or depth, or for another target of the same shapes (its
                :func:`norm_digest` differs), or ``target`` hands out no embedding; a published
                folder of a layout it does not read.
        """
        facts = HeadTarget.of(target)
        path = Path(path)
        if path.is_dir():  # a published EAGLE-3 checkpoint: converted once into a head file, cached
            path = converted_head(path, facts)
        if not path.is_file():
            raise ModelNotFoundError(f"no EAGLE head at {path}")
        published = path.name in ("config.json", "pytorch_model.bin") or path.name.endswith(
            (".safetensors", ".index.json")
        )
        if published and (path.parent / "config.json").is_file():
            raise InvalidParameterError(  # a file of a published folder (its config.json or weights)
                f"{path} is a file of a published EAGLE-3 folder: give the folder, --eagle-head {path.parent}"
            )
        try:
            if is_gguf(path):
                config, state, training = read_head_gguf(path)
            else:
                stored = torch.load(path, map_location="cpu", weights_only=True)
                config, state, training = stored["config"], stored["state_dict"], stored.get("training")
            shape = HeadShape.from_fields(config)
        except ModelIntegrityError:
            raise
        except Exception as exc:  # torch raises many kinds for a damaged file
            raise ModelIntegrityError(
                f"{path} is not a readable EAGLE head ({one_line(exc)}); a head is the .gguf or "
                "torch file verispec train-head writes"
            ) from exc
        state = facts.check_head(shape, state, path)  # another target refused; a shared LM head's rows lent
        head = cls(shape, facts.embed_tokens, state["d2t"])
        try:
            head.load_state_dict(state)
        except RuntimeError as exc:
            raise ModelIntegrityError(f"{path}: its weights do not fit its own config ({exc})") from exc
        head.training_record = dict(training or {})
        return head

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Target token ids (int64, same shape) of draft-vocabulary rows ``draft_ids``."""
        return self.d2t[draft_ids]

    def fuse(self, features: Tensor) -> Tensor:
        """``fc`` over the target's concatenated features ``[T, layers * hidden]`` -> ``[T, hidden]``."""
        if features.dim() != 2 or features.shape[1] != self.fc.in_features:
            raise InvalidParameterError(f"features must be [rows, {self.fc.in_features}], got {list(features.shape)}")
        return self.fc(features.to(self.norm.weight.dtype))  # fc may be a block-quantized layer (eagle_blocks)

    def logits(self, hidden: Tensor, dtype: torch.dtype | None = torch.float32) -> Tensor:
        """``[T, draft_vocab_size]`` scores of the draft rows from the layer's output, as
        ``dtype`` (None: the head's own, e.g. bf16 in training, where the loss reads them in fp32)."""
        scores = self.lm_head(self.norm(hidden))
        return scores if dtype is None else scores.to(dtype)

    def layer(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, past_keys: Tensor, past_values: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The decoder layer (§3) over explicit keys: rows attend to ``past + their own`` keys.

        Args:
            hidden: ``[T, hidden]`` fused features or the head's previous outputs.
            token_ids: int64 ``[T]`` the token after each row's (embedded by the target).
            positions: int64 ``[T]`` rotary positions.
            past_keys, past_values: ``[kv_heads, S, head_dim]`` (rotated keys).
            mask: bool ``[T, S + T]``, True where a row may attend.
        Returns:
            ``(out [T, hidden], keys [kv_heads, T, head_dim], values [kv_heads, T, head_dim])``.
        """
        out, [(keys, values)] = self.layer_segments(hidden, token_ids, positions, [(past_keys, past_values, mask)])
        return out, keys, values

    def layer_segments(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, segments: Sequence[tuple[Tensor, Tensor, Tensor]]
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """:meth:`layer` over the rows of several sequences at once: ``segments`` holds each one's
        ``(past_keys, past_values, mask)``, in row order (segment i's rows are the next
        ``mask.shape[0]`` rows). Norms, projections and the MLP run over all rows (the weights
        read once), attention per segment over its own keys. Returns ``(out [T, hidden], [(keys,
        values)] of each segment's rows)``."""
        shape, rows = self.shape, hidden.shape[0]
        with torch.no_grad():  # the target's embedding stays frozen
            embedded = self.embed_tokens(token_ids).to(hidden.dtype)
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_norm(embedded), normed], dim=-1)
        q = self.q_proj(x).view(rows, shape.num_attention_heads, shape.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(rows, shape.num_key_value_heads, shape.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(rows, shape.num_key_value_heads, shape.head_dim).transpose(0, 1)
        angles = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], -1)  # fp32 even for a bf16 head (positions up to thousands)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        parts, new, start = [], [], 0
        for past_keys, past_values, mask in segments:
            stop = start + mask.shape[0]
            new.append((k[:, start:stop], v[:, start:stop]))
            keys, values = torch.cat([past_keys, new[-1][0]], dim=1), torch.cat([past_values, new[-1][1]], dim=1)
            parts.append(
                F.scaled_dot_product_attention(
                    q[None, :, start:stop],
                    keys[None],
                    values[None],
                    attn_mask=mask[None, None],
                    enable_gqa=True,  # GQA: kv heads shared
                )[0]
            )
            start = stop
        attended = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        residual = normed if shape.norm_before_residual else hidden  # EAGLE-3's: before hidden_norm
        h = residual + self.o_proj(attended.transpose(0, 1).reshape(rows, -1))
        y = self.post_attention_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)), new

    def new_sequence(self) -> EagleHead:
        """The same head for another sequence: the weights shared (not copied), its own empty KV cache."""
        clone = copy.copy(self)  # the parameter dicts are shared; the cache attributes become the clone's
        clone._keys, clone._values = self._keys[:, :0], self._values[:, :0]
        return clone

    @property
    def num_cached_tokens(self) -> int:
        """Rows in the head's KV cache (= the default position of the next row)."""
        return self._keys.shape[1]

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cache rows (0 empties; the current length is a no-op).
        Raises ValueError beyond the length."""
        if not 0 <= num_tokens <= self.num_cached_tokens:
            raise ValueError(f"cannot truncate a cache of {self.num_cached_tokens} rows to {num_tokens}")
        self._keys, self._values = self._keys[:, :num_tokens], self._values[:, :num_tokens]

    def release(self) -> None:
        """Empty the cache and free its storage (``truncate(0)`` keeps a view of it)."""
        self._keys, self._values = self._keys[:, :0].clone(), self._values[:, :0].clone()

    def forward(
        self,
        token_ids: Sequence[int] | Tensor,
        *,
        features: Tensor | None = None,
        hidden: Tensor | None = None,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Append ``T`` rows to the head's cache and score them (inference).

        Args:
            token_ids: ``[T]`` the token after each row's feature.
            features: float ``[T, layers * hidden]`` target features (through ``fc``); or
            hidden: float ``[T, hidden]`` the head's own earlier outputs (``fc`` skipped).
            positions: int64 ``[T]`` (None: ``num_cached_tokens ...``).
            attention_mask: bool ``[T, num_cached_tokens + T]`` (None: causal), e.g. a tree's.
        Returns:
            ``(logits float32 [T, draft_vocab_size], hidden [T, hidden])``; ``hidden`` (before the
            final norm) feeds the next draft step.
        Raises:
            InvalidParameterError: not exactly one of ``features`` / ``hidden``, or a bad shape.
        """
        return forward_heads([HeadCall(self, token_ids, features, hidden, positions, attention_mask)])[0]
