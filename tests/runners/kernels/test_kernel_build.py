"""Building the gguf kernels from the copy of their sources kept in the build folder: two installs
of one verispec (two virtual environments, two checkouts) share the folder, keyed by the sources'
contents, and must not rebuild it in turn (ninja rebuilds whenever a source's path changes)."""

import shutil
import sysconfig

from torch.utils import cpp_extension

import verispec.runners.kernels as kernels


def test_two_installs_build_from_one_copy_of_the_sources(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **options: built.append(options["sources"]))
    directory = tmp_path / "kernels" / kernels.build_key()
    directory.mkdir(parents=True)
    originals = [path.name for path in kernels.SOURCES]

    kernels._load(directory)  # the first install
    copies = sorted((directory / "src").iterdir())
    assert [path.name for path in copies] == sorted(originals + ["core.h"])
    assert all(copy.read_bytes() == (kernels.DIRECTORY / copy.name).read_bytes() for copy in copies)
    stamps = {copy: copy.stat().st_mtime_ns for copy in copies}

    other = tmp_path / "other-install"  # the same sources at another path
    shutil.copytree(kernels.DIRECTORY, other)
    monkeypatch.setattr(kernels, "SOURCES", tuple(other / name for name in originals))
    monkeypatch.setattr(kernels, "HEADERS", (other / "core.h",))
    kernels._load(directory)

    expected = [str(directory / "src" / name) for name in originals]
    assert built == [expected, expected]  # one build.ninja for both: nothing to rebuild
    assert {copy: copy.stat().st_mtime_ns for copy in copies} == stamps  # untouched: ninja sees old times

    (directory / "src" / "portable.cpp").write_text("// damaged")  # a copy that differs is written again
    kernels._load(directory)
    assert (directory / "src" / "portable.cpp").read_bytes() == (other / "portable.cpp").read_bytes()


def other(paths):
    return lambda *args, **kwargs: [path.replace("/torch/", "/other-venv/torch/") for path in paths]


def test_installs_whose_command_lines_differ_get_their_own_build_folder(monkeypatch):
    # issue 54, item 6: two virtual environments of one torch shared a folder and rebuilt it in turn
    # (35.7 s each time): its build.ninja carried each one's torch include path
    key = kernels.build_key()
    assert kernels.build_key() == key  # the same install: the same folder
    cases = [
        (cpp_extension, "include_paths", other(cpp_extension.include_paths())),  # another venv's torch headers
        (cpp_extension, "library_paths", other(cpp_extension.library_paths())),  # ... and libraries
    ]
    for owner, name, value in cases:
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, value)
            assert kernels.build_key() != key, name
    with monkeypatch.context() as patch:
        patch.setenv("CXX", "clang++")  # another compiler
        assert kernels.build_key() != key
    with monkeypatch.context() as patch:
        patch.setattr(sysconfig, "get_paths", lambda: {"include": "/other/python3.11"})  # another Python's headers
        assert kernels.build_key() != key
    assert kernels.build_key() == key


def test_the_key_covers_the_command_lines_ninja_writes():
    kernels.gguf_kernels()  # built (or loaded) in the suite's home
    ninja = (kernels.kernel_build_dir() / "build.ninja").read_text()
    facts = kernels.command_line_facts()
    resolved = facts.pop(1)  # the compiler's file: named by $CXX in build.ninja
    assert all(fact in ninja for fact in facts), (facts, ninja[:600])
    assert resolved.endswith(facts[0]) or resolved == ""
