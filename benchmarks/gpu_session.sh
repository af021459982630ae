#!/usr/bin/env bash
# One device session's GPU work, in one go: carried wheels, native helpers built, then the stages
# named as arguments (at least one: `setup` runs the set-up alone; `suite own` the whole GPU suite),
# each under its own time limit, logs and JSON under $OUT.
#
#   bash benchmarks/gpu_session.sh STAGE...   (the stages are run_stage's case labels below; a name
#     that is none of them is refused before the set-up, with the list)
#
#   new       the GPU tests added by the current issue (issue 24: real paths, HF defaults, fault
#             injection, the ambient fuzz, whose FUZZ line -s shows), one process
#   new_before  the same tests run on the code before the change (.before/): they should fail
#   before45  issue 45's GPU tests on the code before it (.before/ = 7a5b4c7): they should fail
#   suite     the whole GPU suite in ONE process, in sequence (a poisoned process shows here), but for
#             the tests marked own_process (all they check runs in subprocesses): `own` runs those
#   files     the GPU suite file by file, each in its own process ($FILES: some files only)
#   per_call  benchmarks/per_call.py for the code before the change (.before/, an export of the
#             base commit: git archive BASE graphtree | tar -x -C .before) and after it, alternated
#             $ROUNDS times (default 2) on the same machine; and a variant of it where .variant/ is
#             there (another copy of graphtree/, git-ignored too)
#
# Set-up on a fresh clone (both folders are git-ignored through .git/info/exclude):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl cupti-python==13.0.1 cloudpickle expecttest   # the device has no network
#   mkdir -p .before && git archive b6016dc graphtree benchmarks | tar -x -C .before   # issue 24's base
# and pass carry=[".whl", ".before"] to the device call (and ".variant", a copy of graphtree/ to
# time beside the change, where there is one: git-ignored likewise).
set -u
if [ $# -eq 0 ]; then  # (a bare call once ran the default whole suite and spent a session's last device time)
  echo "usage: bash benchmarks/gpu_session.sh STAGE... (setup: the set-up alone; suite own: the whole GPU suite)" >&2
  exit 2
fi
# A misspelt stage matched no case and ran nothing, after the set-up's device time: refused here.
known=" $(grep -oE '^    [a-z_0-9]+\)' "$0" | tr -d ' )' | tr '\n' ' ')"
for stage in "$@"; do
  case $known in
    *" $stage "*) ;;
    *) echo "gpu_session.sh: no stage '$stage'; the stages:$known" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The image's site-packages take no .pyc files: every process compiled torch's sources again
# (import torch 4.5 s, torch._dynamo 6 s on the H100 host). A writable cache for them:
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
export GRAPHTREE_TEST_TIMES=$OUT/test-times.txt  # each test's duration as it ends (tests/gpu/conftest.py)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # subprocesses of the tests import graphtree from here
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
env | grep -E '^PYTHON(DONTWRITEBYTECODE|PYCACHEPREFIX)=' | tee "$OUT/python-env.txt"
unset PYTHONDONTWRITEBYTECODE
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, torch._dynamo, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
python3 -c "from graphtree import _native; m = _native.wait(900); print('native helpers:', _native.status(), '| CUDA part:', hasattr(m, 'capture_begin_isolated'))" 2>&1 | tail -3 | tee -a "$OUT/device.txt"

