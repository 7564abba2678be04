#!/usr/bin/env bash
# Builds the GPU test, CPU test, benchmark (bench, bench-backward) and example
# binaries (release) and puts them in DIR with run-tests.sh and run-bench.sh,
# so they run on a GPU host that has no Rust toolchain:
#   scripts/gpu-bundle.sh bundle && (cd bundle && ./run-tests.sh && ./run-bench.sh --quick)
# With --candle, also the candle integration's tests, training bench and
# example (candle-tests, bench-candle_training, example-candle_llama_attention),
# built with nvcc from
# scripts/setup-candle-cuda.sh for CUDA_COMPUTE_CAP (default 90).
# Refuses to bundle binaries whose committed cubins were not assembled from
# the embedded PTX (the GPU host would JIT-compile the whole module on first
# use, minutes of device time): run scripts/update-cubins.sh first, or set
# FLASH_ATTN_BUNDLE_JIT=1 to bundle anyway.
set -euo pipefail
dir=${1:?usage: scripts/gpu-bundle.sh DIR [--candle]}
candle=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
cd "$root"


log=$(mktemp)
trap 'rm -f "$log"' EXIT

build() {
  cargo test --release --no-run --message-format=json-render-diagnostics --test gpu --test cpu
  cargo bench --no-run --message-format=json-render-diagnostics --bench attention --bench backward
  cargo build --release --message-format=json-render-diagnostics --examples
  if [ "$candle" = --candle ]; then
    (
      eval "$(scripts/setup-candle-cuda.sh)"
      export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP_GPU:-90}"
      cargo test --release --no-run --features candle --message-format=json-render-diagnostics --test candle
      cargo bench --no-run --features candle --message-format=json-render-diagnostics --bench candle_training
      cargo build --release --features candle --message-format=json-render-diagnostics \
        --example candle_llama_attention
    )
  fi
}

# Once for the build's messages (shown, and kept to check for the warning
# of build.rs's `embed_cubins`: keep the two texts in step), once (nothing
# left to build) for the executables' paths.
build 2>&1 >/dev/null | tee "$log" >&2
if grep -q "were not assembled from the embedded PTX" "$log" && [ "${FLASH_ATTN_BUNDLE_JIT:-0}" != 1 ]; then
  echo "gpu-bundle: the binaries would embed stale cubins (see the warning above): run" \
    "scripts/update-cubins.sh and bundle again, or set FLASH_ATTN_BUNDLE_JIT=1" >&2
  exit 1
fi
build 2>/dev/null | python3 scripts/cargo-executables.py | while read -r name exe; do
  case "$name" in
    gpu) cp "$exe" "$dir/gpu-tests" ;;
    cpu) cp "$exe" "$dir/cpu-tests" ;;
    candle) cp "$exe" "$dir/candle-tests" ;;
    attention) cp "$exe" "$dir/bench" ;;
    backward) cp "$exe" "$dir/bench-backward" ;;
    candle_training) cp "$exe" "$dir/bench-candle_training" ;;
    *) cp "$exe" "$dir/example-$name" ;;
  esac
done

cat > "$dir/run-tests.sh" <<'SH'
#!/usr/bin/env bash
# GPU test suite (libtest-mimic; arguments are passed through, e.g. --test-threads 4).
set -euo pipefail
cd "$(dirname "$0")"
./gpu-tests "$@"
SH
cat > "$dir/run-bench.sh" <<'SH'
#!/usr/bin/env bash
# Benchmarks; JSON lines go to ${BENCH_JSON:-./flash-attn-bench.jsonl}. Arguments
# are passed through (--filter SUBSTR, --quick).
set -euo pipefail
cd "$(dirname "$0")"
./bench --json "${BENCH_JSON:-$PWD/flash-attn-bench.jsonl}" "$@"
SH
chmod +x "$dir"/run-tests.sh "$dir"/run-bench.sh
ls -l "$dir"
