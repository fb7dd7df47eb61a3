# Two commands for a fresh machine: `make demo` and `make test` (each installs what it needs).
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verispec-installed
PROMPT ?= def fibonacci(n):
LLAMACPP ?= 1

.PHONY: install demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU torch first, so no dependency can pull a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# Optional llama.cpp runner: compiles llama.cpp (~5 min; pip caches the wheel). If the build
	# fails (no compiler/cmake) its tests skip with the reason. LLAMACPP=0 skips it.
	if [ "$(LLAMACPP)" = "1" ]; then CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY) -m pip install -q -e ".[llamacpp]" \
		|| echo "warning: the llamacpp extra did not build; tests of the llama.cpp runner will be skipped"; fi
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/verispec generate "$(PROMPT)"

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
