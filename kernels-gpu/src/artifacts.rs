//! The kernels' build artifacts, on the host (feature `build`): where this
//! package keeps its committed PTX and how it and the cubins are checked, how
//! the PTX is built from these sources, and the toolchain that builds it.
//! flash-attn's build.rs is the caller; nothing here runs on a GPU.
//!
//! Files:
//! - this package's `ptx/flash_attn_sm{75,80,90,90a}.ptx.zst` and
//!   `ptx/manifest.json` ([`PtxManifest`]): written by
//!   `scripts/update-ptx.sh` from a source build; CI rebuilds and compares.
//! - the `flash-attn-cubins` (Turing to Ada) and `flash-attn-cubins-hopper`
//!   packages' `cubin/*.cubin.zst` and `cubin/manifest.json`: assembled from
//!   that PTX by `scripts/update-cubins.sh` with pinned ptxas versions.
//!
//! Every artifact is stored as a zstd frame ([`ZST_SUFFIX`]; level 19 with
//! long-distance matching, `scripts/artifact-zst.sh`) and embedded as one:
//! 113 MB of PTX and cubins take 8.8 MB, against 23 MB as gzip in the
//! `.crate` files, whose 32 KiB window cannot reach the repeats between
//! kernels. xz (preset 9e) packs them into 7.3 MB but unpacks about 3x
//! slower, which every `FlashAttention::new` would pay (docs/perf-notes.md,
//! v69). The manifests hash the unpacked bytes.

extern crate std;

use std::collections::BTreeMap;
use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::string::{String, ToString};
use std::vec::Vec;
use std::{format, println, vec};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::config::{Entry, PtxArch};

/// This package's directory: `kernels-gpu/` of a checkout, or the unpacked
/// crate in cargo's registry cache. Both hold the sources and the artifacts.
pub const PACKAGE_DIR: &str = env!("CARGO_MANIFEST_DIR");
/// Committed PTX, relative to [`PACKAGE_DIR`].
pub const PTX_DIR: &str = "ptx";
/// The manifest file name in [`PTX_DIR`] and in the cubin directory.
pub const MANIFEST: &str = "manifest.json";
/// Names the rustc that builds the kernels, overriding the search.
pub const KERNEL_RUSTC_VAR: &str = "FLASH_ATTN_KERNEL_RUSTC";
/// This module builds and checks the PTX but is not part of it; it is left
/// out of [`source_hash`] so that editing it does not mark the committed PTX
/// stale. A change here that changes the PTX bytes is caught where every
/// such change is: CI's rebuild-and-compare (`scripts/update-ptx.sh --check`).
const THIS_FILE: &str = "src/artifacts.rs";
const PTX_TARGET: &str = "nvptx64-nvidia-cuda";
/// Where Debian's `rust-web-src` (with `rustc-web`) puts the library source.
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_RUST_SRC: &str = "/usr/lib/rustlib/src/rust/library";
/// LLVM's default is 225. Every closure of the unrolled fragment loops must be
/// inlined: one left as a call takes the address of the warp's accumulator
/// arrays, which then live in local memory; the default leaves some calls in
/// the largest kernels, depending on what else the module holds.
const INLINE_THRESHOLD: u32 = 10_000;

/// What every committed and embedded artifact's name ends with: the file
/// holds a zstd frame of the named file.
pub const ZST_SUFFIX: &str = ".zst";

/// `flash_attn_sm80.ptx` for `Sm80`: the name in the manifests; with
/// [`ZST_SUFFIX`], the file in [`PTX_DIR`] and in `OUT_DIR`.
pub fn ptx_file_name(arch: PtxArch) -> String {
    format!("flash_attn_{}.ptx", arch.target_cpu().replace('_', ""))
}

