"""Command-line interface: parse, validate, call the pipeline, format.

Generated text goes to stdout as it is accepted; statistics, progress and errors go to stderr so
the text can be piped. A user mistake prints ``error: ...`` and exits with status 2, never a
traceback. Knows nothing about decoding internals.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from verispec.engine import GenerationOutput, SpeculativeConfig
from verispec.errors import VerispecError
from verispec.models.cli import models_app
from verispec.pipeline import DEFAULT_DRAFT, DEFAULT_TARGET, SpeculativePipeline, peak_rss_bytes
from verispec.sampling import SamplingParams

app = typer.Typer(help="verispec: lossless speculative decoding.", no_args_is_help=True, add_completion=False)
app.add_typer(models_app, name="models")
err = Console(stderr=True)


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; read from stdin when omitted."),
    target: str = typer.Option(DEFAULT_TARGET, help="Target model: built-in name, .gguf file, HF directory or hub id."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model reference (same forms as --target)."),
    method: str = typer.Option("draft", help="none (plain decoding) or draft (draft-model speculation)."),
    num_speculative_tokens: int = typer.Option(5, "--num-speculative-tokens", "-k", help="Draft tokens per target pass."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, help="Nucleus mass in (0, 1]."),
    repetition_penalty: float = typer.Option(1.0, help="CTRL repetition penalty (1 = off)."),
    max_tokens: int = typer.Option(128, help="New tokens at most."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    stop: Optional[List[str]] = typer.Option(None, help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, help="Apply the model's chat template to the prompt."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, token_ids, metrics)."),
) -> None:
    """Generate text with the target, speculatively verified against a draft."""
    try:
        if prompt is None:
            if sys.stdin.isatty():
                raise VerispecError("give a PROMPT argument or pipe the prompt on stdin")
            prompt = sys.stdin.read()
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_tokens,
            seed=seed,
            stop=tuple(stop or ()),
        )
        spec = SpeculativeConfig(method=method, num_speculative_tokens=num_speculative_tokens)
        with err.status(f"loading {target}" + (f" + {draft}" if method != "none" else "")):
            pipe = SpeculativePipeline.load(target, draft if method != "none" else None, dtype=dtype)
        output = None
        for chunk in pipe.stream(prompt, params, spec, chat=chat):
            if not as_json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            output = chunk.output or output
    except VerispecError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    models = [vars(m) for m in pipe.model_summaries()]
    if as_json:
        data = output.to_dict()
        data.update(method=method, models=models, peak_rss_bytes=peak_rss_bytes())
        print(json.dumps(data))
    else:
        sys.stdout.write("\n")
        err.print(stats_table(output, method, models))


def stats_table(output: GenerationOutput, method: str, models: list[dict]) -> Table:
    """The stats a user reads after a generation (ms, tokens/s, MiB)."""
    m, spec = output.metrics, output.metrics.spec
    table = Table(title=f"verispec · method={method} · finish={output.finish_reason}", show_header=False)
    table.add_column("metric", style="cyan")
    table.add_column("value", justify="right")

    def fmt(value, pattern="{:.1f}"):
        return "—" if value is None else pattern.format(value)

    rows = [
        ("prompt / output tokens", f"{m.prompt_tokens} / {m.output_tokens}"),
        ("TTFT (ms)", fmt(m.ttft_ms)),
        ("TPOT (ms)", fmt(m.tpot_ms)),
        ("decode tokens/s", fmt(m.decode_tokens_per_s, "{:.2f}")),
        ("total tokens/s", fmt(m.total_tokens_per_s, "{:.2f}")),
        ("target forwards", str(m.num_target_forwards)),
        ("time in target / draft (ms)", f"{m.target_ms:.0f} / {m.draft_ms:.0f}"),
    ]
    if method != "none":
        rows += [
            ("drafts / drafted / accepted", f"{spec.num_drafts} / {spec.num_draft_tokens} / {spec.num_accepted_tokens}"),
            ("acceptance rate", fmt(spec.acceptance_rate, "{:.3f}")),
            ("mean acceptance length", fmt(spec.mean_acceptance_length, "{:.2f}")),
            ("acceptance per position", " ".join(f"{r:.2f}" for r in spec.acceptance_rate_per_position)),
            ("accepted-length histogram", " ".join(str(c) for c in spec.accepted_length_histogram)),
        ]
    for model in models:
        rows.append(
            (f"{model['role']}: {model['name']}", f"load {model['load_time_s']:.1f} s · {model['param_bytes'] / 2**20:.0f} MiB")
        )
    rows.append(("peak RSS (MiB)", f"{peak_rss_bytes() / 2**20:.0f}"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def main() -> None:  # pragma: no cover - console script entry
    app()
