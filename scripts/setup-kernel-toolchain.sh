#!/usr/bin/env bash
# Installs what building the kernels from source and checking them needs.
# Idempotent: whatever is already there is kept.
#
#  - The kernel toolchain: a rustc (>= 1.96) whose sysroot has the standard
#    library source, for `-Zbuild-std=core` (rustup's nvptx64 target ships no
#    prebuilt core). On Debian/Ubuntu: apt's rustc-web + rust-web-src, which put
#    rustc in /usr/bin and the source in /usr/lib/rustlib/src/rust/library,
#    where build.rs finds them. With --rustup[=TOOLCHAIN] (or when apt is not
#    available): `rustup component add rust-src` for TOOLCHAIN (default stable).
#  - ptxas, from the PyPI wheel nvidia-cuda-nvcc, into
#    $FLASH_ATTN_TOOLS/nvcc (default ~/.cache/flash-attn-tools), unless
#    scripts/ptxas.sh already finds one.
#  - the `zstd` command (apt), which packs and unpacks the committed PTX and
#    cubins (scripts/artifact-zst.sh).
#
# Note: the committed PTX is built with apt's rustc-web 1.96 on Debian bookworm
# (bookworm-security); another rustc version generally emits different PTX, so
# `scripts/update-ptx.sh --check` would then report a difference.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

MIN_RUSTC_MINOR=96 # rustc 1.96
NVCC_WHEEL="nvidia-cuda-nvcc==13.*"
TOOLS="${FLASH_ATTN_TOOLS:-$HOME/.cache/flash-attn-tools}"
DEBIAN_RUST_SRC=/usr/lib/rustlib/src/rust/library

rustup_toolchain=""
for arg in "$@"; do
    case "$arg" in
    --rustup) rustup_toolchain=stable ;;
    --rustup=*) rustup_toolchain="${arg#--rustup=}" ;;
    -h | --help)
        sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "usage: $0 [--rustup[=TOOLCHAIN]]" >&2
        exit 2
        ;;
    esac
done

log() { echo "setup-kernel-toolchain: $*"; }
die() {
    echo "setup-kernel-toolchain: error: $*" >&2
    exit 1
}

# Root commands go through sudo when not root (and sudo exists).
sudo=""
if [[ "$(id -u)" -ne 0 ]] && command -v sudo >/dev/null; then
    sudo="sudo"
fi

have_apt() { command -v apt-get >/dev/null && command -v dpkg-query >/dev/null; }

# True when `rustc -V` of $1 reports at least 1.$MIN_RUSTC_MINOR.
rustc_is_recent() {
    local version
    version=$("$1" -V 2>/dev/null | awk '{print $2}') || return 1
    local major minor
    IFS=. read -r major minor _ <<<"$version"
    [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]] || return 1
    ((major > 1 || (major == 1 && minor >= MIN_RUSTC_MINOR)))
}

