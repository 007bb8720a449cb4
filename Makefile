# Two targets a newcomer needs: `make demo` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean system-deps

# promtool, prometheus and alertmanager (for the rule, dashboard and end-to-end alert tests) and chromium
# (the findings page's browser test, driven by Playwright; never a downloaded browser) come from Debian's
# packages when missing
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@command -v promtool >/dev/null && command -v prometheus-alertmanager >/dev/null \
		&& command -v chromium >/dev/null || { \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q \
		--no-install-recommends prometheus prometheus-alertmanager chromium; }

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
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) bench/hooks_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
