"""``verispec train-head``: an EAGLE-3 head for a target, trained on this machine from the
target's own answers (self-distillation), with a progress bar, checkpoints and a loss plot.

This module parses, validates and shows progress; the data (:func:`verispec.training.data.collect`),
the loop (:mod:`verispec.training.loop`) and the files beside the head
(:mod:`verispec.training.files`) are the training package's. The steps: check every option,
collect (or, with ``--resume``, read) the data, choose the teacher, build the head, train, save."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from verispec.bench.workload import WorkloadError
from verispec.cli.common import err, runner_option, target_option, user_errors
from verispec.cli.head_training import reader as _reader
from verispec.cli.head_training import train as _train
from verispec.cli.options import PipelineOptions
from verispec.engine.loader import DEFAULT_TARGET
from verispec.errors import InvalidParameterError

DEFAULT_MAGPIE = 256  # self-generated instructions when no --prompts file is given

# train-head's options, each declared once
Out = Annotated[
    Path,
    typer.Option(
        help="Head file to write (and to continue with --resume): .gguf (GGUF, architecture eagle3), else a torch "
        "file.",
    ),
]
Target = Annotated[str, target_option("The target the head drafts for (built-in name, .gguf file, HF directory).")]
Prompts = Annotated[
    list[Path] | None,
    typer.Option(
        help="JSONL prompts of your own traffic ('prompt' or 'turns' per line; repeatable). Benchmark prompts are "
        "refused.",
    ),
]
Magpie = Annotated[
    int | None,
    typer.Option(
        min=0,
        help=f"Instructions the target writes itself (Magpie) and then answers (default: {DEFAULT_MAGPIE} without "
        "--prompts, else 0).",
    ),
]
Code = Annotated[
    list[Path] | None,
    typer.Option(
        help="Code or text directories the target reads teacher-forced (repeatable), e.g. Python's standard library.",
    ),
]
CodeTokens = Annotated[int, typer.Option(min=0, help="Tokens of --code at most.")]
MaxTokens = Annotated[int, typer.Option(min=1, help="Tokens of each answer the target writes.")]
DraftVocab = Annotated[
    int,
    typer.Option(
        min=1, help="Rows of the head's draft vocabulary (the most frequent tokens of the data; EOS always in)."
    ),
]
HeadIntermediate = Annotated[
    int,
    typer.Option(
        min=1,
        help="Width of the head's MLP (the target's own is 8960 for the 1.5B default): narrower drafts and trains "
        "faster.",
    ),
]
SharedLmHead = Annotated[
    bool,
    typer.Option(
        "--shared-lm-head/--own-lm-head",
        help="Draft with the target's own LM-head rows, frozen and not stored (EAGLE's shared head: less to learn, a "
        "smaller file), or train the head's own (EAGLE-3).",
    ),
]
Weights = Annotated[
    str,
    typer.Option(
        help="How --out stores the matrices: f32 (what --resume continues exactly), f16, or q8_0 (8.5 bits a weight, "
        "what the gguf runner drafts with: a head to ship).",
    ),
]
Minutes = Annotated[
    float | None, typer.Option(help="Training budget in minutes (the data is generated first, outside it).")
]
Steps = Annotated[
    int | None, typer.Option(min=1, help="Optimiser steps at most (with --minutes: whichever comes first).")
]
Lr = Annotated[float, typer.Option(help="AdamW learning rate.")]
BatchPositions = Annotated[int, typer.Option(min=1, help="Anchors per optimiser step.")]
HeldOut = Annotated[
    float, typer.Option(help="Fraction of the sequences kept out of training for the agreement figures.")
]
Seed = Annotated[
    int, typer.Option(help="Seeds the data (Magpie), the split, the batch order and the head's initialisation.")
]
Runner = Annotated[str, runner_option("Runner that answers the prompts (default auto: gguf on a CPU).")]
Teacher = Annotated[
    str,
    typer.Option(
        help="Who reads the data for the head to learn from: 'runner' (the target on --runner's kernels, e.g. the "
        "gguf runner: the quantized model served, at its prefill speed), 'torch' (float32 transformers), 'auto' "
        "(runner where it can hand out its hidden states: gguf, int8).",
    ),
]
TeacherCache = Annotated[
    str | None,
    typer.Option(
        help="Folder keeping the target's reading of each sequence (features, ~24 KB a token for the 1.5B default), "
        "so --resume and later runs on the same data skip it (default: --out with .teacher; 'none': keep "
        "nothing).",
    ),
]
Device = Annotated[
    str,
    typer.Option(
        help="Where the head trains and the float32 teacher runs (torch device: cpu, cuda, cuda:1, mps); the gguf "
        "runner reads on the CPU either way.",
    ),
]
Precision = Annotated[
    str,
    typer.Option(
        help="Float format of the training step: bf16 (fp32 master weights, bf16 matrix products, fp32 loss), f32, "
        "or auto (bf16 where the CPU multiplies bf16 natively: AMX-BF16 or AVX512-BF16; f32 elsewhere).",
    ),
]
CheckpointMinutes = Annotated[
    float, typer.Option(help="Write the head to --out this often while training (and on Ctrl-C).")
]
Resume = Annotated[bool, typer.Option(help="Continue the head in --out with the data recorded beside it.")]
Plot = Annotated[Path | None, typer.Option(help="Loss-curve PNG (default: --out with .png).")]


def train_head(
    ctx: typer.Context,
    out: Out = ...,
    target: Target = DEFAULT_TARGET,
    prompts: Prompts = None,
    magpie: Magpie = None,
    code: Code = None,
    code_tokens: CodeTokens = 100_000,
    max_tokens: MaxTokens = 256,
    draft_vocab: DraftVocab = 32_000,
    head_intermediate: HeadIntermediate = 2048,
    shared_lm_head: SharedLmHead = True,
    weights: Weights = "f32",
    minutes: Minutes = 60.0,
    steps: Steps = None,
    lr: Lr = 3e-4,
    batch_positions: BatchPositions = 512,
    held_out: HeldOut = 0.1,
    seed: Seed = 0,
    runner: Runner = "auto",
    teacher: Teacher = "auto",
    teacher_cache: TeacherCache = None,
    device: Device = "cpu",
    precision: Precision = "auto",
    checkpoint_minutes: CheckpointMinutes = 5.0,
    resume: Resume = False,
    plot: Plot = None,
) -> None:
    """Train an EAGLE-3 draft head for TARGET on the target's own answers; use it with --eagle-head."""
    params = dict(locals())
    from verispec.training.files import plot_training, save_checkpoint

    paths = _Paths(out)
    with user_errors(OSError, WorkloadError):
        options = _check(params, paths)
        pipeline = PipelineOptions(target, method="none", one_method=True, runner=runner).check_before_loading()
        err.print(f"precision: {options.precision_reason}")  # once every option is known good
        data, pipe = _data(params, paths, pipeline)
        reader, pipe = _teacher_runner(pipe, pipeline, teacher)
        model, head = _head(params, paths, data)
        optimizer, record = _record(head, params, data, options.train, paths, reader, pipe)
        read, cache = _reader(head, model, reader, record["teacher"], target, teacher_cache, out)
        report = _train(
            head, model.model, data, options.train, out, checkpoint_minutes, optimizer, paths.optimizer, read, weights
        )
        if cache is not None:
            err.print(cache.summary())
        record["runs"].append(_run_record(report, options.train))
        save_checkpoint(head, out, optimizer, paths.optimizer, weights)
        plot_training(report, plot or out.with_suffix(".png"))
    err.print(
        f"wrote {out}: {report.steps} steps in {report.seconds / 60:.1f} min; held-out top-1 agreement "
        f"{report.held_out_top1_before:.3f} -> {report.held_out_top1:.3f} (by draft step: "
        f"{', '.join(f'{x:.3f}' for x in report.held_out_top1_by_step)}); loss plot {plot or out.with_suffix('.png')}"
    )


