#!/bin/bash
# On a GPU machine without a package registry: the image's python3 (torch, lightning) plus what
# bundle.sh packed into .devenv/; then gpu_check.py as `make gpu-check` runs it, its report and
# log in $OUT (default reports/), the commands' logs in $OUT/logs.tgz. BUDGET: seconds before the
# checks are interrupted (the report keeps the rows that finished). Run again on the same machine (say
# with other checks or --share, and another OUT), it skips the setup done by the first. FEDRAY_WHEEL:
# another build of fedray to check (ab.sh).
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${OUT:-reports}")
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
export PYTHONPATH=/tmp/site
if [ ! -e /tmp/site/.fedray-ready ]; then
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .devenv/site.tar.xz || exit 3
    touch /tmp/site/.fedray-ready
fi
# fedray itself: bundle.sh's wheel, or FEDRAY_WHEEL (ab.sh switches builds), installed when it changed
wheel=${FEDRAY_WHEEL:-$(ls .devenv/fedray-*.whl | head -1)}
[ -f "$wheel" ] || { echo "no wheel of fedray: '$wheel' (bundle.sh, or wheels.sh for FEDRAY_WHEEL)" >&2; exit 4; }
sum=$(sha1sum <"$wheel")
if [ "$(cat /tmp/site/.fedray-wheel 2>/dev/null)" != "$sum" ]; then
    rm -f /tmp/site/.fedray-wheel
    python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall "$wheel" || exit 4
    echo "$sum" >/tmp/site/.fedray-wheel
fi
python3 -c "import ray, mlflow, lightning, torch, sys; print(sys.executable, 'ray', ray.__version__, 'mlflow', mlflow.__version__, 'lightning', lightning.__version__, 'torch', torch.__version__, torch.cuda.is_available())" || exit 5
ls "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/fedray" || exit 6
echo "setup $(( $(date +%s) - t0 )) s"
PYTHONUNBUFFERED=1 timeout -s INT -k 30 "${BUDGET:-900}" python3 benchmarks/gpu_check.py --out "$OUT/gpu-check.md" --keep "$@" 2>&1 | tee "$OUT/gpu-check.log"
rc=$?
cd /tmp && tar -czf "$OUT/logs.tgz" fedray-gpu-check-*/logs 2>/dev/null
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader
echo "total $(( $(date +%s) - t0 )) s, gpu_check exit $rc"
exit $rc
