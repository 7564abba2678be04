#!/usr/bin/env bash
# Prints the path of the ptxas to use, or fails with a hint. In order:
#   $PTXAS; `ptxas` on PATH; the one scripts/setup-kernel-toolchain.sh installed
#   under $FLASH_ATTN_TOOLS/nvcc (default ~/.cache/flash-attn-tools);
#   /usr/local/cuda/bin/ptxas.
# Usage: ptxas=$(scripts/ptxas.sh)
set -euo pipefail

tools="${FLASH_ATTN_TOOLS:-$HOME/.cache/flash-attn-tools}"

if [[ -n "${PTXAS:-}" ]]; then
    if ! command -v "$PTXAS"; then
        echo "ptxas.sh: PTXAS=$PTXAS is not an executable" >&2
        exit 1
    fi
    exit 0
fi

if command -v ptxas; then
    exit 0
fi

# The nvidia-cuda-nvcc wheel puts it at nvidia/cu<major>/bin/ptxas; take the
# newest if several are installed.
if [[ -d "$tools/nvcc" ]]; then
    found=$(find "$tools/nvcc" -path '*/bin/ptxas' -type f | sort -V | tail -n 1)
    if [[ -n "$found" ]]; then
        # Some unpackers drop the executable bit.
        [[ -x "$found" ]] || chmod +x "$found"
        echo "$found"
        exit 0
    fi
fi

if [[ -x /usr/local/cuda/bin/ptxas ]]; then
    echo /usr/local/cuda/bin/ptxas
    exit 0
fi

echo "ptxas.sh: no ptxas found (set PTXAS, put ptxas on PATH, or run scripts/setup-kernel-toolchain.sh)" >&2
exit 1
