# Sourced by the benchmarks/h200_*.sh scripts: the results folder, unbuffered output, and the
# device machine's missing wheels (.whl/, from ../shared/device/wheels.sh) when carried.
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH  # ninja's, for FlashInfer's JIT
fi
# FlashInfer, pruned (benchmarks/flashinfer_bundle.py) when .fi is carried; its JIT builds (nvcc,
# minutes per kernel variant) under FLASHINFER_WORKSPACE_BASE for this machine's life
if [ -f .fi/flashinfer.tar.xz ] && [ ! -d /tmp/site/flashinfer ]; then
  mkdir -p /tmp/site && tar xJf .fi/flashinfer.tar.xz -C /tmp/site
fi
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} FLASHINFER_WORKSPACE_BASE=/tmp/fi
# Its built kernels travel too: save_fi_ws leaves /tmp/fi in $OUT as fi_ws.tgz (14 MB with the
# fa3 and fa2 variants the tests build); copied to .fi/ws/ here, ninja finds them up to date
# (the sources' times are the bundle's, older than the builds): they load without nvcc.
if [ -f .fi/ws/fi_ws.tgz ] && [ ! -d /tmp/fi ]; then tar xzf .fi/ws/fi_ws.tgz -C /tmp; fi
save_fi_ws() { [ -d /tmp/fi ] && tar czf "$OUT/fi_ws.tgz" -C /tmp fi; }
# Triton's cache travels between sessions: h200_suite.sh leaves it in $OUT as tcache.tgz.NN
# parts (<= 15 MB each, the device tool's per-file limit); copy them to .tcache/ here (git
# ignores it) and carry .tcache: kernels whose source did not change skip their compile.
export TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".tcache/tcache.tgz*" > /dev/null; then
  cat .tcache/tcache.tgz* | tar xzf - -C "$TRITON_CACHE_DIR" || echo "device_env: .tcache unreadable, compiling afresh"
fi
# The carried entries' access times go back to 1970: an entry this run reads (a hit) gets a
# new one (relatime updates an access time older than the file's change), one it compiles is
# new; save_tcache drops the rest (a kernel whose source changed never hits its old entries).
TCACHE_T0=$(date +%s)
find "$TRITON_CACHE_DIR" -type f -exec touch -a -d @1 {} + 2>/dev/null
TCACHE_MAX=${TCACHE_MAX:-42000000}  # bytes compressed: 3 parts, beside .whl (15 MB) and the tree
prune_tcache() {  # the entries (one folder per kernel variant) this run neither read nor wrote;
  # only where a carried entry shows a read (a filesystem mounted noatime would show none)
  local d hits=0 stale=()
  for d in "$TRITON_CACHE_DIR"/*/; do
    if [ -n "$(find "$d" -type f -newermt "@$TCACHE_T0" -print -quit)" ]; then continue; fi
    if [ -n "$(find "$d" -type f -newerat "@$TCACHE_T0" -print -quit)" ]; then
      hits=$((hits + 1))
    else
      stale+=("$d")
    fi
  done
  if [ "$hits" -gt 0 ]; then
    echo "device_env: Triton cache: ${#stale[@]} entries unused by this run dropped, $hits carried ones hit"
    rm -rf "${stale[@]}"
  else
    echo "device_env: Triton cache: no read seen (noatime?), nothing dropped"
  fi
}
save_tcache() {  # Triton's cache back in $OUT as tcache.tgz.NN parts of 15 MB, at most
  # TCACHE_MAX bytes: within the 8 files that come back and, with .whl, the 64 MiB that
  # travel. Only each kernel's cubin and metadata travel: a hit loads nothing else (Triton's
  # own TRITON_STORE_BINARY_ONLY mode), and the IR text (ttir, ttgir, llir, ptx, source) is
  # 4/5 of the cache: 324 MB -> 66 MB on disk, 43 -> 15 MB compressed. Entries this run did
  # not use are dropped first (prune_tcache).
  prune_tcache
  (cd "$TRITON_CACHE_DIR" \
    && find . -type f \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
      -o -name '*.source' \) -delete \
    && tar czf /tmp/tcache.tgz .) || return
  local size
  size=$(stat -c %s /tmp/tcache.tgz)
  if [ "$size" -ge "$TCACHE_MAX" ]; then
    echo "device_env: Triton cache $size bytes compressed, over TCACHE_MAX=$TCACHE_MAX: not saved"
    return
  fi
  split -b 15000000 -d /tmp/tcache.tgz "$OUT/tcache.tgz."
}
