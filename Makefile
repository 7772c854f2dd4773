# Every target builds .venv first: a fresh machine needs only Python >= 3.11 (3.12+ preferred).
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
# Newest Python >= 3.12 on PATH or under pyenv (mitmproxy 12 needs 3.12), else 3.11 (mitmproxy 11.0.2).
PYTHON ?= $(shell for v in 3.14 3.13 3.12 3.11; do \
	  p=$$(command -v python$$v 2>/dev/null) && $$p -c '' 2>/dev/null && { echo $$p; exit; }; \
	  for d in $$HOME/.pyenv/versions/$$v*/bin/python$$v; do [ -x $$d ] && { echo $$d; exit; }; done; \
	done; command -v python3 || echo python3)
# mitmproxy 11.0.2 (the last release for 3.11) pins h11 <= 0.14 (CVE-2025-43859, request smuggling);
# 0.16 has the fix and passes the whole suite under 11.0.2 (docs/OPERATIONS.md), so 3.11 venvs get it.
H11_FIXED := h11>=0.16

.PHONY: venv test lint typecheck demo clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info>=(3,11) else 1)' || { \
	  echo "kvgate needs Python >= 3.11 (3.12+ preferred); found $$($(PYTHON) -V 2>&1). Set PYTHON=/path/to/python3.12"; \
	  exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info>=(3,12) else 1)' || \
	  echo "note: using $$($(PYTHON) -V 2>&1) with mitmproxy 11.0.2 and $(H11_FIXED) (prefer 3.12+)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(BIN)/pip install -q -e '.[dev]' 2>&1 | grep -vE 'is ignored|BuildBackendWarning|_filter_existing' ; test $${PIPESTATUS[0]} -eq 0
	@$(BIN)/python -c 'import sys; sys.exit(0 if sys.version_info>=(3,12) else 1)' || { \
	  $(BIN)/pip install -q --no-deps '$(H11_FIXED)' 2>&1 | grep -vE 'is ignored|dependency (resolver|conflicts)|requires h11' ; \
	  test $${PIPESTATUS[0]} -eq 0; }
	touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

typecheck: venv  # strict over policy/ store/ runtime/ plugin/ agent/ ([tool.mypy] in pyproject.toml)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest -q -p no:cacheprovider

demo: venv
	$(BIN)/kvgate demo

clean:
	rm -rf $(VENV)
