"""Workload JSONL parsing: both line formats, bad lines named by number, selection, shortcuts."""

import json

import pytest

from verispec.bench.workload import (
    BUILTIN_WORKLOADS,
    WorkloadError,
    WorkloadItem,
    load_workload,
    parse_jsonl,
    read_jsonl,
    regroup,
    select,
)


def lines(*rows):
    return [row if isinstance(row, str) else json.dumps(row) for row in rows]


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": "def f():"}, WorkloadItem("1", "default", "def f():", chat=False)),  # raw text, no category
        ({"turns": ["Hi", "Again"], "category": "qa"}, WorkloadItem("1", "qa", "Hi", chat=True)),  # first turn, chat
        ({"question_id": 81, "turns": ["Hi"]}, WorkloadItem("81", "default", "Hi", chat=True)),  # Spec-Bench id
        ({"task_id": "HumanEval/3", "prompt": "x"}, WorkloadItem("HumanEval/3", "default", "x", chat=False)),
        ({"id": "a", "prompt": "x", "turns": ["y"]}, WorkloadItem("a", "default", "x", chat=False)),  # prompt wins
    ],
)
def test_line_formats(row, expected):
    assert parse_jsonl(lines(row)) == [expected]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ('["a list"]', "line 2: expected a JSON object, got list"),
        ('{"category": "x"}', "line 2: needs a 'prompt'"),
        ('{"prompt": ""}', "line 2: 'prompt' must be a non-empty string"),
        ('{"prompt": 3}', "line 2: 'prompt' must be a non-empty string"),
        ('{"turns": []}', "line 2: 'turns' must be a non-empty list"),
        ('{"turns": ["ok", 5]}', "line 2: 'turns' must be a non-empty list"),
        ('{"prompt": "x", "category": 7}', "line 2: 'category' must be a non-empty string"),
        ('{"id": "1", "prompt": "again"}', "line 2: id '1' already used on line 1"),  # duplicate id
    ],
)
def test_bad_line_names_its_number(bad, message):
    with pytest.raises(WorkloadError, match=message):
        parse_jsonl(lines({"id": "1", "prompt": "fine"}, bad), "w.jsonl")


def test_blank_lines_are_skipped_but_counted():
    items = parse_jsonl(["", json.dumps({"prompt": "a"}), "   ", json.dumps({"prompt": "b"})])
    assert [i.id for i in items] == ["2", "4"]  # ids default to the line number


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "w.jsonl").write_text("\n\n")
    with pytest.raises(WorkloadError, match="no prompts"):
        read_jsonl(tmp_path / "w.jsonl")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        read_jsonl(tmp_path / "absent.jsonl")


def test_select_limits_per_category_in_first_seen_order():
    items = parse_jsonl(lines(*({"prompt": str(i), "category": c} for i, c in enumerate("abab a b".replace(" ", "")))))
    assert [(i.category, i.text) for i in select(items, limit=2)] == [("a", "0"), ("a", "2"), ("b", "1"), ("b", "3")]
    assert [i.text for i in select(items, categories=["b"], limit=1)] == ["1"]
    with pytest.raises(WorkloadError, match="unknown category zz"):
        select(items, categories=["zz"])
    with pytest.raises(WorkloadError, match="--limit must be >= 1"):
        select(items, limit=0)


def test_specbench_tasks_merge_the_mt_bench_categories():
    items = [WorkloadItem(str(i), c, "t", True) for i, c in enumerate(["writing", "coding", "qa", "rag"])]
    assert [i.category for i in regroup(items, "specbench_task")] == ["mt_bench", "mt_bench", "qa", "rag"]
    assert [i.category for i in regroup(items, "humaneval")] == ["humaneval"] * 4


SPECBENCH_CATEGORIES = [  # in the order of ../shared/data/specbench_questions.jsonl
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    "translation", "summarization", "qa", "math_reasoning", "rag",
]  # fmt: skip


def shared_data(folder):
    """A shared data folder in the real files' formats: Spec-Bench's 13 categories (2 questions
    each, ``question_id``/``category``/``turns``), HumanEval's ``task_id``/``prompt`` rows."""
    folder.mkdir(parents=True)
    rows = [
        {"question_id": 10 * i + j, "category": c, "turns": [f"{c} question {j}"], "reference": []}
        for i, c in enumerate(SPECBENCH_CATEGORIES)
        for j in range(2)
    ]
    (folder / "specbench_questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(4)]
    (folder / "humaneval_dev.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return folder


def test_builtin_shortcuts_read_the_shared_data(tmp_path, monkeypatch):
    from verispec.bench import workload

    monkeypatch.setenv(workload.DATA_DIR_ENV, str(shared_data(tmp_path / "data")))
    tasks = load_workload("specbench", limit=1)
    assert [i.category for i in tasks] == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert all(i.chat for i in tasks)
    assert len(load_workload("specbench-categories", limit=1)) == 13
    humaneval = load_workload("humaneval", limit=3)
    assert [i.id for i in humaneval] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and not humaneval[0].chat
    assert set(BUILTIN_WORKLOADS) == {"specbench", "specbench-categories", "humaneval"}


def test_workload_needs_exactly_one_source(tmp_path):
    with pytest.raises(WorkloadError, match="either"):
        load_workload(None, None)
    with pytest.raises(WorkloadError, match="unknown workload"):
        load_workload("nope")


def project_layout(tmp_path, monkeypatch, with_data: bool):
    """A checkout ``tmp_path/project`` (this module's source file placed at
    ``project/src/verispec/bench/workload.py``), with ``tmp_path/shared/data`` beside it or not;
    no ``$VERISPEC_DATA_DIR``. Returns (project root, the shared data folder)."""
    from verispec.bench import workload

    root = tmp_path / "project"
    (root / "src" / "verispec" / "bench").mkdir(parents=True)
    monkeypatch.setattr(workload, "__file__", str(root / "src" / "verispec" / "bench" / "workload.py"))
    monkeypatch.delenv(workload.DATA_DIR_ENV, raising=False)
    data = tmp_path / "shared" / "data"
    if with_data:
        shared_data(data)
    return root, data


def test_shared_data_is_found_beside_the_project_from_any_folder(tmp_path, monkeypatch):
    # ``../shared/data`` beside the project root (the checkout holding src/), whatever the working
    # directory: before, the source-tree candidate looked beside src/ instead
    from verispec.bench import workload

    _, data = project_layout(tmp_path, monkeypatch, with_data=True)
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    assert workload.data_dir() == data.resolve()


def test_a_missing_shared_data_folder_names_each_place_tried_once(tmp_path, monkeypatch):
    from verispec.bench import workload

    root, data = project_layout(tmp_path, monkeypatch, with_data=False)
    monkeypatch.chdir(root)  # the working directory's candidate is the source tree's: it was named twice
    with pytest.raises(WorkloadError) as missing:
        workload.data_dir()
    assert f"(tried {data.resolve()}); set VERISPEC_DATA_DIR" in str(missing.value)
