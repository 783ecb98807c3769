# The README's two commands. Each sets itself up on a fresh machine (a .venv with
# the package and what it needs, installed only when setup.cfg changed), then runs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# libtpu must never look for a cloud metadata server (off limits and a 2-minute
# stall here), and torch must not autoload torch_tpu where no TPU is wanted.
export TPU_SKIP_MDS_QUERY := 1
export TORCH_DEVICE_BACKEND_AUTOLOAD := 0

.PHONY: demo test bench setup clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[tpu,test,bench,notebook,serve]'
	# Ray Serve LLM imports vLLM's protocol classes; its wheel's deps pull CUDA (README "Serving")
	$(BIN)/python -m pip install --quiet --no-deps vllm==0.29.0
	touch $@

demo: $(STAMP)
	$(BIN)/python -m ray_train_tpu demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
