# specwire: `make demo` runs the main job, `make test` runs the tests. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install models demo test test-all lint protos clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: torch first and pinned, so no later requirement can pull a newer (multi-GB CUDA) build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[server,test,bench]'
	touch $(STAMP)

install: $(STAMP)

models: $(STAMP)
	$(PY) scripts/fetch_models.py

demo: models
	$(VENV)/bin/specwire demo

test: $(STAMP)
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m ''

lint: $(STAMP)
	$(VENV)/bin/ruff check .

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
