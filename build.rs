//! Provides the kernels to the host crate: writes into `$OUT_DIR` the PTX of
//! every module (`flash_attn_sm75.ptx.zst`, `flash_attn_sm80.ptx.zst`,
//! `flash_attn_sm90.ptx.zst`, `flash_attn_sm90a.ptx.zst`, zstd frames embedded with
//! `include_bytes!` and unpacked by the host when it loads one), its manifest,
//! and the committed cubins (the `flash-attn-cubins` and
//! `flash-attn-cubins-hopper` packages, `kernels-cubin/` and
//! `kernels-cubin-hopper/` here, also zstd) that were assembled from exactly
//! that PTX (empty files for the others, whose GPUs then JIT the PTX).
//!
//! The PTX comes from the `flash-attn-kernels` package (`kernels-gpu/` here,
//! the unpacked crate for a crates.io user), one of two ways:
//! - **committed**: its `ptx/`, when the manifest records the hash of its
//!   current sources and the files match their recorded hashes;
//! - **source**: compiled from its sources by a nested cargo with a kernel
//!   toolchain (a rustc with `rust-src`, for `-Zbuild-std=core`).
//!
//! `FLASH_ATTN_PTX=committed|source` forces one. Unset, the committed PTX is
//! used when it is current (it is byte for byte what a source build makes:
//! CI checks that), and the sources are built when they were edited since,
//! if a kernel toolchain is found; stale PTX is never used silently.
//! The logic shared with the scripts lives in `flash_attn_kernels::artifacts`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

use flash_attn_kernels::artifacts::{self, CommittedError, PtxSet};

const MODE_VAR: &str = "FLASH_ATTN_PTX";
/// The manifest of the embedded PTX, beside it in `$OUT_DIR`.
const OUT_MANIFEST: &str = "ptx-manifest.json";
const SETUP_HINT: &str = "install the kernel toolchain (scripts/setup-kernel-toolchain.sh) so that \
     the PTX is built from the kernel sources, or refresh the committed PTX with scripts/update-ptx.sh";

fn main() {
    let package = Path::new(artifacts::PACKAGE_DIR);
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    artifacts::emit_rerun_directives(package);
    println!("cargo:rerun-if-env-changed={MODE_VAR}");

    let (ptx, origin) = match env::var(MODE_VAR).as_deref() {
        Err(env::VarError::NotPresent) | Ok("") => match artifacts::committed_ptx(package) {
            Ok(ptx) => (ptx, "committed"),
            Err(stale @ CommittedError::Stale { .. }) => match kernel_rustc() {
                Some(rustc) => (build_from_source(package, &out_dir, &rustc), "source"),
                None => panic!("{stale}; {SETUP_HINT}"),
            },
            Err(e) => panic!("{e}; {SETUP_HINT}"),
        },
        Ok("committed") => (committed_or_panic(package), "committed"),
        Ok("source") => {
            let rustc = kernel_rustc().unwrap_or_else(|| {
                panic!(
                    "{MODE_VAR}=source, but no kernel toolchain was found (a rustc with \
                     rust-src: ${}, /usr/bin/rustc with Debian's rust-web-src, or cargo's \
                     rustc with the rust-src component); run scripts/setup-kernel-toolchain.sh",
                    artifacts::KERNEL_RUSTC_VAR
                )
            });
            (build_from_source(package, &out_dir, &rustc), "source")
        }
        Ok(other) => panic!("{MODE_VAR}={other:?}: expected `source`, `committed` or unset"),
        Err(e) => panic!("{MODE_VAR}: {e}"),
    };
    println!("cargo:rustc-env=FLASH_ATTN_PTX_ORIGIN={origin}");
    for module in &ptx.modules {
        let name = artifacts::ptx_file_name(module.arch);
        write(
            &out_dir.join(format!("{name}{}", artifacts::ZST_SUFFIX)),
            &module.zst,
        );
    }
    write(
        &out_dir.join(OUT_MANIFEST),
        ptx.manifest.to_json().as_bytes(),
    );
    let cubins = [
        Path::new(flash_attn_cubins::CUBIN_DIR),
        Path::new(flash_attn_cubins_hopper::CUBIN_DIR),
    ];
    for dir in cubins {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    embed_cubins(&cubins, &out_dir, &ptx);
}

fn kernel_rustc() -> Option<PathBuf> {
    artifacts::find_kernel_rustc().unwrap_or_else(|e| panic!("{e}"))
}

fn committed_or_panic(package: &Path) -> PtxSet {
    artifacts::committed_ptx(package).unwrap_or_else(|e| panic!("{e}; {SETUP_HINT}"))
}

fn build_from_source(package: &Path, out_dir: &Path, rustc: &Path) -> PtxSet {
    // Another kernel rustc (say, after an apt upgrade) must rebuild the PTX.
    if rustc.is_absolute() {
        println!("cargo:rerun-if-changed={}", rustc.display());
    }
    // Inside OUT_DIR: the nested cargo never waits on the outer build's
    // target-dir lock, and later builds reuse it.
    let ptx = artifacts::build_ptx(package, rustc, &out_dir.join("kernels-target"))
        .unwrap_or_else(|report| {
            eprintln!("{report}");
            panic!(
                "building the kernels from source with {} failed (the nested cargo's output is above)",
                rustc.display()
            )
        });
    if !matches!(artifacts::committed_ptx(package), Ok(c) if c.manifest.ptx_sha256 == ptx.manifest.ptx_sha256)
    {
        println!(
            "cargo:warning=the committed PTX does not match the kernel sources; refresh it with \
             scripts/update-ptx.sh"
        );
    }
    ptx
}

/// Copies each committed cubin assembled from this build's PTX into OUT_DIR,
/// and an empty file for the others (the host then loads the PTX for that GPU).
fn embed_cubins(cubin_dirs: &[&Path], out_dir: &Path, ptx: &PtxSet) {
    let mut stale = Vec::new();
    for (name, zst) in artifacts::matching_cubins(cubin_dirs, ptx) {
        if zst.is_none() {
            stale.push(name);
        }
        write(
            &out_dir.join(format!("{name}{}", artifacts::ZST_SUFFIX)),
            &zst.unwrap_or_default(),
        );
    }
    // scripts/gpu-bundle.sh refuses a bundle on this warning's text.
    if !stale.is_empty() {
        println!(
            "cargo:warning=the committed cubins {stale:?} were not assembled from the embedded PTX; \
             those GPUs will JIT-compile the PTX on first use (refresh: scripts/update-cubins.sh)"
        );
    }
}

fn write(path: &Path, bytes: &[u8]) {
    fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}
