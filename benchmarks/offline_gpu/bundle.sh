#!/bin/bash
# Packs what `make gpu-check` needs onto a GPU machine that has no package registry but an image
# with Python 3.12, torch and lightning (the lent H100/H200 machines): everything else fedray imports,
# at the versions of this checkout's .venv, as one stripped site folder (.devenv/site.tar.xz, about
# 38 MB), plus fedray itself as a wheel. Run it here after `make install` (it reads .venv's versions);
# then, on that machine, from the repository root:
#     bash benchmarks/offline_gpu/run.sh [gpu_check.py options]      (carry .devenv and .data)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=${PYVER:-3.12}
OUT=.devenv
# what fedray needs beyond such an image (ray without its Java jars, RLlib and LLM parts; mlflow
# without its UI's JavaScript; the dashboard's extras are not needed: fedray starts Ray without it)
CARRY="alembic annotated-types blinker cachetools cffi cryptography databricks-sdk docker
fastapi Flask flask-cors Flask-WTF gitdb GitPython googleapis-common-protos graphene graphql-core
graphql-relay gunicorn huey importlib_metadata itsdangerous jsonschema jsonschema-specifications Mako
mlflow mlflow-skinny mlflow-tracing opentelemetry-api opentelemetry-exporter-prometheus
opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions prettytable protobuf
pycparser pydantic pydantic_core python-dotenv ray referencing rpds-py skops smmap SQLAlchemy sqlparse
starlette tensorboardX typing-inspection uvicorn wcwidth WTForms"
pins=$(.venv/bin/pip list --format=freeze 2>/dev/null | python3 -c "
import re, sys
want = {re.sub(r'[-_.]+', '-', n.lower()) for n in sys.argv[1].split()}
for line in sys.stdin:
    name = line.split('==')[0]
    if re.sub(r'[-_.]+', '-', name.lower()) in want:
        print(line.strip())
" "$CARRY")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=""
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version "$PYVER" \
    --implementation cp $platforms --target "$work/site" $pins
cd "$work/site"
rm -rf ray/jars ray/rllib ray/llm ray/dashboard/client/build/static/js/*.map mlflow/server/js/build
strip --strip-unneeded ray/_raylet.so
strip ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet
find . -name __pycache__ -prune -exec rm -rf {} +
cd - >/dev/null
mkdir -p "$OUT"
tar -C "$work/site" -cf - . | xz -T0 -8 >"$OUT/site.tar.xz"
rm -f "$OUT"/fedray-*.whl
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$OUT" . >/dev/null
rm -rf build
ls -la "$OUT"