/// The cubins the host embeds: (file name, the PTX module it is assembled from).
pub const CUBINS: [(&str, PtxArch); 8] = [
    ("flash_attn_sm75.cubin", PtxArch::Sm75),
    ("flash_attn_sm80.cubin", PtxArch::Sm80),
    ("flash_attn_sm86.cubin", PtxArch::Sm80),
    ("flash_attn_sm89.cubin", PtxArch::Sm80),
    ("flash_attn_sm90.cubin", PtxArch::Sm90),
    ("flash_attn_sm90.cu13.cubin", PtxArch::Sm90),
    ("flash_attn_sm90a.cubin", PtxArch::Sm90a),
    ("flash_attn_sm90a.cu13.cubin", PtxArch::Sm90a),
];

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))
}

/// Capacity [`unzstd`] reserves from a frame header's recorded size at
/// most: above any module (the largest, sm_90a's PTX, is 28 MB), so a
/// corrupt header cannot make the allocation fail.
const UNPACK_RESERVE_LIMIT: usize = 1 << 28;

/// The bytes the zstd frame `zst` holds. An error if anything follows the
/// frame (the host reads one) or if its header records another size than
/// it holds (the host reserves what the header records).
pub fn unzstd(zst: &[u8]) -> Result<Vec<u8>, String> {
    let not_zstd = |e: &dyn core::fmt::Display| format!("not a zstd frame: {e}");
    let mut frame = ruzstd::decoding::StreamingDecoder::new(zst).map_err(|e| not_zstd(&e))?;
    let recorded = frame.decoder.content_size();
    let mut out = Vec::with_capacity((recorded as usize).min(UNPACK_RESERVE_LIMIT));
    std::io::Read::read_to_end(&mut frame, &mut out).map_err(|e| not_zstd(&e))?;
    if !frame.into_inner().is_empty() {
        return Err("more than one zstd frame".to_string());
    }
    if recorded != 0 && recorded != out.len() as u64 {
        return Err(format!(
            "the frame records {recorded} bytes but holds {}",
            out.len()
        ));
    }
    Ok(out)
}

/// `bytes` as a zstd frame of raw (uncompressed) blocks: how a source build
/// embeds its PTX. Compressing at level 19 takes half a minute, which kernel
/// work would pay on every rebuild.
pub fn zstd_stored(bytes: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Uncompressed)
}

/// Reads `dir/name` + [`ZST_SUFFIX`]: (the frame, the bytes it unpacks to).
fn read_zst(dir: &Path, name: &str) -> Result<(Vec<u8>, Vec<u8>), String> {
    let path = dir.join(format!("{name}{ZST_SUFFIX}"));
    let zst = read(&path)?;
    let bytes = unzstd(&zst).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((zst, bytes))
}

// ---------------------------------------------------------------------------
// Source hash and manifests
// ---------------------------------------------------------------------------

/// sha256 over the device sources, `src/**` of this package except this
/// module: each file contributes its `/`-separated path relative to the
/// package, a NUL, its contents and a NUL, in path order. `Cargo.toml` is not
/// hashed because `cargo package` rewrites it (the hash must be the same in a
/// checkout and in the published crate); the build recipe (flags, profile)
/// lives in this module, outside the hash, for the reason given at `THIS_FILE`.
pub fn source_hash(package_dir: &Path) -> Result<String, String> {
    let mut files = Vec::new();
    collect_files(package_dir, Path::new("src"), &mut files)?;
    files.retain(|f| f != THIS_FILE);
    files.sort();
    let mut hasher = Sha256::new();
    for rel in &files {
        hasher.update(rel.as_bytes());
        hasher.update([0]);
        hasher.update(read(&package_dir.join(rel))?);
        hasher.update([0]);
    }
    Ok(hex(&hasher.finalize()))
}

