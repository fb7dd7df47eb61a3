"""``verispec train-head``: an EAGLE-3 head for a target, trained on this machine from the
target's own answers (self-distillation), with a progress bar, checkpoints and a loss plot.

This module parses, validates and shows progress; the data (:func:`verispec.training.data.collect`),
the loop (:mod:`verispec.training.loop`) and the files beside the head
(:mod:`verispec.training.files`) are the training package's."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import typer

from verispec.bench.workload import WorkloadError
from verispec.cli.common import err, runner_option, target_option, user_errors
from verispec.errors import InvalidParameterError

DEFAULT_MAGPIE = 256  # self-generated instructions when no --prompts file is given


def train_head(
    ctx: typer.Context,
    out: Path = typer.Option(
        ...,
        help="Head file to write (and to continue with --resume): .gguf (GGUF, architecture eagle3), else a torch "
        "file.",
    ),
    target: str = target_option("The target the head drafts for (built-in name, .gguf file, HF directory)."),
    prompts: list[Path] | None = typer.Option(
        None,
        help="JSONL prompts of your own traffic ('prompt' or 'turns' per line; repeatable). Benchmark prompts are "
        "refused.",
    ),
    magpie: int | None = typer.Option(
        None,
        min=0,
        help=f"Instructions the target writes itself (Magpie) and then answers (default: {DEFAULT_MAGPIE} without "
        "--prompts, else 0).",
    ),
    code: list[Path] | None = typer.Option(
        None,
        help="Code or text directories the target reads teacher-forced (repeatable), e.g. Python's standard library.",
    ),
    code_tokens: int = typer.Option(100_000, min=0, help="Tokens of --code at most."),
    max_tokens: int = typer.Option(256, min=1, help="Tokens of each answer the target writes."),
    draft_vocab: int = typer.Option(
        32_000, min=1, help="Rows of the head's draft vocabulary (the most frequent tokens of the data; EOS always in)."
    ),
    head_intermediate: int = typer.Option(
        2048,
        min=1,
        help="Width of the head's MLP (the target's own is 8960 for the 1.5B default): narrower drafts and trains "
        "faster.",
    ),
    shared_lm_head: bool = typer.Option(
        True,
        "--shared-lm-head/--own-lm-head",
        help="Draft with the target's own LM-head rows, frozen and not stored (EAGLE's shared head: less to learn, a "
        "smaller file), or train the head's own (EAGLE-3).",
    ),
    weights: str = typer.Option(
        "f32",
        help="How --out stores the matrices: f32 (what --resume continues exactly), f16, or q8_0 (8.5 bits a weight, "
        "what the gguf runner drafts with: a head to ship).",
    ),
    minutes: float | None = typer.Option(
        60.0, help="Training budget in minutes (the data is generated first, outside it)."
    ),
    steps: int | None = typer.Option(
        None, min=1, help="Optimiser steps at most (with --minutes: whichever comes first)."
    ),
    lr: float = typer.Option(3e-4, help="AdamW learning rate."),
    batch_positions: int = typer.Option(512, min=1, help="Anchors per optimiser step."),
    held_out: float = typer.Option(
        0.1, help="Fraction of the sequences kept out of training for the agreement figures."
    ),
    seed: int = typer.Option(
        0, help="Seeds the data (Magpie), the split, the batch order and the head's initialisation."
    ),
    runner: str = runner_option("Runner that answers the prompts (default auto: gguf on a CPU)."),
    teacher: str = typer.Option(
        "auto",
        help="Who reads the data for the head to learn from: 'runner' (the target on --runner's kernels, e.g. the "
        "gguf runner: the quantized model served, at its prefill speed), 'torch' (float32 transformers), 'auto' "
        "(runner where it can hand out its hidden states: gguf, int8).",
    ),
    teacher_cache: str | None = typer.Option(
        None,
        help="Folder keeping the target's reading of each sequence (features, ~24 KB a token for the 1.5B default), "
        "so --resume and later runs on the same data skip it (default: --out with .teacher; 'none': keep "
        "nothing).",
    ),
    device: str = typer.Option(
        "cpu",
        help="Where the head trains and the float32 teacher runs (torch device: cpu, cuda, cuda:1, mps); the gguf "
        "runner reads on the CPU either way.",
    ),
    precision: str = typer.Option(
        "auto",
        help="Float format of the training step: bf16 (fp32 master weights, bf16 matrix products, fp32 loss), f32, "
        "or auto (bf16 where the CPU multiplies bf16 natively: AMX-BF16 or AVX512-BF16; f32 elsewhere).",
    ),
    checkpoint_minutes: float = typer.Option(
        5.0, help="Write the head to --out this often while training (and on Ctrl-C)."
    ),
    resume: bool = typer.Option(False, help="Continue the head in --out with the data recorded beside it."),
    plot: Path | None = typer.Option(None, help="Loss-curve PNG (default: --out with .png)."),
) -> None:
    """Train an EAGLE-3 draft head for TARGET on the target's own answers; use it with --eagle-head."""

    from verispec.engine.loader import SpeculativePipeline
    from verispec.models.loading import load_model, parse_device
    from verispec.runners.cpu.reduced_vocab import token_counts
    from verispec.runners.eagle.file import WEIGHT_TYPES
    from verispec.runners.eagle.head import EagleHead, choose_draft_vocabulary
    from verispec.training.data import HeadData, collect
    from verispec.training.files import load_optimizer_state, plot_training, save_checkpoint
    from verispec.training.loop import TrainOptions, make_optimizer
    from verispec.training.precision import choose_precision

    command = _command_line(ctx.params)
    data_path = out.with_name(out.name + ".data.json")
    optimizer_path = out.with_name(out.name + ".optimizer.pt")
    with user_errors(OSError, WorkloadError):
        if not out.parent.is_dir():
            raise InvalidParameterError(f"--out {out}: the folder {out.parent} does not exist")
        if resume and not (out.is_file() and data_path.is_file()):
            raise InvalidParameterError(f"--resume needs {out} and {data_path} from an earlier run")
        if not resume and out.exists():
            raise InvalidParameterError(f"{out} exists: pass --resume to continue it, or another --out")
        if weights not in WEIGHT_TYPES:
            raise InvalidParameterError(f"--weights must be one of {', '.join(WEIGHT_TYPES)}, not {weights!r}")
        parse_device(device)  # before any data is generated: a missing GPU is said at once
        chosen = choose_precision(precision, device)
        if teacher not in ("auto", "runner", "torch"):
            raise InvalidParameterError(f"--teacher must be auto, runner or torch, not {teacher!r}")
        options = TrainOptions(
            steps=steps,
            minutes=minutes,
            lr=lr,
            batch_positions=batch_positions,
            held_out=held_out,
            seed=seed,
            precision=chosen.precision,
        )
        for path in prompts or []:  # before the target loads (minutes on --runner torch)
            if not Path(path).is_file():
                raise InvalidParameterError(f"--prompts {path}: no such file (JSONL, 'prompt' or 'turns' per line)")
        for path in code or []:
            if not Path(path).exists():
                raise InvalidParameterError(f"--code {path}: no such file or directory")
        err.print(f"precision: {chosen.reason}")  # once every option is known good
        pipe = None
        if resume:
            data = HeadData.load(data_path)
            err.print(
                f"resuming {out}: {data.manifest['sequences']} sequences, {data.manifest['tokens']} tokens from "
                f"{data_path}"
            )
        else:
            pipe = SpeculativePipeline.load(target, None, **_runner_options(runner))
            data = collect(
                pipe,
                prompts or [],
                DEFAULT_MAGPIE if magpie is None and not prompts else (magpie or 0),
                code or [],
                code_tokens,
                max_tokens,
                seed,
                console=err if err.is_terminal else None,
            )
            err.print(f"training data: {data.manifest['sequences']} sequences, {data.manifest['tokens']} tokens")
            data.save(data_path)
        if teacher != "torch" and pipe is None:
            pipe = SpeculativePipeline.load(target, None, **_runner_options(runner))
        reader = None if teacher == "torch" else pipe.target_runner
        if reader is not None and not hasattr(reader, "capture_final_hidden"):
            if teacher == "runner":
                raise InvalidParameterError(
                    f"--teacher runner: the {pipe.runner_kind} runner cannot hand out its hidden states; "
                    "use --runner gguf (or int8), or --teacher torch"
                )
            reader = None
        if reader is None:
            pipe = None  # its memory back before the float32 model loads
        err.print(
            "the teacher: "
            f"{'the target on the ' + pipe.runner_kind + ' runner' if reader is not None else 'float32 transformers'}"
        )
        with _announce(f"loading {target} into torch (the teacher: its features and distributions)"):
            model = load_model(target, device=device)
        if resume:
            head = EagleHead.load(out, model.model)
        else:
            counts = token_counts(data.sequences, model.vocab_size)
            size = min(draft_vocab, model.vocab_size)
            draft_ids = choose_draft_vocabulary(counts, size, eos_token_ids=model.eos_token_ids)
            head = EagleHead.from_target(
                model.model,
                draft_token_ids=draft_ids,
                seed=seed,
                intermediate_size=head_intermediate,
                lm_head_from_target=shared_lm_head,
            )
        head.to(model.model.device)  # --device: the head trains beside the float32 target
        record = dict(head.training_record)
        record.update(command=command, seed=seed, target=target, data=data.manifest, runs=record.get("runs", []))
        head.training_record = record
        options.steps_before = sum(run.get("steps", 0) for run in record["runs"])
        optimizer = make_optimizer(head, options, load_optimizer_state(optimizer_path, err.print) if resume else None)
        record["teacher"] = "torch" if reader is None else pipe.runner_kind
        read, cache = _reader(head, model, reader, record["teacher"], target, teacher_cache, out)
        report = _train(
            head, model.model, data, options, out, checkpoint_minutes, optimizer, optimizer_path, read, weights
        )
        if cache is not None:
            err.print(cache.summary())
        record["runs"].append(
            {
                "steps": report.steps,
                "precision": options.precision,
                "seconds": round(report.seconds, 1),
                "positions": report.positions,
                "held_out_top1_before": report.held_out_top1_before,
                "held_out_top1": report.held_out_top1,
                "held_out_top1_by_step": report.held_out_top1_by_step,
                "held_out_loss": report.held_out_loss,
                "final_loss": report.losses[-1] if report.losses else None,
            }
        )
        save_checkpoint(head, out, optimizer, optimizer_path, weights)
        plot_training(report, plot or out.with_suffix(".png"))
    err.print(
        f"wrote {out}: {report.steps} steps in {report.seconds / 60:.1f} min; held-out top-1 agreement "
        f"{report.held_out_top1_before:.3f} -> {report.held_out_top1:.3f} (by draft step: "
        f"{', '.join(f'{x:.3f}' for x in report.held_out_top1_by_step)}); loss plot {plot or out.with_suffix('.png')}"
    )


