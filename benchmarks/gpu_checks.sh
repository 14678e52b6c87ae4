#!/usr/bin/env bash
# Every GPU check the issues ask for, in one script, for a session that is lent a GPU machine.
#
#   bash benchmarks/gpu_checks.sh quick   # env, MixedPrecision vs peers (amp_bench), bench
#                                         # model/matmul/h2d, doctor, GPU tests, DDP fork tests
#   bash benchmarks/gpu_checks.sh rest    # nvjpeg pipeline -> ResNet-50, to_device, overhead
#                                         # benchmarks, autotuner JPEG grid on all cores, DDP
#                                         # example, tune_batch_size vs a sweep (3 models)
#
# `bash benchmarks/gpu_checks.sh rest whatif_gpu checkpoint_bench` runs only the steps named
# (a rerun of the failed ones); a name that is no step of the part is an error (exit 2).
#
# Steps run most important first, each under its own time limit, and the whole part under a
# deadline: GPU_CHECKS_DEADLINE_S seconds (default 500) from the start. A step's limit is cut to
# the time left, and a step that would start with under 30 s left is skipped (and logged as
# skipped), so a part finishes inside a tool call that allows 600 s. Both parts at the default
# need more than a 15-minute lease minus the machine start: give them e.g. 420 and 300.
#
# Logs and JSON go to a work folder (${TMPDIR:-/tmp}/gpu-checks-<part>); after every step
# all of it is packed into ONE archive, $OUT/<part>.tar.gz (OUT defaults to ./gpu-out), so a
# run killed midway still returns everything done so far, as a single file (the device tool
# returns at most 8). `tar xzf <part>.tar.gz` gives <step>.txt, the JSON files and summary.txt:
# one line per step (name, exit code, seconds), also printed as "== step ..." lines and again
# at the end, so the last lines of output are the overview. Exit 124/137: the step ran out of
# time.
#
# Runs from the repository root with the source tree on PYTHONPATH (the GPU machine has its
# own torch/torchvision and no registry access). It also runs on a CPU-only machine (tiny
# sizes), so that it can be checked before a lease:
#   OUT=/tmp/gq PYTHON=python bash benchmarks/gpu_checks.sh quick && tar tzf /tmp/gq/quick.tar.gz
set -u
SECONDS=0
part="${1:-quick}"
case "$part" in
  quick | rest) ;;
  *) echo "usage: $0 quick|rest [STEP ...]" >&2; exit 2 ;;
esac
shift $(($# > 0 ? 1 : 0))
selected=" $* "  # named steps only (e.g. a rerun of the failed ones); empty: every step
ran=" "
deadline="${GPU_CHECKS_DEADLINE_S:-500}"
case "$deadline" in
  '' | *[!0-9]*) echo "GPU_CHECKS_DEADLINE_S must be a whole number of seconds, got '$deadline'" >&2; exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then  # relative to where the script was started from
  OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd) || { echo "cannot write to OUT=$OUT" >&2; exit 2; }
fi
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
WORK="${TMPDIR:-/tmp}/gpu-checks-$part"
rm -rf "$WORK"
mkdir -p "$WORK"
ARCHIVE="$OUT/$part.tar.gz"
PY="${PYTHON:-python3}"

pack() {  # the whole work folder as one archive, replaced atomically (a kill keeps the last)
  tar -C "$WORK" -czf "$ARCHIVE.tmp" . && mv -f "$ARCHIVE.tmp" "$ARCHIVE"
}

note() {  # one summary line: on stdout and in summary.txt
  echo "$*" | tee -a "$WORK/summary.txt"
}

step() {  # step NAME SECONDS CMD...: run with a time limit, keep the log, never stop the script
  local name=$1 limit=$2 left rc started
  shift 2
  if [ "$selected" != "  " ] && [[ "$selected" != *" $name "* ]]; then
    return  # not among the steps named on the command line
  fi
  ran="$ran$name "
  left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then
    note "== step $name: skipped (${left}s left of GPU_CHECKS_DEADLINE_S=$deadline)"
    pack
    return
  fi
  # timeout may take 10 s more to kill a step that ignores SIGTERM
  if [ $((left - 10)) -lt "$limit" ]; then limit=$((left - 10)); fi
  echo; echo "######## $name (limit ${limit}s, $(date +%T))"
  started=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.txt"
  rc=${PIPESTATUS[0]}
  note "== step $name: exit $rc, $((SECONDS - started))s (limit ${limit}s)"
  pack
}

