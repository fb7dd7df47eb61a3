"""Building the gguf kernels from the copy of their sources kept in the build folder: two installs
of one verispec (two virtual environments, two checkouts) share the folder, keyed by the sources'
contents, and must not rebuild it in turn (ninja rebuilds whenever a source's path changes)."""

import shutil

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
