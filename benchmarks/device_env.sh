# Sourced by the benchmarks/h200_*.sh scripts: the results folder, unbuffered output, and the
# device machine's missing wheels (.whl/, from ../shared/device/wheels.sh) when carried.
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# Triton's cache travels between sessions: h200_suite.sh leaves it in $OUT as tcache.tgz.NN
# parts (<= 15 MB each, the device tool's per-file limit); copy them to .tcache/ here (git
# ignores it) and carry .tcache: kernels whose source did not change skip their compile.
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".tcache/tcache.tgz*" > /dev/null; then
  cat .tcache/tcache.tgz* | tar xzf - -C "$TRITON_CACHE_DIR" || echo "device_env: .tcache unreadable, compiling afresh"
fi
save_tcache() {  # Triton's cache back in $OUT as tcache.tgz.NN parts: at most 4 of 15 MB,
  # within the 8 files that come back and, with .whl, the 64 MiB that travel. Only each
  # kernel's cubin and metadata travel: a hit loads nothing else (Triton's own
  # TRITON_STORE_BINARY_ONLY mode), and the IR text (ttir, ttgir, llir, ptx, source) is
  # 4/5 of the cache: 324 MB -> 66 MB on disk, 43 -> 15 MB compressed (the one carried
  # since 2026-12-01).
  (cd "$TRITON_CACHE_DIR" \
    && find . -type f \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
      -o -name '*.source' \) -delete \
    && tar czf /tmp/tcache.tgz .) \
    && [ "$(stat -c %s /tmp/tcache.tgz)" -lt 55000000 ] && split -b 15000000 -d /tmp/tcache.tgz "$OUT/tcache.tgz."
}
