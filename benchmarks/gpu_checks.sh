#!/usr/bin/env bash
# Every GPU check the issues ask for, in one script, for a session that is lent a GPU machine.
#
#   bash benchmarks/gpu_checks.sh quick   # ~5 min: doctor, MixedPrecision vs peers, GPU tests,
#                                         #         bench model/matmul/h2d
#   bash benchmarks/gpu_checks.sh rest    # ~5 min: pipelines (nvjpeg -> ResNet-50), overhead
#                                         #         benchmarks, autotuner JPEG grid on all cores
#
# Runs from the repository root with the source tree on PYTHONPATH (the GPU machine has its
# own torch/torchvision and no registry access). Every step has its own time limit, so one
# hang cannot eat the rest; results land in $OUT (or ./gpu-out when OUT is unset).
# It also runs on a CPU-only machine (tiny sizes) so that it can be checked before a lease.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
part="${1:-quick}"

step() {  # step NAME SECONDS CMD...: run with a time limit, keep the log, never stop the script
  local name=$1 limit=$2
  shift 2
  echo; echo "######## $name (limit ${limit}s, $(date +%T))"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "######## $name: exit ${PIPESTATUS[0]}"
}

cuda=$($PY -c 'import torch; print(int(torch.cuda.is_available()))')

if [ "$part" = quick ]; then
  step env 30 bash -c "nvidia-smi -L 2>/dev/null; $PY -c 'import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__, torchvision.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else \"cpu\")'"
  step doctor 60 $PY -m trainperf doctor
  step amp_bench 240 $PY benchmarks/amp_bench.py --json "$OUT/amp_bench.json"
  step gpu_tests 240 $PY -m pytest -q -p no:cacheprovider -ra -m requires_cuda tests
  step ddp_fork_tests 120 $PY -m pytest -q -p no:cacheprovider -ra tests/test_ddp.py -k "fork or returns_rank0 or master_port"
  step bench_matmul 60 $PY -m trainperf bench matmul --json
  step bench_h2d 60 $PY -m trainperf bench h2d --json
  if [ "$cuda" = 1 ]; then
    step bench_resnet50 120 $PY -m trainperf bench model --model resnet50 --precision all
    step bench_vit 150 $PY -m trainperf bench model --model vit_b_16 --precision all
  else
    step bench_resnet50 120 $PY -m trainperf bench model --model resnet50 --precision fp32
  fi
elif [ "$part" = rest ]; then
  if [ "$cuda" = 1 ]; then
    step pipeline_bench 240 $PY benchmarks/pipeline_bench.py --images 4096 --backends nvjpeg,torchvision --tune-budget 20 --seconds 8 --train-resnet --steps 30 --json "$OUT/pipeline_bench.json"
    step autotune_jpeg 270 $PY benchmarks/autotune_bench.py --datasets jpeg --batch-size 128 --workers 0,8,12,14,15,16,24 --prefetch 2 --pin true --budget 30 --json "$OUT/autotune_jpeg.json"
  else
    step pipeline_bench 240 $PY benchmarks/pipeline_bench.py --images 64 --backends torchvision --tune-budget 3 --seconds 2 --json "$OUT/pipeline_bench.json"
    step autotune_jpeg 240 $PY benchmarks/autotune_bench.py --datasets jpeg --quick --json "$OUT/autotune_jpeg.json"
  fi
  step bench_overhead 150 $PY benchmarks/bench_overhead.py --json "$OUT/bench_overhead.json"
  step watch_overhead 120 $PY benchmarks/watch_overhead.py --json "$OUT/watch_overhead.json"
  step ddp_example 90 $PY examples/ddp_train.py
else
  echo "usage: $0 quick|rest" >&2
  exit 2
fi
echo; echo "results in $OUT"