fn collect_files(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), String> {
    let entries = fs::read_dir(root.join(dir))
        .map_err(|e| format!("reading {}: {e}", root.join(dir).display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("reading {}: {e}", dir.display()))?;
        let rel = dir.join(entry.file_name());
        let is_dir = entry
            .file_type()
            .map_err(|e| format!("{}: {e}", rel.display()))?
            .is_dir();
        if is_dir {
            collect_files(root, &rel, out)?;
        } else {
            let rel = rel
                .to_str()
                .ok_or_else(|| format!("non-UTF-8 path {}", rel.display()))?;
            out.push(rel.replace('\\', "/"));
        }
    }
    Ok(())
}

/// `ptx/manifest.json`: what the PTX was built from and the hash of each file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PtxManifest {
    /// [`source_hash`] of the sources the PTX was built from.
    pub source_hash: String,
    /// `rustc -V` of the kernel toolchain that built it.
    pub rustc: String,
    /// PTX file name -> sha256 of its contents.
    pub ptx_sha256: BTreeMap<String, String>,
}

impl PtxManifest {
    /// Pretty JSON with sorted keys and a trailing newline (byte-stable, so
    /// CI compares the committed manifest with a rebuilt one by bytes).
    pub fn to_json(&self) -> String {
        let value = json!({
            "about": "PTX of flash-attn-kernels built from src/** (source_hash); \
                      refresh with scripts/update-ptx.sh",
            "source_hash": self.source_hash,
            "rustc": self.rustc,
            "ptx_sha256": self.ptx_sha256,
        });
        serde_json::to_string_pretty(&value).expect("a JSON value serialises") + "\n"
    }

    /// Reads what [`PtxManifest::to_json`] writes.
    pub fn from_json(text: &str) -> Result<PtxManifest, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let field = |key: &str| {
            value[key]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("no string `{key}`"))
        };
        let ptx_sha256 = value["ptx_sha256"]
            .as_object()
            .ok_or("no object `ptx_sha256`")?
            .iter()
            .map(|(name, hash)| {
                let hash = hash
                    .as_str()
                    .ok_or(format!("`ptx_sha256.{name}` is not a string"))?;
                Ok((name.clone(), hash.to_string()))
            })
            .collect::<Result<_, String>>()?;
        Ok(PtxManifest {
            source_hash: field("source_hash")?,
            rustc: field("rustc")?,
            ptx_sha256,
        })
    }
}

/// The PTX of every [`PtxArch::ALL`] module, in that order, with its manifest.
#[derive(Clone, Debug)]
pub struct PtxSet {
    /// What it was built from and the files' hashes.
    pub manifest: PtxManifest,
    /// One per module.
    pub modules: Vec<PtxModule>,
}

/// One module's PTX, as the zstd frame to embed: the committed file (checked
/// against the manifest), or [`zstd_stored`] for a source build.
#[derive(Clone, Debug)]
pub struct PtxModule {
    /// The target it was built for.
    pub arch: PtxArch,
    /// The zstd frame of the PTX text.
    pub zst: Vec<u8>,
}

/// Why the committed PTX cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommittedError {
    /// Built from other sources than the ones in this package: a kernel edit
    /// without `scripts/update-ptx.sh`. A kernel toolchain can rebuild it.
    Stale {
        /// The manifest's `source_hash`.
        recorded: String,
        /// [`source_hash`] of the sources now.
        actual: String,
    },
    /// Missing, unreadable, or not what the manifest records.
    Broken(String),
}

impl core::fmt::Display for CommittedError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            CommittedError::Stale { recorded, actual } => write!(
                f,
                "the committed PTX of flash-attn-kernels ({PTX_DIR}/) is stale: it was built from kernel sources \
                 with hash {recorded}, but src/** now hashes to {actual}"
            ),
            CommittedError::Broken(why) => write!(f, "the committed PTX is unusable: {why}"),
        }
    }
}

