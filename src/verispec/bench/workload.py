"""Benchmark workloads: JSONL prompt files and the built-in shortcuts to the shared data.

Owns the two line formats (``{"prompt": ...}`` sent as raw text, ``{"turns": [...]}`` whose
first user turn goes through the chat template), the optional ``category``, the Spec-Bench
grouping of categories into its six tasks, and ``--limit`` per category. Knows nothing about
models or tokenizers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError

DEFAULT_CATEGORY = "default"
DATA_DIR_ENV = "VERISPEC_DATA_DIR"
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# Spec-Bench (Xia et al. 2024, §5.1): MT-bench's 8 categories form one "multi-turn conversation" task.
SPECBENCH_TASK_OF = {name: "mt_bench" for name in MT_BENCH_CATEGORIES}


class WorkloadError(VerispecError):
    """A workload file is missing, unreadable, or has a malformed line."""


@dataclass(frozen=True)
class WorkloadItem:
    """One prompt: ``id`` (unique in the workload), ``category``, the ``text`` and whether it
    is a user turn to send through the chat template (``chat``)."""

    id: str
    category: str
    text: str
    chat: bool


@dataclass(frozen=True)
class BuiltinWorkload:
    """A shortcut name: the shared data file it reads and how categories are grouped."""

    file_name: str
    description: str
    group: str = "category"  # "category" (as in the file), "specbench_task", or a fixed category name


BUILTIN_WORKLOADS = {
    "specbench": BuiltinWorkload("specbench_questions.jsonl", "Spec-Bench, its 6 tasks", "specbench_task"),
    "specbench-categories": BuiltinWorkload("specbench_questions.jsonl", "Spec-Bench, its 13 categories"),
    "humaneval": BuiltinWorkload("humaneval_dev.jsonl", "HumanEval/0-81 code completion", "humaneval"),
}


def parse_line(line: str, line_number: int, source: str = "<workload>") -> WorkloadItem | None:
    """The item on one JSONL line (1-based ``line_number``), or None for a blank line.

    Raises:
        WorkloadError: not a JSON object, neither ``prompt`` (non-empty string) nor ``turns``
            (non-empty list of strings), or a non-string ``category``; the message names the
            file and line.
    """
    if not line.strip():
        return None

    def bad(reason: str) -> WorkloadError:
        return WorkloadError(f"{source}, line {line_number}: {reason}")

    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise bad(f"expected a JSON object, got {type(row).__name__}")
    category = row.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category:
        raise bad("'category' must be a non-empty string")
    if "prompt" in row:
        text, chat = row["prompt"], False
        if not isinstance(text, str) or not text:
            raise bad("'prompt' must be a non-empty string")
    elif "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise bad("'turns' must be a non-empty list of non-empty strings")
        text, chat = turns[0], True
    else:
        raise bad("needs a 'prompt' (string) or 'turns' (list of user turns)")
    item_id = row.get("question_id", row.get("task_id", row.get("id", line_number)))
    return WorkloadItem(id=str(item_id), category=category, text=text, chat=chat)


def parse_jsonl(lines: Iterable[str], source: str = "<workload>") -> list[WorkloadItem]:
    """Every item of a JSONL text, in order; see :func:`parse_line` for the errors.

    Raises:
        WorkloadError: also when two lines share an id, or when there is no item at all.
    """
    items: list[WorkloadItem] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        item = parse_line(line, number, source)
        if item is None:
            continue
        if item.id in seen:
            raise WorkloadError(f"{source}, line {number}: id {item.id!r} already used on line {seen[item.id]}")
        seen[item.id] = number
        items.append(item)
    if not items:
        raise WorkloadError(f"{source}: no prompts (the file is empty)")
    return items


def read_jsonl(path: Path | str) -> list[WorkloadItem]:
    """Items of the JSONL file at ``path``. Raises WorkloadError (missing file, bad line)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as source:
            return parse_jsonl(source, str(path))
    except OSError as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def data_dir() -> Path:
    """The shared data folder: ``$VERISPEC_DATA_DIR``, else ``../shared/data`` next to the
    project root (from the working directory, then from this source tree).

    Raises:
        WorkloadError: none of them exists.
    """
    candidates = [Path(os.environ[DATA_DIR_ENV])] if os.environ.get(DATA_DIR_ENV) else []
    candidates += [
        Path.cwd() / ".." / "shared" / "data",
        Path(__file__).resolve().parents[3] / ".." / "shared" / "data",  # <root>/src/verispec/bench/
    ]
    candidates = list(dict.fromkeys(c.resolve() for c in candidates))  # run from the root: one folder, said once
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    raise WorkloadError(
        f"cannot find the shared data folder (tried {', '.join(str(c) for c in candidates)}); "
        f"set {DATA_DIR_ENV} or pass --prompts FILE"
    )


def regroup(items: Sequence[WorkloadItem], group: str) -> list[WorkloadItem]:
    """Items with their category replaced as ``group`` says (see :class:`BuiltinWorkload`)."""
    if group == "category":
        return list(items)
    if group == "specbench_task":
        return [_with_category(item, SPECBENCH_TASK_OF.get(item.category, item.category)) for item in items]
    return [_with_category(item, group) for item in items]


def select(
    items: Sequence[WorkloadItem], categories: Sequence[str] | None = None, limit: int | None = None
) -> list[WorkloadItem]:
    """The first ``limit`` items of each category (all when None), only ``categories`` if given.

    Order: categories in order of first appearance, items in file order within each.
    Raises:
        WorkloadError: a requested category is absent, or ``limit`` < 1.
    """
    if limit is not None and limit < 1:
        raise WorkloadError(f"--limit must be >= 1, got {limit}")
    by_category: dict[str, list[WorkloadItem]] = {}
    for item in items:
        by_category.setdefault(item.category, []).append(item)
    if categories:
        missing = [c for c in categories if c not in by_category]
        if missing:
            raise WorkloadError(
                f"unknown categor{'y' if len(missing) == 1 else 'ies'} {', '.join(missing)}; "
                f"the workload has {', '.join(by_category)}"
            )
        by_category = {c: by_category[c] for c in by_category if c in categories}
    return [item for group in by_category.values() for item in group[:limit]]


def load_workload(
    workload: str | None = None,
    prompts: Path | str | None = None,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
) -> list[WorkloadItem]:
    """The prompts of a built-in ``workload`` name or of the ``prompts`` file (exactly one).

    Raises:
        WorkloadError: both or neither given, an unknown name, a bad file or selection.
    """
    if (workload is None) == (prompts is None):
        raise WorkloadError("give either a built-in --workload or --prompts FILE")
    if prompts is not None:
        return select(read_jsonl(prompts), categories, limit)
    if workload not in BUILTIN_WORKLOADS:
        raise WorkloadError(
            f"unknown workload {workload!r}; built-in: {', '.join(BUILTIN_WORKLOADS)} (or --prompts FILE)"
        )
    builtin = BUILTIN_WORKLOADS[workload]
    items = regroup(read_jsonl(data_dir() / builtin.file_name), builtin.group)
    return select(items, categories, limit)


def _with_category(item: WorkloadItem, category: str) -> WorkloadItem:
    return WorkloadItem(id=item.id, category=category, text=item.text, chat=item.chat)
