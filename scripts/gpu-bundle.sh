#!/usr/bin/env bash
# Builds the GPU test, CPU test, benchmark and example binaries (release) and
# puts them in DIR with run-tests.sh and run-bench.sh, so they run on a GPU host
# that has no Rust toolchain:
#   scripts/gpu-bundle.sh bundle && (cd bundle && ./run-tests.sh && ./run-bench.sh --quick)
set -euo pipefail
dir=${1:?usage: scripts/gpu-bundle.sh DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
cd "$root"

# Prints "<target name> <executable>" for every executable cargo produced.
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
'
}

{
  cargo test --release --no-run --message-format=json-render-diagnostics --test gpu --test cpu
  cargo bench --no-run --message-format=json-render-diagnostics --bench attention
  cargo build --release --message-format=json-render-diagnostics --examples
} | executables | while read -r name exe; do
  case "$name" in
    gpu) cp "$exe" "$dir/gpu-tests" ;;
    cpu) cp "$exe" "$dir/cpu-tests" ;;
    attention) cp "$exe" "$dir/bench" ;;
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