class _Paths:
    """The files beside the head: its data record and its optimiser's state."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data = out.with_name(out.name + ".data.json")
        self.optimizer = out.with_name(out.name + ".optimizer.pt")


class _Checked:
    """What :func:`_check` made of the options: the training options and why that precision."""

    def __init__(self, train, precision_reason: str) -> None:
        self.train = train
        self.precision_reason = precision_reason


def _check(params: dict[str, Any], paths: _Paths) -> _Checked:
    """Every refusal of train-head's own options, before any data is generated or model loads.

    Raises:
        InvalidParameterError: a missing folder or file, --resume without its files, an existing
            --out without it, unknown weights or teacher, a bad training option.
        VerispecError: a device this machine does not have.
    """
    from verispec.models.loading import parse_device
    from verispec.runners.eagle.file import WEIGHT_TYPES
    from verispec.training.loop import TrainOptions
    from verispec.training.precision import choose_precision

    p, out = params, paths.out
    if not out.parent.is_dir():
        raise InvalidParameterError(f"--out {out}: the folder {out.parent} does not exist")
    if p["resume"] and not (out.is_file() and paths.data.is_file()):
        raise InvalidParameterError(f"--resume needs {out} and {paths.data} from an earlier run")
    if not p["resume"] and out.exists():
        raise InvalidParameterError(f"{out} exists: pass --resume to continue it, or another --out")
    if p["weights"] not in WEIGHT_TYPES:
        raise InvalidParameterError(f"--weights must be one of {', '.join(WEIGHT_TYPES)}, not {p['weights']!r}")
    parse_device(p["device"])  # before any data is generated: a missing GPU is said at once
    chosen = choose_precision(p["precision"], p["device"])
    if p["teacher"] not in ("auto", "runner", "torch"):
        raise InvalidParameterError(f"--teacher must be auto, runner or torch, not {p['teacher']!r}")
    names = ("steps", "minutes", "lr", "batch_positions", "held_out", "seed")
    train = TrainOptions(**{name: p[name] for name in names}, precision=chosen.precision)
    for path in p["prompts"] or []:  # before the target loads (minutes on --runner torch)
        if not Path(path).is_file():
            raise InvalidParameterError(f"--prompts {path}: no such file (JSONL, 'prompt' or 'turns' per line)")
    for path in p["code"] or []:
        if not Path(path).exists():
            raise InvalidParameterError(f"--code {path}: no such file or directory")
    return _Checked(train, chosen.reason)


def _data(params: dict[str, Any], paths: _Paths, pipeline: PipelineOptions):
    """The training data: the earlier run's (--resume), else collected from the target (loaded
    here) and recorded beside the head; returns ``(data, the pipeline or None)``."""
    from verispec.training.data import HeadData, collect

    p = params
    if p["resume"]:
        data = HeadData.load(paths.data)
        err.print(
            f"resuming {paths.out}: {data.manifest['sequences']} sequences, {data.manifest['tokens']} tokens from "
            f"{paths.data}"
        )
        return data, None
    pipe = pipeline.load()
    magpie = DEFAULT_MAGPIE if p["magpie"] is None and not p["prompts"] else (p["magpie"] or 0)
    data = collect(
        pipe,
        p["prompts"] or [],
        magpie,
        p["code"] or [],
        p["code_tokens"],
        p["max_tokens"],
        p["seed"],
        console=err if err.is_terminal else None,
    )
    err.print(f"training data: {data.manifest['sequences']} sequences, {data.manifest['tokens']} tokens")
    data.save(paths.data)
    return data, pipe


def _teacher_runner(pipe, pipeline: PipelineOptions, teacher: str):
    """The runner that reads the data for the head (None: float32 transformers), and the
    pipeline still held (None once it is not the teacher: its memory back first).

    Raises:
        InvalidParameterError: ``--teacher runner`` on a runner that cannot hand out its hidden states.
    """
    if teacher != "torch" and pipe is None:
        pipe = pipeline.load()
    reader = None if teacher == "torch" else pipe.target_runner
    if reader is not None and not reader.supports_final_hidden:
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
    return reader, pipe


def _head(params: dict[str, Any], paths: _Paths, data):
    """The float32 target (the teacher's features and distributions) and the head: the one in
    --out (--resume), else a new one over the data's most frequent tokens; returns ``(model, head)``."""
    from verispec.models.loading import load_model
    from verispec.runners.cpu.reduced_vocab import token_counts
    from verispec.runners.eagle.head import EagleHead, choose_draft_vocabulary

    p = params
    with _announce(f"loading {p['target']} into torch (the teacher: its features and distributions)"):
        model = load_model(p["target"], device=p["device"])
    if p["resume"]:
        head = EagleHead.load(paths.out, model.model)
    else:
        counts = token_counts(data.sequences, model.vocab_size)
        size = min(p["draft_vocab"], model.vocab_size)
        draft_ids = choose_draft_vocabulary(counts, size, eos_token_ids=model.eos_token_ids)
        head = EagleHead.from_target(
            model.model,
            draft_token_ids=draft_ids,
            seed=p["seed"],
            intermediate_size=p["head_intermediate"],
            lm_head_from_target=p["shared_lm_head"],
        )
    head.to(model.model.device)  # --device: the head trains beside the float32 target
    return model, head


def _record(head, params: dict[str, Any], data, options, paths: _Paths, reader, pipe):
    """The head's training record (this command, its data, its earlier runs) and the optimiser
    (its state continued on --resume); returns ``(optimizer, record)``."""
    from verispec.training.files import load_optimizer_state
    from verispec.training.loop import make_optimizer

    p = params
    record = dict(head.training_record)
    command = _command_line(p["ctx"].params)
    record.update(command=command, seed=p["seed"], target=p["target"], data=data.manifest, runs=record.get("runs", []))
    head.training_record = record
    options.steps_before = sum(run.get("steps", 0) for run in record["runs"])
    state = load_optimizer_state(paths.optimizer, err.print) if p["resume"] else None
    optimizer = make_optimizer(head, options, state)
    record["teacher"] = "torch" if reader is None else pipe.runner_kind
    return optimizer, record


def _run_record(report, options) -> dict:
    """One training run as the head's record keeps it."""
    return {
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


def _announce(what: str):
    from verispec.progress import announce_slow

    return announce_slow(what, "once per run")