# The one-process suite in the background, in a process session of its own, so that it outlives
# this call (the machine stays warm 30 s between calls) and may run past 600 s. It runs from a
# snapshot of the tree ($1-tree): a later call copies the working tree again, and once a new module
# was missing under the running suite for a moment. $1: its folder; the rest: VAR=value for it.
suite_in_background() {
  local bg=$1; shift
  mkdir -p "$bg" && rm -f "$bg"/* && rm -rf "$bg-tree" && cp -a . "$bg-tree"
  env "$@" setsid nohup bash -c "cd $bg-tree && PYTHONPATH=$bg-tree:$PYTHONPATH GRAPHTREE_TEST_TIMES=$bg/test-times.txt timeout -s INT -k 20 ${SUITE_TIMEOUT:-1500} \
    python3 -m pytest -q -m '${MARK:-gpu and not own_process}' -p no:cacheprovider --durations=30 tests/gpu > $bg/suite.log 2>&1; \
    echo \$? > $bg/rc" > /dev/null 2>&1 < /dev/null &
  echo "suite ($bg, ${*:-GRAPHTREE_NATIVE=${GRAPHTREE_NATIVE:-}}) started in the background at $(date +%T)" | tee "$OUT/suite_bg$(basename "$bg" | sed 's/^bg//').txt"
}

# Wait for the background suite in $1 (at most $WAIT_S seconds), then bring its log back.
suite_waited() {
  local bg=$1 tag; tag=$(basename "$1" | sed 's/^bg//')
  for _ in $(seq ${WAIT_S:-540}); do [ -f "$bg/rc" ] && break; sleep 1; done
  cp "$bg/suite.log" "$OUT/suite$tag.log" 2>/dev/null; cp "$bg/test-times.txt" "$OUT/suite$tag-test-times.txt" 2>/dev/null
  echo "suite ($bg) rc: $(cat "$bg/rc" 2>/dev/null || echo 'still running') at $(date +%T)"; tail -40 "$OUT/suite$tag.log"
}

# per_call.py run from the copy of graphtree/ in $1 (.before/ or .variant/, git-ignored), where it is
# there, with helpers built apart; its JSON as per_call_$2_$3.json.
per_call_in() {
  [ -d "$1" ] || return 0
  echo "== $2"
  (cd "$1" && TORCH_EXTENSIONS_DIR=/tmp/ext_$2 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
    timeout 150 python3 ../benchmarks/per_call.py --json "$OUT/per_call_$2_$3.json" 2>&1 | sed -n 3,18p)
}

# One stage, as a function: a stage may run others (rest47) without the set-up above again.
run_stage() {
  local stage=$1
  case $stage in
    setup)  # the set-up above alone (wheels, device, native helpers built)
      ;;
    startup)  # what one fresh process costs (the GPU tests start ~60): torch, CUDA, graphtree, a first tree
      for code in "import torch" "import torch; torch.zeros(1, device='cuda')" "import torch, graphtree; torch.zeros(1, device='cuda')" \
          "import torch, graphtree; f = graphtree.graphed(lambda x: x * 2); x = torch.zeros(1, device='cuda'); [f(x) for _ in range(4)]; torch.cuda.synchronize()"; do
        TIMEFORMAT="%R s  $code"
        { time python3 -c "$code" >/dev/null 2>&1; } 2>&1 | tee -a "$OUT/startup.txt"
      done
      python3 -X importtime -c "import graphtree" 2>&1 | sort -t'|' -k2 -n | tail -15 > "$OUT/importtime.txt"
      ;;
    readme)  # the README's first snippet as pasted, and graphtree demo: their output goes in the README
      python3 -c "$(python3 -c 'import sys; sys.path.insert(0, "tests"); from test_readme import first_snippet; print(first_snippet())')" 2>&1 | tee "$OUT/readme_snippet.txt"
      timeout 300 python3 -m graphtree demo 2>&1 | tee "$OUT/demo.txt" | tail -25  # what `graphtree demo` runs
      ;;
    first)  # a fresh process up to its first replay, stage by stage (benchmarks/first_call.py)
      TIMEFORMAT="%R s  the whole process"
      { time python3 benchmarks/first_call.py; } 2>&1 | tee "$OUT/first_call.txt"
      ;;
    probes)  # facts the next issues' designs rest on: CUPTI's graph node ids (issue 29)
      timeout 120 python3 benchmarks/cupti_graph_ids.py 2>&1 | tee "$OUT/cupti_graph_ids.txt" | tail -30
      ;;
    measure)  # the measurements written on the CPU for issues 26, 27 and 29, each under a time limit
      timeout 150 python3 benchmarks/probe_breaks_models.py 2>&1 | tee "$OUT/probe_breaks_models.txt" | tail -20
      timeout 120 python3 benchmarks/break_cost.py --json "$OUT/break_cost.json" 2>&1 | tee "$OUT/break_cost.txt" | tail -6
      timeout 150 python3 benchmarks/churn.py --json "$OUT/churn.json" 2>&1 | tee "$OUT/churn.txt" | tail -8
      timeout 150 python3 benchmarks/recording_cost.py --runs 3 2>&1 | tee "$OUT/recording_cost.txt" | tail -3
      ;;
    generate)  # issue 27: where a token's time goes, and the generate scenario (HF's default a contender)
      timeout 240 python3 benchmarks/generate_breakdown.py --json "$OUT/generate_breakdown.json" 2>&1 | tee "$OUT/generate_breakdown.txt" | grep -v '^W1' | tail -16
      timeout 120 python3 benchmarks/forward_cpu.py 2>&1 | tee "$OUT/forward_cpu.txt" | tail -8
      timeout 300 python3 -m graphtree bench --scenarios generate --budget 280 --out "$OUT/bench-generate" 2>&1 | tee "$OUT/bench-generate.log" | grep -v '^W1' | tail -25
      ;;
    matrix)  # issue 27's acceptance table: four model families, batch 1 and a padded 4, greedy and sampling
      timeout 560 python3 benchmarks/generate_matrix.py --json "$OUT/generate_matrix.json" 2>&1 | tee "$OUT/generate_matrix.txt" | grep -v '^W1' | tail -70
      ;;
    next)  # what the sixth session left (docs/gpu-notes.md), in one call: the generate scenario with
           # reduce-overhead in a process of its own, read_call with the C++ walk loaded, kernels per
           # token (graphtree's graph against HF's compiled default), the per-call floor
      timeout 300 python3 -m graphtree bench --scenarios generate --budget 280 --out "$OUT/bench-generate" 2>&1 | tee "$OUT/bench-generate.log" | grep -v '^W1' | tail -25
      timeout 90 python3 benchmarks/forward_cpu.py 2>&1 | tee "$OUT/forward_cpu.txt" | tail -8
      timeout 90 python3 benchmarks/generate_kernels.py --json "$OUT/generate_kernels.json" 2>&1 | tee "$OUT/generate_kernels.txt" | grep -v '^W1' | tail -6
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 benchmarks/per_call.py --json "$OUT/per_call_after.json" 2>&1 | tail -14
      ;;
    collectives)  # issue 31: collectives inside recordings under torchrun (two ranks where two GPUs are),
                  # then the tensor-parallel timings on every GPU of the machine
      timeout -s INT -k 20 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_collectives_gpu.py 2>&1 | tee "$OUT/collectives.log" | grep -v '^W1' | tail -30
      NGPU=$(nvidia-smi -L | wc -l)
      timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" benchmarks/tp_step.py --bench \
        --json "$OUT/tp_bench_${NGPU}gpu.json" 2>&1 | tee "$OUT/tp_bench.log" | grep -v '^W1' | grep -E '^\{|Error|error' | tail -20
      ;;
    training)  # issue 28: forward and backward graphs behind autograd (tree/training.py), whole steps recorded
      timeout -s INT -k 20 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_training_gpu.py \
        tests/gpu/test_train_step_gpu.py 2>&1 | tee "$OUT/training.log" | grep -v '^W1' | tail -40
      ;;
    train_bench)  # issue 28: time per step, first steps, memory: eager, graphtree, hand capture, make_graphed_callables, reduce-overhead
      timeout 420 python3 benchmarks/train_step.py ${TRAIN_ARGS:-} --json "$OUT/train_step.json" 2>&1 | tee "$OUT/train_step.log" | grep -v '^W1' | tail -30
      ;;
    bench_train)  # issue 28: graphtree bench's train scenario (its JSON and plot are the committed result)
      timeout 420 python3 -m graphtree bench --scenarios train --contenders eager,graphtree,handwritten,compile-reduce-overhead \
        --budget ${TRAIN_BUDGET:-330} --out "$OUT/bench-train" 2>&1 | tee "$OUT/bench-train.log" | grep -v '^W1' | tail -30
      ;;
    churn)  # issue 27, item 5: churning shapes and HF's dynamic cache against eager
      timeout 240 python3 benchmarks/churn.py --json "$OUT/churn.json" 2>&1 | tee "$OUT/churn.log" | tail -15
      ;;
    ddp)  # issue 48: a DDP (then FSDP2) training step on every GPU of the machine under torchrun (eager, graphtree, by hand)
      NGPU=$(nvidia-smi -L | wc -l)
      for model in ${DDP_MODELS:-gpt resnet18}; do
        timeout -s INT -k 20 ${DDP_TIMEOUT:-240} python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
          benchmarks/ddp_step.py --model "$model" --steps ${DDP_STEPS:-100} --json "$OUT/ddp_${model}_${NGPU}gpu.json" 2>&1 \
          | tee "$OUT/ddp_${model}.log" | grep -v '^W1' | tail -40
      done
      timeout -s INT -k 20 ${DDP_TIMEOUT:-240} python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
        benchmarks/ddp_step.py --model gpt --wrap fsdp2 --steps ${DDP_STEPS:-100} --json "$OUT/fsdp2_gpt_${NGPU}gpu.json" 2>&1 \
        | tee "$OUT/fsdp2_gpt.log" | grep -v '^W1' | tail -40
      ;;
    bench_ranks)  # issue 48: graphtree bench's ddp and tp scenarios on every GPU, under torchrun (JSON + plot)
      NGPU=$(nvidia-smi -L | wc -l)
      timeout -s INT -k 20 ${RANKS_TIMEOUT:-540} python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
        -m graphtree bench --scenarios ddp,tp ${RANKS_ARGS:-} --out "$OUT/bench-ranks" 2>&1 | tee "$OUT/bench-ranks.log" | grep -v '^W1' | tail -40
      ;;
    tp_dtensor)  # issue 48, item 2: a decoder parallelised with torch.distributed.tensor.parallel, on every GPU
      NGPU=$(nvidia-smi -L | wc -l)
      timeout -s INT -k 20 ${TP_TIMEOUT:-240} python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
        benchmarks/tp_dtensor.py --json "$OUT/tp_dtensor_${NGPU}gpu.json" 2>&1 | tee "$OUT/tp_dtensor.log" | grep -v '^W1' | tail -40
      ;;
    floats)  # issue 45, item 3: a serving loop's new Python temperature per call, against eager
      timeout 240 python3 benchmarks/per_request_float.py --json "$OUT/per_request_float.json" 2>&1 | tee "$OUT/per_request_float.log" | tail -20
      ;;
    sampler)  # issue 45, item 3: where the sampler's graphed call loses to the hand graph (its copy-in, launch, call path)
      timeout 200 python3 benchmarks/probes/sampler_breakdown.py --json "$OUT/sampler_breakdown.json" 2>&1 | tee "$OUT/sampler_breakdown.log" | tail -45
      ;;
    churn_overhead)  # issue 45, item 6: graphtree's eager path on the host, a no-op and the MLP, and the Python it runs
      timeout 200 python3 benchmarks/probes/churn_overhead.py 2>&1 | tee "$OUT/churn_overhead.log" | tail -20
      ;;
    churn_inside)  # issue 45, item 6: the MLP's own time inside the function, plain and through graphtree's eager path
      timeout 150 python3 benchmarks/probes/churn_inside.py 2>&1 | tee "$OUT/churn_inside.log" | tail -12
      ;;
    copy_in)  # issue 45, item 3: the sampler's copy-in piece by piece (copies, the number's write, a fill_), host time
      timeout 200 python3 benchmarks/probes/copy_in_parts.py 2>&1 | tee "$OUT/copy_in_parts.log" | tail -80
      ;;
    parts)  # issue 26: modules graphed in parts (tree/parts.py): their GPU tests and Faster R-CNN graphed whole, profiled
      timeout -s INT -k 20 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_parts_gpu.py \
        tests/gpu/test_profile_gpu.py -k "parts or faster_rcnn" 2>&1 | tee "$OUT/parts.log" | grep -v '^W1' | tail -30
      ;;
    bench_breaks)  # issue 26: the breaks scenario (eager, whole-call fallback, breaks on)
      timeout 300 python3 -m graphtree bench --scenarios breaks --budget 280 --out "$OUT/bench-breaks" 2>&1 | tee "$OUT/bench-breaks.log" | tail -25
      ;;
    new15)  # the fifteenth session's GPU tests, written after its device time was spent (one process, ~2 min)
      timeout -s INT -k 20 ${NEW_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --durations=10 \
        tests/gpu/test_opinfo_findings_gpu.py::test_a_conjugate_view_input_replays_with_its_values_conjugated \
        tests/gpu/test_compile_inside_gpu.py tests/gpu/test_real_paths_gpu.py tests/gpu/test_native_gpu.py \
        tests/gpu/test_host_scalars_gpu.py::test_an_int_operand_is_a_device_scalar_too \
        tests/gpu/test_ported_cudagraph_trees_gpu.py::test_dynamic_warmup 2>&1 | tee "$OUT/new15.log" | tail -30
      ;;
    new16)  # the sixteenth session's GPU work written after its device time: the DDP/FSDP2 test (torchrun,
            # one rank and up to four), then graphtree bench's generate scenario, quick (HF's compile kept, four cases)
      timeout -s INT -k 20 ${NEW_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_ddp_gpu.py \
        "tests/gpu/test_real_paths_gpu.py::test_a_config_objects_attribute_the_code_reads_is_never_replayed_stale" \
        "tests/gpu/test_real_paths_gpu.py::test_a_helper_defined_anew_is_called_not_the_recorded_one" 2>&1 \
        | tee "$OUT/new16.log" | grep -v '^W1' | tail -20
      timeout 300 python3 -m graphtree bench --quick --scenarios generate --budget 280 --out "$OUT/bench-generate-quick" 2>&1 \
        | tee "$OUT/bench-generate-quick.log" | grep -v '^W1' | tail -25
      ;;
    new17)  # the seventeenth session's fix of a library module's setting (nn.LeakyReLU's slope, nn.Dropout's p) on
            # the code before it (.before/: git archive 8baa6f8 graphtree; the test must fail there), then the
            # generate scenario whole (issue 46's table: HF's compile kept, four cases)
      (cd .before && PYTHONPATH=$PWD:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/ext_before timeout -s INT -k 20 150 \
        python3 -m pytest -q -p no:cacheprovider --tb=line -rf \
        "../tests/gpu/test_real_paths_gpu.py::test_a_library_modules_setting_changed_between_calls_is_never_replayed_stale" \
        2>&1 | tee "$OUT/new17_before.log" | grep -v '^W1' | tail -6)
      timeout 330 python3 -m graphtree bench --scenarios generate --budget 300 --out "$OUT/bench-generate" 2>&1 \
        | tee "$OUT/bench-generate.log" | grep -v '^W1' | tail -40
      ;;
    new18)  # what the seventeenth session wrote after its device time (~3 min): torch.compile tracing in a
            # capture warms up again (test_compile_inside_gpu.py), a library module's setting, the DDP test
      timeout -s INT -k 20 ${NEW_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --durations=5 \
        tests/gpu/test_compile_inside_gpu.py \
        "tests/gpu/test_real_paths_gpu.py::test_a_library_modules_setting_changed_between_calls_is_never_replayed_stale" \
        tests/gpu/test_ddp_gpu.py 2>&1 | tee "$OUT/new18.log" | grep -v '^W1' | tail -15
      ;;
    sdpa)  # the eighteenth session's question: a graphed HF model's SDPA logits against eager's,
           # bit for bit, as is and with transformers' capture check hidden (~2 min)
      timeout 300 python3 benchmarks/probes/hf_sdpa_capture.py --json "$OUT/hf_sdpa_capture.json" 2>&1 \
        | tee "$OUT/hf_sdpa_capture.txt" | grep -v '^W1' | tail -12
      ;;
    hf_sources)  # issue 46 runs transformers' generation tests from its 5.17 sources: are they on the device?
                 # (the sdist on PyPI has no tests/models nor tests/generation; GitHub is not reachable)
      python3 -c "import transformers, os; print(transformers.__version__, os.path.dirname(transformers.__file__))"
      timeout 60 find / -xdev -path '*tests/generation/test_utils.py' 2>/dev/null | head -5 | tee "$OUT/hf_sources.txt"
      ;;
    new19|before19)  # the eighteenth and nineteenth sessions' keying fixes, written without a GPU: new19 on this
                     # code, before19 on the code before them (.before/: git archive a4ad6bf graphtree; they must
                     # fail there, but test_hooks_gpu.py's transformers test, which guards the fix against a slowdown)
      TESTS="tests/gpu/test_real_paths_gpu.py::test_a_class_attribute_set_between_calls_is_never_replayed_stale
        tests/gpu/test_real_paths_gpu.py::test_torchs_fp32_precision_api_neither_raises_nor_replays_the_other_precision
        tests/gpu/test_real_paths_gpu.py::test_a_submodule_put_in_another_mode_between_calls_is_never_replayed_stale
        tests/gpu/test_real_paths_gpu.py::test_the_mode_of_a_model_a_graphed_methods_object_holds_is_never_replayed_stale
        tests/gpu/test_real_paths_gpu.py::test_a_global_read_in_a_submodules_forward_set_between_calls_is_never_replayed_stale
        tests/gpu/test_real_paths_gpu.py::test_a_submodule_without_parameters_replaced_between_calls_is_never_replayed_stale
        tests/gpu/test_real_paths_gpu.py::test_a_setting_of_a_module_passed_as_an_argument_set_between_calls_is_never_replayed_stale
        tests/gpu/test_hf_defaults_gpu.py::test_a_config_setting_changed_between_calls_is_never_replayed_stale
        tests/gpu/test_real_paths_gpu.py::test_an_attribute_probed_with_a_default_and_set_after_the_first_calls_is_never_replayed_stale
        tests/gpu/test_hooks_gpu.py"
      if [ "$stage" = before19 ]; then
        (cd .before && PYTHONPATH=$PWD:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/ext_before timeout -s INT -k 20 240 \
          python3 -m pytest -q -p no:cacheprovider --tb=line -rf $(echo $TESTS | sed 's#tests/#../tests/#g') 2>&1 \
          | tee "$OUT/before19.log" | grep -v '^W1' | tail -12)
      else
        timeout -s INT -k 20 240 python3 -m pytest -q -p no:cacheprovider --tb=short $TESTS 2>&1 | tee "$OUT/new19.log" | grep -v '^W1' | tail -20
      fi
      ;;
    torch_capture)  # random numbers through torch's own capture (no native stand-ins), as on torch >= 2.12 or
                    # without a C++ compiler: the files named in $FILES (default: the random and ported ones)
                    # with _native.capture set to None once the helpers are built (tree/draws.py)
      timeout -s INT -k 20 ${SUITE_TIMEOUT:-300} python3 -c "
import sys, pytest, graphtree._native as n
n.wait(300); n.capture = None
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '-rf', *sys.argv[1:]]))" \
        ${FILES:-tests/gpu/test_random_gpu.py tests/gpu/test_ported_test_cuda_gpu.py tests/gpu/test_ported_cudagraph_trees_gpu.py} \
        2>&1 | tee "$OUT/torch_capture.log" | tail -25
      ;;
    some)  # the files named in $FILES, in one process
      timeout -s INT -k 20 ${SUITE_TIMEOUT:-540} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 ${K:+-k "$K"} $FILES 2>&1 | tee "$OUT/some.log" | tail -30
      ;;
    new)  # issues 43-44: random numbers equal to eager's (test_random_gpu.py), a closure cell rebound, and
          # the captures random numbers touch (training recordings, whole steps, fault injection)
      timeout -s INT -k 20 ${NEW_TIMEOUT:-420} python3 -m pytest -q --durations=15 -p no:cacheprovider tests/gpu/test_random_gpu.py \
        tests/gpu/test_real_paths_gpu.py tests/gpu/test_module_training_gpu.py tests/gpu/test_train_step_gpu.py \
        tests/gpu/test_fault_injection_gpu.py tests/gpu/test_breaks_gpu.py 2>&1 | tee "$OUT/new.log" | tail -40
      ;;
    headers)  # what the installed torch's CUDA generator and graph offer (the native CUDA part builds against them)
      inc=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
      grep -n "capture_prologue\|capture_epilogue\|replay_prologue\|register_graph\|philox_offset_per_thread\|set_current_seed\|state_;\|capturing_\|offset_intragraph_" \
        "$inc/ATen/cuda/CUDAGeneratorImpl.h" "$inc/ATen/cuda/CUDAGraph.h" 2>&1 | tee "$OUT/headers.txt" | tail -40
      ;;
    new_before)  # the same new tests against the code before the change (.before/): each should fail, for its bug
      # run from .before/ so that its graphtree comes first on sys.path (python -m puts the cwd there)
      (cd .before && PYTHONPATH=$PWD:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/ext_before timeout -s INT -k 20 ${NEW_TIMEOUT:-300} \
        python3 -m pytest -q -p no:cacheprovider --tb=line -rf ${K:+-k "$K"} \
        ${NEW_TESTS:-../tests/gpu/test_random_gpu.py ../tests/gpu/test_real_paths_gpu.py} 2>&1 | tee "$OUT/new_before.log" | tail -40)
      ;;
    before45)  # issue 45's GPU tests on the code before it (.before/: git archive 7a5b4c7 graphtree benchmarks):
               # copied there with the conftest and helpers, so that the subprocesses they start import that code too
      mkdir -p .before/tests/gpu && cp tests/gpu/conftest.py tests/gpu/_tiny_hf.py tests/gpu/_subprocesses.py tests/gpu/test_users_next_gpu.py \
        tests/gpu/test_late_faults_gpu.py tests/gpu/test_churn_gpu.py tests/gpu/test_host_scalars_gpu.py .before/tests/gpu/ && cp pyproject.toml .before/
      (cd .before && PYTHONPATH=$PWD:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/ext_before timeout -s INT -k 20 ${NEW_TIMEOUT:-300} \
        python3 -m pytest -q -p no:cacheprovider --tb=line -rf -s tests/gpu/test_users_next_gpu.py tests/gpu/test_late_faults_gpu.py \
        tests/gpu/test_churn_gpu.py tests/gpu/test_host_scalars_gpu.py 2>&1 | tee "$OUT/before45.log" | grep -E "MEMORY|FAILED|passed|failed" | tail -30)
      ;;
    suite)  # tests marked own_process run all they check in subprocesses: no state of this process to
            # poison or be poisoned by; they run in `files` (and `own`), which keeps this under a call
      timeout -s INT -k 20 ${SUITE_TIMEOUT:-575} python3 -m pytest -q -m "gpu and not own_process" -p no:cacheprovider --durations=30 tests/gpu 2>&1 | tee "$OUT/suite.log" | tail -30
      ;;
    suite_breaks_on)  # the one-process suite with breaks on by default (max_break_values=8), in a copy:
                      # what making them the default would do, before it is made
      rm -rf /tmp/breaks-on && mkdir -p /tmp/breaks-on && cp -r graphtree tests pyproject.toml /tmp/breaks-on/
      sed -i 's/max_break_values: int = 0,/max_break_values: int = 8,/' /tmp/breaks-on/graphtree/tree/graphed.py
      grep -c 'max_break_values: int = 8' /tmp/breaks-on/graphtree/tree/graphed.py | sed 's/^/defaults switched: /'
      (cd /tmp/breaks-on && PYTHONPATH=/tmp/breaks-on:$PYTHONPATH timeout -s INT -k 20 ${SUITE_TIMEOUT:-540} \
        python3 -m pytest -q -m "gpu and not own_process" -p no:cacheprovider --durations=10 tests/gpu 2>&1 \
        | tee "$OUT/suite_breaks_on.log" | tail -30)
      ;;
    suite_bg)  # the one-process suite in the background (suite_in_background, above); `suite_wait` in
               # the next call waits for it and brings its log back. BG (default /tmp/bg) names its
               # folder: BG=/tmp/bg-off GRAPHTREE_NATIVE=0 runs a second suite, with the native helpers
               # off, beside or after the first (or use suites_bg)
      suite_in_background "${BG:-/tmp/bg}"
      ;;
    all_bg)  # `own` in the background, then (falling through) suites_bg's two suites beside it: on a
             # machine of one GPU all three share it (the suites' 2 x ~700 s and own's ~360 s do not
             # fit in sequence in a session)
      MARK="gpu and own_process" suite_in_background /tmp/bg-own
      ;&
    suites_bg)  # both one-process suites in the background: the helpers on (GPU 0) and off
                # (GRAPHTREE_NATIVE=0, on GPU 1 where the machine has two, else beside the first);
                # `suites_wait` brings both logs back
      suite_in_background /tmp/bg
      off_gpu=${CUDA_VISIBLE_DEVICES:-}
      [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && off_gpu=1
      suite_in_background /tmp/bg-off GRAPHTREE_NATIVE=0 ${off_gpu:+CUDA_VISIBLE_DEVICES=$off_gpu}
      ;;
    suites_wait)  # suite_wait for both of suites_bg's runs
      suite_waited /tmp/bg; suite_waited /tmp/bg-off
      ;;
    all_wait)  # all_bg's three runs: wait until each has ended (at most $WAIT_S seconds in all), bring their logs back
      for _ in $(seq ${WAIT_S:-540}); do [ -f /tmp/bg/rc ] && [ -f /tmp/bg-off/rc ] && [ -f /tmp/bg-own/rc ] && break; sleep 1; done
      WAIT_S=0 suite_waited /tmp/bg; WAIT_S=0 suite_waited /tmp/bg-off; WAIT_S=0 suite_waited /tmp/bg-own
      ;;
    suite_wait)  # wait for suite_bg's run in $BG (at most $WAIT_S seconds), then bring its log back
      suite_waited "${BG:-/tmp/bg}"
      ;;
    stop_bg)  # end background suites, each with its process group (setsid made each wrapper a group's
              # leader); the pattern cannot match this command's own line
      for pid in $(pgrep -f "cd /tmp/[b]g"); do kill -- "-$pid" 2>/dev/null || true; done
      ;;
    pack)  # last: everything under $OUT in one logs.tgz (at most 8 files come back from a call)
      tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/" && ls -l "$OUT"
      ;;
    own)
      timeout -s INT -k 20 ${SUITE_TIMEOUT:-540} python3 -m pytest -q -m "gpu and own_process" -p no:cacheprovider --durations=10 tests/gpu 2>&1 | tee "$OUT/own.log" | tail -15
      ;;
    files)  # $FILES: some of them (a call of 10 minutes does not hold them all)
      for f in ${FILES:-tests/gpu/test_*.py}; do
        printf '%s: ' "$f" | tee -a "$OUT/files.log"
        timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider "$f" 2>&1 | tail -1 | tee -a "$OUT/files.log"
      done
      ;;
    conform)  # issue 44: PyTorch's OpInfo database through graphtree (benchmarks/conformance/opinfo_sweep.py,
              # ~10 min on one GPU: CONFORM_OPS names some operators, CONFORM_TIMEOUT its limit), then the
              # ported CUDA-graph tests; conformance.json holds both (needs the expecttest wheel in .whl)
      # CONFORM_GPU=1 on a two-GPU machine: the sweep on the second GPU while suite_bg runs on the first
      ${CONFORM_GPU:+env CUDA_VISIBLE_DEVICES=$CONFORM_GPU} timeout -s INT ${CONFORM_TIMEOUT:-480} python3 benchmarks/conformance/opinfo_sweep.py --workers ${CONFORM_WORKERS:-4} --budget ${CONFORM_BUDGET:-330} \
        ${CONFORM_OPS:+--ops "$CONFORM_OPS"} ${CONFORM_ARGS:-} --json "$OUT/conformance.json" --records "$OUT/conformance-records.jsonl" 2>&1 | tee "$OUT/conform.log" | tail -40
      ${CONFORM_GPU:+env CUDA_VISIBLE_DEVICES=$CONFORM_GPU} timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_random_gpu.py tests/gpu/test_ported_test_cuda_gpu.py \
        tests/gpu/test_ported_cudagraph_trees_gpu.py 2>&1 | tee "$OUT/ported.log" | tail -3
      python3 - "$OUT" <<'PY'
import json, re, sys
sys.path.insert(0, "tests/gpu")
from test_ported_test_cuda_gpu import NOT_APPLICABLE as A
from test_ported_cudagraph_trees_gpu import NOT_APPLICABLE as B
out = sys.argv[1]
line = open(f"{out}/ported.log").read().strip().splitlines()[-1]
count = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped)", line)}
path = f"{out}/conformance.json"
res = json.load(open(path))
res["ported_tests"] = {"passed": count.get("passed", 0), "failed": count.get("failed", 0), "not_applicable": len(A) + len(B)}
json.dump(res, open(path, "w"), indent=2)
print("ported_tests:", res["ported_tests"])
PY
      ;;
    random_replay)  # issue 43: what a draw costs a replay, torch's prologue against graphtree's hand-off
      timeout 180 python3 benchmarks/random_replay.py --json "$OUT/random_replay.json" 2>&1 | tail -8
      ;;
    fast_hit)  # branch fast-hit: its GPU tests and the suites that exercise replays most, in one process
      timeout -s INT -k 20 ${SUITE_TIMEOUT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_fast_hit_gpu.py \
        tests/gpu/test_hooks_gpu.py tests/gpu/test_real_paths_gpu.py tests/gpu/test_random_gpu.py tests/gpu/test_tree_gpu.py \
        tests/gpu/test_fuzz_ambient_gpu.py tests/gpu/test_fuzz_gpu.py tests/gpu/test_models_gpu.py 2>&1 | tee "$OUT/fast_hit.log" | tail -25
      ;;
    sweep)  # the OpInfo sweep alone (conform without its rerun of the ported tests, which the suites hold)
      timeout -s INT ${CONFORM_TIMEOUT:-480} python3 benchmarks/conformance/opinfo_sweep.py --workers ${CONFORM_WORKERS:-4} --budget ${CONFORM_BUDGET:-330} \
        ${CONFORM_OPS:+--ops "$CONFORM_OPS"} ${CONFORM_ARGS:-} --json "$OUT/conformance.json" --records "$OUT/conformance-records.jsonl" 2>&1 | tee "$OUT/conform.log" | tail -40
      ;;
    decode_loop)  # issue 47: the demo GPT's decode loop (batch 1, 4 layers of 256), graphtree against a hand-written graph
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 240 python3 benchmarks/decode_loop.py --json "$OUT/decode_loop.json" 2>&1 | tail -12
      ;;
    breakdown)  # issue 47: each piece of a replay hit timed alone, then a profile (benchmarks/fastpath_breakdown.py)
      PYTHONPATH=$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 180 python3 benchmarks/fastpath_breakdown.py 2>&1 | tee "$OUT/breakdown.txt" | head -70
      ;;
    call_walk)  # issue 47, item 4: the graphtree modules a replayed call stops in, and how often it returns to one it left
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 benchmarks/call_walk.py 2>&1 | tee "$OUT/call_walk.txt" | tail -8
      ;;
    rest47)  # what issue 47 still needs (docs/gpu-notes.md, "For the next device session"), by the card
             # that came: on an H200 its per_call rows (before and after, $ROUNDS times) and the share file;
             # on an H100 the share file and the OpInfo sweep. ~350 s in all, each under its stage's limits
      if grep -q H200 "$OUT/device.txt"; then
        run_stage per_call
        FILES=tests/gpu/test_share_channel_gpu.py run_stage files
      else
        FILES=tests/gpu/test_share_channel_gpu.py run_stage files
        CONFORM_WORKERS=${CONFORM_WORKERS:-12} CONFORM_BUDGET=${CONFORM_BUDGET:-200} CONFORM_TIMEOUT=${CONFORM_TIMEOUT:-270} \
          run_stage sweep
      fi
      ;;
    param_check)  # issue 47's question of the address check: cache lines or not, and a prefetch pass (~2 min)
      timeout 240 python3 benchmarks/probes/param_check_cache.py --variants --json "$OUT/param_check.json" 2>&1 | tee "$OUT/param_check.txt" | tail -20
      ;;
    per_call)  # before (.before/) and after, alternated $ROUNDS times (default 2): eager moved 4 us between
               # two processes of the same code on the H100 (nineteenth session), so one of each tells little
      for round in $(seq ${ROUNDS:-2}); do
        per_call_in .before before "$round"
        PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 150 python3 benchmarks/per_call.py --json "$OUT/per_call_after_$round.json" 2>&1 | sed -n 3,18p
        per_call_in .variant variant "$round"  # (a variant of the change to weigh against it)
      done
      # one process's figures carry a bias of their own: the targets are read off the median over processes
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/per_call.py --summary "$OUT"/per_call_*_*.json
      ;;
  esac
}

for stage in "$@"; do run_stage "$stage"; done
