"""Every cache file is checked before it is trusted: a truncated or corrupt one is said once on
stderr (naming the file and what was wrong) and rebuilt, equal to a fresh build; never read as
data, never a traceback. One section per kind: the format itself, cost curves, derived weights,
the suffix cache, the kernels' build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from verispec.errors import CacheFileError, InvalidParameterError
from verispec.models import cache_files
from verispec.models.cache_files import ForeignFileError, atomic_write, read_checked, report_damaged, write_checked
from verispec.proposers.suffix import SuffixCache
from verispec.runners.costs import CostCache, CostCurve
from verispec.runners.cpu.weight_cache import WeightCache


def truncate(path: Path, keep: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2 if keep is None else keep)


def flip_last_byte(path: Path) -> None:
    """One bit pattern changed, the size kept; the modification time moves (as any write's does,
    here by a whole second, past the file system's clock tick)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    mtime_ns = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))
    os.utime(path, ns=(mtime_ns, mtime_ns + 10**9))


def reports(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("verispec: cache file")]


# --- the checked format and atomic writes -------------------------------------------------------


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda p: truncate(p), CacheFileError, "after its header, not 1000 .truncated"),  # cut in the payload
        (lambda p: truncate(p, keep=30), CacheFileError, "within its header .truncated"),  # cut in the header
        (lambda p: truncate(p, keep=4), ForeignFileError, "no verispec header"),  # too short to tell whose it was
        (flip_last_byte, CacheFileError, "sha256"),  # same size, one byte changed
        (lambda p: p.write_bytes(b'{"a": 1}'), ForeignFileError, "no verispec header"),  # another format
    ],
)
def test_a_damaged_checked_file_is_refused_saying_why(tmp_path, damage, error, message):
    path = tmp_path / "file"
    write_checked(path, "kind/1", b"x" * 1000)
    assert read_checked(path, "kind/1") == b"x" * 1000
    damage(path)
    with pytest.raises(error, match=message):
        read_checked(path, "kind/1")


def test_a_checked_file_of_another_kind_is_foreign(tmp_path):
    write_checked(tmp_path / "file", "kind/1", b"data")
    with pytest.raises(ForeignFileError, match="not 'kind/2'"):
        read_checked(tmp_path / "file", "kind/2")


def test_a_crash_while_writing_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "file"
    atomic_write(path, b"old")

    def crash(out):
        out.write(b"half of the new")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(path, crash)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["file"]


def test_damage_is_reported_once_per_file_and_problem(capsys, tmp_path):
    for _ in range(3):
        report_damaged(tmp_path / "a", "is cut", "rebuilt")
    report_damaged(tmp_path / "a", "is other", "rebuilt")
    assert reports(capsys) == [
        f"verispec: cache file {tmp_path / 'a'} is cut; rebuilt",
        f"verispec: cache file {tmp_path / 'a'} is other; rebuilt",
    ]


# --- cost curves ---------------------------------------------------------------------------------

CURVE = CostCurve("gguf:avx2", "tiny:925920", {1: 36.0, 2: 39.5, 4: 45.25, 8: 56.0, 16: 81.0}, 16, 2, 1.5)


@pytest.mark.parametrize("damage", [truncate, flip_last_byte, lambda p: p.write_text(json.dumps({"m": {}}))])
def test_a_damaged_cost_file_is_reported_once_and_measured_again(tmp_path, capsys, damage):
    cache = CostCache(tmp_path / "costs", machine="m")
    cache.put("tiny:925920", CURVE)
    damage(cache.path)
    assert cache.get("tiny:925920", "gguf:avx2") is None and cache.get("tiny:925920", "gguf:avx2") is None
    (line,) = reports(capsys)  # two reads, one line
    assert str(cache.path) in line and "measured again" in line
    cache.put("tiny:925920", CURVE)  # what the runner choice does after measuring
    fresh = CostCache(tmp_path / "fresh", machine="m")
    fresh.put("tiny:925920", CURVE)
    assert cache.path.read_bytes() == fresh.path.read_bytes()
    assert cache.get("tiny:925920", "gguf:avx2") == CURVE and reports(capsys) == []


# --- derived weights -----------------------------------------------------------------------------

MATRICES = {
    "blk.0.q": (torch.arange(-64, 64, dtype=torch.int8).reshape(8, 16), torch.linspace(0, 1, 8)),
    "blk.0.k": (torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16),),
}


def load_weights(gguf_path: Path, directory: Path, computed: list[str]) -> dict:
    cache = WeightCache(gguf_path, directory, "iq4_nl", 1)

    def compute(key):
        computed.append(key)
        return MATRICES[key]

    arrays = {key: tuple(t.clone() for t in cache.get(key, lambda key=key: compute(key))) for key in MATRICES}
    cache.finish()
    return arrays


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda bin_, index: truncate(bin_), "truncated"),  # the arrays cut short
        (lambda bin_, index: flip_last_byte(bin_), "crc32"),  # one weight changed, size kept
        (lambda bin_, index: truncate(index), "truncated"),  # the index cut short
        (lambda bin_, index: index.write_text('{"matrices": {}}'), "no verispec header"),  # an older verispec's index
    ],
)
def test_a_damaged_weight_cache_is_reported_once_and_rebuilt_equal(tmp_path, capsys, damage, problem):
    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(b"GGUF")
    computed: list[str] = []
    first = load_weights(gguf_path, tmp_path / "weights", computed)
    (data,) = (tmp_path / "weights").glob("*.bin")
    assert load_weights(gguf_path, tmp_path / "weights", computed) and computed == list(MATRICES)  # a hit
    damage(data, data.with_suffix(".json"))
    rebuilt = load_weights(gguf_path, tmp_path / "weights", computed)
    assert computed == 2 * list(MATRICES)  # computed again, not read
    (line,) = reports(capsys)
    assert problem in line and "computed again" in line and str(tmp_path / "weights") in line
    load_weights(gguf_path, tmp_path / "fresh", [])
    assert data.read_bytes() == next((tmp_path / "fresh").glob("*.bin")).read_bytes()  # equal to a fresh build
    for key in MATRICES:
        assert all(torch.equal(a, b) for a, b in zip(rebuilt[key], first[key]))
    assert load_weights(gguf_path, tmp_path / "weights", computed) and computed == 2 * list(MATRICES)  # a hit again
    assert reports(capsys) == []


