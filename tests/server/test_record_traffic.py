"""serve --record-traffic DIR: every answered request's prompt lands in DIR as training JSONL that
train-head --prompts reads; refused and failed requests do not; a write that fails costs the
request nothing."""

import json
import os

import httpx
import pytest
from typer.testing import CliRunner

from server_support import FIXED_DRAFT, LiveServer, tiny_pipeline, wait_ready
from verispec.bench.workload import read_jsonl
from verispec.errors import InvalidParameterError
from verispec.server import create_app
from verispec.server.traffic import TrafficRecorder


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traffic")
    app = create_app(tiny_pipeline(), max_tokens_cap=16, default_spec=FIXED_DRAFT, record_traffic=str(folder))
    with LiveServer(app) as server:
        wait_ready(server.url)
        yield server, folder, app.state.verispec.traffic


def test_answered_prompts_are_recorded_in_the_training_format(recorded):
    server, folder, recorder = recorded
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "and again"},
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"model": "tiny-target", "messages": messages, "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        with http.stream(
            "POST",
            "/v1/completions",
            json={"model": "tiny-target", "prompt": ["ab!c", "!!ab"], "max_tokens": 4, "stream": True, "n": 2},
        ) as stream:
            assert stream.status_code == 200 and stream.read().decode().rstrip().endswith("data: [DONE]")
        refused = http.post(
            "/v1/completions", json={"model": "tiny-target", "prompt": "never", "max_tokens": 4, "temperature": -1}
        )
        assert refused.status_code == 400
        missing = http.post("/v1/completions", json={"model": "another", "prompt": "never", "max_tokens": 4})
        assert missing.status_code == 404
    path = folder / f"traffic-{os.getpid()}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["category"] for r in rows] == ["chat", "completion", "completion"]  # n = 2: each prompt once
    assert rows[0]["turns"] == ["hello there", "and again"]  # user turns only: no system or assistant text
    assert [r["prompt"] for r in rows[1:]] == ["ab!c", "!!ab"]
    assert "never" not in path.read_text() and recorder.recorded == 3 and recorder.failed == 0
    items = read_jsonl(path)  # what train-head --prompts and bench --prompts read
    assert [(i.text, i.chat) for i in items] == [("hello there", True), ("ab!c", False), ("!!ab", False)]


def test_a_failed_write_is_counted_and_the_request_answered(recorded):
    server, folder, recorder = recorded
    path, before = recorder.path, recorder.recorded
    try:
        recorder.path = folder / "a-folder"  # opening it for append fails like a full disk
        recorder.path.mkdir()
        with httpx.Client(base_url=server.url, timeout=60) as http:
            answer = http.post("/v1/completions", json={"model": "tiny-target", "prompt": "abc", "max_tokens": 4})
        assert answer.status_code == 200
        assert recorder.failed == 1 and recorder.recorded == before
    finally:
        recorder.path = path


def test_an_unusable_folder_is_refused(tmp_path):
    with pytest.raises(InvalidParameterError, match="not a writable folder"):
        TrafficRecorder(tmp_path / "missing")
    from verispec import cli

    result = CliRunner().invoke(cli.app, ["serve", "--record-traffic", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "not a writable folder" in result.output