# apt-get install [--no-install-recommends] of the packages not yet installed.
# `apt-get update` runs only when the package lists do not know a package, or
# when an install fails on stale lists.
apt_install() {
    local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q)
    if [[ "${1:-}" == --no-install-recommends ]]; then
        install+=("$1")
        shift
    fi
    local missing=() pkg
    for pkg in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
            missing+=("$pkg")
        fi
    done
    ((${#missing[@]} > 0)) || return 0
    if [[ -n "$sudo" ]]; then
        install=("$sudo" "${install[@]}")
    fi
    if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        log "apt-get update"
        $sudo apt-get update -q
    fi
    log "apt-get install ${missing[*]}"
    if ! "${install[@]}" "${missing[@]}"; then
        log "install failed; retrying after apt-get update"
        $sudo apt-get update -q
        "${install[@]}" "${missing[@]}"
    fi
}

# Sets kernel_rustc.
install_rust_apt() {
    if [[ ! -d "$DEBIAN_RUST_SRC" ]] || ! rustc_is_recent /usr/bin/rustc; then
        # With recommends (cargo-web, rust-web-llvm), as the committed PTX was built.
        apt_install rustc-web rust-web-src
        # apt_install leaves installed packages alone; an old rustc-web is upgraded.
        if ! rustc_is_recent /usr/bin/rustc; then
            log "upgrading rustc-web and rust-web-src"
            $sudo apt-get update -q
            $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q rustc-web rust-web-src
        fi
    fi
    [[ -d "$DEBIAN_RUST_SRC" ]] || die "apt installed rust-web-src, but $DEBIAN_RUST_SRC is missing"
    rustc_is_recent /usr/bin/rustc ||
        die "/usr/bin/rustc is $(/usr/bin/rustc -V); 1.$MIN_RUSTC_MINOR or newer is needed (on Debian bookworm it comes from bookworm-security: is it in the apt sources?)"
    kernel_rustc=/usr/bin/rustc
}

# Sets kernel_rustc.
install_rust_rustup() {
    local toolchain="$1"
    command -v rustup >/dev/null || die "rustup not found"
    if ! rustup run "$toolchain" rustc -V >/dev/null 2>&1; then
        log "rustup toolchain install $toolchain"
        rustup toolchain install --profile minimal "$toolchain"
    fi
    kernel_rustc=$(rustup which --toolchain "$toolchain" rustc)
    rustc_is_recent "$kernel_rustc" ||
        die "$kernel_rustc is $("$kernel_rustc" -V); 1.$MIN_RUSTC_MINOR or newer is needed (pass --rustup=TOOLCHAIN)"
    log "rustup component add rust-src --toolchain $toolchain"
    rustup component add rust-src --toolchain "$toolchain"
}

ensure_python_pip() {
    if command -v python3 >/dev/null && python3 -m pip --version >/dev/null 2>&1; then
        return 0
    fi
    have_apt || die "python3 with pip is needed to install ptxas"
    apt_install --no-install-recommends python3 python3-pip
}

# Sets ptxas.
install_ptxas() {
    if ptxas=$(scripts/ptxas.sh 2>/dev/null); then
        return 0
    fi
    ensure_python_pip
    log "pip install $NVCC_WHEEL into $TOOLS/nvcc"
    mkdir -p "$TOOLS"
    # --target installs outside any Python environment (so PEP 668's
    # externally-managed check does not apply); --no-deps: ptxas is
    # self-contained, the wheel's dependencies are not needed.
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
        --only-binary=:all: --upgrade --target "$TOOLS/nvcc" "$NVCC_WHEEL"
    ptxas=$(FLASH_ATTN_TOOLS="$TOOLS" scripts/ptxas.sh) || die "installed $NVCC_WHEEL, but found no ptxas in it"
}

install_zstd() {
    command -v zstd >/dev/null && return 0
    have_apt || die "the zstd command is needed (scripts/artifact-zst.sh); install it"
    apt_install --no-install-recommends zstd
}

kernel_rustc=""
if [[ -n "${FLASH_ATTN_KERNEL_RUSTC:-}" ]]; then
    # build.rs checks that this rustc has rust-src.
    kernel_rustc="$FLASH_ATTN_KERNEL_RUSTC"
    log "using FLASH_ATTN_KERNEL_RUSTC=$kernel_rustc"
elif [[ -n "$rustup_toolchain" ]]; then
    install_rust_rustup "$rustup_toolchain"
elif have_apt; then
    install_rust_apt
else
    install_rust_rustup stable
fi

install_ptxas
install_zstd

echo
echo "kernel rustc: $kernel_rustc ($("$kernel_rustc" -V))"
echo "ptxas:        $ptxas ($("$ptxas" --version | tail -n 1))"
if [[ "$kernel_rustc" != /usr/bin/rustc && -z "${FLASH_ATTN_KERNEL_RUSTC:-}" ]]; then
    echo "build.rs finds this rustc when it is the one cargo uses; otherwise run"
    echo "  export FLASH_ATTN_KERNEL_RUSTC=$kernel_rustc"
fi
if [[ "$ptxas" == "$TOOLS"/* && -n "${FLASH_ATTN_TOOLS:-}" ]]; then
    echo "scripts/ptxas.sh finds it while FLASH_ATTN_TOOLS=$FLASH_ATTN_TOOLS is set (or export PTXAS=$ptxas)"
fi
