"""How ``verispec serve --replicas`` stops and where Ray keeps its files (issue 54, item 5): SIGTERM
exits 0 and SIGINT 130 after Ray Serve and Ray are shut down (Ray's own driver handler made SIGTERM
a ``sys.exit`` and the process ended with 134), and a local cluster's files go under
``$VERISPEC_HOME/ray`` (or ``--ray-temp-dir``), not Ray's ``/tmp/ray``. Ray itself is replaced by a
stand-in that records the calls, so no cluster starts."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gguf_models import MIXED, write_gguf_model
from verispec.cli import app
from verispec.errors import InvalidParameterError
from verispec.models.store import verispec_home
from verispec.server import ray_session, replicas
from verispec.server.ray_session import MAX_TEMP_DIR_CHARS, ray_temp_dir


class FakeRay:
    """``ray`` and ``ray.serve`` as run_replicas calls them; ``init`` installs the SIGTERM handler
    Ray's driver installs (``sys.exit(signum)``)."""

    def __init__(self) -> None:
        self.calls: list = []
        self.initialized = False

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **options) -> None:
        self.calls.append(("ray.init", options))
        self.initialized = True
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    def cluster_resources(self) -> dict:
        return {"CPU": 64.0}

    def shutdown(self) -> None:
        self.calls.append(("ray.shutdown",))

    def start(self, **options) -> None:
        self.calls.append(("serve.start",))

    def run(self, application, **options):
        self.calls.append(("serve.run",))
        return "handle"

    def serve_shutdown(self) -> None:
        self.calls.append(("serve.shutdown",))


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    serve = type("Serve", (), {"start": fake.start, "run": fake.run, "shutdown": fake.serve_shutdown})
    monkeypatch.setattr(replicas, "import_serve", lambda: (fake, serve))
    monkeypatch.setattr("verispec.cli.replicas.import_serve", lambda: (fake, serve))
    monkeypatch.setattr(replicas, "build_deployment", lambda spec, scaling: "application")
    previous = signal.getsignal(signal.SIGTERM)
    yield fake
    signal.signal(signal.SIGTERM, previous)  # what the stand-in's init installed goes


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_gguf_model(tmp_path_factory.mktemp("ray-session") / "target.gguf", MIXED)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_stop_signal_shuts_serve_and_ray_down_and_exits_as_a_shell_expects(fake_ray, target, signum, exit_code):
    args = ["serve", "--replicas", "2", "--target", str(target), "--draft", "none", "--port", str(free_port())]
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signum))
    timer.start()
    try:
        result = CliRunner().invoke(app, args)
    finally:
        timer.cancel()
    assert result.exit_code == exit_code, result.output
    assert [call[0] for call in fake_ray.calls] == [
        "ray.init",
        "serve.start",
        "serve.run",
        "serve.shutdown",
        "ray.shutdown",
    ]
    assert fake_ray.calls[0][1]["_temp_dir"] == str((verispec_home() / "ray").resolve())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # pytest's handler back


@pytest.fixture
def short_dir():
    """A folder with a short path (pytest's tmp_path is longer than Ray's sockets allow)."""
    folder = Path(tempfile.mkdtemp(prefix="vs-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_ray_temp_dir_flag_is_used_and_refused_with_a_cluster_address(fake_ray, target, short_dir, monkeypatch):
    monkeypatch.chdir(short_dir)
    args = ["serve", "--replicas", "2", "--target", str(target), "--draft", "none", "--port", str(free_port())]
    result = CliRunner().invoke(app, [*args, "--ray-address", "auto", "--ray-temp-dir", "r"])
    assert result.exit_code == 2 and "--ray-temp-dir is for a cluster this command starts" in result.output
    assert fake_ray.calls == []  # refused before Ray

    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        result = CliRunner().invoke(app, [*args, "--ray-temp-dir", "r"])
    finally:
        timer.cancel()
    assert result.exit_code == 0, result.output
    assert fake_ray.calls[0][1]["_temp_dir"] == str(short_dir.resolve() / "r")


def test_the_temp_dir_fits_rays_socket_paths(short_dir, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", "/tmp/vh")
    assert ray_temp_dir() == ("/tmp/vh/ray", None)
    monkeypatch.setenv("VERISPEC_HOME", "/tmp/" + "h" * MAX_TEMP_DIR_CHARS)
    folder, notice = ray_temp_dir()  # too long: Ray's own default, said
    assert folder is None and "too long for Ray's socket paths" in notice and "--ray-temp-dir" in notice
    with pytest.raises(InvalidParameterError, match="would pass the 107-byte limit"):
        ray_temp_dir("/tmp/" + "d" * MAX_TEMP_DIR_CHARS)
    (short_dir / "f").write_text("x")
    monkeypatch.chdir(short_dir)
    with pytest.raises(InvalidParameterError, match="is a file"):
        ray_temp_dir("f")


def test_a_second_signal_does_not_cut_the_shutdown_short():
    with pytest.raises(ray_session.Stopped) as caught, ray_session.StopSignals():
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: raises Stopped
        for _ in range(1000):
            pass
    assert caught.value.signum == signal.SIGTERM
    stops = ray_session.StopSignals()
    with stops:
        stops._stopping = True  # shutting down already
        os.kill(os.getpid(), signal.SIGINT)  # ignored
        for _ in range(1000):
            pass
