# Sourced by the benchmarks/h200_*.sh scripts: the results folder, unbuffered output, and the
# device machine's missing wheels (.whl/, from ../shared/device/wheels.sh) when carried.
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