/// The committed PTX of the package at `package_dir`, after checking that it
/// was built from the package's current sources and is what the manifest
/// records, byte for byte.
pub fn committed_ptx(package_dir: &Path) -> Result<PtxSet, CommittedError> {
    let dir = package_dir.join(PTX_DIR);
    let broken = CommittedError::Broken;
    let text = String::from_utf8(read(&dir.join(MANIFEST)).map_err(broken)?)
        .map_err(|e| broken(format!("{PTX_DIR}/{MANIFEST}: {e}")))?;
    let manifest = PtxManifest::from_json(&text)
        .map_err(|e| broken(format!("{PTX_DIR}/{MANIFEST} is corrupt: {e}")))?;
    let actual = source_hash(package_dir).map_err(broken)?;
    if manifest.source_hash != actual {
        return Err(CommittedError::Stale {
            recorded: manifest.source_hash,
            actual,
        });
    }
    let mut modules = Vec::new();
    for arch in PtxArch::ALL {
        let name = ptx_file_name(arch);
        let (zst, bytes) = read_zst(&dir, &name).map_err(broken)?;
        let recorded = manifest
            .ptx_sha256
            .get(&name)
            .map_or("none", String::as_str);
        let hash = sha256_hex(&bytes);
        if recorded != hash {
            return Err(broken(format!(
                "{PTX_DIR}/{name}{ZST_SUFFIX} unpacks to sha256 {hash}, but {MANIFEST} records {recorded}"
            )));
        }
        std::str::from_utf8(&bytes).map_err(|e| broken(format!("{name}: {e}")))?;
        modules.push(PtxModule { arch, zst });
    }
    Ok(PtxSet { manifest, modules })
}

