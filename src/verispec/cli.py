"""Command-line interface: parse, validate, call the pipeline, format.

Generated text goes to stdout as it is accepted; statistics, progress and errors go to stderr so
the text can be piped. A user mistake prints ``error: ...`` and exits with status 2, never a
traceback. Knows nothing about decoding internals.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from verispec.ops.audit import QualityAuditor, describe_audit
from verispec.engine import SpeculativeConfig
from verispec.errors import InvalidParameterError, VerispecError
from verispec.generate_stats import plain_comparison, stats_table
from verispec.datastore_cli import datastore_app
from verispec.models.cli import models_app
from verispec.engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, DrafterOptions, SpeculativePipeline
from verispec.metrics import peak_rss_bytes
from verispec.runners.notices import kernel_facts, runner_label
from verispec.runners.select import RunnerOptions
from verispec.spec.sampling import SamplingParams

RUNNER_HELP = (
    "auto (default: gguf on a CPU when it can run the files, else the fastest by measured cost curves), "
    "gguf (the GGUF file's own 4-bit blocks, batch-invariant C++ kernels: exact and fast on a CPU), "
    "int8 (batch-invariant int8 re-quantization, Llama/Qwen2), llamacpp (GGUF through llama.cpp, needs the "
    "llamacpp extra; not exact under speculation) or torch (transformers, any device: the fp32 reference)."
)

app = typer.Typer(help="verispec: lossless speculative decoding.", no_args_is_help=True, add_completion=False)
app.add_typer(models_app, name="models")
app.add_typer(datastore_app, name="datastore")
err = Console(stderr=True)


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; read from stdin when omitted."),
    target: str = typer.Option(DEFAULT_TARGET, help="Target model: built-in name, .gguf file, HF directory or hub id."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model reference (same forms as --target), or 'none'."),
    method: str = typer.Option(
        "auto",
        help="auto (suffix lookup in this request and earlier ones when it matches, else the draft model, else layer skip; per step), "
        "draft, ngram, suffix (continuations seen in earlier requests and this one), layer-skip, "
        "tree (token trees: n-gram branches, else the draft's tree), or none (plain decoding).",
    ),
    num_speculative_tokens: int = typer.Option(
        8, "--num-speculative-tokens", "-k", help="Draft tokens per target pass: fixed (constant) or at most."
    ),
    schedule: str = typer.Option("cost", help="Draft length: cost (cost-model controller), heuristic or constant."),
    draft_stop_threshold: float = typer.Option(0.0, help="Stop drafting below this draft confidence (0 = off)."),
    min_ngram: int = typer.Option(2, help="Shortest context suffix n-gram lookup matches (methods ngram, tree)."),
    max_ngram: int = typer.Option(4, help="Longest context suffix n-gram lookup matches (methods ngram, tree)."),
    tree_choices: Optional[str] = typer.Option(
        None,
        help="Static draft tree shape for --method tree, as JSON paths of child ranks, e.g. "
        "'[[0],[1],[0,0],[0,1],[0,0,0]]' (default: dynamic tree).",
    ),
    layer_skip_layers: Optional[int] = typer.Option(
        None, help="Target layers the layer-skip drafter runs (default: a quarter; 0 = no layer skip)."
    ),
    draft_quantization: str = typer.Option(
        "auto", help="auto (iq4_nl on the gguf runner, else none); none; int8 (weight-only, --runner torch); iq4_nl or q4_0 (--runner gguf: the draft's 5-8-bit matrices re-quantized to 4.5 bits per weight as they load, once, kept under $VERISPEC_HOME/weights). Changes only what the draft proposes, never the output."
    ),
    runner: str = typer.Option("auto", help=RUNNER_HELP),
    compare_plain: bool = typer.Option(
        False, "--compare-plain", help="Also decode the prompt plainly (after a 4-token untimed warm-up) and print both rates, the measured speedup and whether the tokens match."
    ),
    draft_vocab: Optional[int] = typer.Option(
        None, help="Reduced draft LM head: keep this many most frequent tokens (FR-Spec; --runner gguf or int8)."
    ),
    draft_vocab_corpus: Optional[List[str]] = typer.Option(
        None, help="Text file whose token counts pick the --draft-vocab tokens (repeatable; default: BPE rank)."
    ),
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
    audit_rate: float = typer.Option(
        0.0, help="Probability of re-decoding this request plainly after the response, to check agreement (0 = off)."
    ),
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
        )
        use_draft = method in ("draft", "auto", "tree") and draft.lower() != "none"
        runners = RunnerOptions(kind=runner, draft_vocab_size=draft_vocab, draft_vocab_corpus=tuple(draft_vocab_corpus or ()))
        if dtype != "float32" and method != "none" and runner == "torch":
            err.print(
                f"[yellow]warning:[/yellow] {dtype} matmuls on this CPU round a k-token verify pass slightly "
                "differently from a 1-token decode step, so at near-ties greedy speculative output can differ "
                "from plain decoding; use --dtype float32 for token-identical output",
                highlight=False,
            )
        with err.status(f"loading {target}" + (f" + {draft}" if use_draft else "")):
            pipe = SpeculativePipeline.load(
                target, draft if use_draft else None, dtype=dtype, drafters=drafters, runners=runners
            )
        for summary in pipe.model_summaries():
            requantized = f", re-quantized to {pipe.draft_requantize}" if summary.role == "draft" and pipe.draft_requantize else ""
            err.print(f"loaded {summary.role} {summary.name} ({runner_label(pipe.runner_kind)}{requantized}, "
                      f"{summary.param_bytes / 2**30:.2f} GiB) in {summary.load_time_s:.1f} s", highlight=False, markup=False)
        if pipe.runner_kind == "llamacpp" and method != "none":
            err.print(
                "[yellow]warning:[/yellow] llama.cpp computes a k-token batch differently from a 1-token step, so "
                "greedy speculative output can differ from plain llama.cpp decoding at near-ties; use --runner gguf "
                "for token-identical output",
                highlight=False,
            )
        if compare_plain:  # both timed runs start warm: neither pays the first pass's one-off costs
            pipe.generate(prompt, SamplingParams(max_tokens=min(4, params.max_tokens)), spec, chat=chat, learn=False)
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
    comparison = None
    if compare_plain:
        try:
            with err.status("plain decoding of the same prompt (--compare-plain)"):
                plain = pipe.generate(prompt, params, SpeculativeConfig(method="none"), chat=chat)
        except VerispecError as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(2) from None
        comparison = plain_comparison(output, plain, greedy=params.temperature == 0)
    if as_json:
        data = output.to_dict()
        data.update(method=method, runner=pipe.runner_kind, **kernel_facts(pipe.runner_kind), models=models, peak_rss_bytes=peak_rss_bytes())
        if comparison is not None:
            data["compare_plain"] = comparison
        print(json.dumps(data))
    else:
        sys.stdout.write("\n")
        err.print(stats_table(output, method, models, comparison))
    if auditor.submit(pipe.encode(prompt, chat=chat), params, output):  # after the response is out
        with err.status("audit: plain decoding of the same request"):
            result = auditor.run_pending(pipe.engine)[0]
        err.print(f"audit: {describe_audit(result)}", highlight=False)


def parse_tree_choices(text: Optional[str], method: str):
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


@app.command()
def serve(
    target: str = typer.Option(DEFAULT_TARGET, help="Target model: built-in name, .gguf file, HF directory or hub id."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model reference, or 'none' to serve plain decoding."),
    method: Optional[str] = typer.Option(None, help="Default method of requests without 'speculative' (draft if a draft is loaded)."),
    num_speculative_tokens: int = typer.Option(5, "--num-speculative-tokens", "-k", help="Default draft tokens per target pass."),
    schedule: str = typer.Option(
        "cost", help="Default draft-length schedule: cost (batch-aware cost model), heuristic or constant."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback unless you say otherwise."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, envvar="VERISPEC_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    runner: str = typer.Option("auto", help=RUNNER_HELP),
    max_queue: int = typer.Option(64, min=1, help="Requests that may wait for the engine before 429."),
    max_num_seqs: Optional[int] = typer.Option(
        None, min=1, help="Requests batched into one target pass (default 8; 1 on the llama.cpp runner)."
    ),
    max_kv_tokens: Optional[int] = typer.Option(
        None, min=1, help="KV-cache tokens the running requests may reserve together (default: a context each)."
    ),
    max_num_batched_tokens: int = typer.Option(
        256, min=1, help="Prompt tokens prefilled per pass while other requests decode (chunked prefill)."
    ),
    max_tokens_cap: int = typer.Option(2048, min=1, help="Largest max_tokens a request may ask for."),
    suffix_cache: Optional[Path] = typer.Option(
        None, help="File for the suffix drafter's cache of past requests: loaded at start if present, written at shutdown."
    ),
    datastore: Optional[Path] = typer.Option(None, help="A corpus datastore (verispec datastore build) the suffix drafter also reads."),
    max_body_bytes: int = typer.Option(4 * 1024 * 1024, min=1024, help="Largest request body (bytes)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    audit_rate: float = typer.Option(
        0.0, help="Fraction of responses re-decoded plainly when the engine is idle, to count agreement (0 = off)."
    ),
    replicas: Optional[int] = typer.Option(None, help="Serve N replicas on Ray Serve, each its own batched engine (needs verispec[ray])."),
    ray_address: Optional[str] = typer.Option(None, help="Join this Ray cluster (e.g. auto or ray://host:10001) instead of starting one."),
    min_replicas: Optional[int] = typer.Option(None, help="Autoscale replicas from this many (Ray Serve autoscaling)."),
    max_replicas: Optional[int] = typer.Option(None, help="Autoscale replicas up to this many."),
    target_ongoing_requests: Optional[float] = typer.Option(None, help="Requests in flight per replica the autoscaler aims at."),
    replica_cpus: Optional[float] = typer.Option(
        None, help="CPUs Ray reserves for each replica, its runners' threads (default: the cores / replicas; 1 on --ray-address)."
    ),
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    import logging

    try:
        import uvicorn

        from verispec.server import ServerConfig, create_app
    except ImportError as exc:
        err.print(f"[red]error:[/red] the server's dependencies are missing ({exc}): pip install -e .", highlight=False, markup=True)
        raise typer.Exit(2) from None
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        err.print(f"[red]error:[/red] --log-level must be debug, info, warning or error, got {log_level!r}", highlight=False)
        raise typer.Exit(2)
    if not 0.0 <= audit_rate <= 1.0:
        err.print(f"[red]error:[/red] --audit-rate must be in [0, 1], got {audit_rate}", highlight=False)
        raise typer.Exit(2)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_draft = draft.lower() != "none"
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        err.print(f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who can reach it can use it")
    if any(v is not None for v in (replicas, ray_address, min_replicas, max_replicas, target_ongoing_requests)):
        from verispec.server.replicas import serve_replicas_command

        code = serve_replicas_command(
            err, target=target, draft=draft if use_draft else None, dtype=dtype, runner=runner, host=host, port=port,
            ray_address=ray_address, suffix_cache=suffix_cache, datastore=datastore,
            max_num_batched_tokens=max_num_batched_tokens, replicas=replicas, min_replicas=min_replicas,
            max_replicas=max_replicas, target_ongoing_requests=target_ongoing_requests, replica_cpus=replica_cpus,
            server=dict(api_key=api_key, max_tokens_cap=max_tokens_cap, max_queue=max_queue, max_body_bytes=max_body_bytes,
                        audit_rate=audit_rate, max_num_seqs=max_num_seqs, max_kv_tokens=max_kv_tokens),
            spec=dict(method=method or ("draft" if use_draft else "none"), num_speculative_tokens=num_speculative_tokens,
                      schedule=schedule),
        )
        raise typer.Exit(code)
    try:
        spec = SpeculativeConfig(
            method=method or ("draft" if use_draft else "none"), num_speculative_tokens=num_speculative_tokens,
            schedule=schedule,
        )
        with err.status(f"loading {target}" + (f" + {draft}" if use_draft else "")):
            pipe = SpeculativePipeline.load(target, draft if use_draft else None, dtype=dtype, runners=RunnerOptions(kind=runner))
    except VerispecError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    config = ServerConfig(
        api_key=api_key, max_tokens_cap=max_tokens_cap, max_queue=max_queue, max_body_bytes=max_body_bytes,
        default_spec=spec, audit_rate=audit_rate, max_num_seqs=max_num_seqs, max_kv_tokens=max_kv_tokens,
        suffix_cache=None if suffix_cache is None else str(suffix_cache),
    )

    pipe.engine.max_num_batched_tokens = max_num_batched_tokens
    if datastore is not None:
        try:
            pipe.use_datastore(datastore)
        except VerispecError as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(2) from None
    try:
        server = create_app(pipe, config)
    except VerispecError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    uvicorn.run(server, host=host, port=port, log_level=log_level.lower())


_WORKLOAD_HELP = "Built-in workload: specbench (6 tasks), specbench-categories (13), humaneval (default: specbench)."


@app.command()
def bench(
    workload: Optional[str] = typer.Option(None, help=_WORKLOAD_HELP),
    prompts: Optional[Path] = typer.Option(None, help="JSONL file: 'prompt' or 'turns' per line, optional 'category'."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated categories to keep."),
    limit: Optional[int] = typer.Option(None, help="Prompts per category at most."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated verispec methods (default: all loaded); none always runs."),
    peers: str = typer.Option("transformers,llama.cpp", help="Peers in the same loop: transformers, llama.cpp, or none."),
    num_speculative_tokens: int = typer.Option(5, "--num-speculative-tokens", "-k", help="Draft tokens per target pass."),
    max_tokens: int = typer.Option(128, help="New tokens at most per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy (checks exactness); > 0 samples."),
    seed: int = typer.Option(0, help="Seed of sampling runs (prompt i uses seed + i) and of the audit draws."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for every runner (default: torch's)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Force the chat template (default: 'turns' lines use it)."),
    audit_rate: float = typer.Option(0.0, help="Fraction of speculative runs audited against plain decoding."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="One short untimed run per runner first."),
    target: str = typer.Option(DEFAULT_TARGET, help="Target model reference."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model reference, or 'none'."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    runner: str = typer.Option("auto", help="Comma-separated runners compared in one run (as generate's --runner), e.g. gguf,int8,torch; transformers peers need torch."),
    curves: bool = typer.Option(False, "--curves/--no-curves", help="Also time one target pass of k = 1..16 tokens and one draft pass per runner."),
    out: Optional[Path] = typer.Option(None, help="Write results.json, report.md and PNG plots into this folder."),
) -> None:
    """Benchmark plain decoding, every speculative method and the peers, interleaved prompt by prompt."""
    from verispec.ops.bench.command import available_methods, load_pipelines, print_summary, run_and_report, split
    from verispec.ops.bench.run import BenchConfig
    from verispec.ops.bench.workload import load_workload
    from verispec.runners.select import RUNNERS

    try:
        kinds = split(runner) or ["auto"]
        unknown = [k for k in kinds if k not in RUNNERS]
        if unknown:
            raise InvalidParameterError(f"unknown runner {', '.join(unknown)}; choose from {', '.join(RUNNERS)}")
        items = load_workload(None if prompts else workload or "specbench", prompts, split(categories), limit)
        pipes, rss = load_pipelines(target, None if draft.lower() == "none" else draft, dtype, err, kinds)
        config = BenchConfig(
            methods=tuple(split(methods) or available_methods(pipes)),
            peers=tuple(p for p in split(peers) if p != "none"),
            num_speculative_tokens=num_speculative_tokens,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            threads=threads,
            warmup=warmup,
            chat=chat,
            audit_rate=audit_rate,
        )
        results = run_and_report(pipes, items, config, out, workload=str(prompts or workload or "specbench"), dtype=dtype, rss=rss,
                                 console=err, curves=curves)
    except VerispecError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    print_summary(results, err)
    if out is not None:
        err.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results.plots)} plots")


def _int_list(text: str, option: str) -> tuple[int, ...]:
    """``"512,2048"`` -> (512, 2048); raises InvalidParameterError on anything but positive ints."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InvalidParameterError(f"{option} takes comma-separated positive integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise InvalidParameterError(f"{option} takes positive integers, got {text!r}")
    return values


