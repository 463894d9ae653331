# `make demo` and `make test` set up .venv themselves on a fresh machine
# (Python 3.11, pip, Debian's apt).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test bench redis-server clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the exact pin takes the CPU wheel; install it first so nothing pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q redis-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q redis-server >/dev/null; }; }

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP) redis-server
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) benchmarks/save_load.py

clean:
	rm -rf $(VENV) build *.egg-info
