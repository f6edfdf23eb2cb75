# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.llmpipe-installed

export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_LOGGING_EXTRA_LOGGERS ?= llmpipe

.PHONY: setup demo chat-demo test lint bench clean-demo device-check docs

setup: $(STAMP)

# Re-installs only when pyproject.toml changes. torch is pinned first so pip takes the local CPU
# wheel instead of a multi-GB CUDA build. DeepSpeed (train.parallel.data=zero) is a source package, built
# after torch against it with the venv's setuptools (no build isolation) and without compiled ops (the
# few it needs are JIT-built on first use, then cached).
$(STAMP): pyproject.toml
	@echo "setup: installing into $(VENV) (once; again when pyproject.toml changes)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	@$(PY) -m pip install --quiet "torch==2.13.0"
	@DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation deepspeed==0.19.8
	@$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

# extra arguments for llmpipe run, e.g.  make demo ARGS="--set train.compile=true"
ARGS ?=

demo: setup
	$(VENV)/bin/llmpipe run configs/tiny.yaml $(ARGS)
	$(VENV)/bin/llmpipe synth-chat artifacts/chat_demo

# after `make demo`: LoRA chat fine-tuning of its model, then the held-out accuracy before and after
chat-demo: setup
	$(VENV)/bin/llmpipe run configs/tiny_chat.yaml $(ARGS)
	$(PY) benchmarks/chat_demo.py

# one table of what works on this machine's GPU/NPU and how fast (benchmarks/device_check.py); on a CPU the
# rows that need the accelerator say why they were skipped
device-check: setup
	$(PY) benchmarks/device_check.py --json artifacts/device_check.json $(ARGS)

# the documentation site: regenerate the config and CLI references from the code, then build site/ (offline)
docs: setup
	$(PY) -m llmpipe.docs_gen
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/inference.py
