"""``verispec generate``: one prompt decoded speculatively, the text streamed to stdout as it is
accepted, the statistics after it on stderr (``--json``: one JSON object on stdout instead)."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import typer

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.audit import QualityAuditor, describe_audit
from verispec.cli.common import (
    DEFAULT_METHOD,
    K_GENERATE,
    draft_option,
    draft_quantization_option,
    draft_vocab_corpus_option,
    draft_vocab_option,
    dtype_option,
    eagle_head_option,
    err,
    head_quantization_option,
    json_option,
    max_context_option,
    num_speculative_tokens_option,
    resolve_draft,
    runner_option,
    target_option,
    user_errors,
)
from verispec.cli.generate_stats import plain_comparison, slowdown_hint, stats_table
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DrafterOptions, PromptCheck, SpeculativePipeline
from verispec.engine.methods import needs_head, uses_draft_model
from verispec.errors import InvalidParameterError
from verispec.metrics import peak_rss_bytes
from verispec.progress import working
from verispec.runners.notices import inexact_warning
from verispec.runners.select import RunnerOptions


def generate(
    prompt: str | None = typer.Argument(None, help="Prompt text; read from stdin when omitted."),
    target: str = target_option(),
    draft: str | None = draft_option("Draft model reference (same forms as --target), or 'none'."),
    method: str = typer.Option(
        DEFAULT_METHOD,
        help="auto (suffix lookup in this request and earlier ones when it matches, else per step the faster of the "
        "EAGLE head and the draft model, chains or trees; layer skip only on --runner torch without either), "
        "draft, ngram, suffix (continuations seen in earlier requests and this one), layer-skip, "
        "eagle (--eagle-head; eagle-tree: its dynamic tree), "
        "tree (token trees: n-gram branches, else the draft's tree), or none (plain decoding).",
    ),
    num_speculative_tokens: int = num_speculative_tokens_option(K_GENERATE),
    schedule: str = typer.Option("cost", help="Draft length: cost (cost-model controller), heuristic or constant."),
    draft_stop_threshold: float = typer.Option(0.0, help="Stop drafting below this draft confidence (0 = off)."),
    min_ngram: int = typer.Option(2, help="Shortest context suffix n-gram lookup matches (methods ngram, tree)."),
    max_ngram: int = typer.Option(4, help="Longest context suffix n-gram lookup matches (methods ngram, tree)."),
    tree_choices: str | None = typer.Option(
        None,
        help="Static draft tree shape for --method tree, as JSON paths of child ranks, e.g. "
        "'[[0],[1],[0,0],[0,1],[0,0,0]]' (default: dynamic tree).",
    ),
    layer_skip_layers: int | None = typer.Option(
        None, help="Target layers the layer-skip drafter runs (default: a quarter; 0 = no layer skip)."
    ),
    draft_quantization: str = draft_quantization_option(),
    eagle_head: Path | None = eagle_head_option(),
    head_quantization: str = head_quantization_option(),
    runner: str = runner_option(),
    max_context: int | None = max_context_option(),
    compare_plain: bool = typer.Option(
        False,
        "--compare-plain",
        help="Also decode the prompt plainly (after a 4-token untimed warm-up) and print both rates, the "
        "measured speedup and whether the tokens match.",
    ),
    draft_vocab: int | None = draft_vocab_option(),
    draft_vocab_corpus: list[str] | None = draft_vocab_corpus_option(),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, help="Nucleus mass in (0, 1]."),
    repetition_penalty: float = typer.Option(1.0, help="CTRL repetition penalty (1 = off)."),
    max_tokens: int = typer.Option(128, help="New tokens at most."),
    seed: int | None = typer.Option(None, help="Seed for sampling."),
    sampling: str = typer.Option(
        "coupled",
        help="coupled (Gumbel-max keyed by seed and position: a seed gives plain decoding's text under "
        "every method) or rejection (modified rejection sampling: the text depends on the drafts).",
    ),
    stop: list[str] | None = typer.Option(None, help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, help="Apply the model's chat template to the prompt."),
    dtype: str = dtype_option(),
    as_json: bool = json_option("Print one JSON object (text, token_ids, metrics)."),
    audit_rate: float = typer.Option(
        0.0, help="Probability of re-decoding this request plainly after the response, to check agreement (0 = off)."
    ),
) -> None:
    """Generate text with the target, speculatively verified against a draft."""
    with user_errors():
        if prompt is None:
            if sys.stdin.isatty():
                raise InvalidParameterError("give a PROMPT argument or pipe the prompt on stdin")
            prompt = stdin_prompt(sys.stdin.read())
        if not prompt:  # before minutes of loading, not after
            raise InvalidParameterError("the prompt is empty: give the text to continue as PROMPT or on stdin")
        if method == "layer-skip" and layer_skip_layers == 0:
            raise InvalidParameterError("--method layer-skip with --layer-skip-layers 0: nothing would draft")
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_tokens,
            seed=seed,
            stop=tuple(stop or ()),
            sampling=sampling,
        )
        auditor = QualityAuditor(audit_rate, seed=seed)
        spec = SpeculativeConfig(
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            schedule=schedule,
            draft_stop_threshold=draft_stop_threshold,
        )
        drafters = DrafterOptions(
            min_ngram=min_ngram,
            max_ngram=max_ngram,
            layer_skip_layers=layer_skip_layers,
            draft_quantization=draft_quantization,
            tree_choices=parse_tree_choices(tree_choices, method),
            eagle_head=eagle_head,
            head_quantization=head_quantization,
        )
        if needs_head(method) and eagle_head is None:
            raise InvalidParameterError(
                f"--method {method} needs --eagle-head FILE (a head from verispec train-head) "
                "or a published EAGLE-3 folder"
            )
        draft = resolve_draft(target, draft) if uses_draft_model(method) else None
        use_draft = draft is not None
        if (draft_vocab is not None or draft_vocab_corpus) and not use_draft:  # else silently without effect
            raise InvalidParameterError(
                "--draft-vocab and --draft-vocab-corpus reduce the draft model's LM head: they need --draft MODEL "
                "and a method that drafts with it (draft, tree or auto)"
            )
        if draft_vocab_corpus and draft_vocab is None:
            raise InvalidParameterError(
                "--draft-vocab-corpus picks the tokens --draft-vocab N keeps: give --draft-vocab"
            )
        runners = RunnerOptions(
            kind=runner,
            max_context_length=max_context,
            draft_vocab_size=draft_vocab,
            draft_vocab_corpus=tuple(draft_vocab_corpus or ()),
        )
        inexact = None if method == "none" else inexact_warning(runner, dtype)  # said before minutes of loading
        if inexact is not None:
            err.print(f"[yellow]warning:[/yellow] {inexact}", highlight=False)
        with err.status(f"loading {target}" + (f" + {draft}" if use_draft else "")):
            pipe = SpeculativePipeline.load(
                target,
                draft if use_draft else None,
                dtype=dtype,
                drafters=drafters,
                runners=runners,
                prefix_cache_gib=0,  # one request: nothing to reuse, and --compare-plain compares cold prompts
                check_prompt=PromptCheck(prompt, params.max_tokens, chat),  # refused before the weights load
            )
        for summary in pipe.model_summaries():
            requantized = (
                f", re-quantized to {pipe.draft_requantize}"
                if summary.role == "draft" and pipe.draft_requantize
                else ""
            )
            err.print(
                f"loaded {summary.role} {summary.name} ({pipe.runner_choice.label}{requantized}, "
                f"{summary.param_bytes / 2**30:.2f} GiB) in {summary.load_time_s:.1f} s",
                highlight=False,
                markup=False,
            )
        pipe.check_window(len(pipe.encode(prompt, chat=chat)), params.max_tokens)  # refused, never cut at the window
        if runner == "auto" and method != "none" and (inexact := inexact_warning(pipe.runner_kind, dtype)):
            err.print(f"[yellow]warning:[/yellow] {inexact}", highlight=False)  # the runner auto chose
        if compare_plain:  # both timed runs start warm: neither pays the first pass's one-off costs
            with working("warming up (--compare-plain)", "4 untimed tokens, so both timed runs start warm", err):
                pipe.generate(
                    prompt, SamplingParams(max_tokens=min(4, params.max_tokens)), spec, chat=chat, learn=False
                )
        output = None
        with (
            working("generating", f"--json prints at the end; at most {params.max_tokens} tokens", err)
            if as_json
            else nullcontext()
        ):
            try:
                for chunk in pipe.stream(prompt, params, spec, chat=chat):
                    if not as_json:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                    output = chunk.output or output
            finally:  # the text's line ends before anything else is said on stderr, even when stopped
                if not as_json:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
        comparison = None
        if compare_plain:
            with working(
                "plain decoding of the same prompt (--compare-plain)", f"at most {params.max_tokens} tokens, timed", err
            ):
                plain = pipe.generate(prompt, params, SpeculativeConfig(method="none"), chat=chat)
            comparison = plain_comparison(output, plain, params)
    models = [vars(m) for m in pipe.model_summaries()]
    if as_json:
        data = output.to_dict()
        data.update(
            method=method,
            runner=pipe.runner_kind,
            **pipe.runner_choice.facts,
            models=models,
            peak_rss_bytes=peak_rss_bytes(),
        )
        if comparison is not None:
            data["compare_plain"] = comparison
        print(json.dumps(data))
    else:
        err.print(stats_table(output, method, models, comparison))
    hint = slowdown_hint(output, method, comparison)
    if hint is not None:
        err.print(hint, style="yellow", highlight=False)
    if auditor.submit(pipe.encode(prompt, chat=chat), params, output):  # after the response is out
        with working("audit: plain decoding of the same request", "--audit-rate", err):
            result = auditor.run_pending(pipe.engine)[0]
        err.print(f"audit: {describe_audit(result)}", highlight=False)


def stdin_prompt(text: str) -> str:
    """A prompt read from stdin without the one newline ``echo`` (or a file's last line) ends it
    with: ``echo "def f():" | verispec generate`` asks what ``verispec generate "def f():"`` asks.
    Only one newline (``\\n`` or ``\\r\\n``) goes; other whitespace is the prompt's."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


def parse_tree_choices(text: str | None, method: str):
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