def _command_line(params: dict) -> str:
    """The command as it ran, every option spelled out (recorded in the head)."""
    words = ["verispec", "train-head"]
    for name, value in params.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value not in (None, False, [], ()):
            for item in value if isinstance(value, (list, tuple)) else [value]:
                words += [flag, shlex.quote(str(item))]
    return " ".join(words)


def _reader(head, model, reader, kind: str, target: str, cache_option: str | None, out: Path):
    """How the target reads one sequence (its runner's passes, or float32 transformers), behind
    the teacher cache unless ``cache_option`` is ``none``; returns ``(read, cache or None)``."""
    from functools import partial

    from verispec.training.cache import TeacherCache, reader_identity
    from verispec.training.loop import runner_teacher, teacher

    layers = head.shape.feature_layers
    if reader is not None:
        read = partial(runner_teacher, reader, feature_layers=layers)
    else:
        read = lambda ids: teacher(model.model, ids, layers)  # noqa: E731
    if cache_option is not None and cache_option.lower() == "none":
        return read, None
    path = getattr(getattr(reader, "weights", None), "path", None)
    if path is None and Path(target).exists():
        path = Path(target)
    folder = Path(cache_option) if cache_option else out.with_name(out.name + ".teacher")
    cache = TeacherCache(folder, reader_identity(kind, f"{target}#{head.shape.target_norm_sha256}", path))
    return cache.reading(read, layers), cache


