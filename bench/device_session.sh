#!/usr/bin/env bash
# On the GPU machine, in one command: install offline (bench/device_setup.sh), then run the named
# steps, each under its own time limit, keeping every log and result in $OUT/results.tgz (re-packed
# after each step, so a step cut off by the command's limit still returns what came before it).
#   DEADLINE=580 bash bench/device_session.sh generate:150 decode-gpt2:200 runtime:120 ...
#   DEADLINE=580 bash bench/device_session.sh run-llama:570      (RUN_SYSTEMS, RUN_JOBS: run.py's --systems, --jobs)
#   DEADLINE=580 bash bench/device_session.sh memory-mlp:90 memory-gpt:120
#   DEADLINE=580 bash bench/device_session.sh sweep:120 chain:60
#   DEADLINE=580 bash bench/device_session.sh fewrow-quick:150 fewrow:420
#   DEADLINE=580 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1,8 bash bench/device_session.sh decode-llama-3.2-1b:250 few-llama-3.2-1b:250
#   DEADLINE=580 bash bench/device_session.sh fewrow-new:260 fewrow-tests:300
#   DEADLINE=580 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 FEW_ROWS=few_16x32x256,few_splitk_16x64x128,few_16x64x128 bash bench/device_session.sh decode-llama-3.2-1b:190 few-llama-3.2-1b:190 fewe-llama-3.2-1b:190
#     (the few-row forms of 2026-11-29 against the fewe_ forms: W's first K steps before the
#     dependent-launch wait, the one-pass _rms forms; alone and chained with the norms against
#     cuBLAS, then the decode at 8 rows: cuBLAS (the default build), old forms, new forms)
#   DEADLINE=580 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1,8 bash bench/device_session.sh decode-llama-3.2-1b:260 fewrow-tests:300
#     (the default build's swapped forms at 8 rows, gemm_defaults.BUILT_IN_LARGE, timed and verified on the GPU)
#   DEADLINE=580 bash bench/device_session.sh attn-chain:120 gpu-all:450
#     (the attention forms of 2026-12-01, the tail forms' new shapes among them; then the GPU suite)
#   DEADLINE=580 SPLIT_ARGS="--models gpt2,mlp" bash bench/device_session.sh split-sweep:120
#     (each site's swapped form at other K slices and whole, bench/split_sweep.py; default: every model)
#   DEADLINE=340 DECODE_LAYERS=8 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 DECODE_ENV="PYTHONPATH=/tmp/abpatch:/tmp/site" bash bench/device_session.sh envdecode-qwen3-0.6b:155 decode-qwen3-0.6b:155
#     (an A/B of a codegen constant without a switch: /tmp/abpatch/sitecustomize.py, written first
#     in the same command, sets it in every process of the envdecode arm, e.g.
#     "import aot.codegen.gemm_defaults as g; g.SLICED_SMALL_N = 0")
#   DEADLINE=580 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1,8,32 DECODE_ENV="AOTPACK_REDUCE_NORM=off" bash bench/device_session.sh decode-llama-3.2-1b:270 envdecode-llama-3.2-1b:270
#     (the default, whose reduce runs the next norm (codegen/gemm_pairs.py), against the sites apart; GPU_K=reduce_runs_the_next_norm ... gpu-k:200 checks it)
#   (DECODE_ENV="AOTPACK_REDUCE_NORM=rms" with decode-gpt2 / envdecode-gpt2: GPT-2's LayerNorm kept apart, against the default; GPU_K=reduce_runs_the_next_layer_norm checks the joined forms)
#   DEADLINE=580 bash bench/device_session.sh gpu-all:570   (the whole GPU suite: a command of its own)
#   DEADLINE=200 AB_ENV_gpt=AOTPACK_TILE_STATS=off AB_SIZES_gpt="batch=8,seq=1 batch=1,seq=16 batch=1,seq=128" bash bench/device_session.sh ab-gpt:170
#     (the default, o and fc joined through the o tile's row statistics at the 16-row tiles, codegen/gemm_stats.py,
#     against the LayerNorm kernel: 1.1-1.2% faster, 2026-12-04; GPU_K=row_statistics gpu-k:120 checks it)
#   DEADLINE=585 DECODE_LAYERS=8 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 DECODE_ENV1=AOTPACK_TILE_STATS_ROW_NORM=off DECODE_ENV2=AOTPACK_QKV_IN_ATTENTION=on PAIRED_BATCH=8 PAIRED_MAY_DIFFER=1 bash bench/device_session.sh decode-llama-3.2-1b:130 env1-llama-3.2-1b:130 env2-llama-3.2-1b:130 paired01-llama-3.2-1b:60 paired20-llama-3.2-1b:60
#     (the default, the RMSNorm's statistics join (o tile -> gate/up at 8 rows), against the norm kernel: 0.9-1.5% faster,
#     2026-12-04, GPU_K=o_and_gate_up_join gpu-k:120 checks it; and q/k/v's K slices summed in the attention against
#     the default: 0.7% slower, GPU_K=qkv_in_attention; PAIRED_MAY_DIFFER scores each arm's tokens against float32)
#   DEADLINE=300 AB_ENV_gpt=AOTPACK_ROWS32_EARLY=on AB_SIZES_gpt="batch=1,seq=32 batch=32,seq=1 batch=1,seq=24" bash bench/device_session.sh ab-gpt:280
#     (BUILT_IN_32's tile with its first W step before the wait, tilee_64x32x128, against the default; untimed as of 2026-12-03)
#   DEADLINE=580 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1 DECODE_ENV1=AOTPACK_ROW_SUM=on PAIRED_BATCH=1 bash bench/device_session.sh decode-llama-3.2-1b:200 env1-llama-3.2-1b:200 paired10-llama-3.2-1b:120
#     (the residual's sum written by the GEMV before, codegen/row_sum.py, against the default at 16 layers; 0.2% faster at 4
#     layers on an H100, 2026-12-06; AOTPACK_FOLD_NORM_SCALES=off in DECODE_ENV1 measures the norm-scale fold the same way)
#   DEADLINE=250 bash bench/device_session.sh prologue-reads:230   (what a one-row norm prologue's reads cost, bench/prologue_reads.py)
#   DEADLINE=575 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1,8 DECODE_ENV1=AOTPACK_FOLD_NORM_SCALES=rms PAIRED_BATCH=1,8 AB_ENV_gpt=AOTPACK_FOLD_NORM_SCALES=rms AB_SIZES_gpt="batch=1,seq=1 batch=1,seq=128" bash bench/device_session.sh decode-gpt2:140 env1-gpt2:140 paired10-gpt2:80 ab-gpt:130
#     (the default, a LayerNorm's scale and shift folded into the projections after it, tracer/norm_scales.py, against the
#     RMSNorm fold alone: GPT-2's decode 1.4% faster at batch 1, the example GPT 1.5-2.1%, H100, 2026-12-06;
#     DECODE_ENV1=AOTPACK_ROW_SUM=on with decode-gpt2 measures the sum join before LayerNorms: 3.2% slower)
#   DEADLINE=560 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1 DECODE_ENV1="AOTPACK_ROW_SUM=on" DECODE_ENV2="AOTPACK_ROW_SUM=on AOTPACK_ROW_SUM_TIE=off" PAIRED_BATCH=1 bash bench/device_session.sh decode-gpt2:110 env1-gpt2:110 env2-gpt2:110 paired10-gpt2:80 paired12-gpt2:80
#     (the residual's sum written by the GEMV before a LayerNorm, its loads tied to the first product (codegen/row_sum.py's
#     _tied), against the default (apart) and against the join untied; DECODE_ENV1=AOTPACK_ROW_SUM_TIE=off with
#     decode-llama-3.2-1b / env1- / paired10- measures the tie before RMSNorms)
#   DEADLINE=560 DECODE_LAYERS=8 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 DECODE_ENV1="AOTPACK_STATS_AFTER_LOOP=off" PAIRED_BATCH=8 bash bench/device_session.sh decode-llama-3.2-1b:90 env1-llama-3.2-1b:90 paired10-llama-3.2-1b:60 decode-gpt2:90 env1-gpt2:90 paired10-gpt2:60
#     (a statistics join's second tile combining them after its K loop, codegen/gemm_stats.py, against the older order:
#     GPT-2 2.0% and Llama-3.2-1B 0.3% faster at batch 8, H100, 2026-12-06; AB1_ENV_gpt=AOTPACK_STATS_AFTER_LOOP=off ab1-gpt for forwards)
#   DEADLINE=330 AB_ENV_gpt=AOTPACK_EARLY_STEPS_LAST=on AB_SIZES_gpt="batch=8,seq=1 batch=1,seq=128 batch=32,seq=1" DECODE_LAYERS=8 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 DECODE_ENV1="AOTPACK_EARLY_STEPS_LAST=on" PAIRED_BATCH=8 PAIRED_MAY_DIFFER=1 bash bench/device_session.sh ab-gpt:80 decode-llama-3.2-1b:90 env1-llama-3.2-1b:90 paired01-llama-3.2-1b:40
#     (the early-loaded W steps' products after the K loop, codegen/gemm_render.EARLY_STEPS_LAST, against the older order:
#     the example GPT's 128-token forward 5.2% faster, the 8-row decodes the same, H100, 2026-12-06; on by default since,
#     so set the switch to off in the B arms to measure it again; tokens may part: the sum over K in another order)
#   DEADLINE=570 AB_ENV_gpt=AOTPACK_SMALL_EARLY=on AB1_ENV_gpt=AOTPACK_ROWS32_EARLY=on AB_SIZES_gpt="batch=8,seq=1 batch=1,seq=16 batch=1,seq=32 batch=32,seq=1" AB_ENV_mlp=AOTPACK_SMALL_EARLY=on AB_SIZES_mlp="batch=8" DECODE_LAYERS=8 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 DECODE_ENV1="AOTPACK_SMALL_EARLY=on" PAIRED_BATCH=8 PAIRED_MAY_DIFFER=1 bash bench/device_session.sh ab-gpt:90 ab1-gpt:90 ab-mlp:60 decode-llama-3.2-1b:100 env1-llama-3.2-1b:100 paired01-llama-3.2-1b:50
#     (the small sites' form at 2-16 rows with W's first two K steps before the wait, gemm_defaults.SMALL_EARLY: timed
#     2026-12-06, on where K <= 768 by default since ("short"); the 17-32-row tile's early W step, ROWS32_EARLY, still
#     untimed since the early steps' products moved after the loop: run ab1-gpt with it alone)
#   DEADLINE=575 AB_ENV_gpt=AOTPACK_HOLD_EARLY_A=on AB1_ENV_gpt=AOTPACK_SMALL_EARLY=on AB_SIZES_gpt="batch=1,seq=128 batch=8,seq=1 batch=1,seq=64 batch=32,seq=1" DECODE_LAYERS=8 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 DECODE_ENV1="AOTPACK_HOLD_EARLY_A=on" DECODE_ENV2="AOTPACK_SMALL_EARLY=on" PAIRED_BATCH=8 PAIRED_MAY_DIFFER=1 bash bench/device_session.sh ab-gpt:95 ab1-gpt:80 decode-llama-3.2-1b:90 env1-llama-3.2-1b:90 env2-llama-3.2-1b:90 paired01-llama-3.2-1b:45 paired02-llama-3.2-1b:45
#     (the early steps' A tiles held in registers through the K loop, gemm_render.HOLD_EARLY_A: the example GPT's
#     128-token forward 2.8% faster, Llama-3.2-1B batch 8 1%, the same bits, H100, 2026-12-06; on by default since, so
#     set it off in the B arms to measure it again; and SMALL_EARLY as above)
#   DEADLINE=575 AB_ENV_gpt=AOTPACK_HOLD_EPILOGUE_LOADS=on AB_SIZES_gpt="batch=8,seq=1 batch=1,seq=16 batch=1,seq=32 batch=32,seq=1" AB_ENV_mlp=AOTPACK_HOLD_EPILOGUE_LOADS=on AB_SIZES_mlp="batch=8 batch=2" DECODE_LAYERS=8 DECODE_SYSTEMS=aotpack DECODE_BATCHES=8 DECODE_ENV1="AOTPACK_HOLD_EPILOGUE_LOADS=on" PAIRED_BATCH=8 bash bench/device_session.sh ab-gpt:95 ab-mlp:60 decode-gpt2:70 env1-gpt2:70 paired01-gpt2:45 decode-llama-3.2-1b:85 env1-llama-3.2-1b:85 paired01-llama-3.2-1b:45
#     (a tensor-core form's epilogue rows held through its K loop, gemm_render.HOLD_EPILOGUE_LOADS, against the default:
#     the statistics joins' first tiles at 2-16 rows, the same speed on an H100, 2026-12-07, so off; that command's B arm also
#     loaded the 32-row tiles' bias before the wait: 4.6% faster at 32 rows, on by default since under EARLY_BIAS; give the
#     Llama steps 100 s each and PAIRED_MAY_DIFFER=1; GPU_K="row_statistics or o_and_gate_up_join" with
#     AOTPACK_HOLD_EPILOGUE_LOADS=on gpu-k:200 checks the held kernels)
#   DEADLINE=200 HOST_SIZES_mlp="batch=1 batch=8" HOST_SIZES_gpt="batch=1,seq=1" bash bench/device_session.sh probe-mlp:90 probe-gpt:100
#     (a call's host time piece by piece: bind_and_check_same against probe-mlp-batch-1-h200-2026-11-30.json's 6.0 us,
#     before the guards' cheaper tests of 2026-12-07, 9.4 -> 4.5 us on the CPU box)
#   DEADLINE=580 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1,8,32 bash bench/device_session.sh decode-llama-3.2-1b:300 decode-gpt2:130 decode-llama:140
#     (the whole models at every batch with the defaults: the first command on an H200, where no figure exists since
#     2026-12-04; run-gpt:570 in a command of its own for the forward beside the other systems)
#   DEADLINE=580 DECODE_SYSTEMS=aotpack DECODE_BATCHES=1,8 DECODE_ENV1="AOTPACK_DECODE_WARPS=4" PAIRED_BATCH=1,8 PAIRED_MAY_DIFFER=1 bash bench/device_session.sh decode-llama:170 env1-llama:170 paired10-llama:120
#     (the decode attention's split form on 2 warps, the default since 2026-12-07 for key tiles up to 64 x 64, against the
#     4 of before on the 0.58B Llama, whose split form has GPT-2's tile: 1.6% faster at batch 1, even at 8, H100, 2026-12-07)
# (DEADLINE: seconds after the start by which every step must end: the command's own limit less a margin)
# decode-MODEL steps read DECODE_SYSTEMS (e.g. aotpack,aotpack-tuned,hf_static_compile), DECODE_TIMEOUT
# (seconds per system), DECODE_BATCHES (e.g. 1 or 1,8,32), DECODE_PROFILE=1 (kernel tables per
# aotpack system and batch), DECODE_WORKLOAD=PROMPT,NEW (every model's, e.g. a long cache; decode-, split-)
# and DECODE_LAYERS=N (each model's first N decoder layers: a quicker A/B; decode-, envdecode-).
# Bundles built on the CPU box travel in .bundles/ (without their split weights: device_setup.sh
# re-creates those from the seeded model files and checks them against the bundle's sha256).
set -uo pipefail
OUT=${OUT:-out}
RES=/tmp/res
# bench/decode.py's bundles: in the checkout's ignored .bundles, which a warm machine keeps between
# calls, so a later call of the same code, switches and sizes reuses them (decode.py's build_key)
# instead of tracing and building again
BUNDLES=${DECODE_BUNDLES:-.bundles/decode}
mkdir -p "$RES" "$OUT"
T0=$(date +%s)
bash bench/device_setup.sh > "$RES/setup.log" 2>&1 || { cat "$RES/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 AOTPACK_GPU_BUNDLES=.bundles
python3 - > "$RES/env.txt" 2>&1 <<'PY'
import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name(), "cc", torch.cuda.get_device_capability())
for name in ("transformers", "timm", "torchvision", "zstandard", "safetensors", "click"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:
        print(name, "missing:", type(e).__name__)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$RES/env.txt" 2>&1
cat "$RES/env.txt"
bundles_of() { if [ "$1" = 0 ]; then echo $BUNDLES; else echo "$BUNDLES-env$1"; fi; }  # a paired step's arm
pack() { cp $BUNDLES/*-tuning.json "$RES/" 2>/dev/null; tar czf "$OUT/results.tgz" -C "$RES" . ; }
pack
for item in "$@"; do
  step=${item%%:*}
  limit=${item#*:}; [ "$limit" = "$item" ] && limit=300
  start=$(date +%s)
  case $step in
    # every GPU test of the repository (tests/gpu, tests/runtime's gpu tests)
    # gpu-all: the whole GPU suite, GPU_WORKERS files at once (default 12: 4 did not finish in 560 s),
    # a line per test as it ends, so that a run cut off by the command's limit still names its failures
    gpu-all) cmd=(python3 -m pytest -m gpu -v -rs -rf -n "${GPU_WORKERS:-12}" tests/gpu tests/runtime) ;;
    # this period's new GPU paths: grouped GEMMs (MoE), encoder-decoders, the runtime's state and generate
    new-paths) cmd=(python3 -m pytest -m gpu -q -rs -x tests/gpu/test_moe_gpu.py tests/gpu/test_seq2seq_gpu.py tests/runtime/test_gpu_state.py tests/runtime/test_gpu.py) ;;
    generate) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_generate_gpu.py tests/gpu/test_decode_attention_gpu.py) ;;
    # what the stops of 2026-11-29 checked on the CPU only: the greedy kernel's by-name parameters in
    # both loaders, aotpack-rt's decode blocks, then the generate suite (GPT-J's rewrite included)
    unverified) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_greedy_gpu.py tests/runtime/test_gpu_state.py tests/gpu/test_generate_gpu.py) ;;
    # the decode attention kernel at the bench's shapes, and a grouped-query Llama's greedy tokens against the CPU's
    decode-tests) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_decode_attention_gpu.py tests/gpu/test_generate_gpu.py -k "llama or decode_attention") ;;
    runtime) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_gpu_runtime.py tests/gpu/test_memory_gpu.py) ;;
    gemm) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_gemm_gpu.py) ;;
    realmodels) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_realmodels_gpu.py) ;;
    # nopdl-MODEL: decode-MODEL with dependent launch off (AOTPACK_DEPENDENT_LAUNCH=0), the same bundles
    nopdl-*) cmd=(env AOTPACK_DEPENDENT_LAUNCH=0 python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#nopdl-}" --out "$RES/decode-nopdl-${step#nopdl-}" --bundles $BUNDLES ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile}) ;;
    decode-*) cmd=(python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#decode-}" --out "$RES/decode-${step#decode-}" --bundles $BUNDLES ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile} ${DECODE_WORKLOAD:+--workload "$DECODE_WORKLOAD"} ${DECODE_LAYERS:+--layers "$DECODE_LAYERS"}) ;;
    # run-MODELS (comma-separated): bench/run.py builds what .bundles lacks here (real models always)
    run-*) cmd=(python3 bench/run.py --models "${step#run-}" --bundles .bundles --out "$RES/run" ${RUN_SYSTEMS:+--systems "$RUN_SYSTEMS"} ${RUN_JOBS:+--jobs "$RUN_JOBS"}) ;;
    tune) cmd=(env OUT="$RES" AOTPACK_GPU_BUNDLES=.bundles bash bench/gemm_tune.sh tune bench verify) ;;
    # GEMM tile shapes against cuBLAS at 128 rows with cold weights, and a forward's GEMMs in one
    # graph with and without dependent launch (bench/gemm_sweep.py)
    # greedy decoding's argmax at wide vocabularies (bench/argmax_sweep.py)
    # this period's GPU tests: GEMV forms and their fusions, decode attention, generate (blocks)
    period) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_gemm_norm_gpu.py tests/gpu/test_decode_attention_gpu.py tests/gpu/test_generate_gpu.py) ;;
    gpu-new) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_gemm_norm_gpu.py tests/gpu/test_decode_attention_gpu.py tests/gpu/test_generate_gpu.py tests/gpu/test_relation_programs_gpu.py tests/runtime/test_gpu_state.py tests/runtime/test_gpu.py) ;;
    rt-zoo) cmd=(python3 -m pytest -m gpu -q -rs -rf -rx --dist load tests/runtime/test_gpu_zoo.py tests/codegen/test_strided_attention.py) ;;
    # the GPU cases fixed since the last run: masked zoo models, strided attention, inputs at a pitch
    rt-fixes) cmd=(python3 -m pytest -m gpu -q -rs -rf --dist load tests/codegen/test_strided_attention.py "tests/runtime/test_gpu_zoo.py::test_the_runtime_equals_the_torch_loader_on_library_free_zoo_models[bert]" "tests/runtime/test_gpu_zoo.py::test_the_runtime_equals_the_torch_loader_on_library_free_zoo_models[llama-attention_mask]" "tests/runtime/test_gpu_zoo.py::test_the_runtime_equals_the_torch_loader_on_library_free_zoo_models[t5-encoder]" tests/runtime/test_gpu.py::test_inputs_at_a_pitch_and_raw_bytes_equal_dense_inputs_on_the_gpu) ;;
    # the runtime's device memory step by step (bench/rt_memory_probe.py) on the bench's library-free bundles
    rt-memory) cmd=(bash -c "python3 bench/rt_memory_probe.py .bundles/*-lf.tpk --json $RES/rt-memory.json") ;;
    # rt-paired-MODEL: the runtime and the torch loader paired in one process on MODEL's library-free
    # bundle (bench/rt_paired.py; built here where .bundles lacks it), e.g. rt-paired-gpt, rt-paired-cnn
    rt-paired-*) m=${step#rt-paired-}; mkdir -p .bundles; cmd=(bash -c "test -f .bundles/$m-lf.tpk || python3 -m aot.cli build --arch sm_90 -q models/$m.py -o .bundles/$m-lf.tpk --library-free; python3 bench/rt_paired.py $m .bundles/$m-lf.tpk --json $RES/rt-paired-$m.json") ;;
    # where the runtime's import phase goes: import times, and cuInit / primary context apart
    rt-import) cmd=(bash -c 'python3 -X importtime -c "import aot.runtime.runner, cuda.bindings.driver" 2>&1 | sort -t"|" -k2 -n | tail -30; python3 -c "import time; t0 = time.perf_counter(); from cuda.bindings import driver as d; t1 = time.perf_counter(); d.cuInit(0); t2 = time.perf_counter(); e, dev = d.cuDeviceGet(0); e, ctx = d.cuDevicePrimaryCtxRetain(dev); d.cuCtxSetCurrent(ctx); t3 = time.perf_counter(); print(f\"import bindings {t1 - t0:.3f} s, cuInit {t2 - t1:.3f} s, primary context {t3 - t2:.3f} s\")"') ;;
    # ab-MODEL: MODEL (models/, else bench/models/) built twice for this GPU (B with the environment AB_ENV_MODEL, else AB_ENV, e.g.
    # AOTPACK_FEW_ROWS=off), then both under the torch loader paired in one process (bench/bundle_paired.py); AB_SIZES_MODEL: shapes such as "batch=32 batch=1,seq=24" instead of the bench's
    # abN-MODEL (N a digit): ab-MODEL with B built under AB<N>_ENV_MODEL, bundles and JSON of its own (A: the default again)
    ab-*|ab[0-9]-*) n=${step%%-*}; n=${n#ab}; m=${step#*-}; v=AB${n}_ENV_$m; z=AB_SIZES_$m; zs=""; for t in ${!z:-}; do zs="$zs --sizes $t"; done; f=models/$m.py; [ -f "$f" ] || f=bench/models/$m.py; mkdir -p /tmp/ab; cmd=(bash -c "python3 -m aot.cli build --arch sm_90 -q $f -o /tmp/ab/$m$n-a.tpk && env ${!v:-${AB_ENV:-AOTPACK_FEW_ROWS=off}} python3 -m aot.cli build --arch sm_90 -q $f -o /tmp/ab/$m$n-b.tpk && python3 bench/bundle_paired.py $m /tmp/ab/$m$n-a.tpk /tmp/ab/$m$n-b.tpk$zs --json $RES/ab$n-$m.json") ;;
    rt-bench) cmd=(python3 bench/run.py --models "${RT_MODELS:-mlp,gpt,cnn}" --systems aotpack,aotpack-lf,aotpack-rt --bundles .bundles --out "$RES/rt" --jobs 4) ;;
    # (--dist load: the cases of one file spread over the workers; each builds its own bundles)
    # the runtime's GPU tests: one-row forms and output tails against the torch loader, chunked weights, state, memory
    rt-gpu) cmd=(python3 -m pytest -m gpu -q -rs -rf --dist load tests/runtime/test_gpu_one_row.py tests/runtime/test_gpu.py tests/runtime/test_gpu_state.py tests/gpu/test_memory_gpu.py) ;;
    # sha256 of the weights on 1-8 threads (bench/hash_threads.py)
    hash) cmd=(python3 bench/hash_threads.py --threads 1,2,4,8) ;;
    rt-size) cmd=(python3 bench/rt_install_size.py --json) ;;
    gemv) cmd=(python3 bench/gemv_sweep.py --chain --json "$RES/gemv-sweep.json") ;;
    # what a one-row norm prologue's reads beside W cost in the step's GEMV chain (bench/prologue_reads.py)
    prologue-reads) cmd=(bash -c "python3 bench/prologue_reads.py --check && python3 bench/prologue_reads.py --json $RES/prologue-reads.json") ;;
    # few-row (2-16 rows) tensor-core GEMM forms against cuBLAS, alone and chained (bench/fewrow_sweep.py)
    fewrow) cmd=(python3 bench/fewrow_sweep.py --chain --json "$RES/fewrow-sweep.json") ;;
    fewrow-quick) cmd=(python3 bench/fewrow_sweep.py --quick --chain --json "$RES/fewrow-quick.json") ;;
    # 2 and 8 rows only, the chains at 8 (each as a bundle runs it: old and new table entries, plain and PDL)
    fewrow-new) cmd=(python3 bench/fewrow_sweep.py --quick --rows 2 8 --chain --chain-rows 8 --json "$RES/fewrow-new.json") ;;
    fewrow-tests) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_gemm_few_rows_gpu.py) ;;
    # the built-in entry's forms alone (2-16 and 17-32 rows), without the named forms' builds
    fewrow-built-in) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_gemm_few_rows_gpu.py -k "built_in or stacked") ;;
    # a decode step's GEMMs at 8 rows as a bundle runs them (the norms with them): cuBLAS against the
    # built-in table's few-row entries (bench/fewrow_sweep.py --table-only), Llama-3.2-1B
    fewrow-table) cmd=(python3 bench/fewrow_sweep.py --model llama-3.2-1b --table-only --rows 8 --chain-rows 8 --json "$RES/fewrow-table.json") ;;
    # decode attention forms in Llama-3.2-1B's attention half-layers: the build's kernel, in the q/k/v
    # GEMV's tail, with the o projection in one kernel (bench/attention_chain.py; --check first)
    attn-chain) cmd=(bash -c "python3 bench/attention_chain.py --check && python3 bench/attention_chain.py --json $RES/attention-chain.json") ;;
    # few-row GEMMs with W's rows on the product's wide side in a decode step's chain (bench/swap_rows.py;
    # SWAP_ARGS: its options, default --rows 8,1; e.g. "--set mma --rows 8 --chains q,o,d")
    # the swapped few-row forms' K slices against the GPU's wave of blocks, per site and as a
    # model's layers (bench/split_sweep.py)
    split-sweep) cmd=(python3 bench/split_sweep.py ${SPLIT_ARGS:-} --json "$RES/split-sweep.json") ;;
    swap-rows) cmd=(python3 bench/swap_rows.py ${SWAP_ARGS:---rows 8,1} --json "$RES/swap-rows.json") ;;
    # few-MODEL: decode-MODEL with the built-in table's few-row entry on (AOTPACK_FEW_ROWS=$FEW_ROWS,
    # default few_16x16x256; FEW_PROLOGUE=0: the plain forms after the norm kernels), bundles of its own
    few-*) cmd=(env AOTPACK_FEW_ROWS="${FEW_ROWS:-few_16x16x256}" AOTPACK_FEW_ROWS_PROLOGUE="${FEW_PROLOGUE:-1}" python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#few-}" --out "$RES/decode-few-${step#few-}" --bundles $BUNDLES-few ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile}) ;;
    # the split-KV decode attention against SDPA on the GPU (512 and 4096 slots, fp16/bf16, batch 1 and 8)
    split-tests) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_decode_attention_gpu.py) ;;
    # the GPU checks written without a GPU (2026-11-29): verify over the split form's cache write,
    # the default flash forms in float16 and bfloat16 against the library's attention
    unrun-tests) cmd=(python3 -m pytest -m gpu -q -rs -rf tests/gpu/test_decode_attention_gpu.py::test_verify_checks_the_split_forms_cache_write tests/gpu/test_gemm_gpu.py::test_default_flash_forms_match_the_library_on_the_gpu) ;;
    # split-MODEL: decode-MODEL with the split-KV decode attention at every cache (AOTPACK_DECODE_SPLIT=$DECODE_SPLIT, default 8), bundles and results of its own
    # splitN-MODEL: the same with N splits (bundles of their own), SPLIT_SYSTEMS (default aotpack) only
    split[0-9]*-*) n=${step%%-*}; n=${n#split}; cmd=(env AOTPACK_DECODE_SPLIT="$n" python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#*-}" --out "$RES/decode-split$n-${step#*-}" --bundles "$BUNDLES-split$n" --systems "${SPLIT_SYSTEMS:-aotpack}" ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile} ${DECODE_WORKLOAD:+--workload "$DECODE_WORKLOAD"}) ;;
    # aotpack-rt's stateful decode on the GPU (blocks, the steps after the last whole block, bf16 logits)
    rt-state) cmd=(python3 -m pytest -m gpu -q -rs -rf tests/runtime/test_gpu_state.py ${RT_K:+-k "$RT_K"}) ;;
    split-*) cmd=(env AOTPACK_DECODE_SPLIT="${DECODE_SPLIT:-8}" python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#split-}" --out "$RES/decode-split-${step#split-}" --bundles $BUNDLES-split ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile} ${DECODE_WORKLOAD:+--workload "$DECODE_WORKLOAD"}) ;;
    # sep-MODEL: decode-MODEL with the split-KV decode attention's combine as a kernel of its own
    # (AOTPACK_DECODE_COMBINE=separate; the default combines in the one kernel), bundles of its own
    sep-*) cmd=(env AOTPACK_DECODE_COMBINE=separate ${DECODE_SPLIT:+AOTPACK_DECODE_SPLIT=$DECODE_SPLIT} python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#sep-}" --out "$RES/decode-sep-${step#sep-}" --bundles $BUNDLES-sep ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile} ${DECODE_WORKLOAD:+--workload "$DECODE_WORKLOAD"}) ;;
    # the greedy step's kernel, generate in blocks, and aotpack-rt's scratch (the split decode attention), on the GPU
    greedy-tests) cmd=(python3 -m pytest -m gpu -q -rs -rf tests/gpu/test_greedy_gpu.py tests/gpu/test_generate_gpu.py tests/runtime/test_gpu_state.py) ;;
    # fewe-MODEL: few-MODEL with the fewe_ forms (AOTPACK_FEW_ROWS=$FEWE_ROWS), bundles and results of its own
    fewe-*) cmd=(env AOTPACK_FEW_ROWS="${FEWE_ROWS:-fewe_16x32x256,fewe_splitk_16x64x128,fewe_16x64x128}" AOTPACK_FEW_ROWS_PROLOGUE=1 python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#fewe-}" --out "$RES/decode-fewe-${step#fewe-}" --bundles $BUNDLES-fewe ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile}) ;;
    gemv-chain) cmd=(python3 bench/gemv_sweep.py --chain-only --json "$RES/gemv-chain.json") ;;
    # a decode step's GEMVs as one persistent kernel (grid barriers) against one kernel per GEMV
    persistent) cmd=(python3 bench/persistent_chain.py --json "$RES/persistent.json") ;;
    # resident-MODEL: the GEMV chain in one persistent kernel whose blocks hold the next GEMV's
    # weights across the grid barrier (bench/persistent_resident.py; gpt2, llama-3.2-1b)
    resident-*) cmd=(python3 bench/persistent_resident.py --model "${step#resident-}" --json "$RES/resident-${step#resident-}.json") ;;
    # host-MODEL: where a forward call's time goes, host and device apart (bench/host_path.py), at
    # each of HOST_SIZES_MODEL, else HOST_SIZES (space-separated, e.g. "batch=1 batch=8"; default
    # batch=1), MODEL's bundle from .bundles, else built here from models/; HOST_AB=N: N rounds of
    # calls bound to their own tensors against a runner that copies them (aot.loader.bindings)
    host-*) m=${step#host-}; v=HOST_SIZES_$m; sizes=${!v:-${HOST_SIZES:-batch=1}}; mkdir -p /tmp/host; b=.bundles/$m.tpk; [ -f "$b" ] || b=/tmp/host/$m.tpk; cmd=(bash -c "test -f $b || python3 -m aot.cli build --arch sm_90 -q models/$m.py -o $b; for s in $sizes; do python3 bench/host_path.py $m $b --sizes \$s ${HOST_AB:+--ab $HOST_AB} --json $RES/host-$m-\${s//[=,]/-}.json || exit 1; done") ;;
    # probe-MODEL: where a forward call's host time goes, piece by piece (bench/call_probe.py: the
    # guards' bind and check, the copies, the replay), at HOST_SIZES_MODEL / HOST_SIZES (default batch=1)
    probe-*) m=${step#probe-}; v=HOST_SIZES_$m; sizes=${!v:-${HOST_SIZES:-batch=1}}; mkdir -p /tmp/host; b=.bundles/$m.tpk; [ -f "$b" ] || b=/tmp/host/$m.tpk; cmd=(bash -c "test -f $b || python3 -m aot.cli build --arch sm_90 -q models/$m.py -o $b; for s in $sizes; do python3 bench/call_probe.py $m $b --sizes \$s --json $RES/probe-$m-\${s//[=,]/-}.json || exit 1; done") ;;
    # gpu-k: the GPU tests of tests/gpu whose ids match GPU_K (pytest's -k), e.g. "gemma2 or copy",
    # a line per test as it ends (a run cut off by its step's limit still names what passed)
    # zoo-k: the GPU tests of tests/runtime whose ids match ZOO_K (pytest's -k), e.g. "nf_resnet26"
    # prebuilt: the library-free bundles of real models built on the build box (.bundles/lf-*.tpk,
    # bench/gpu_test_bundles.py --image-sizes ...) against their CPU path, and the runtime against the torch loader
    prebuilt) cmd=(python3 -m pytest -m gpu -v -rs -rf tests/runtime/test_gpu_prebuilt.py) ;;
    zoo-k) cmd=(python3 -m pytest -m gpu -v -rs -rf tests/runtime -k "${ZOO_K:?set ZOO_K}") ;;
    gpu-k) cmd=(python3 -m pytest -m gpu -v -rs -rf tests/gpu -k "${GPU_K:?set GPU_K}") ;;
    # the torch loader's CUDA-graph calls against eager (inputs and outputs copied by the driver),
    # borrowed outputs and memory: mlp, gpt and cnn built here where .bundles lacks them
    gpu-runtime) mkdir -p .bundles; cmd=(bash -c "for m in mlp gpt cnn; do test -f .bundles/\$m.tpk || python3 -m aot.cli build --arch sm_90 -q models/\$m.py -o .bundles/\$m.tpk || exit 1; done; python3 -m pytest -m gpu -q -rs -rf tests/gpu/test_gpu_runtime.py tests/gpu/test_memory_gpu.py") ;;
    # envdecode-MODEL: decode-MODEL with the build's environment DECODE_ENV (e.g.
    # AOTPACK_SLICED_PROLOGUE=off), bundles and results of their own: an A/B beside decode-MODEL
    # envN-MODEL (N a digit): envdecode-MODEL with DECODE_ENV<N>, bundles and results of its own
    # (several arms of one model in one command, e.g. DECODE_ENV1="AOTPACK_REDUCE_NORM=off")
    env[0-9]-*) n=${step:3:1}; var=DECODE_ENV$n; cmd=(env ${!var:?set $var} python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#env?-}" --out "$RES/decode-env$n-${step#env?-}" --bundles "$BUNDLES-env$n" ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile} ${DECODE_WORKLOAD:+--workload "$DECODE_WORKLOAD"} ${DECODE_LAYERS:+--layers "$DECODE_LAYERS"}) ;;
    # kprofile-MODEL: bench/kernel_profile.py at KPROFILE_SIZES="BATCH SEQ" (default 1 128): the
    # kernels one by one, then the calls through their graphs with each kernel's share of the chain
    kprofile-*) m=${step#kprofile-}; mkdir -p .bundles; cmd=(bash -c "test -f .bundles/$m.tpk || python3 -m aot.cli build --arch sm_90 -q models/$m.py -o .bundles/$m.tpk; python3 bench/kernel_profile.py $m ${KPROFILE_SIZES:-1 128} 30 > $RES/kprofile-$m.txt") ;;
    # paired-MODEL: the bundles of env1-MODEL (A) and decode-MODEL (B), run before it, timed in one
    # process round by round (bench/decode_paired.py; PAIRED_BATCH, e.g. 1,8; PAIRED_ROUNDS;
    # PAIRED_MAY_DIFFER=1: time bundles whose greedy tokens part, as a sum's new order may make them,
    # and score each one's tokens by the model in float32)
    # pairedAB-MODEL: envA-MODEL's bundles (A) against envB-MODEL's, a digit each (0: decode-MODEL's);
    # paired-MODEL is paired10-MODEL (its JSON named paired-MODEL)
    paired-*|paired[0-9][0-9]-*) ab=${step%%-*}; ab=${ab#paired}; m=${step#*-}; s=$m${DECODE_LAYERS:+-${DECODE_LAYERS}layers}; da=${ab:0:1}; db=${ab:1:1}; [ -n "$ab" ] || { da=1; db=0; }; cmd=(python3 bench/decode_paired.py "$m" "$(bundles_of "$da")/$s.tpk" "$(bundles_of "$db")/$s.tpk" --batch "${PAIRED_BATCH:-1}" --rounds "${PAIRED_ROUNDS:-12}" ${PAIRED_MAY_DIFFER:+--tokens-may-differ --score} ${DECODE_LAYERS:+--layers $DECODE_LAYERS} --json "$RES/paired$ab-$m.json") ;;
    envdecode-*) cmd=(env ${DECODE_ENV:?set DECODE_ENV} python3 bench/decode.py --timeout "${DECODE_TIMEOUT:-200}" --models "${step#envdecode-}" --out "$RES/decode-env-${step#envdecode-}" --bundles $BUNDLES-env ${DECODE_SYSTEMS:+--systems "$DECODE_SYSTEMS"} ${DECODE_BATCHES:+--batches "$DECODE_BATCHES"} ${DECODE_PROFILE:+--profile} ${DECODE_WORKLOAD:+--workload "$DECODE_WORKLOAD"} ${DECODE_LAYERS:+--layers "$DECODE_LAYERS"}) ;;
    # newer architectures (DeepSeek-V3/V2, Llama 4, sliding and full layers mixed) generate the CPU's tokens on the GPU
    newer-tests) cmd=(python3 -m pytest -m gpu -q -rs -rf tests/gpu/test_generate_gpu.py -k newer_architectures) ;;
    # batch-1 GEMVs whose weights stream through TMA (tensor descriptors), against the default form
    # and a plain streaming read (bench/tma_gemv.py; TMA_ARGS, e.g. --quick)
    tma) cmd=(python3 bench/tma_gemv.py ${TMA_ARGS:-} --json "$RES/tma-gemv.json") ;;
    # the decode step's GEMV chain with the next GEMV's weights prefetched into L2 (bench/persistent_chain.py --quick)
    l2chain) cmd=(python3 bench/persistent_chain.py --quick --json "$RES/l2-prefetch-chain.json") ;;
    # the attention's window streaming gate/up's weights into L2 (bench/persistent_chain.py --ahead)
    l2ahead) cmd=(python3 bench/persistent_chain.py --ahead --json "$RES/l2-ahead-chain.json") ;;
    # aotpack verify on a 2-layer Llama-3.2-1B with the fused one-row forms
    verify-llama) cmd=(python3 -m pytest -m gpu -q -rs tests/gpu/test_gemm_norm_gpu.py) ;;
    argmax) cmd=(python3 bench/argmax_sweep.py --json "$RES/argmax.json") ;;
    sweep) cmd=(python3 bench/gemm_sweep.py --rows 128 --json "$RES/gemm-sweep.json") ;;
    chain) cmd=(python3 bench/gemm_sweep.py --rows 128 --chain --json "$RES/gemm-chain.json") ;;
    # memory-MODEL: where its device memory goes, stage by stage (bench/memory_stages.py, .bundles/MODEL.tpk)
    memory-*) cmd=(python3 bench/memory_stages.py --model "${step#memory-}" --bundle ".bundles/${step#memory-}.tpk" --out "$RES/memory-${step#memory-}.json") ;;
    *) echo "unknown step $step"; continue ;;
  esac
  if [ -n "${DEADLINE:-}" ]; then  # seconds after the start by which every step must have ended
    left=$((DEADLINE - start + T0))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -le 0 ] && { echo "== $step skipped: past the deadline"; continue; }
  fi
  echo "== $step (limit ${limit}s, at +$((start - T0))s): ${cmd[*]}"
  timeout -k 10 "$limit" "${cmd[@]}" > "$RES/$step.log" 2>&1
  rc=$?
  echo "== $step rc=$rc in $(( $(date +%s) - start ))s"
  tail -15 "$RES/$step.log"
  pack
done
