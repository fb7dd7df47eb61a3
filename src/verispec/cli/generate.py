"""``verispec generate``: one prompt decoded speculatively, the text streamed to stdout as it is
accepted, the statistics after it on stderr (``--json``: one JSON object on stdout instead).

The steps: parse and check the options (:class:`~verispec.cli.options.PipelineOptions`), load
the pipeline (the prompt refused before the weights if it cannot fit), stream the text, report."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from typing import Annotated

import typer

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.audit import QualityAuditor, describe_audit
from verispec.cli.common import (
    DEFAULT_METHOD,
    K_GENERATE,
    DraftQuantization,
    DraftVocab,
    DraftVocabCorpus,
    Dtype,
    EagleHead,
    HeadQuantization,
    MaxContext,
    NumSpeculativeTokens,
    Runner,
    Target,
    draft_option,
    err,
    json_option,
    user_errors,
)
from verispec.cli.generate_stats import plain_comparison, slowdown_hint, stats_table
from verispec.cli.options import PipelineOptions, from_params, parse_tree_choices
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DEFAULT_TARGET, PromptCheck
from verispec.engine.methods import method_help
from verispec.errors import InvalidParameterError
from verispec.metrics import peak_rss_bytes
from verispec.progress import working
from verispec.runners.notices import inexact_warning

# generate's own options, each declared once (the shared ones are verispec.cli.common's)
Prompt = Annotated[str | None, typer.Argument(help="Prompt text; read from stdin when omitted.")]
Draft = Annotated[str | None, draft_option("Draft model reference (same forms as --target), or 'none'.")]
Method = Annotated[
    str,
    typer.Option(
        help=method_help(),  # from the drafters' declarations
    ),
]
Schedule = Annotated[str, typer.Option(help="Draft length: cost (cost-model controller), heuristic or constant.")]
DraftStopThreshold = Annotated[float, typer.Option(help="Stop drafting below this draft confidence (0 = off).")]
MinNgram = Annotated[int, typer.Option(help="Shortest context suffix n-gram lookup matches (methods ngram, tree).")]
MaxNgram = Annotated[int, typer.Option(help="Longest context suffix n-gram lookup matches (methods ngram, tree).")]
TreeChoices = Annotated[
    str | None,
    typer.Option(
        help="Static draft tree shape for --method tree, as JSON paths of child ranks, e.g. "
        "'[[0],[1],[0,0],[0,1],[0,0,0]]' (default: dynamic tree).",
    ),
]
LayerSkipLayers = Annotated[
    int | None,
    typer.Option(help="Target layers the layer-skip drafter runs (default: a quarter; 0 = no layer skip)."),
]
ComparePlain = Annotated[
    bool,
    typer.Option(
        "--compare-plain",
        help="Also decode the prompt plainly (after a 4-token untimed warm-up) and print both rates, the "
        "measured speedup and whether the tokens match.",
    ),
]
Temperature = Annotated[float, typer.Option(help="0 = greedy.")]
TopK = Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")]
TopP = Annotated[float, typer.Option(help="Nucleus mass in (0, 1].")]
RepetitionPenalty = Annotated[float, typer.Option(help="CTRL repetition penalty (1 = off).")]
MaxTokens = Annotated[int, typer.Option(help="New tokens at most.")]
Seed = Annotated[int | None, typer.Option(help="Seed for sampling.")]
Sampling = Annotated[
    str,
    typer.Option(
        help="coupled (Gumbel-max keyed by seed and position: a seed gives plain decoding's text under "
        "every method) or rejection (modified rejection sampling: the text depends on the drafts).",
    ),
]
Stop = Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")]
Chat = Annotated[bool, typer.Option(help="Apply the model's chat template to the prompt.")]
AsJson = Annotated[bool, json_option("Print one JSON object (text, token_ids, metrics).")]
AuditRate = Annotated[
    float,
    typer.Option(
        help="Probability of re-decoding this request plainly after the response, to check agreement (0 = off)."
    ),
]


def generate(
    prompt: Prompt = None,
    target: Target = DEFAULT_TARGET,
    draft: Draft = None,
    method: Method = DEFAULT_METHOD,
    num_speculative_tokens: NumSpeculativeTokens = K_GENERATE,
    schedule: Schedule = "cost",
    draft_stop_threshold: DraftStopThreshold = 0.0,
    min_ngram: MinNgram = 2,
    max_ngram: MaxNgram = 4,
    tree_choices: TreeChoices = None,
    layer_skip_layers: LayerSkipLayers = None,
    draft_quantization: DraftQuantization = "auto",
    eagle_head: EagleHead = None,
    head_quantization: HeadQuantization = "auto",
    runner: Runner = "auto",
    max_context: MaxContext = None,
    compare_plain: ComparePlain = False,
    draft_vocab: DraftVocab = None,
    draft_vocab_corpus: DraftVocabCorpus = None,
    temperature: Temperature = 0.0,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    max_tokens: MaxTokens = 128,
    seed: Seed = None,
    sampling: Sampling = "coupled",
    stop: Stop = None,
    chat: Chat = False,
    dtype: Dtype = "float32",
    as_json: AsJson = False,
    audit_rate: AuditRate = 0.0,
) -> None:
    """Generate text with the target, speculatively verified against a draft."""
    params = dict(locals())
    with user_errors():
        prompt = read_prompt(prompt)
        sampling_params = from_params(SamplingParams, params, stop=tuple(stop or ()))
        auditor = QualityAuditor(audit_rate, seed=seed)
        spec = from_params(SpeculativeConfig, params)
        # one request: no prefix cache to reuse, and --compare-plain compares cold prompts
        options = PipelineOptions.from_cli(params, one_method=True, prefix_cache_gib=0).check_before_loading()
        pipe = load(options, prompt, sampling_params.max_tokens, chat)
        output, comparison = decode(pipe, prompt, sampling_params, spec, chat, compare_plain, as_json)
    report(pipe, method, output, comparison, as_json)
    if auditor.submit(pipe.encode(prompt, chat=chat), sampling_params, output):  # after the response is out
        with working("audit: plain decoding of the same request", "--audit-rate", err):
            result = auditor.run_pending(pipe.engine)[0]
        err.print(f"audit: {describe_audit(result)}", highlight=False)


def read_prompt(prompt: str | None) -> str:
    """The prompt: the argument, else stdin (:func:`stdin_prompt`).

    Raises:
        InvalidParameterError: no prompt on a terminal, or an empty one (before minutes of loading).
    """
    if prompt is None:
        if sys.stdin.isatty():
            raise InvalidParameterError("give a PROMPT argument or pipe the prompt on stdin")
        prompt = stdin_prompt(sys.stdin.read())
    if not prompt:
        raise InvalidParameterError("the prompt is empty: give the text to continue as PROMPT or on stdin")
    return prompt


def load(options: PipelineOptions, prompt: str, max_tokens: int, chat: bool):
    """The pipeline of ``options`` (checked), the prompt refused before the weights load if it
    cannot fit; the loaded models said on stderr, and the runner's inexactness warned of."""
    exact = options.method == "none"
    inexact = None if exact else inexact_warning(options.runner, options.dtype)  # said before minutes of loading
    if inexact is not None:
        err.print(f"[yellow]warning:[/yellow] {inexact}", highlight=False)
    pipe = options.load(check_prompt=PromptCheck(prompt, max_tokens, chat))
    for summary in pipe.model_summaries():
        requantized = (
            f", re-quantized to {pipe.draft_requantize}" if summary.role == "draft" and pipe.draft_requantize else ""
        )
        err.print(
            f"loaded {summary.role} {summary.name} ({pipe.runner_choice.label}{requantized}, "
            f"{summary.param_bytes / 2**30:.2f} GiB) in {summary.load_time_s:.1f} s",
            highlight=False,
            markup=False,
        )
    pipe.check_window(len(pipe.encode(prompt, chat=chat)), max_tokens)  # refused, never cut at the window
    if options.runner == "auto" and not exact and (inexact := inexact_warning(pipe.runner_kind, options.dtype)):
        err.print(f"[yellow]warning:[/yellow] {inexact}", highlight=False)  # the runner auto chose
    return pipe


