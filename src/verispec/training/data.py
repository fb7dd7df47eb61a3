"""Training data for an EAGLE head: token sequences the target itself wrote, and their manifest.

Owns where sequences come from (the user's prompt files, self-generated instructions, a code
corpus), answering prompts with the target (batched, greedy; :func:`collect` runs the stages),
the refusal of benchmark prompts, and the manifest a head records of its data. Knows nothing
about the head or the loss (:mod:`verispec.training.loop`).

Self-distillation (EAGLE-3, Li et al. 2025, arXiv 2503.01840, §4: the target's own responses);
self-generated instructions as Magpie (Xu et al. 2024, arXiv 2406.08464, §2.1): the chat
template's prefix up to the user turn, sampled from the target, is an instruction in the style of
the data it was aligned on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.workload import BUILTIN_WORKLOADS, WorkloadError, data_dir, read_jsonl
from verispec.engine import SpeculativeConfig
from verispec.engine.scheduler import Scheduler
from verispec.errors import InvalidParameterError
from verispec.progress import steps
from verispec.training.corpus import corpus_files

MAGPIE_MARKER = "\x00verispec-magpie\x00"  # stands for the user's words when the template is cut


@dataclass
class HeadData:
    """Sequences (prompt + the target's answer, or a corpus window) and what they came from.

    ``manifest``: ``{"sources": [{"kind", "path", "sha256", "sequences", "tokens"}], "sequences",
    "tokens"}``, stored in the head so anyone can see what it was trained on.
    """

    sequences: list[list[int]] = field(default_factory=list)
    manifest: dict = field(default_factory=lambda: {"sources": [], "sequences": 0, "tokens": 0})

    def add(
        self, kind: str, sequences: Sequence[Sequence[int]], path: str | None = None, sha256: str | None = None
    ) -> None:
        kept = [list(s) for s in sequences if len(s) >= 2]
        self.sequences += kept
        tokens = sum(len(s) for s in kept)
        self.manifest["sources"].append(
            {"kind": kind, "path": path, "sha256": sha256, "sequences": len(kept), "tokens": tokens}
        )
        self.manifest["sequences"] += len(kept)
        self.manifest["tokens"] += tokens

    def save(self, path: Path) -> None:
        """Write the sequences and manifest as JSON (so ``--resume`` does not generate them again)."""
        path.write_text(json.dumps({"manifest": self.manifest, "sequences": self.sequences}))

    @classmethod
    def load(cls, path: Path) -> HeadData:
        """Raises InvalidParameterError for a file that is not one :meth:`save` wrote."""
        try:
            stored = json.loads(path.read_text())
            return cls([list(map(int, s)) for s in stored["sequences"]], stored["manifest"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidParameterError(f"{path} is not a head-training data file ({exc})") from exc


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def benchmark_prompts() -> set[str]:
    """The prompt texts of the built-in benchmark workloads (Spec-Bench, HumanEval) where their
    files exist here: what a head must never be trained on, since it is measured on them."""
    try:
        folder = data_dir()
    except WorkloadError:
        return set()
    texts: set[str] = set()
    for workload in BUILTIN_WORKLOADS.values():
        if (folder / workload.file_name).is_file():
            texts |= {item.text.strip() for item in read_jsonl(folder / workload.file_name)}
    return texts


def read_prompt_files(paths: Sequence[Path]) -> list[tuple[Path, list]]:
    """Each JSONL file's items (``{"prompt"}`` raw text or ``{"turns"}`` user turns, as ``bench``
    reads them).

    Raises:
        WorkloadError: a missing or malformed file.
        InvalidParameterError: a file holding a prompt of a benchmark workload.
    """
    banned = benchmark_prompts()
    files = []
    for path in paths:
        items = read_jsonl(path)
        leaked = [item.id for item in items if item.text.strip() in banned]
        if leaked:
            raise InvalidParameterError(
                f"{path} holds {len(leaked)} benchmark prompt(s) (e.g. id {leaked[0]}): a head trained on them would "
                "inflate every figure measured on Spec-Bench or HumanEval; remove them"
            )
        files.append((path, items))
    return files


def magpie_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where the user's words start (Magpie, §2.1).

    Raises:
        InvalidParameterError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidParameterError("self-generated instructions need a chat template; give --prompts files instead")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": MAGPIE_MARKER}], tokenize=False, add_generation_prompt=False
    )
    return list(tokenizer.encode(text[: text.index(MAGPIE_MARKER)], add_special_tokens=False))


def generate_all(
    engine,
    prompts: Sequence[Sequence[int]],
    params: Callable[[int], SamplingParams],
    *,
    max_num_seqs: int = 8,
    on_done: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """The output token ids of every prompt, run together through a :class:`Scheduler` (the
    lossless ``auto`` method: the outputs are the target's own); ``params(i)`` for prompt ``i``.
    An output that ended its turn ends with the EOS token (the engine's first: outputs leave it
    out, and a head must learn to draft it); one cut at ``max_tokens`` does not. Prompts the
    engine refuses (over the context) give an empty output."""
    scheduler = Scheduler(engine, max_num_seqs=max_num_seqs if engine.supports_batching else 1)
    spec = SpeculativeConfig(method="auto", num_speculative_tokens=4, schedule="cost")
    requests, outputs = {}, [[] for _ in prompts]
    for index, prompt in enumerate(prompts):
        try:
            requests[id(scheduler.add(prompt, params(index), spec, tag=index))] = index
        except (InvalidParameterError, ValueError):
            continue
    done = 0
    while scheduler.running or scheduler.waiting:
        for request, chunk in scheduler.step():
            if chunk.output is not None:
                ended_turn = chunk.output.finish_reason == "stop" and engine.eos_token_ids
                outputs[request.tag] = list(chunk.output.token_ids) + ([engine.eos_token_ids[0]] if ended_turn else [])
                done += 1
                if on_done is not None:
                    on_done(done)
    return outputs


def magpie_instructions(engine, tokenizer, count: int, *, seed: int, max_tokens: int = 96, **kwargs) -> list[str]:
    """``count`` user instructions the target writes itself after the template's prefix
    (temperature 1, top-p 0.95, seeded per instruction); empty or cut-off ones are dropped."""
    prefix = magpie_prefix(tokenizer)
    params = lambda i: SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed * 1_000_003 + i)  # noqa: E731
    outputs = generate_all(engine, [prefix] * count, params, **kwargs)
    eos = set(engine.eos_token_ids)
    texts = []
    for ids in outputs:
        if ids and ids[-1] in eos:  # finished its turn: a whole instruction
            text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
            if len(text) >= 8:
                texts.append(text)
    return texts


def code_windows(tokenizer, paths: Sequence[Path], *, window: int = 512, max_tokens: int = 200_000) -> list[list[int]]:
    """Windows of ``window`` tokens of the text files under ``paths`` (teacher-forced: the target
    reads the code, nothing is generated), up to ``max_tokens`` in all, files in sorted order."""
    windows, total = [], 0
    for path in corpus_files(list(paths)):
        ids = list(tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False))
        for start in range(0, max(len(ids) - 1, 0), window):
            piece = ids[start : start + window]
            if len(piece) >= 16:
                windows.append(piece)
                total += len(piece)
            if total >= max_tokens:
                return windows
    return windows


def collect(
    pipe,
    prompt_files: Sequence[Path],
    magpie: int,
    code_dirs: Sequence[Path],
    code_tokens: int,
    max_tokens: int,
    seed: int,
    console=None,
) -> HeadData:
    """The training data: the target's answers (greedy, ``max_tokens`` at most) to the prompt files
    and to ``magpie`` instructions it writes itself, and windows of the code directories
    (``code_tokens`` at most); progress per stage (:func:`verispec.progress.steps`: a bar on
    ``console``, lines in a log where it is None). ``pipe``: a loaded pipeline of the target.

    Raises:
        InvalidParameterError: no sequence at all came out.
        WorkloadError: a prompt file is unreadable or holds benchmark prompts.
    """
    data = HeadData()
    greedy = lambda i: SamplingParams(max_tokens=max_tokens)  # noqa: E731

    def stage(title: str, total: int, run, item: str):
        with steps(title, total, console=console) as shown:
            shown.running(title)

            def on_done(n: int) -> None:
                while shown.done < n:
                    shown.finished(f"{item} {shown.done + 1} done")

            return run(on_done)

    for path, items in read_prompt_files(prompt_files):
        prompts = [pipe.encode(item.text, chat=item.chat) for item in items]
        outputs = stage(
            f"answering {path.name}",
            len(items),
            lambda on_done, prompts=prompts: generate_all(pipe.engine, prompts, greedy, on_done=on_done),
            "answer",
        )
        data.add("prompts", [p + o for p, o in zip(prompts, outputs)], str(path), file_sha256(path))
    if magpie:
        texts = stage(
            "writing instructions (Magpie)",
            magpie,
            lambda on_done: magpie_instructions(pipe.engine, pipe.tokenizer, magpie, seed=seed, on_done=on_done),
            "instruction",
        )
        prompts = [pipe.encode(text, chat=True) for text in texts]
        outputs = stage(
            "answering them",
            len(texts),
            lambda on_done: generate_all(pipe.engine, prompts, greedy, on_done=on_done),
            "answer",
        )
        data.add("magpie", [p + o for p, o in zip(prompts, outputs)], f"{magpie} asked, {len(texts)} kept, seed {seed}")
    if code_dirs and code_tokens:
        windows = code_windows(pipe.tokenizer, code_dirs, max_tokens=code_tokens)
        data.add("code", windows, ", ".join(str(d) for d in code_dirs))
    if not data.sequences:
        raise InvalidParameterError("no training data: give --prompts, --magpie or --code")
    return data
