"""What every command shares: the stderr console, the one user-error handler and the options
several commands take.

A user mistake is a :class:`verispec.errors.VerispecError`, raised wherever it is found (argument
checks raise :class:`~verispec.errors.InvalidParameterError`); :func:`user_errors` turns it into
``error: ...`` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from verispec.errors import VerispecError

err = Console(stderr=True)
"""Statistics, progress, warnings and errors: stderr, so that stdout can be piped."""

USER_ERROR_EXIT = 2


@contextmanager
def user_errors(*also: type[BaseException]) -> Iterator[None]:
    """Print a :class:`VerispecError` (or one of ``also``, e.g. ``OSError``) as ``error: ...`` in
    red on stderr, the message verbatim (never read as markup), and exit with status 2.

    A context manager, and a decorator too (``@user_errors()``), as any ``contextmanager``.
    """
    try:
        yield
    except (VerispecError, *also) as exc:
        err.print(Text.assemble(("error:", "red"), f" {exc}"), highlight=False, soft_wrap=True)
        raise typer.Exit(USER_ERROR_EXIT) from None


def draft_or_none(draft: str) -> str | None:
    """``--draft none`` (any case) as None: no draft model."""
    return None if draft.lower() == "none" else draft


def resolve_draft(target: str, draft: str | None) -> str | None:
    """The draft model a command loads: ``--draft`` as given (``none``: None), or, when it is not
    given, the built-in draft where ``target`` is known to share its tokenizer, else no draft model,
    said in one line on stderr (:func:`verispec.models.preflight.default_draft`; no download, at most
    the target's GGUF header read).

    Raises:
        ModelNotFoundError, ModelIntegrityError: ``target`` names nothing usable, or a broken file.
    """
    if draft is not None:
        return draft_or_none(draft)
    from verispec.models.preflight import default_draft

    chosen = default_draft(target)
    if chosen.reason is not None:
        err.print(chosen.reason, highlight=False, markup=False, soft_wrap=True)
    return chosen.draft


# --- shared options: one definition each; a command passes its own help only where it says more.

TARGET_HELP = "Target model: built-in name, .gguf file, HF directory or hub id."
DRAFT_HELP = "Draft model reference, or 'none'."
DRAFT_DEFAULT_HELP = (
    " Default: the built-in qwen2.5-coder-0.5b-instruct when the target has its tokenizer (the built-in target "
    "does), else none (said on stderr)."
)
RUNNER_HELP = (
    "auto (default: gguf on a CPU when it can run the files, else the fastest by measured cost curves), "
    "gguf (the GGUF file's own 4-bit blocks, batch-invariant C++ kernels: exact and fast on a CPU), "
    "int8 (batch-invariant int8 re-quantization, Llama/Qwen2), llamacpp (GGUF through llama.cpp, needs the "
    "llamacpp extra; not exact under speculation) or torch (transformers, any device: the fp32 reference)."
)
WORKLOAD_HELP = (
    "Built-in workload: specbench (6 tasks), specbench-categories (13), humaneval (default: specbench); bench "
    "also takes multiturn (a support chat re-sending its conversation) and completion (a file growing at the "
    "cursor): verispec with and without its prefix cache against llama.cpp reusing its last prompt."
)
PROMPTS_HELP = "JSONL file: 'prompt' or 'turns' per line, optional 'category'."
NUM_SPECULATIVE_TOKENS_HELP = (
    "Draft tokens per target pass: the draft length under the constant schedule, the most under the others."
)

# -k's default is the one option whose value differs by command, on purpose:
K_GENERATE = 8  # generate's default schedule is cost: 8 is only the bound the controller picks k under
K_SERVE = 5  # the default of requests that give no 'speculative' of their own (SpeculativeConfig's)
K_BENCH = 5  # bench runs the constant schedule: every method compared at this one draft length
K_ADVISE = 5  # the draft length alpha and the costs are measured at; the predictions then cover k = 1..--max-k


# The default --method of generate and serve (one default for both): auto drafts with the suffix /
# n-gram lookup where it matches, else the draft model, and its cost schedule prices each step by
# what it costs the whole batch, so under continuous batching it takes plain steps when speculation
# would cost more than it saves (where draft alone keeps drafting). docs/methods.md says why.
DEFAULT_METHOD = "auto"
MAX_CONTEXT_HELP = (
    "Context window in tokens (prompt + output), the KV cache each sequence allocates (default: "
    "min(the model's trained context, 4096); at most the trained context). A request whose prompt plus "
    "max tokens exceeds it is refused."
)


DTYPE_HELP = (
    "float32, bfloat16 or float16: the float model of --runner torch / transformers (the gguf, int8 and "
    "llama.cpp runners compute in their own formats)."
)
DRAFT_QUANTIZATION_HELP = (
    "auto (iq4_nl on the gguf runner, else none); none; int8 (weight-only, --runner torch); iq4_nl or q4_0 "
    "(--runner gguf: the draft's 5-8-bit matrices re-quantized to 4.5 bits per weight as they load, once, "
    "kept under $VERISPEC_HOME/weights). Changes only what the draft proposes, never the output."
)
HEAD_QUANTIZATION_HELP = (
    "The EAGLE head's linear layers at inference: auto (q8_0 over the gguf runner, else none), none "
    "(float32), q8_0 or iq4_nl (GGUF blocks, the gguf kernels). Changes only what the head drafts, never "
    "the output."
)
EAGLE_HEAD_HELP = (
    "EAGLE-3 head for --method eagle (and for auto to draft with it where the lookup fails): a file "
    "from verispec train-head, or a published EAGLE-3 folder (config.json + model.safetensors or "
    "pytorch_model.bin, as the EAGLE authors and SpecForge publish and vLLM/SGLang load), converted once "
    "and cached under $VERISPEC_HOME/eagle-heads."
)


# Each shared option once, as the type of a command's parameter (``target: Target = DEFAULT_TARGET``;
# the default stays in the signature, where typer reads it). A command that says more about an
# option passes its own help to the factory: ``Annotated[str, target_option("...")]``.


def target_option(help: str = TARGET_HELP) -> Any:
    """``--target``; default :data:`DEFAULT_TARGET`."""
    return typer.Option(help=help)


def draft_option(help: str = DRAFT_HELP) -> Any:
    """``--draft``: None when not given (:func:`resolve_draft` decides then)."""
    return typer.Option(help=help + DRAFT_DEFAULT_HELP, show_default=False)


def runner_option(help: str = RUNNER_HELP) -> Any:
    """``--runner``; default ``auto``."""
    return typer.Option(help=help)


def prompts_option(help: str = PROMPTS_HELP) -> Any:
    return typer.Option(help=help)


def json_option(help: str) -> Any:
    """``--json``; default False."""
    return typer.Option("--json", help=help)


Target = Annotated[str, target_option()]
Draft = Annotated[str | None, draft_option()]
Runner = Annotated[str, runner_option()]
Dtype = Annotated[str, typer.Option(help=DTYPE_HELP)]
MaxContext = Annotated[int | None, typer.Option("--max-context", min=1, help=MAX_CONTEXT_HELP)]
NumSpeculativeTokens = Annotated[int, typer.Option("--num-speculative-tokens", "-k", help=NUM_SPECULATIVE_TOKENS_HELP)]
"""``-k/--num-speculative-tokens``; its default is one of the ``K_*`` constants above."""
DraftQuantization = Annotated[str, typer.Option(help=DRAFT_QUANTIZATION_HELP)]
DraftVocab = Annotated[
    int | None,
    typer.Option(
        help="Reduced draft LM head: keep this many most frequent tokens (FR-Spec; --runner gguf or int8); "
        "on gguf it also scores each request's own tokens. Default: 32768 on gguf for vocabularies over 65536, "
        "else the full head; 0: the full head."
    ),
]
DraftVocabCorpus = Annotated[
    list[str] | None,
    typer.Option(help="Text file whose token counts pick the --draft-vocab tokens (repeatable; default: BPE rank)."),
]
HeadQuantization = Annotated[str, typer.Option(help=HEAD_QUANTIZATION_HELP)]
EagleHead = Annotated[Path | None, typer.Option(help=EAGLE_HEAD_HELP)]
Workload = Annotated[str | None, typer.Option(help=WORKLOAD_HELP)]
Prompts = Annotated[Path | None, prompts_option()]
Categories = Annotated[str | None, typer.Option(help="Comma-separated categories to keep.")]
ChatTemplate = Annotated[
    bool | None,
    typer.Option("--chat/--no-chat", help="Force the chat template (default: 'turns' lines use it)."),
]
"""``--chat/--no-chat`` of the workload commands: None leaves it to each prompt line."""
