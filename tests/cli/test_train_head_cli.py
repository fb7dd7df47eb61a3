"""``verispec train-head`` on a tiny GGUF target: the target answers the prompts, the head trains,
is written with its record (command, data manifest, runs), drafts under ``generate --method
eagle`` with the output of plain decoding, continues with ``--resume``; benchmark prompts, an
existing ``--out`` and a missing head are refused with a clear error."""

import json

import pytest
import torch
from typer.testing import CliRunner

from gguf_models import write_gguf_model
from verispec.cli import app
from verispec.runners.cpu.gguf_runner import GGUFRunner
from verispec.runners.eagle.head import EagleHead
from verispec.training import precision
from verispec.training.precision import choose_precision

cli = CliRunner()
PROMPTS = ["abc def", "hello world", "xyz!", "foo bar baz", "qwerty", "a+b=c"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train-head")
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return folder, write_gguf_model(folder / "target.gguf")


def train(folder, target, out, *extra):
    args = [
        "train-head",
        "--target",
        str(target),
        "--out",
        str(out),
        "--prompts",
        str(folder / "prompts.jsonl"),
        "--steps",
        "4",
        "--max-tokens",
        "12",
        "--draft-vocab",
        "64",
        "--batch-positions",
        "32",
        "--held-out",
        "0.2",
    ]
    return cli.invoke(app, args + list(extra))


def tokens(target, head, method):
    args = [
        "generate",
        "abc def",
        "--target",
        str(target),
        "--draft",
        "none",
        "--method",
        method,
        "--eagle-head",
        str(head),
        "--schedule",
        "constant",
        "-k",
        "3",
        "--max-tokens",
        "20",
        "--json",
    ]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_train_then_draft_then_resume(files):
    folder, target = files
    out = folder / "head.gguf"
    result = train(folder, target, out)
    assert result.exit_code == 0, result.output
    assert "held-out top-1 agreement" in result.output and (folder / "head.png").stat().st_size > 0
    head = EagleHead.load(out, GGUFRunner.from_file(target, max_context_length=64))
    record = head.training_record
    assert record["command"].startswith("verispec train-head --target") and record["seed"] == 0
    assert record["data"]["sources"][0]["kind"] == "prompts" and record["data"]["sequences"] == len(PROMPTS)
    assert len(record["data"]["sources"][0]["sha256"]) == 64 and record["runs"][0]["steps"] == 4
    assert "the teacher: the target on the gguf runner" in result.output and record["teacher"] == "gguf"  # auto
    plain, eagle = tokens(target, out, "none"), tokens(target, out, "eagle")
    assert eagle["token_ids"] == plain["token_ids"]
    assert eagle["metrics"]["spec"]["num_draft_tokens"] > 0  # the head drafted
    assert (folder / "head.gguf.optimizer.pt").stat().st_size > 0  # AdamW's moments, for --resume
    auto = choose_precision("auto").precision  # bf16 where the CPU has native bf16, else f32
    assert f"precision: {auto}" in result.output and record["runs"][0]["precision"] == auto
    again = train(folder, target, out, "--resume", "--precision", "f32")  # resumes across precisions
    assert again.exit_code == 0, again.output
    assert "precision: f32, as asked" in again.output
    assert "starts afresh" not in again.output
    # the target read the data once: the second run took every sequence from the teacher cache
    assert f"{len(PROMPTS)} sequences from the cache, 0 read by the target" in " ".join(again.output.split())
    assert len(list((folder / "head.gguf.teacher").glob("*.safetensors"))) == len(PROMPTS)
    assert [
        run["steps"]
        for run in EagleHead.load(out, GGUFRunner.from_file(target, max_context_length=64)).training_record["runs"]
    ] == [4, 4]
    runs = EagleHead.load(out, GGUFRunner.from_file(target, max_context_length=64)).training_record["runs"]
    assert [run["precision"] for run in runs] == [auto, "f32"]


def test_refusals(files, tmp_path, monkeypatch):
    folder, target = files
    result = train(folder, target, tmp_path / "t.pt", "--teacher", "nope")
    assert result.exit_code == 2 and "--teacher must be auto, runner or torch" in result.output
    result = train(folder, target, tmp_path / "gpu.pt", "--device", "cuda:63")  # no machine has a 64th GPU
    assert (
        result.exit_code == 2
        and "device 'cuda:63' is not available" in result.output
        and "Traceback" not in result.output
    )
    assert (
        "training data" not in result.output and not (tmp_path / "gpu.pt").exists()
    )  # said before any data was generated
    monkeypatch.setattr(precision, "_torch_flags", lambda: {"avx2"})  # a CPU without native bf16
    result = train(folder, target, tmp_path / "bf16.pt", "--precision", "bf16")
    assert result.exit_code == 2 and "--precision bf16 needs a CPU with native bf16" in result.output
    assert "Traceback" not in result.output and "training data" not in result.output  # said before any data
    monkeypatch.undo()
    result = train(folder, target, tmp_path / "t.pt", "--teacher", "torch", "--teacher-cache", "none")
    assert result.exit_code == 0 and "the teacher: float32 transformers" in result.output
    assert "teacher cache" not in result.output and not (tmp_path / "t.pt.teacher").exists()
    assert (
        EagleHead.load(tmp_path / "t.pt", GGUFRunner.from_file(target, max_context_length=64)).training_record[
            "teacher"
        ]
        == "torch"
    )
    (tmp_path / "head.pt").write_bytes(b"x")
    result = train(folder, target, tmp_path / "head.pt")
    assert result.exit_code == 2 and "exists: pass --resume" in result.output
    result = train(folder, target, tmp_path / "new.pt", "--resume")
    assert result.exit_code == 2 and "--resume needs" in result.output
    data = tmp_path / "data"
    data.mkdir()
    (data / "humaneval_dev.jsonl").write_text(json.dumps({"task_id": "HumanEval/0", "prompt": PROMPTS[2]}) + "\n")
    monkeypatch.setenv("VERISPEC_DATA_DIR", str(data))
    result = train(folder, target, tmp_path / "leak.pt")
    assert result.exit_code == 2 and "holds 1 benchmark prompt(s)" in result.output
    assert not (tmp_path / "leak.pt").exists()
    result = cli.invoke(app, ["generate", "ab", "--target", str(target), "--draft", "none", "--method", "eagle"])
    assert result.exit_code == 2 and "--method eagle needs --eagle-head FILE" in result.output
    result = cli.invoke(app, ["generate", "ab", "--target", str(target), "--draft", "none", "--method", "eagle-tree"])
    assert result.exit_code == 2 and "--method eagle-tree needs --eagle-head FILE" in result.output


def test_the_server_drafts_with_the_head_and_answers_as_plain(files, tmp_path):
    """``"speculative": {"method": "eagle"}`` (and ``"eagle-tree"``) on the server: the same text as
    plain decoding, drafts counted."""
    import httpx

    from server_support import LiveServer
    from verispec.engine.loader import DrafterOptions, SpeculativePipeline
    from verispec.runners.select import RunnerOptions
    from verispec.server import create_app

    folder, target = files
    result = train(folder, target, tmp_path / "head.pt")
    assert result.exit_code == 0, result.output
    pipe = SpeculativePipeline.load(
        str(target), None, runners=RunnerOptions(kind="gguf"), drafters=DrafterOptions(eagle_head=tmp_path / "head.pt")
    )
    with LiveServer(create_app(pipe)) as server:

        def complete(method):
            body = {
                "model": pipe.target.name,
                "prompt": "abc def",
                "max_tokens": 24,
                "temperature": 0,
                "speculative": {"method": method, "num_speculative_tokens": 3, "schedule": "constant"},
            }
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        plain, eagle, tree = complete("none"), complete("eagle"), complete("eagle-tree")
    assert eagle["choices"][0]["text"] == plain["choices"][0]["text"] == tree["choices"][0]["text"]
    assert eagle["usage"]["num_draft_tokens"] > 0 and plain["usage"]["num_draft_tokens"] == 0
    assert tree["usage"]["num_draft_tokens"] > 0


def test_a_replica_serves_the_head_and_answers_as_plain(files, tmp_path):
    """``serve --replicas N --eagle-head FILE``: each replica's app (what Ray Serve runs, built here
    without Ray) loads the head and drafts with it; the text is plain decoding's."""
    import httpx

    from server_support import LiveServer
    from verispec.engine.loader import DrafterOptions
    from verispec.server import ServerConfig
    from verispec.server.replicas import REPLICA_HEADER, ReplicaSpec, replica_app

    folder, target = files
    result = train(folder, target, tmp_path / "head.pt")
    assert result.exit_code == 0, result.output
    spec = ReplicaSpec(
        str(target),
        None,
        runner="gguf",
        config=ServerConfig(max_num_seqs=2),
        drafters=DrafterOptions(eagle_head=str(tmp_path / "head.pt")),
    )
    with LiveServer(replica_app(spec, "replica-0")) as server:

        def complete(method):
            body = {
                "model": "target.gguf",
                "prompt": "hello world",
                "max_tokens": 20,
                "temperature": 0,
                "speculative": {"method": method, "num_speculative_tokens": 3, "schedule": "constant"},
            }
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.headers[REPLICA_HEADER] == "replica-0"
            return response.json()

        plain, eagle = complete("none"), complete("eagle")
    assert eagle["choices"][0]["text"] == plain["choices"][0]["text"]
    assert eagle["usage"]["num_draft_tokens"] > 0


def test_serve_checks_the_head_before_anything_starts(files, tmp_path):
    folder, target = files
    result = cli.invoke(
        app,
        [
            "serve",
            "--target",
            str(target),
            "--draft",
            "none",
            "--replicas",
            "2",
            "--eagle-head",
            str(tmp_path / "missing.gguf"),
        ],
    )
    assert result.exit_code == 2 and "no such file" in result.output, result.output
    (tmp_path / "head.pt").write_bytes(b"")
    result = cli.invoke(
        app,
        [
            "serve",
            "--target",
            str(target),
            "--draft",
            "none",
            "--replicas",
            "2",
            "--eagle-head",
            str(tmp_path / "head.pt"),
            "--head-quantization",
            "q3",
        ],
    )
    assert result.exit_code == 2 and "unknown head quantization" in result.output, result.output
    # a damaged head and one for another target: refused here, once, before Ray starts any replica
    (tmp_path / "garbage.pt").write_bytes(bytes(range(256)) * 20)
    result = cli.invoke(
        app,
        [
            "serve",
            "--target",
            str(target),
            "--draft",
            "none",
            "--runner",
            "gguf",
            "--replicas",
            "2",
            "--eagle-head",
            str(tmp_path / "garbage.pt"),
        ],
    )
    assert result.exit_code == 2 and "is not a readable EAGLE head" in result.output, result.output
    assert "Traceback" not in result.output and "weights_only" not in result.output
    error = result.output[result.output.index("error:") :]
    assert len(error) < 400, error  # one short error, not torch's paragraphs of advice
    other = write_gguf_model(tmp_path / "other.gguf", seed=7)
    assert train(folder, other, tmp_path / "other-head.pt").exit_code == 0
    result = cli.invoke(
        app,
        [
            "serve",
            "--target",
            str(target),
            "--draft",
            "none",
            "--runner",
            "gguf",
            "--replicas",
            "2",
            "--eagle-head",
            str(tmp_path / "other-head.pt"),
        ],
    )
    assert result.exit_code == 2 and "trained for another target" in result.output, result.output


def test_advise_measures_the_head_and_prices_its_memory(files, tmp_path):
    """advise --eagle-head: eagle measured beside plain decoding, and the head's weights + KV cache
    reported as a share of the target's (issue 28: <= 10 %)."""
    from verispec.bench.advise_memory import head_kv_bytes
    from verispec.models.loading import load_model

    _, target = files
    head = EagleHead.from_target(load_model(str(target)).model, draft_token_ids=torch.arange(64), seed=0)
    head.save(tmp_path / "head.gguf")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abc def", "category": "chat"}\n')
    result = cli.invoke(
        app,
        [
            "advise",
            "--prompts",
            str(prompts),
            "--target",
            str(target),
            "--draft",
            "none",
            "--runner",
            "gguf",
            "--methods",
            "eagle",
            "--eagle-head",
            str(tmp_path / "head.gguf"),
            "--max-tokens",
            "8",
            "--max-k",
            "4",
            "--context-length",
            "100",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    advice = json.loads(result.stdout.strip().splitlines()[-1])
    memory = advice["memory"]
    loaded = EagleHead.load(tmp_path / "head.gguf", GGUFRunner.from_file(target, max_context_length=64))
    assert memory["head_kv_bytes"] == head_kv_bytes(loaded, 100) > 0
    assert memory["head_param_bytes"] > 0
    target_total = memory["target_param_bytes"] + memory["target_kv_bytes"]
    assert memory["head_overhead_pct"] == pytest.approx(
        100 * (memory["head_param_bytes"] + memory["head_kv_bytes"]) / target_total
    )
    assert "EAGLE head" in result.output and [f["method"] for f in advice["fits"]][:1] == ["eagle"]


@pytest.mark.parametrize(
    "option, message",
    [
        (["--lr", "-1"], "error: lr must be > 0, got -1.0"),  # was a traceback from torch's AdamW
        (["--held-out", "1.5"], "error: held_out must be in [0, 1), got 1.5"),  # was said after the data was made
        (["--minutes", "0"], "error: minutes must be > 0, got 0.0"),  # was a head written after 0 steps
    ],
)
def test_training_options_are_refused_before_anything_loads(tmp_path, monkeypatch, option, message):
    from verispec.engine.loader import SpeculativePipeline

    def load(cls, *args, **kwargs):
        raise AssertionError("loaded the target before checking the options")

    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(load))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    result = CliRunner().invoke(
        app, ["train-head", "--out", str(tmp_path / "head.gguf"), "--prompts", str(prompts), *option]
    )
    assert result.exit_code == 2 and result.output.strip() == message, result.output
    assert not (tmp_path / "head.gguf").exists()


@pytest.mark.parametrize(
    "option, message",
    [
        ("--prompts", "error: --prompts {missing}: no such file (JSONL, 'prompt' or 'turns' per line)"),
        ("--code", "error: --code {missing}: no such file or directory"),
    ],
)
def test_missing_data_is_refused_before_the_target_loads(tmp_path, monkeypatch, option, message):
    from verispec.engine.loader import SpeculativePipeline

    def load(cls, *args, **kwargs):
        raise AssertionError("loaded the target before checking the data")

    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(load))
    missing = tmp_path / "nope"
    result = CliRunner().invoke(app, ["train-head", "--out", str(tmp_path / "head.gguf"), option, str(missing)])
    assert result.exit_code == 2 and result.output.strip() == message.format(missing=missing), result.output