cuda=$(timeout 120 "$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
note "== $part: cuda=${cuda:-?}, deadline ${deadline}s, archive $ARCHIVE"
pytest=("$PY" -m pytest -q -p no:cacheprovider -ra --timeout 60)

if [ "$part" = quick ]; then
  step env 30 bash -c "nvidia-smi -L 2>/dev/null; $PY -c 'import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__, torchvision.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else \"cpu\")'"
  step amp_bench 240 "$PY" benchmarks/amp_bench.py --json "$WORK/amp_bench.json"
  if [ "$cuda" = 1 ]; then
    step bench_resnet50 120 "$PY" -m trainperf bench model --model resnet50 --precision all
    step bench_vit 150 "$PY" -m trainperf bench model --model vit_b_16 --precision all
  else
    step bench_resnet50 120 "$PY" -m trainperf bench model --model resnet50 --precision fp32
  fi
  step bench_matmul 60 "$PY" -m trainperf bench matmul --json
  step bench_h2d 60 "$PY" -m trainperf bench h2d --json
  step doctor 60 "$PY" -m trainperf doctor
  step doctor_dist 90 "$PY" -m trainperf doctor --dist
  step gpu_links 30 "$PY" -c 'import trainperf; from trainperf.doctor import read_gpu_links, link_estimate; l = read_gpu_links(trainperf.gpus()); print(l); print(link_estimate(l))'
  step gpu_tests 240 "${pytest[@]}" -m requires_cuda tests
  step ddp_fork_tests 120 "${pytest[@]}" tests/ddp -k "fork or returns_rank0 or master_port"
else
  if [ "$cuda" = 1 ]; then
    step pipeline_bench 240 "$PY" benchmarks/pipeline_bench.py --images 4096 --backends nvjpeg,torchvision --tune-budget 20 --seconds 8 --train-resnet --steps 30 --json "$WORK/pipeline_bench.json"
  else
    step pipeline_bench 240 "$PY" benchmarks/pipeline_bench.py --images 64 --backends torchvision --tune-budget 3 --seconds 2 --json "$WORK/pipeline_bench.json"
  fi
  if [ "$cuda" = 1 ]; then
    step to_device 60 "$PY" benchmarks/to_device_bench.py --device cuda:0 --rounds 5 --json "$WORK/to_device.json"
  else
    step to_device 60 "$PY" benchmarks/to_device_bench.py --reps 20 --rounds 3 --json "$WORK/to_device.json"
  fi
  if [ "$cuda" = 1 ]; then
    step checkpoint_bench 420 "$PY" benchmarks/checkpoint_bench.py --device cuda --size-mb 1024 --repeats 3 --seconds 3 --writers thread --json "$WORK/checkpoint_bench.json"
  else
    step checkpoint_bench 120 "$PY" benchmarks/checkpoint_bench.py --size-mb 16 --repeats 1 --seconds 0.5 --json "$WORK/checkpoint_bench.json"
    step checkpoint_dry 60 "$PY" benchmarks/checkpoint_bench.py --device cuda --dry-run --skip agree
  fi
  step bench_overhead 150 "$PY" benchmarks/bench_overhead.py --rounds 3 --json "$WORK/bench_overhead.json"
  step watch_overhead 120 "$PY" benchmarks/watch_overhead.py --rounds 3 --json "$WORK/watch_overhead.json"
  if [ "$cuda" = 1 ]; then  # watch's predictions: fp32 -> bf16, PIL -> workers / nvJPEG (16 cores)
    step whatif_gpu 240 "$PY" benchmarks/whatif_bench.py --device cuda --rounds 2 --reports --json "$WORK/whatif_gpu.json"
  else
    step whatif_gpu 120 "$PY" benchmarks/whatif_bench.py --device cuda --dry-run --rounds 1 --scale 0.3 --json "$WORK/whatif_gpu.json"
  fi
  if [ "$cuda" = 1 ]; then
    step autotune_jpeg 180 "$PY" benchmarks/autotune_bench.py --datasets jpeg --batch-size 128 --workers 0,8,16,24 --prefetch 2 --pin true --budget 20 --json "$WORK/autotune_jpeg.json"
  else
    step autotune_jpeg 240 "$PY" benchmarks/autotune_bench.py --datasets jpeg --quick --json "$WORK/autotune_jpeg.json"
  fi
  step ddp_example 90 "$PY" examples/ddp_train.py
  if [ "$cuda" = 1 ]; then
    step launch_detection 240 "$PY" benchmarks/launch_bench.py --backend nccl --only-detection --json "$WORK/launch_detection_gpu.json"
  fi
  step launch_detection_cpu 240 "$PY" benchmarks/launch_bench.py --only-detection --json "$WORK/launch_detection_cpu.json"
  if [ "$cuda" = 1 ]; then
    for model in resnet50 vit_b_16 gpt2; do
      step "batch_size_$model" 300 "$PY" benchmarks/batch_size_bench.py --device cuda --models "$model" --json "$WORK/batch_size_$model.json"
    done
  else
    step batch_size 240 "$PY" benchmarks/batch_size_bench.py --quick --json "$WORK/batch_size.json"
  fi
fi
echo; echo "######## summary ($part, ${SECONDS}s)"
cat "$WORK/summary.txt"
echo "results in $ARCHIVE (tar xzf it)"
unknown=""
for name in $selected; do
  [[ "$ran" == *" $name "* ]] || unknown="$unknown $name"
done
if [ -n "$unknown" ]; then
  note "== no such step in $part:$unknown (the step names are those of the '== step' lines)"
  pack
  exit 2
fi
