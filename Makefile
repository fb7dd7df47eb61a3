# Two commands for a fresh machine: `make demo` and `make test` (each installs what it needs).
# `make docs` builds the documentation site (docs/, mkdocs.yml) into site/.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verispec-installed
LLAMACPP_STAMP := $(VENV)/.verispec-llamacpp
PROMPT ?= def fibonacci(n):
LLAMACPP ?= 1

.PHONY: install install-llamacpp demo test docs lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU torch first, so no dependency can pull a multi-GB CUDA build.
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	touch $@

# Optional llama.cpp runner and peer: compiles llama.cpp (~5 min; pip caches the wheel). If the
# build fails (no compiler/cmake) its tests skip with the reason. LLAMACPP=0 skips it.
# Native ISA without AMX: llama.cpp's AMX matmul segfaults on the first decode on some Sapphire
# Rapids hosts, AMX permission granted or not (ggml-org/llama.cpp#20824; seen here 2026-12-02).
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 -DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16
$(LLAMACPP_STAMP): $(STAMP)
	if [ "$(LLAMACPP)" = "1" ]; then CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PY) -m pip install -q -e ".[llamacpp]" \
		|| echo "warning: the llamacpp extra did not build; tests of the llama.cpp runner will be skipped"; fi
	touch $@

install: $(STAMP)

install-llamacpp: $(LLAMACPP_STAMP)

# The demo needs neither llama.cpp nor a GPU: the gguf runner's kernels compile on first use (~20 s).
demo: install
	$(VENV)/bin/verispec generate "$(PROMPT)" --compare-plain

# The real pair goes into the user's model cache once, by the store (a no-op when cached); the suite
# only reads it from there, writing into a temporary VERISPEC_HOME of its own. Offline, its tests skip.
# Gemma 3 270M (Google's Gemma terms, said when it downloads) is the real test of the gemma3 path.
REAL_MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct gemma-3-270m
test: install install-llamacpp
	for model in $(REAL_MODELS); do $(VENV)/bin/verispec models fetch --quiet $$model >/dev/null \
		|| echo "warning: could not fetch $$model; the real-pair tests will be skipped"; done
	$(PY) -m pytest -q

# The docs site: mkdocs with mkdocs-material; --strict fails on any warning (broken links, pages left out of nav).
docs: install
	$(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Lint: ruff check and ruff format --check (line length 120, [tool.ruff] in pyproject.toml); CI runs it (.ci/run).
lint: install
	$(PY) -m pip install -q -e ".[lint]"
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
