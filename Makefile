# `make test` is the README's test command and what .ci/run runs. --durations=25: the slowest tests by name,
# so a long silent stretch of dots can be traced to the test that took it.
PY ?= python3

.PHONY: install test lint bench

install:
	$(PY) -m pip install -q torch==2.13.0 -e ".[test]"
	$(PY) -m pip install -q --no-deps -r requirements-bundles.txt

lint:
	$(PY) -m ruff check snapkv_sessions tests examples

test: install lint
	$(PY) -m pytest -q -ra --durations=25

bench:
	snapkv-sessions bench overhead --model smollm2-135m-instruct --lengths 2048,4096,8192 --repeats 3
