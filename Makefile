# Two targets a newcomer needs: `make demo` and `make test`. Both set themselves up.
# `make test-fast` runs the unit tier alone, its property and flood tests left out (under a minute), while you edit.
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

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mcp-stream-exporter demo

lint: $(STAMP)
	$(PY) -m ruff check exporter tests bench dashboards
	$(PY) -m mypy

test: lint system-deps
	$(PY) -m pytest -q -p no:cacheprovider --durations=12

test-fast: $(STAMP) system-deps
	$(PY) -m pytest -q -p no:cacheprovider -m "not fuzz and not load" tests/unit

bench: $(STAMP)
	$(PY) bench/hooks_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
