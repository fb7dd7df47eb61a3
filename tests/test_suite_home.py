"""The suite writes only into a home of its own (tests/conftest.py), never the user's caches."""

import os
import tempfile
from pathlib import Path

from verispec.models.store import READONLY_ENV, ModelStore, readonly_model_dirs, verispec_home
from verispec.runners.costs import CostCache
from verispec.runners.cpu.weight_cache import default_cache_dir
from verispec.runners.kernels import kernel_build_dir


def test_the_suites_home_is_a_temporary_folder_not_the_users(user_verispec_home):
    home = verispec_home().resolve()
    assert home != user_verispec_home.resolve()
    assert home != (Path.home() / ".cache" / "verispec").resolve()
    assert home.is_relative_to(Path(tempfile.gettempdir()).resolve()) and home.name.startswith("verispec-test-home-")
    assert not user_verispec_home.resolve().is_relative_to(home)


def test_every_cache_the_suite_writes_lies_in_its_home(user_verispec_home):
    home = verispec_home().resolve()
    written = [ModelStore().home, CostCache().path, default_cache_dir(), kernel_build_dir()]
    assert all(Path(path).resolve().is_relative_to(home) for path in written), written


def test_the_users_model_files_are_only_read(user_verispec_home):
    assert user_verispec_home / "models" in readonly_model_dirs()
    assert os.environ[READONLY_ENV]
    assert ModelStore().readonly == readonly_model_dirs()  # looked in after the own store, never written
