# make test / make demo do all setup (venv + installs) on a fresh machine, then run.
# An installed torch is kept: the venv sees system site-packages. Without one, TORCH_SPEC is installed
# (CI: the CPU wheel that lies on the machine's disk).
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
BIN := $(VENV)/bin

.PHONY: setup install test test-all demo clean

# Stamps in the venv: `make test` installs again only what changed since the last install.
DEPS_STAMP    := $(VENV)/.pagedattn-deps
INSTALL_STAMP := $(VENV)/.pagedattn-installed
PACKAGE_FILES := pyproject.toml $(shell find pagedattn codegen templates -type f \
                   -not -name '*.pyc' -not -path '*/__pycache__/*' 2>/dev/null)

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(DEPS_STAMP): pyproject.toml | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	@extra=$$($(BIN)/python -c "import torch; v=torch.version.cuda; print('cu12' if v and v.startswith('12') else 'cu13')"); \
	  echo "installing pagedattn[$$extra,test] (non-editable)"; \
	  $(BIN)/pip install -q ".[$$extra,test]"
	@touch $@

# (a deps install newer than every package file installed this very tree: nothing to do again)
$(INSTALL_STAMP): $(DEPS_STAMP) $(PACKAGE_FILES)
	@if [ -n "$$(find $(PACKAGE_FILES) -maxdepth 0 -newer $(DEPS_STAMP) | head -n 1)" ]; then \
	  echo "installing pagedattn from this tree"; \
	  $(BIN)/pip install -q --no-deps --force-reinstall .; \
	fi
	@touch $@

setup: $(DEPS_STAMP)

install: $(INSTALL_STAMP)

# CPU tests always run; GPU tests skip without CUDA. pytest's exit code (5 = nothing ran) fails make.
# `make test` compiles a representative subset of the attention variants; `make test-all` compiles
# every variant for sm_80 and sm_90a too (tests marked `slow`: about an hour on 2 cores).
# (run from tests/ so that the installed package, not the source folder, is imported)
test: install
	cd tests && ../$(BIN)/python -m pytest -q -ra -m "not slow" . $(PYTEST_ARGS)

test-all: install
	cd tests && ../$(BIN)/python -m pytest -q -ra . $(PYTEST_ARGS)

demo: install
	$(BIN)/python -m pagedattn.demo

clean:
	rm -rf $(VENV) build *.egg-info
