"""One pipeline's options, parsed once: what generate, serve (and its replicas), bench, advise and
train-head share (the models, the runner, the drafters), the one check that refuses every user
mistake among them before any model loads, and the one place the loader's
:class:`~verispec.engine.loader.DrafterOptions` and :class:`~verispec.runners.select.RunnerOptions`
are built from the command line.

The options themselves are declared once, in :mod:`verispec.cli.common`, as the types of each
command's parameters; a command hands its parameters over with ``PipelineOptions.from_cli(params)``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from verispec.cli.common import err, resolve_draft
from verispec.engine.loader import DEFAULT_TARGET, DrafterOptions, PromptCheck, SpeculativePipeline
from verispec.engine.methods import needs_head, uses_draft_model
from verispec.engine.prefix_cache import DEFAULT_PREFIX_CACHE_GIB
from verispec.errors import InvalidParameterError
from verispec.runners.select import RUNNERS, RunnerOptions

T = TypeVar("T")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # serve's --max-num-batched-tokens default, the engine's own


def from_params(cls: type[T], params: Mapping[str, Any], **overrides: Any) -> T:
    """``cls`` (a dataclass) from a command's parameters (``locals()`` on entry): each field
    taken from the parameter of its name where the command has one, ``overrides`` last."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in params.items() if k in names} | overrides)


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline a command loads, as its options say (names as the command-line options').

    Attributes:
        target, draft: ``--target``; ``--draft`` as given (None: the default draft,
            :func:`~verispec.cli.common.resolve_draft`; ``none``: no draft model).
        method: the method decoded (generate), the requests' default (serve), or None where a
            command compares several (bench, advise).
        one_method: only ``method`` runs (generate, train-head): the draft model loads only
            where that method drafts with it.
        runners_listed: ``--runner`` is a comma-separated list, one pipeline each (bench).
        dtype, runner, max_context, draft_vocab, draft_vocab_corpus: how the models run
            (:meth:`runner_options`).
        min_ngram, max_ngram, layer_skip_layers, draft_quantization, tree_choices (the option's
            JSON text), eagle_head, head_quantization, datastore: the drafters (:meth:`drafters`).
        prefix_cache_gib, max_num_batched_tokens: the engine's (serve's options).
        draft_model: the draft model loaded, set by :meth:`check_before_loading` (None: none).
        checked: whether :meth:`check_before_loading` made these options; :meth:`load` needs it.
    """

    target: str = DEFAULT_TARGET
    draft: str | None = None
    method: str | None = None
    one_method: bool = False
    runners_listed: bool = False
    dtype: str = "float32"
    runner: str = "auto"
    max_context: int | None = None
    draft_vocab: int | None = None
    draft_vocab_corpus: tuple[str, ...] | list[str] | None = ()
    min_ngram: int = 2
    max_ngram: int = 4
    layer_skip_layers: int | None = None
    draft_quantization: str = "auto"
    tree_choices: str | None = None
    eagle_head: Path | None = None
    head_quantization: str = "auto"
    datastore: Path | None = None
    prefix_cache_gib: float = DEFAULT_PREFIX_CACHE_GIB
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    draft_model: str | None = None
    checked: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "draft_vocab_corpus", tuple(self.draft_vocab_corpus or ()))

    @classmethod
    def from_cli(cls, params: Mapping[str, Any], **overrides: Any) -> PipelineOptions:
        """The options from a command's parameters (see :func:`from_params`)."""
        return from_params(cls, params, **overrides)

    @property
    def runner_kinds(self) -> list[str]:
        """The runners to load: ``--runner``, or each one it lists (:attr:`runners_listed`)."""
        if not self.runners_listed:
            return [self.runner]
        return [part.strip() for part in self.runner.split(",") if part.strip()] or ["auto"]

    def drafters(self) -> DrafterOptions:
        """How the drafters are built: the one place the command line makes them.

        Raises:
            InvalidParameterError: malformed ``--tree-choices`` or one without ``--method tree``,
                an unknown quantization, a negative layer count.
        """
        return DrafterOptions(
            min_ngram=self.min_ngram,
            max_ngram=self.max_ngram,
            layer_skip_layers=self.layer_skip_layers,
            draft_quantization=self.draft_quantization,
            tree_choices=parse_tree_choices(self.tree_choices, self.method),
            eagle_head=self.eagle_head,
            head_quantization=self.head_quantization,
            datastore=self.datastore,
        )

    def runner_options(self, kind: str | None = None) -> RunnerOptions:
        """How the models run, on ``kind`` (default: ``--runner``). Raises InvalidParameterError."""
        return RunnerOptions(
            kind=kind or self.runner,
            max_context_length=self.max_context,
            draft_vocab_size=self.draft_vocab,
            draft_vocab_corpus=self.draft_vocab_corpus,
        )

    def check_before_loading(self, *, models: bool = False) -> PipelineOptions:
        """Refuse every mistake in these options before any model loads, and return them with
        the draft model decided (:attr:`draft_model`; the default draft said on stderr).
        ``models``: also read the model references and compare the vocabularies
        (:func:`verispec.models.preflight.check_before_loading`), for loads that happen elsewhere
        (replicas, each of which would otherwise fail on its own).

        Raises:
            InvalidParameterError: the refusals of :meth:`_check_options` and :meth:`_check_draft`.
            ModelNotFoundError, ModelIntegrityError, IncompatibleDraftError: ``models`` checks.
        """
        self._check_options()
        if self.one_method and not uses_draft_model(self.method or "none"):
            draft_model = None
        else:
            draft_model = resolve_draft(self.target, self.draft)
        self._check_draft(draft_model)
        if models:
            from verispec.models.preflight import check_before_loading

            check_before_loading(self.target, draft_model)
        return dataclasses.replace(self, draft_model=draft_model, checked=True)

    def _check_options(self) -> None:
        """The refusals that need no model reference: a method without its drafter, the
        drafters' and runners' own checks."""
        if self.method == "layer-skip" and self.layer_skip_layers == 0:
            raise InvalidParameterError("--method layer-skip with --layer-skip-layers 0: nothing would draft")
        self.drafters()  # its checks: the tree, the quantizations
        if self.method is not None and needs_head(self.method) and self.eagle_head is None:
            raise InvalidParameterError(
                f"--method {self.method} needs --eagle-head FILE (a head from verispec train-head) or a published "
                "EAGLE-3 folder"
            )
        if self.eagle_head is not None and not Path(self.eagle_head).exists():
            raise InvalidParameterError(
                f"--eagle-head {self.eagle_head}: no such file or folder (a head from verispec train-head, or a "
                "published EAGLE-3 folder)"
            )
        unknown = [kind for kind in self.runner_kinds if kind not in RUNNERS]
        if unknown and self.runners_listed:
            raise InvalidParameterError(f"unknown runner {', '.join(unknown)}; choose from {', '.join(RUNNERS)}")
        for kind in self.runner_kinds:
            self.runner_options(kind)

    def _check_draft(self, draft_model: str | None) -> None:
        """The reduced draft head's options need a draft model (else silently without effect)."""
        if (self.draft_vocab is not None or self.draft_vocab_corpus) and draft_model is None:
            raise InvalidParameterError(
                "--draft-vocab and --draft-vocab-corpus reduce the draft model's LM head: they need --draft MODEL "
                "and a method that drafts with it (draft, tree or auto)"
            )
        if self.draft_vocab_corpus and self.draft_vocab is None:
            raise InvalidParameterError(
                "--draft-vocab-corpus picks the tokens --draft-vocab N keeps: give --draft-vocab"
            )

    def load(self, *, check_prompt: PromptCheck | None = None, status: str | None = None) -> SpeculativePipeline:
        """The pipeline, loaded under a status line on stderr (``status``, default ``loading
        TARGET + DRAFT``). ``check_prompt``: a prompt refused before the weights load.
        Raises as :meth:`SpeculativePipeline.load` does."""
        if not self.checked:
            raise RuntimeError("PipelineOptions.load before check_before_loading")
        draft = self.draft_model
        with err.status(status or f"loading {self.target}" + (f" + {draft}" if draft else "")):
            return SpeculativePipeline.load(
                self.target,
                draft,
                dtype=self.dtype,
                drafters=self.drafters(),
                runners=self.runner_options(),
                max_num_batched_tokens=self.max_num_batched_tokens,
                prefix_cache_gib=self.prefix_cache_gib,
                check_prompt=check_prompt,
            )


def parse_tree_choices(text: str | None, method: str | None):
    """``--tree-choices`` as a list of rank paths (validated by DrafterOptions), or None.

    Raises:
        InvalidParameterError: malformed JSON, or the option given without ``--method tree``.
    """
    if text is None:
        return None
    if method != "tree":
        raise InvalidParameterError(f"--tree-choices needs --method tree, got --method {method}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"--tree-choices is not valid JSON ({exc.msg}): {text!r}") from None


__all__ = ["PipelineOptions", "from_params", "parse_tree_choices"]
