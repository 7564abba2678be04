#!/usr/bin/env bash
# The committed PTX and cubins are zstd frames (flash_attn_kernels::artifacts).
#
#   scripts/artifact-zst.sh pack FILE ZST     write FILE into ZST as a zstd frame, unless
#                                             ZST already unpacks to FILE's bytes (so a
#                                             refresh that changes nothing leaves no diff)
#   scripts/artifact-zst.sh unpack ZST FILE   write the bytes ZST holds into FILE
#   scripts/artifact-zst.sh same FILE ZST     exit 0 if ZST unpacks to FILE's bytes, else 1
#
# Level 19 with long-distance matching: the repeats between kernels of one
# module lie further apart than level 19's own 8 MiB window. Each file is one
# frame (the build script and the host read one frame and refuse anything
# after it) whose window is its own size, which they unpack with the ruzstd
# crate. Do not raise --long above 27: ruzstd refuses windows over 128 MiB.
set -euo pipefail

usage() {
    sed -n '4,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
command -v zstd >/dev/null || {
    echo "artifact-zst: the zstd command is needed (scripts/setup-kernel-toolchain.sh installs it)" >&2
    exit 1
}
same() {
    [[ -f "$2" ]] &&
        zstd -lv -- "$2" 2>/dev/null | grep -qx '# Zstandard Frames: 1' &&
        zstd -dcq -- "$2" 2>/dev/null | cmp -s - "$1"
}

(($# == 3)) || usage
case "$1" in
pack) same "$2" "$3" || zstd -q -f --single-thread -19 --long=27 -o "$3" -- "$2" ;;
unpack) zstd -dq -f -o "$3" -- "$2" ;;
same) same "$2" "$3" ;;
*) usage ;;
esac