/// Each of [`CUBINS`] with its zstd frame if the committed cubin in the first
/// of `dirs` (the cubin packages') whose `manifest.json` lists it is intact
/// and was assembled from the PTX in `ptx` (by the hashes in that
/// manifest), else `None`: a kernel edit never runs stale machine code.
pub fn matching_cubins(dirs: &[&Path], ptx: &PtxSet) -> Vec<(&'static str, Option<Vec<u8>>)> {
    let manifests: Vec<(&Path, Value)> = dirs
        .iter()
        .map(|&dir| {
            let manifest = fs::read(dir.join(MANIFEST))
                .ok()
                .and_then(|t| serde_json::from_slice(&t).ok())
                .unwrap_or(Value::Null);
            (dir, manifest)
        })
        .collect();
    CUBINS
        .iter()
        .map(|&(name, arch)| {
            let Some((dir, entry)) = manifests
                .iter()
                .map(|(dir, m)| (*dir, &m["cubins"][name]))
                .find(|(_, e)| !e.is_null())
            else {
                return (name, None);
            };
            let ptx_name = ptx_file_name(arch);
            let ptx_matches = entry["ptx"].as_str() == Some(&*ptx_name)
                && ptx
                    .manifest
                    .ptx_sha256
                    .get(&ptx_name)
                    .is_some_and(|h| entry["ptx_sha256"].as_str() == Some(h));
            if !ptx_matches {
                return (name, None);
            }
            let zst = read_zst(dir, name)
                .ok()
                .filter(|(_, b)| entry["sha256"].as_str() == Some(&*sha256_hex(b)))
                .map(|(zst, _)| zst);
            (name, zst)
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Kernel toolchain and the source build
// ---------------------------------------------------------------------------

/// The rustc to build the kernels with: `$FLASH_ATTN_KERNEL_RUSTC` (an error
/// if it has no `rust-src`), else Debian's `rustc-web` with `rust-web-src`
/// (what `scripts/setup-kernel-toolchain.sh` installs), else `$RUSTC` or
/// `rustc` if its sysroot has `rust-src`; `Ok(None)` when there is none.
pub fn find_kernel_rustc() -> Result<Option<PathBuf>, String> {
    // An explicit choice that does not work is an error, not a silent fallback.
    if let Some(rustc) = env::var_os(KERNEL_RUSTC_VAR).filter(|v| !v.is_empty()) {
        let rustc = PathBuf::from(rustc);
        return if has_rust_src(&rustc) {
            Ok(Some(rustc))
        } else {
            Err(format!(
                "{KERNEL_RUSTC_VAR}={}: its sysroot has no lib/rustlib/src/rust/library \
                 (rust-src), which -Zbuild-std=core needs",
                rustc.display()
            ))
        };
    }
    if Path::new(DEBIAN_RUST_SRC).is_dir() && Path::new(DEBIAN_RUSTC).is_file() {
        return Ok(Some(PathBuf::from(DEBIAN_RUSTC)));
    }
    let rustc = PathBuf::from(env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()));
    Ok(has_rust_src(&rustc).then_some(rustc))
}

fn has_rust_src(rustc: &Path) -> bool {
    let Ok(out) = Command::new(rustc).args(["--print", "sysroot"]).output() else {
        return false;
    };
    let sysroot = String::from_utf8_lossy(&out.stdout).trim().to_string();
    out.status.success()
        && Path::new(&sysroot)
            .join("lib/rustlib/src/rust/library")
            .is_dir()
}

fn rustc_version(rustc: &Path) -> Result<String, String> {
    let out = Command::new(rustc)
        .arg("-V")
        .output()
        .map_err(|e| format!("running {} -V: {e}", rustc.display()))?;
    if !out.status.success() {
        return Err(format!("{} -V failed", rustc.display()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Builds the PTX of every module from the sources in `package_dir` with
/// `rustc`, each in its own target dir under `target_root` (the modules build
/// in parallel: each is mostly one single-threaded compilation of `core` and
/// of the fat-LTO kernel crate). On failure: the first module's nested cargo
/// output and command line (the modules usually fail alike).
pub fn build_ptx(package_dir: &Path, rustc: &Path, target_root: &Path) -> Result<PtxSet, String> {
    let results: Vec<Result<String, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = PtxArch::ALL
            .iter()
            .map(|&arch| {
                let target_dir = target_root.join(arch.target_cpu());
                s.spawn(move || build_module(package_dir, rustc, arch, &target_dir))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let mut modules = Vec::new();
    let mut ptx_sha256 = BTreeMap::new();
    for (arch, result) in PtxArch::ALL.into_iter().zip(results) {
        let text = result.map_err(|e| format!("{}: {e}", arch.target_cpu()))?;
        ptx_sha256.insert(ptx_file_name(arch), sha256_hex(text.as_bytes()));
        modules.push(PtxModule {
            arch,
            zst: zstd_stored(text.as_bytes()),
        });
    }
    let manifest = PtxManifest {
        source_hash: source_hash(package_dir)?,
        rustc: rustc_version(rustc)?,
        ptx_sha256,
    };
    Ok(PtxSet { manifest, modules })
}

/// Compiles the kernel crate to PTX for one module and adds the launch bounds.
fn build_module(
    package_dir: &Path,
    rustc: &Path,
    arch: PtxArch,
    target_dir: &Path,
) -> Result<String, String> {
    let cpu = arch.target_cpu();
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let linker = if Path::new("/bin/true").exists() {
        "/bin/true"
    } else {
        "true"
    };
    let manifest = package_dir.join("Cargo.toml");
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(package_dir)
        .args(["rustc", "--release", "--locked", "--manifest-path"])
        .arg(&manifest)
        .args([
            "--target",
            PTX_TARGET,
            "-Zbuild-std=core",
            "--crate-type",
            "cdylib",
        ])
        .arg("--target-dir")
        .arg(target_dir);
    // The profile comes from the command line, not from a manifest: as a
    // workspace member (or a dependency) this package's own `[profile]` would
    // be ignored. `panic = "abort"`: nvptx64 has no unwinding.
    for setting in [
        "lto=\"fat\"",
        "panic=\"abort\"",
        "codegen-units=1",
        "opt-level=3",
        "debug=false",
    ] {
        cmd.arg("--config")
            .arg(format!("profile.release.{setting}"));
    }
    cmd.arg("--")
        .arg("--emit=asm")
        .arg(format!("-Ctarget-cpu={cpu}"))
        .args(
            arch.ptx_isa_feature()
                .map(|f| format!("-Ctarget-feature=+{f}")),
        )
        .arg(format!("-Cllvm-args=-inline-threshold={INLINE_THRESHOLD}"))
        // Nothing is linked; the `--emit=asm` output is all that is wanted.
        .arg(format!("-Clinker={linker}"));
    sanitize_env(&mut cmd);
    cmd.env("RUSTC", rustc).env("RUSTC_BOOTSTRAP", "1");

    let out = cmd
        .output()
        .map_err(|e| format!("running {}: {e}", Path::new(&cargo).display()))?;
    if !out.status.success() {
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
        return Err(format!(
            "{}{}\nfailed: RUSTC={} RUSTC_BOOTSTRAP=1 {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            rustc.display(),
            Path::new(&cargo).display(),
            args.join(" ")
        ));
    }
    let asm = target_dir
        .join(PTX_TARGET)
        .join("release/deps/flash_attn_kernels.s");
    let ptx = String::from_utf8(read(&asm)?).map_err(|e| format!("{}: {e}", asm.display()))?;
    let target_line = format!(".target {cpu}");
    if !ptx.lines().any(|l| l.trim() == target_line) {
        return Err(format!(
            "{} is not PTX for {cpu} (no `{target_line}` line)",
            asm.display()
        ));
    }
    let ptx = add_launch_bounds(&ptx, arch)?;
    Ok(match arch {
        PtxArch::Sm90a => align_tensor_map_params(&ptx),
        PtxArch::Sm75 | PtxArch::Sm80 | PtxArch::Sm90 => ptx,
    })
}

/// Raises the alignment of every entry's first parameter that is tensor maps
/// to the 128 bytes nvcc declares for a `CUtensorMap` (TMA requires 64),
/// which rustc cannot declare (`#[repr(align(64))]` on a by-value kernel
/// parameter is an internal compiler error; `params::TensorMap` is
/// `align(16)`). At 16 the driver may place the map at a 16-byte boundary of
/// the parameter bank, and TMA faults with a misaligned address (seen on H100). In the `sm_90a`
/// module a first parameter of a multiple of 128 bytes at alignment 16 is
/// tensor maps by convention (`kernels::entries`); nothing else changes.
pub fn align_tensor_map_params(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len());
    for line in ptx.split_inclusive('\n') {
        let decl = line.trim_start();
        let is_maps = decl
            .strip_prefix(".param .align 16 .b8 ")
            .and_then(|rest| rest.split_once("_param_0["))
            .and_then(|(_, size)| size.split_once(']'))
            .and_then(|(size, _)| size.parse::<usize>().ok())
            .is_some_and(|size| size > 0 && size % 128 == 0);
        if is_maps {
            out.push_str(&line.replacen(".align 16", ".align 128", 1));
        } else {
            out.push_str(line);
        }
    }
    out
}

/// Variables of an enclosing cargo build that must not leak into the nested
/// one: its flags, wrappers (`cargo clippy` sets `RUSTC_WORKSPACE_WRAPPER`),
/// target, profile, jobserver, and the build-script variables describing the
/// outer package.
fn sanitize_env(cmd: &mut Command) {
    const REMOVE: &[&str] = &[
        "RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTDOCFLAGS",
        "RUSTC_LINKER",
        "MAKEFLAGS",
        "MFLAGS",
        "TARGET",
        "HOST",
        "OUT_DIR",
        "OPT_LEVEL",
        "PROFILE",
        "DEBUG",
        "NUM_JOBS",
    ];
    // CARGO_* configures cargo itself; only the user's network/registry
    // settings and CARGO_HOME are meant for every cargo.
    const KEEP_CARGO_PREFIXES: &[&str] = &[
        "CARGO_NET_",
        "CARGO_HTTP_",
        "CARGO_REGISTRIES_",
        "CARGO_REGISTRY_",
    ];
    for (key, _) in env::vars_os() {
        let Some(name) = key.to_str() else { continue };
        let cargo_var =
            name == "CARGO" || name.starts_with("CARGO_") || name.starts_with("__CARGO");
        let keep = name == "CARGO_HOME" || KEEP_CARGO_PREFIXES.iter().any(|p| name.starts_with(p));
        if REMOVE.contains(&name) || (cargo_var && !keep) {
            cmd.env_remove(OsString::from(name));
        }
    }
}

/// Inserts `.maxntid T, 1, 1` (and `.minnctapersm N` where the config asks)
/// between each entry's parameter list and its body, T being the entry's
/// threads per CTA. Without `.maxntid` ptxas must assume CTAs of up to 1024
/// threads and limits every kernel to 64 registers per thread; without an
/// occupancy target it picks its own and may spill to reach it. Everything
/// else is kept byte for byte. Every entry of [`PtxArch::entries`] must be defined
/// exactly once, and no other.
pub fn add_launch_bounds(ptx: &str, arch: PtxArch) -> Result<String, String> {
    let cpu = arch.target_cpu();
    let entries = arch.entries();
    let mut out = String::with_capacity(ptx.len() + 32 * entries.len());
    let mut found: Vec<&str> = vec![];
    // The entry whose body has not started yet.
    let mut pending: Option<&Entry> = None;
    for line in ptx.split_inclusive('\n') {
        let trimmed = line.trim();
        if let Some(name) = entry_name(trimmed) {
            let entry = entries.iter().find(|e| e.name == name).ok_or_else(|| {
                format!("{cpu} PTX has entry `{name}`, which is not in its config entry list")
            })?;
            if found.contains(&name) {
                return Err(format!("{cpu} PTX defines entry `{name}` twice"));
            }
            if pending.is_some() {
                return Err(format!("{cpu} PTX: entry without a body before `{name}`"));
            }
            found.push(entry.name);
            pending = Some(entry);
        } else if let Some(entry) = pending {
            if trimmed.starts_with(".maxntid") || trimmed.starts_with(".reqntid") {
                return Err(format!(
                    "{cpu} PTX: entry `{}` already declares its thread count",
                    entry.name
                ));
            }
            if trimmed == "{" {
                out.push_str(&format!(".maxntid {}, 1, 1\n", entry.threads(arch)));
                if let Some(n) = entry.min_ctas_per_sm(arch) {
                    out.push_str(&format!(".minnctapersm {n}\n"));
                }
                pending = None;
            }
        }
        out.push_str(line);
    }
    if pending.is_some() {
        return Err(format!("{cpu} PTX ends inside an entry's parameter list"));
    }
    let missing: Vec<&str> = entries
        .iter()
        .map(|e| e.name)
        .filter(|n| !found.contains(n))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{cpu} PTX lacks the entries {missing:?} of its config entry list"
        ));
    }
    Ok(out)
}

/// The name in `.visible .entry NAME(` (or `.entry NAME(`), if `line` starts an entry.
fn entry_name(line: &str) -> Option<&str> {
    let rest = line.strip_prefix(".visible ").unwrap_or(line);
    let rest = rest.strip_prefix(".entry")?.trim_start();
    let end = rest
        .find(|c: char| c == '(' || c.is_whitespace())
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// Prints `cargo:rerun-if-changed` for everything [`committed_ptx`] and
/// [`build_ptx`] read in `package_dir` (the caller adds the cubin directory), and
/// `cargo:rerun-if-env-changed` for the toolchain variable.
pub fn emit_rerun_directives(package_dir: &Path) {
    for rel in ["src", "Cargo.toml", PTX_DIR] {
        println!("cargo:rerun-if-changed={}", package_dir.join(rel).display());
    }
    println!("cargo:rerun-if-env-changed={KERNEL_RUSTC_VAR}");
}
