# Two targets a newcomer needs: `make demo` and `make test`. Both set themselves up.
# `make test-fast` runs the unit tier alone on the sources as they are, its property and flood tests left out
# (under a minute), while you edit.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean system-deps

# promtool, prometheus and alertmanager (for the rule, dashboard and end-to-end alert tests),
# redis-server (the guard's shared storage) and chromium (the findings page's browser test, driven by
# Playwright; never a downloaded browser) come from Debian's packages when missing
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@command -v promtool >/dev/null && command -v prometheus-alertmanager >/dev/null \
		&& command -v redis-server >/dev/null && command -v chromium >/dev/null || { \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q \
		--no-install-recommends prometheus prometheus-alertmanager redis-server chromium; }

# The package is installed as it ships, its hooks' hot path compiled with mypyc (setup.py), so tests,
# demo and bench run what users run; it is rebuilt and reinstalled whenever a file of it changes.
SOURCES := setup.py pyproject.toml $(shell find exporter -type f -not -path '*/__pycache__/*' \
	-not -path '*.egg-info/*' -not -name '*.so')

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mcp-stream-exporter demo

lint: $(STAMP)
	$(PY) -m ruff check exporter tests bench dashboards setup.py
	$(PY) -m mypy

# every tier on the installed (compiled) package, then the unit tier again on the pure-Python sources,
# which a machine without a C compiler installs
test: lint system-deps
	$(PY) -m pytest -q -p no:cacheprovider --durations=12
	PYTHONPATH=exporter $(PY) -m pytest -q -p no:cacheprovider -m "not fuzz and not load" tests/unit

# the sources as they are in the tree (pure Python, no rebuild): the loop while you edit
test-fast: $(STAMP) system-deps
	PYTHONPATH=exporter $(PY) -m pytest -q -p no:cacheprovider -m "not fuzz and not load" tests/unit

bench: $(STAMP)
	$(PY) bench/hooks_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
