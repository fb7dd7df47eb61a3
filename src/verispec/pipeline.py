"""Loading a target (and optionally a draft) into a ready-to-use engine: the library entry point.

Owns: the wiring of model store -> runners -> drafters -> engine, the compatibility check of the
pair, prompt encoding (chat template or raw) and the description of the loaded models (load
time, memory). Knows nothing about the decoding algorithm itself.

Example::

    pipe = SpeculativePipeline.load()                    # built-in Qwen2.5-Coder 1.5B + 0.5B
    out = pipe.generate("def fibonacci(n):", SamplingParams(max_tokens=64))
    print(out.text, out.metrics.spec.acceptance_rate)
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Iterator

from verispec.engine import GenerationOutput, SpeculativeConfig, SpeculativeEngine, StreamChunk
from verispec.errors import InvalidParameterError
from verispec.models.compat import check_draft_compatibility
from verispec.models.loading import LoadedModel, load_model
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners.torch_runner import TransformersRunner
from verispec.sampling import SamplingParams

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass
class ModelSummary:
    """What a user needs to know about one loaded model. Bytes and seconds."""

    role: str
    name: str
    path: str | None
    load_time_s: float
    param_bytes: int
    vocab_size: int
    context_length: int

    @classmethod
    def of(cls, role: str, loaded: LoadedModel) -> ModelSummary:
        return cls(
            role=role,
            name=loaded.name,
            path=str(loaded.path) if loaded.path else None,
            load_time_s=loaded.load_time_s,
            param_bytes=loaded.param_bytes,
            vocab_size=loaded.vocab_size,
            context_length=loaded.context_length,
        )


class SpeculativePipeline:
    """A target, an optional draft, their tokenizer and the engine over them.

    Use :meth:`load`; the constructor takes already loaded models (tests, custom setups).
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None) -> None:
        if draft is not None:
            check_draft_compatibility(
                target.tokenizer,
                draft.tokenizer,
                target_vocab_size=target.vocab_size,
                draft_vocab_size=draft.vocab_size,
                target_eos_token_ids=target.eos_token_ids,
                draft_eos_token_ids=draft.eos_token_ids,
            )
        self.target = target
        self.draft = draft
        self.tokenizer = target.tokenizer
        proposers = {}
        if draft is not None:
            proposers["draft"] = DraftModelProposer(
                TransformersRunner(draft.model, max_context_length=draft.context_length)
            )
        self.engine = SpeculativeEngine(
            TransformersRunner(target.model, max_context_length=target.context_length),
            self.tokenizer,
            eos_token_ids=target.eos_token_ids,
            proposers=proposers,
        )

    @classmethod
    def load(
        cls,
        target: str = DEFAULT_TARGET,
        draft: str | None = DEFAULT_DRAFT,
        *,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> SpeculativePipeline:
        """Load the target and (unless ``draft`` is None) the draft, then check they fit together.

        Raises:
            ModelNotFoundError, ModelIntegrityError, ModelFetchError: from the model store.
            IncompatibleDraftError: the draft's tokenizer or EOS differs from the target's.
            InvalidParameterError: unknown dtype.
        """
        target_model = load_model(target, dtype=dtype, device=device)
        draft_model = load_model(draft, dtype=dtype, device=device) if draft else None
        return cls(target_model, draft_model)

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; with ``chat``, as one user turn through the model's template.

        Raises:
            InvalidParameterError: empty prompt, or ``chat`` for a model without a chat template.
        """
        if not prompt:
            raise InvalidParameterError("the prompt is empty")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidParameterError(f"{self.target.name} has no chat template: drop --chat")
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def generate(
        self, prompt: str, params: SamplingParams | None = None, spec: SpeculativeConfig | None = None, *, chat: bool = False
    ) -> GenerationOutput:
        """Encode ``prompt`` and generate; see :meth:`SpeculativeEngine.stream`."""
        return self.engine.generate(self.encode(prompt, chat=chat), params, spec)

    def stream(
        self, prompt: str, params: SamplingParams | None = None, spec: SpeculativeConfig | None = None, *, chat: bool = False
    ) -> Iterator[StreamChunk]:
        """Encode ``prompt`` and stream chunks; the last one carries the output."""
        return self.engine.stream(self.encode(prompt, chat=chat), params, spec)

    def model_summaries(self) -> list[ModelSummary]:
        summaries = [ModelSummary.of("target", self.target)]
        if self.draft is not None:
            summaries.append(ModelSummary.of("draft", self.draft))
        return summaries


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
