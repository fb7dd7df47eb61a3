"""Nothing learnt is lost by a crash: the suffix cache is snapshotted atomically a short interval
after it changed (here a fraction of a second; 60 s in the server), a failed write keeps the
previous snapshot whole, and a server killed without shutting down comes back with at least its
last snapshot's entries."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest

from verispec.errors import InvalidParameterError
from verispec.models import cache_files
from verispec.proposers.suffix import SuffixCache
from verispec.proposers.suffix_file import SuffixSnapshots

INTERVAL_S = 0.05  # short, so a test waits a fraction of a second


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    """Poll ``condition`` every 20 ms until it holds; only whether it did is asserted, not when."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def loaded(path) -> list[list[int]]:
    cache = SuffixCache()
    cache.load(path)
    return cache.sequences()


def test_a_snapshot_appears_after_a_change(tmp_path):
    cache = SuffixCache()
    path = tmp_path / "suffix.cache"
    snapshots = SuffixSnapshots(cache, path, interval_s=INTERVAL_S, written=cache.num_changes).start()
    try:
        time.sleep(3 * INTERVAL_S)
        assert not path.exists()  # nothing changed: nothing written
        cache.add([1, 2, 3, 4])
        assert wait_for(path.exists)
        assert loaded(path) == [[1, 2, 3, 4]]
        cache.add([5, 6, 7])
        assert wait_for(lambda: loaded(path) == [[1, 2, 3, 4], [5, 6, 7]])  # the next change too
    finally:
        snapshots.stop()
    assert not [p for p in os.listdir(tmp_path) if p != "suffix.cache"]  # no temporary left


def test_stop_writes_the_last_change(tmp_path):
    cache = SuffixCache()
    snapshots = SuffixSnapshots(cache, tmp_path / "suffix.cache", interval_s=3600).start()  # the thread never wakes
    cache.add([1, 2, 3])
    snapshots.stop()
    assert loaded(tmp_path / "suffix.cache") == [[1, 2, 3]]


def test_a_crash_mid_write_keeps_the_previous_snapshot(tmp_path, monkeypatch, caplog):
    cache = SuffixCache()
    path = tmp_path / "suffix.cache"
    cache.add([1, 2, 3, 4])
    snapshots = SuffixSnapshots(cache, path, interval_s=3600)
    assert snapshots.write_now()
    before = path.read_bytes()

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")  # the new bytes are written, not yet renamed

    cache.add([5, 6, 7])
    with monkeypatch.context() as patched, caplog.at_level(logging.ERROR, "verispec.suffix"):
        patched.setattr(cache_files.os, "fsync", failing_fsync)
        assert not snapshots.write_now() and not snapshots.write_now()
    assert path.read_bytes() == before and loaded(path) == [[1, 2, 3, 4]]  # the previous snapshot, whole
    assert os.listdir(tmp_path) == ["suffix.cache"]  # the half-written one is gone
    assert len([r for r in caplog.records if "could not write a snapshot" in r.getMessage()]) == 1  # said once
    assert snapshots.write_now() and loaded(path) == [[1, 2, 3, 4], [5, 6, 7]]  # the disk is back: written


def test_a_bad_interval_is_refused(tmp_path):
    with pytest.raises(InvalidParameterError, match="> 0"):
        SuffixSnapshots(SuffixCache(), tmp_path / "c", interval_s=0)


def test_a_killed_server_comes_back_with_its_last_snapshot(tmp_path):
    import httpx

    from server_support import LiveServer, tiny_pipeline, wait_ready
    from verispec.server import create_app

    path, survivor = tmp_path / "suffix.cache", tmp_path / "after-kill.cache"
    body = {
        "model": "tiny-target",
        "prompt": "Hello",
        "max_tokens": 12,
        "temperature": 0,
        "speculative": {"method": "suffix"},
    }
    with LiveServer(create_app(tiny_pipeline(), suffix_cache=str(path), suffix_snapshot_s=INTERVAL_S)) as server:
        wait_ready(server.url)
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert wait_for(lambda: path.exists() and loaded(path))  # snapshotted while it serves
        shutil.copy(path, survivor)  # what a kill -9 now leaves on disk (no shutdown write)
    entries = loaded(survivor)
    assert entries and all(tokens for tokens in entries)
    restarted = create_app(tiny_pipeline(), suffix_cache=str(survivor))
    cache = restarted.state.verispec.pipeline.engine.proposers["suffix"].cache
    assert cache.sequences() == entries  # at least the last snapshot's entries
    with LiveServer(restarted) as server:
        wait_ready(server.url)
        second = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["num_accepted_tokens"] > first["usage"]["num_accepted_tokens"]  # it remembered


def test_serve_takes_the_snapshot_interval(monkeypatch, tmp_path):
    """serve --suffix-snapshot-seconds: the interval reaches the server; 0 or less is refused."""
    import uvicorn
    from typer.testing import CliRunner

    from server_support import tiny_pipeline
    from verispec import cli
    from verispec.engine.loader import SpeculativePipeline

    captured = {}
    monkeypatch.setattr(SpeculativePipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline()))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: captured.update(app=app))
    args = ["serve", "--suffix-cache", str(tmp_path / "suffix.cache"), "--suffix-snapshot-seconds"]
    result = CliRunner().invoke(cli.app, args + ["5"])
    assert result.exit_code == 0, result.output
    assert captured["app"].state.verispec.config.suffix_snapshot_s == 5.0
    result = CliRunner().invoke(cli.app, args + ["0"])
    assert result.exit_code == 2 and "--suffix-snapshot-seconds must be > 0, got 0.0" in result.output
