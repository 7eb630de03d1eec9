# Two entry points: `make demo` and `make test`. Both create .venv and install openmla into it.
# On a machine without CUDA the CPU builds torch==2.13.0 and triton==3.6.0 are pinned here (and only
# here; numpy<2.4 because NumPy 2.4 breaks the interpreter's loops over loaded bounds); where python3 already has a CUDA torch, the venv reuses it (--system-site-packages).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python


.PHONY: demo test test-gpu lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "using the CUDA torch of $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && \
		$(PY) -m pip install --quiet "torch==2.13.0" "triton==3.6.0" "numpy<2.4"; \
	fi
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test]"
	@touch $@

demo: $(VENV)/.installed
	$(PY) -m openmla demo

# one worker per core: the interpreter runs each test on one core
test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto

# ruff (installed by the test extra): lint and format-check the whole tree.
lint: $(VENV)/.installed
	@rc=0; $(PY) -m ruff check . || rc=1; $(PY) -m ruff format --check . || rc=1; exit $$rc

# `openmla bench` with the bench extra (progress bar, plots); ARGS="--quick --label x" passes options.
bench: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-build-isolation -e ".[bench]"
	$(PY) -m openmla bench $(ARGS)

# The same test files at real shapes; run on a CUDA machine.
test-gpu: $(VENV)/.installed
	OPENMLA_TEST_DEVICE=cuda $(PY) -m pytest -q

clean:
	rm -rf $(VENV)
