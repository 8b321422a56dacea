# specwire: `make demo` runs the main job, `make test` runs the tests. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install models demo test test-all test-compose test-triton36 lint protos gpu-wheels certs docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: torch first and pinned, so no later requirement can pull a newer (multi-GB CUDA) build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[server,gateway,test,bench,docs]'
	touch $(STAMP)

install: $(STAMP)

# PAIR=gemma3: Gemma 3 270M (an architecture on the transformers backend) drafted by prompt lookup
PAIR ?= default
models: $(STAMP)
	$(PY) scripts/fetch_models.py --keep-gguf --pair $(PAIR)

demo: models
	$(VENV)/bin/specwire demo --pair $(PAIR)

# Two workers, one per core of the 2-core machine the suite is sized for. A file's tests stay on one worker, so its
# module fixtures (stacks of service processes) start once, and files are handed out in collection order, which
# tests/conftest.py starts with the longest ones (xdist would otherwise order them by their number of tests).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-all: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m ''

# The documentation site (mkdocs.yml) into site/, strict: a broken link, anchor or reference fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Builds the image and runs compose.yaml for real (scripts/compose_check.py); exit 77 = no Docker engine possible.
test-compose: $(STAMP)
	$(PY) scripts/compose_check.py || [ $$? -eq 77 ]

# The kernels under triton 3.6 (the GPU check machine's version): a side environment with torch 2.13 and triton
# 3.6.0 that borrows the rest from .venv; interpreter tests and ahead-of-time compiles. numpy < 2.4: triton 3.6's
# interpreter breaks on numpy 2.4 (triton-lang/triton#9171).
T36 := .venv-triton36
test-triton36: $(STAMP)
	test -x $(T36)/bin/python || python3 -m venv $(T36)
	$(T36)/bin/python -m pip install -q torch==2.13.0 triton==3.6.0 'numpy<2.4'
	$(PY) -c "import site; print(site.getsitepackages()[0])" > $$($(T36)/bin/python -c "import site; print(site.getsitepackages()[0])")/specwire-venv.pth
	TRITON_INTERPRET=1 $(T36)/bin/python -m pytest -p no:cacheprovider -q tests/test_kernels_triton.py \
	  tests/test_philox.py tests/test_rejection_sampler.py tests/test_sampling_probs.py tests/test_kernels_aot.py \
	  tests/test_static_forward.py
	$(T36)/bin/python -c "import triton; assert triton.__version__.startswith('3.6'), triton.__version__"

# Development TLS material and tokens for compose.yaml (never for production).
certs: $(STAMP)
	$(PY) scripts/make_dev_certs.py deploy/certs --host verifier --host verifier-b --host draft-a --host draft-b

lint: $(STAMP)
	$(VENV)/bin/ruff check .

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

# Pure-Python wheels the GPU check machine lacks (bench/gpu_check.sh installs them there, offline).
gpu-wheels: $(STAMP)
	rm -rf .gpu-wheels && $(PY) -m pip download -q --no-deps --only-binary=:all: -d .gpu-wheels \
	  structlog grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 gguf pytest pluggy iniconfig packaging pygments
	# NOTE: the stubs check the grpcio and protobuf runtimes they were generated for: bring those for Python 3.12.
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu-wheels grpcio==1.85.1 'protobuf>=6.31,<8'

clean:
	rm -rf $(VENV) $(T36) .pytest_cache .ruff_cache site
