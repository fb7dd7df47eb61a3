# Two commands for a fresh machine: `make demo` and `make test` (each installs what it needs).
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verispec-installed
PROMPT ?= def fibonacci(n):

.PHONY: install demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU torch first, so no dependency can pull a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/verispec generate "$(PROMPT)"

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
