# make demo / make test: each creates .venv and installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# An unpinned torch pulls a multi-GB CUDA build; when the venv has no torch yet
# we install the CPU build first, and pyproject.toml's floor (torch>=2.4) is
# then already met. The development machines carry that wheel on local disk;
# elsewhere, point pip at PyTorch's CPU index, e.g.
#   make test TORCH_CPU="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[dev,bench,integrations]'
	touch $@

# One training step with every activation on disk: peak memory with and
# without, step time, gradients against eager's; it ends on that result
# (NOTE [ Demo output ] in tierstore/cli.py). The benchmarks, and the targets
# they check, run on their own: see benchmarks/README.md.
demo: $(STAMP)
	$(BIN)/tierstore demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot follow setuptools' editable import hook, which maps backends/ to
# tierstore.backends; check a link tree laid out like the installed package.
# The development harnesses in benchmarks/ are checked with it: several reach
# internals, and a move must break them here, not on a GPU machine.
typecheck: $(STAMP)
	rm -rf .build/typecheck && mkdir -p .build/typecheck/tierstore
	ln -s $(CURDIR)/tierstore/* .build/typecheck/tierstore/
	ln -s $(CURDIR)/backends .build/typecheck/tierstore/backends
	cd .build/typecheck && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p tierstore
	cd .build/typecheck && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml \
	    $(CURDIR)/benchmarks/*.py

pytest: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .build
