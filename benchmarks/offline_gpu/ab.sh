#!/bin/bash
# Two builds of fedray on a GPU machine: gpu_check's check 5 (the cross-device shape), A B A B ...
# (PAIRS pairs, default 2; CHECKS=5,7 for more checks; ROUNDS check 5's rounds, default 20: more
# rounds read the steady utilisation better), each run cold, with nvidia-smi's utilisation
# sampled every 100 ms throughout. The builds are the wheels in .devenv/a/ and .devenv/b/
# (wheels.sh makes them). Prints each run's table row; every report, log and the trace go into
# $OUT/ab.tgz (one file, packed however the command ends). Carry .devenv and .data:
#     bash benchmarks/offline_gpu/ab.sh
cd "$(dirname "$0")/../.."
for build in a b; do
    ls .devenv/$build/fedray-*.whl >/dev/null 2>&1 || { echo "no wheel in .devenv/$build/ (wheels.sh)" >&2; exit 2; }
done
O=$(realpath -m "${OUT:-reports}")
work=$(mktemp -d)
mkdir -p "$O"
(while :; do echo "$(date +%s.%N) $(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits | head -1)"; sleep 0.1; done) >"$work/smi.txt" 2>/dev/null &
sampler=$!
# a timeout or Ctrl-C still packs what the finished runs left
trap 'kill $sampler 2>/dev/null; tar -C "$work" -czf "$O/ab.tgz" . && rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
for i in $(seq "${PAIRS:-2}"); do
    for build in a b; do
        echo "=== $build $i $(date +%s.%N)"
        FEDRAY_WHEEL=$(ls .devenv/$build/fedray-*.whl | head -1) OUT="$work/$build$i" BUDGET="${RUN_BUDGET:-150}" \
            bash benchmarks/offline_gpu/run.sh --only "${CHECKS:-5}" --rounds "${ROUNDS:-20}" | grep -E '^[0-9]+[a-z]? |setup|total|FAIL|Error'
        echo "=== end $build $i $(date +%s.%N)"
    done
done