@app.command("bench-runners")
def bench_runners(
    runners: str = typer.Option("gguf,llamacpp", help="Comma-separated runners: gguf, int8, llamacpp, torch (slow)."),
    methods: str = typer.Option("none,ngram,draft,draft-frspec,tree,auto", help="Comma-separated: none, ngram, draft, draft-frspec, tree, auto."),
    prompts: Optional[Path] = typer.Option(None, help="JSONL file with a 'prompt' per line (default: HumanEval dev from the shared data)."),
    num_prompts: int = typer.Option(10, min=1, help="Prompts decoded by every method."),
    max_tokens: int = typer.Option(128, min=1, help="New tokens per prompt at most (greedy, stop at EOS)."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", "-k", help="Draft tokens per target pass."),
    schedule: str = typer.Option("constant", help="constant, heuristic or cost (seeded with the measured curve)."),
    draft_vocab: int = typer.Option(32768, help="Rows of the reduced draft head (draft-frspec)."),
    draft_quantization: str = typer.Option("iq4_nl", help="The gguf runner's drafts: iq4_nl (re-quantized as they load, the default of generate/serve), q4_0, or none (the file's blocks)."),
    draft_vocab_corpus: Optional[List[str]] = typer.Option(None, help="Files/directories counted for draft-frspec (default: Python stdlib)."),
    exactness_prompts: int = typer.Option(0, min=0, help="Also compare plain vs speculative output (32 tokens) on this many prompts."),
    quality_prompts: int = typer.Option(0, min=0, help="Also score each runner against the float32 model (teacher-forced, 32 tokens) on this many prompts."),
    prefill_tokens: str = typer.Option("", help="Also time one prefill of each of these prompt lengths, e.g. 512,2048 (llama.cpp beside)."),
    threads: int = typer.Option(0, min=0, help="CPU threads for every runner and the peer (0: torch's default)."),
    peer: bool = typer.Option(True, "--peer/--no-peer", help="Time llama-cpp-python's own plain decoding of the target GGUF."),
    target: str = typer.Option(DEFAULT_TARGET, help="Target model (a GGUF reference)."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model (a GGUF reference)."),
    out: Path = typer.Option(Path("bench-runners.json"), help="Where to write the JSON report."),
) -> None:
    """Cost curves and end-to-end tokens/s of each runner and method, beside llama.cpp's plain decoding."""
    from verispec.ops.bench.runners_table import format_table
    from verispec.ops.bench.runner_compare import RunnersBenchConfig, run_runners_bench

    try:
        config = RunnersBenchConfig(
            target=target, draft=draft, runners=tuple(r for r in runners.split(",") if r), methods=tuple(m for m in methods.split(",") if m),
            prompts_file=str(prompts or ""), num_prompts=num_prompts, max_tokens=max_tokens, num_speculative_tokens=num_speculative_tokens,
            schedule=schedule, draft_vocab_size=draft_vocab, draft_vocab_corpus=tuple(draft_vocab_corpus or ()),
            exactness_prompts=exactness_prompts, threads=threads, peer=peer, draft_quantization=draft_quantization,
            prefill_tokens=_int_list(prefill_tokens, "--prefill-tokens"), quality_prompts=quality_prompts,
        )
        report = run_runners_bench(config, log=lambda line: err.print(line, highlight=False, markup=False))
    except VerispecError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    out.write_text(json.dumps(report, indent=1))
    for table in format_table(report):
        err.print(table)
    err.print(f"wrote {out}")


@app.command()
def advise(
    workload: Optional[str] = typer.Option(None, help=_WORKLOAD_HELP),
    prompts: Optional[Path] = typer.Option(None, help="JSONL file: 'prompt' or 'turns' per line, optional 'category'."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated categories to keep."),
    limit: int = typer.Option(1, help="Prompts per category measured."),
    methods: str = typer.Option("draft,ngram", help="Comma-separated drafters to assess."),
    num_speculative_tokens: int = typer.Option(5, "--num-speculative-tokens", "-k", help="Draft length of the measurement."),
    max_k: int = typer.Option(10, min=1, max=64, help="Largest draft length in the predictions."),
    max_tokens: int = typer.Option(64, help="New tokens per measured prompt."),
    context_length: int = typer.Option(4096, min=1, help="Context length for the KV-cache memory estimate (tokens)."),
    memory_budget: Optional[float] = typer.Option(None, help="Memory available for weights + KV caches, GiB."),
    gpu_cost_per_month: Optional[float] = typer.Option(None, help="Monthly cost of the machine, for the cost per million tokens."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: torch's)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Force the chat template (default: 'turns' lines use it)."),
    target: str = typer.Option(DEFAULT_TARGET, help="Target model reference."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model reference, or 'none'."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    runner: str = typer.Option("auto", help="The runner advised on (as generate's --runner): the one you would run."),
    as_json: bool = typer.Option(False, "--json", help="Also print the advice as one JSON object on stdout."),
    export: Optional[str] = typer.Option(None, help="Write the advised setup for vllm, sglang or transformers (JSON)."),
    export_file: Optional[Path] = typer.Option(None, help="File for --export's JSON (default: stdout)."),
) -> None:
    """Measure α and costs on a workload sample and say whether speculation pays, per category."""
    from verispec.ops.advise import advise as run_advice
    from verispec.ops.advise_render import render
    from verispec.ops.bench.command import load_pipelines, progress, runs_per_prompt, split
    from verispec.ops.bench.run import BenchConfig
    from verispec.ops.bench.workload import load_workload

    from verispec.ops.export import EXPORT_TOOLS

    if export is not None and export not in EXPORT_TOOLS:
        err.print(f"[red]error:[/red] --export must be one of {', '.join(EXPORT_TOOLS)}, got {export!r}", highlight=False)
        raise typer.Exit(2)
    if export is not None and as_json and export_file is None:
        err.print("[red]error:[/red] --json and --export both write to stdout: give --export-file", highlight=False)
        raise typer.Exit(2)
    try:
        items = load_workload(None if prompts else workload or "specbench", prompts, split(categories), limit)
        config = BenchConfig(
            methods=tuple(split(methods)), peers=(), num_speculative_tokens=num_speculative_tokens,
            max_tokens=max_tokens, threads=threads, chat=chat,
        )
        pipes, _ = load_pipelines(target, None if draft.lower() == "none" else draft, dtype, err, [runner])
        pipe = next(iter(pipes.values()))
        with progress(err, len(items) * runs_per_prompt(config)) as on_run:
            advice = run_advice(
                pipe, items, config, max_k=max_k, context_length=context_length,
                memory_budget_bytes=int(memory_budget * 2**30) if memory_budget is not None else None,
                gpu_cost_per_month=gpu_cost_per_month, on_run=on_run,
            )
    except VerispecError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    render(advice, err)
    if as_json:
        print(json.dumps(advice.to_dict()))
    if export is not None:
        from verispec.ops.advise_render import export_advice

        try:
            export_advice(advice, export, export_file, target, None if draft.lower() == "none" else draft, pipe.drafters, err)
        except VerispecError as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(2) from None


def main() -> None:  # pragma: no cover - console script entry
    app()
