"""What a request's prompt becomes and whether it fits: a prompt's or a conversation's token ids
(raw, one user turn, or OpenAI messages through the chat template), the pipeline's conversation
methods (:class:`PromptMethods`), the refusal of a request past the context window, and the same
checks run from the tokenizer before any weights load (:class:`PromptCheck`). Knows nothing about
loading weights or decoding.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verispec.algorithms.sampling import SamplingParams
from verispec.engine.request import GenerationOutput, SpeculativeConfig, StreamChunk
from verispec.errors import ContextLengthError, InvalidParameterError
from verispec.models.conversation import conversation_ids
from verispec.models.gguf_tokenizer import chat_token_ids
from verispec.models.loading import LoadedModel, TokenizerInfo
from verispec.runners.select import DEFAULT_MAX_CONTEXT, RunnerOptions

if TYPE_CHECKING:
    from verispec.engine.loop import SpeculativeEngine


@dataclass(frozen=True)
class PromptCheck:
    """A request :meth:`verispec.engine.loader.SpeculativePipeline.load` refuses before any weights
    load when it could not run: ``chat`` on a model without a chat template, or ``prompt`` (as
    :func:`encode_prompt` makes it) plus ``max_tokens`` past the context window. Known from the GGUF header and the
    tokenizer in well under 5 s, instead of after the models load."""

    prompt: str
    max_tokens: int = 0
    chat: bool = False


def encode_prompt(tokenizer, name: str, prompt: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``prompt`` as the pipeline feeds them to ``name``'s model: with ``chat``, one
    user turn through the tokenizer's chat template (BOS as llama.cpp puts it), else the text with
    the tokenizer's special tokens (BOS where the model adds one).

    Raises:
        InvalidParameterError: empty prompt, or ``chat`` for a tokenizer without a chat template.
    """
    if not prompt:
        raise InvalidParameterError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidParameterError(f"{name} has no chat template: drop --chat")
        return chat_token_ids(tokenizer, [{"role": "user", "content": prompt}])  # BOS as llama.cpp
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def check_window(num_prompt_tokens: int, max_tokens: int, window: int) -> None:
    """Refuse a request of ``num_prompt_tokens`` + ``max_tokens`` that cannot finish inside a
    context ``window`` (tokens).

    Raises:
        ContextLengthError: ``num_prompt_tokens`` >= ``window``, or ``num_prompt_tokens +
            max_tokens`` > ``window``; the message gives the numbers.
    """
    if num_prompt_tokens >= window:
        raise ContextLengthError(
            f"the prompt has {num_prompt_tokens} tokens but the context window is {window}: shorten it"
        )
    if num_prompt_tokens + max_tokens > window:
        raise ContextLengthError(
            f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens} "
            f"({num_prompt_tokens + max_tokens} in all) but the context window is {window}: "
            f"ask for at most {window - num_prompt_tokens} tokens, shorten the prompt or raise --max-context"
        )


def check_prompt_first(check: PromptCheck, info: TokenizerInfo, kind: str, runners: RunnerOptions) -> None:
    """:class:`PromptCheck` against a tokenizer and the window the runner ``kind`` will have: the
    trained context, cut to ``runners.max_context_length`` or, on every runner but torch, to
    ``DEFAULT_MAX_CONTEXT`` (``auto`` not decided yet: the trained context, the larger)."""
    token_ids = encode_prompt(info.tokenizer, info.name, check.prompt, chat=check.chat)
    if runners.max_context_length is not None:
        capacity = runners.max_context_length
    elif kind in ("torch", "auto"):
        capacity = info.context_length
    else:
        capacity = DEFAULT_MAX_CONTEXT
    check_window(len(token_ids), check.max_tokens, min(info.context_length, capacity))


class PromptMethods:
    """The prompt side of :class:`verispec.engine.loader.SpeculativePipeline`, which mixes it in:
    a prompt or a conversation as token ids, and a conversation's next turn (:meth:`chat`,
    :meth:`stream_chat`). Uses the pipeline's ``tokenizer``, ``target`` and ``engine``."""

    tokenizer: Any
    target: LoadedModel
    engine: SpeculativeEngine

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; with ``chat``, as one user turn through the model's template.

        Raises:
            InvalidParameterError: empty prompt, or ``chat`` for a model without a chat template.
        """
        return encode_prompt(self.tokenizer, self.target.name, prompt, chat=chat)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a conversation through the target's chat template, ready for the
        assistant's turn, exactly as the server's ``/v1/chat/completions`` renders it
        (:func:`verispec.models.conversation.conversation_ids`: OpenAI message and tool dicts).

        Raises:
            ConversationError (an InvalidParameterError): no chat template, no messages, a message
                of an unknown role or without content, or messages the template refuses.
        """
        return conversation_ids(self.tokenizer, self.target.name, messages, tools)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        learn: bool = True,
    ) -> GenerationOutput:
        """The assistant's next turn of a conversation: ``messages`` as OpenAI chat messages
        (``[{"role": "system", "content": ...}, {"role": "user", ...}, {"role": "assistant", ...}, ...]``),
        ``tools`` as OpenAI tool definitions, rendered by :meth:`encode_chat` (the server's template
        code), then generated as :meth:`generate` does. The text is the model's own: a tool call
        comes as the model writes it (Qwen2.5: a ``<tool_call>`` block; the server parses those
        into ``tool_calls``). Raises as :meth:`encode_chat` and the engine do.

        Example::

            out = pipe.chat([{"role": "system", "content": "Answer in one line."},
                             {"role": "user", "content": "What is a KV cache?"}], SamplingParams(max_tokens=64))
        """
        return self.engine.generate(self.encode_chat(messages, tools), params, spec, learn=learn)

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Iterator[StreamChunk]:
        """:meth:`chat`'s turn as stream chunks; the last one carries the output."""
        return self.engine.stream(self.encode_chat(messages, tools), params, spec)