def _runner_options(runner: str) -> dict:
    from verispec.runners.select import RunnerOptions

    return {"runners": RunnerOptions(kind=runner)}


def _announce(what: str):
    from verispec.progress import announce_slow

    return announce_slow(what, "once per run")


def _train(
    head,
    model,
    data,
    options,
    out: Path,
    checkpoint_minutes: float,
    optimizer,
    optimizer_path: Path,
    read=None,
    weights: str = "f32",
):
    """:func:`verispec.training.loop.train_head` under a rich bar on a terminal, else a line on
    stderr every :data:`verispec.progress.LINE_EVERY_S` seconds (a log shows it too); the head
    and its optimiser's state written beside ``out`` every ``checkpoint_minutes`` and on Ctrl-C
    (then exit 130)."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from verispec import progress
    from verispec.training.files import save_checkpoint
    from verispec.training.loop import train_head as run

    last_save = last_line = time.monotonic()
    total = options.steps if options.minutes is None else None
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed}"),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
    )
    bar = Progress(*columns, console=err) if err.is_terminal else None
    with bar if bar is not None else nullcontext():
        reading = bar.add_task("the target reading the data", total=None, stats="") if bar is not None else None
        task = bar.add_task("training the head", total=total, stats="") if bar is not None else None
        start = train_start = time.monotonic()

        def on_step(step: int, loss: float, top1: float, rate: float) -> None:
            nonlocal last_save, last_line
            now = time.monotonic()
            stats = f"loss {loss:.3f}  top-1 {top1:.3f}  ~{rate:.0f} positions/s"
            if bar is not None:
                bar.update(task, completed=step, stats=stats)
            elif step == 1 or now - last_line >= progress.LINE_EVERY_S or step == total:
                print(
                    f"verispec: training the head · step {step}{'' if total is None else f'/{total}'} · {stats} "
                    f"({now - train_start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                last_line = now
            if now - last_save > 60 * checkpoint_minutes:
                save_checkpoint(head, out, optimizer, optimizer_path, weights)
                last_save = time.monotonic()

        def on_teacher(done: int, total: int) -> None:  # before training: one pass per sequence
            nonlocal last_line, train_start
            now = train_start = time.monotonic()
            if bar is not None:
                bar.update(reading, completed=done, total=total)
            elif done in (1, total) or now - last_line >= progress.LINE_EVERY_S:
                print(
                    f"verispec: the target reading the data (its features and distributions) {done}/{total} "
                    f"({now - start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                last_line = now

        try:
            return run(
                head,
                model,
                data.sequences,
                options,
                on_step=on_step,
                on_teacher=on_teacher,
                optimizer=optimizer,
                read=read,
            )
        except KeyboardInterrupt:
            save_checkpoint(head, out, optimizer, optimizer_path, weights)
            err.print(f"interrupted: the head so far is in {out}; continue with --resume")
            raise typer.Exit(130) from None