# --- the suffix cache ----------------------------------------------------------------------------

SEQUENCES = [[1, 2, 3, 4, 5], [7, 2, 3, 9], [5, 5, 5]]


def saved_suffix_cache(path: Path) -> SuffixCache:
    cache = SuffixCache(min_ngram=2, max_ngram=4)
    for tokens in SEQUENCES:
        cache.add(tokens)
    cache.save(path)
    return cache


@pytest.mark.parametrize("damage", [truncate, flip_last_byte])
def test_a_damaged_suffix_cache_is_never_read(tmp_path, damage):
    saved_suffix_cache(tmp_path / "suffix.cache")
    damage(tmp_path / "suffix.cache")
    cache = SuffixCache(min_ngram=2, max_ngram=4)
    with pytest.raises(CacheFileError):
        cache.load(tmp_path / "suffix.cache")
    assert cache.num_sequences == 0


def test_the_first_suffix_cache_format_is_still_read(tmp_path):
    tokens = np.array([t for seq in SEQUENCES for t in seq], dtype=np.int64)
    np.savez(tmp_path / "old.npz", tokens=tokens, lengths=np.array([len(s) for s in SEQUENCES]), format=np.array([1]))
    cache = SuffixCache(min_ngram=2, max_ngram=4)
    assert cache.load(tmp_path / "old.npz") == 3 and cache.sequences() == SEQUENCES


def test_the_server_reports_a_damaged_suffix_cache_once_and_writes_it_anew(tmp_path, capsys):
    from server_support import LiveServer, tiny_pipeline, wait_ready
    from verispec.server import create_app

    path = tmp_path / "suffix.cache"
    saved_suffix_cache(path)
    truncate(path)
    with LiveServer(create_app(tiny_pipeline(), suffix_cache=str(path))) as server:
        wait_ready(server.url)
    (line,) = reports(capsys)
    assert str(path) in line and "truncated" in line and "empty suffix cache" in line
    assert SuffixCache().load(path) == 0  # rewritten whole at shutdown: checked, empty
    path.write_bytes(b"someone's data")  # not ours: refused, never overwritten
    with pytest.raises(InvalidParameterError, match="not a verispec suffix cache"):
        create_app(tiny_pipeline(), suffix_cache=str(path))


# --- the kernels' build --------------------------------------------------------------------------


def fake_build(directory: Path) -> Path:
    from verispec.runners.kernels import _record_build

    directory.mkdir(parents=True)
    library = directory / "verispec_gguf_x.so"
    library.write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    (directory / "formats.o").write_bytes(b"object")
    _record_build(directory, library)
    return library


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda lib, d: truncate(lib), "truncated"),
        (lambda lib, d: flip_last_byte(lib), "sha256"),
        (lambda lib, d: (d / "verispec-build.json").unlink(), "without a build record"),
        (lambda lib, d: truncate(d / "verispec-build.json"), "damaged build record"),
    ],
)
def test_a_damaged_kernel_library_is_reported_once_and_removed_for_relinking(tmp_path, capsys, damage, problem):
    from verispec.runners.kernels import check_build

    library = fake_build(tmp_path / "build")
    check_build(tmp_path / "build")
    assert library.exists() and reports(capsys) == []  # intact: kept
    damage(library, tmp_path / "build")
    check_build(tmp_path / "build")
    check_build(tmp_path / "build")
    (line,) = reports(capsys)
    assert problem in line and "linked again" in line
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == ["formats.o"]  # the objects stay: only a link


def test_a_stale_torch_build_lock_is_removed(tmp_path, capsys):
    from verispec.runners.kernels import check_build, fcntl

    if fcntl is None:
        pytest.skip("no flock here: a torch lock cannot be told stale")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "lock").write_text("")
    check_build(tmp_path / "build")
    assert not (tmp_path / "build" / "lock").exists() and "killed" in reports(capsys)[0]


def test_a_truncated_kernel_library_is_linked_again_and_computes_the_same(tmp_path):
    from verispec.runners.kernels import gguf_kernels

    kernels = gguf_kernels()  # this session's build: in the home of the test that built it first
    built = Path(kernels.__file__).parent  # (not kernel_build_dir(): the suite's home may not have it)
    home = tmp_path / "home"
    copy = home / "kernels" / built.name
    shutil.copytree(built, copy)
    (library,) = copy.glob("*.so")
    truncate(library)
    gate_up = torch.linspace(-4, 4, 2 * 3 * 40).reshape(3, 80)
    script = (
        "import sys, torch; from verispec.runners.kernels import gguf_kernels; "
        "torch.save(gguf_kernels().silu_mul(torch.load(sys.argv[1]), 0), sys.argv[2])"
    )
    torch.save(gate_up, tmp_path / "in.pt")
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env={**os.environ, "VERISPEC_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    damaged = [line for line in result.stderr.splitlines() if line.startswith("verispec: cache file")]
    assert len(damaged) == 1 and "truncated" in damaged[0] and "Traceback" not in result.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt"), kernels.silu_mul(gate_up, 0))
    assert library.stat().st_size == next(built.glob("*.so")).stat().st_size  # whole again