def decode(
    pipe, prompt: str, params: SamplingParams, spec: SpeculativeConfig, chat: bool, compare: bool, as_json: bool
):
    """Stream the text to stdout (``as_json``: keep it for the end), after a short untimed
    warm-up and followed by a plain decode when ``compare`` (--compare-plain); returns
    ``(output, comparison or None)``."""
    if compare:  # both timed runs start warm: neither pays the first pass's one-off costs
        with working("warming up (--compare-plain)", "4 untimed tokens, so both timed runs start warm", err):
            pipe.generate(prompt, SamplingParams(max_tokens=min(4, params.max_tokens)), spec, chat=chat, learn=False)
    output = None
    shown = working("generating", f"--json prints at the end; at most {params.max_tokens} tokens", err)
    with shown if as_json else nullcontext():
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
    if not compare:
        return output, None
    with working(
        "plain decoding of the same prompt (--compare-plain)", f"at most {params.max_tokens} tokens, timed", err
    ):
        plain = pipe.generate(prompt, params, SpeculativeConfig(method="none"), chat=chat)
    return output, plain_comparison(output, plain, params)


def report(pipe, method: str, output, comparison: dict | None, as_json: bool) -> None:
    """The statistics: a table on stderr, or with ``as_json`` one JSON object on stdout; then a
    hint where speculation was slower than it should be."""
    models = [vars(m) for m in pipe.model_summaries()]
    if as_json:
        data = output.to_dict()
        data.update(method=method, runner=pipe.runner_kind, **pipe.runner_choice.facts, models=models)
        data.update(peak_rss_bytes=peak_rss_bytes())
        if comparison is not None:
            data["compare_plain"] = comparison
        print(json.dumps(data))
    else:
        err.print(stats_table(output, method, models, comparison))
    hint = slowdown_hint(output, method, comparison)
    if hint is not None:
        err.print(hint, style="yellow", highlight=False)


def stdin_prompt(text: str) -> str:
    """A prompt read from stdin without the one newline ``echo`` (or a file's last line) ends it
    with: ``echo "def f():" | verispec generate`` asks what ``verispec generate "def f():"`` asks.
    Only one newline (``\\n`` or ``\\r\\n``) goes; other whitespace is the prompt's."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


__all__ = ["generate", "parse_tree_choices", "stdin_prompt"]
