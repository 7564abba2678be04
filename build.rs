//! Provides the PTX of the device crate (`kernels-gpu`) to the host crate.
//!
//! Output in `$OUT_DIR`: `flash_attn_sm80.ptx`, `flash_attn_sm90.ptx` (one per
//! `PTX_ARCHS` entry, embedded by the host with `include_str!`) and
//! `ptx-manifest.toml`.
//!
//! The PTX comes from one of two places:
//! - **source**: the kernels are compiled with a nested cargo. This needs a
//!   "kernel toolchain": a rustc whose sysroot has the standard library's source
//!   (`-Zbuild-std=core`; rustup's nvptx64 target ships no prebuilt `core`).
//! - **committed**: `kernels-gpu/ptx/`, used only when its manifest records the
//!   hash of the current kernel sources and the files match their recorded
//!   hashes. Stale PTX must never be used silently, so anything else is an error.
//!
//! `FLASH_ATTN_PTX=source|committed` forces one; unset, source is used when a
//! kernel toolchain is found. `FLASH_ATTN_KERNEL_RUSTC` names the kernel rustc.
//!
//! This script never writes into the source tree: `scripts/update-ptx.sh` copies
//! the `$OUT_DIR` files into `kernels-gpu/ptx/`.

use std::collections::BTreeMap;
use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flash_attn_kernels::config::{Entry, PtxArch, ENTRIES};
use sha2::{Digest, Sha256};

const MODE_VAR: &str = "FLASH_ATTN_PTX";
const KERNEL_RUSTC_VAR: &str = "FLASH_ATTN_KERNEL_RUSTC";
const KERNEL_CRATE: &str = "kernels-gpu";
const COMMITTED_DIR: &str = "kernels-gpu/ptx";
const COMMITTED_MANIFEST: &str = "manifest.toml";
const OUT_MANIFEST: &str = "ptx-manifest.toml";
const PTX_TARGET: &str = "nvptx64-nvidia-cuda";
/// Where Debian's `rust-web-src` (with `rustc-web`) puts the library source.
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_RUST_SRC: &str = "/usr/lib/rustlib/src/rust/library";
const SETUP_HINT: &str = "either install the kernel toolchain with `scripts/setup-kernel-toolchain.sh` \
     and build with FLASH_ATTN_PTX unset or `source` (the PTX is then built from the kernel sources), \
     or refresh the committed PTX with `scripts/update-ptx.sh`";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Auto,
    Source,
    Committed,
}

/// The contents of a PTX manifest.
struct Manifest {
    source_hash: String,
    rustc: String,
    /// PTX file name -> sha256 of its contents.
    ptx_sha256: BTreeMap<String, String>,
}

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    emit_rerun_directives();

    let mode = mode_from_env();
    let source_hash = source_hash(&root);
    // In `committed` mode no toolchain is looked for, so that mode behaves the
    // same on every machine.
    let kernel_rustc = match mode {
        Mode::Committed => None,
        Mode::Auto | Mode::Source => find_kernel_rustc(),
    };
    let origin = match (mode, kernel_rustc) {
        (Mode::Source | Mode::Auto, Some(rustc)) => {
            build_from_source(&root, &out_dir, &rustc, &source_hash);
            "source"
        }
        (Mode::Source, None) => panic!(
            "{MODE_VAR}=source, but no kernel toolchain was found (a rustc with rust-src: \
             ${KERNEL_RUSTC_VAR}, {DEBIAN_RUSTC} with {DEBIAN_RUST_SRC}, or cargo's rustc \
             with the rust-src component); run `scripts/setup-kernel-toolchain.sh`"
        ),
        (Mode::Committed | Mode::Auto, _) => {
            use_committed(&root, &out_dir, &source_hash);
            "committed"
        }
    };
    println!("cargo:rustc-env=FLASH_ATTN_PTX_ORIGIN={origin}");
    embed_cubins(&root, &out_dir);
}

fn emit_rerun_directives() {
    for path in [
        "kernels-gpu/src",
        "kernels-gpu/Cargo.toml",
        COMMITTED_DIR,
        CUBIN_DIR,
        "build.rs",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    println!("cargo:rerun-if-env-changed={MODE_VAR}");
    println!("cargo:rerun-if-env-changed={KERNEL_RUSTC_VAR}");
}

fn mode_from_env() -> Mode {
    match env::var(MODE_VAR).as_deref() {
        Err(env::VarError::NotPresent) | Ok("") | Ok("auto") => Mode::Auto,
        Ok("source") => Mode::Source,
        Ok("committed") => Mode::Committed,
        Ok(other) => panic!("{MODE_VAR}={other:?}: expected `source`, `committed` or unset"),
        Err(e) => panic!("{MODE_VAR}: {e}"),
    }
}

/// `flash_attn_sm80.ptx` for `sm_80`: the name the host's `include_str!` uses.
fn ptx_file_name(arch: &str) -> String {
    format!("flash_attn_{}.ptx", arch.replace('_', ""))
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------
// Source hash
// ---------------------------------------------------------------------------

/// sha256 over everything that determines the PTX apart from the toolchain:
/// the kernel crate's manifest and sources, and this script (which
/// post-processes the PTX). Each file contributes its path relative to the
/// repository root, a NUL, its contents and a NUL, in a fixed order.
fn source_hash(root: &Path) -> String {
    let mut files = vec!["kernels-gpu/Cargo.toml".to_string()];
    let mut sources = Vec::new();
    collect_files(root, Path::new("kernels-gpu/src"), &mut sources);
    sources.sort();
    files.extend(sources);
    files.push("build.rs".to_string());

    let mut hasher = Sha256::new();
    for rel in &files {
        let content = fs::read(root.join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"));
        hasher.update(rel.as_bytes());
        hasher.update([0]);
        hasher.update(&content);
        hasher.update([0]);
    }
    hex(&hasher.finalize())
}

/// Appends the `/`-separated paths (relative to `root`) of all files under `dir`.
fn collect_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let entries =
        fs::read_dir(root.join(dir)).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.expect("directory entry");
        let rel = dir.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            collect_files(root, &rel, out);
        } else {
            let rel = rel
                .to_str()
                .unwrap_or_else(|| panic!("non-UTF-8 path {}", rel.display()));
            out.push(rel.replace('\\', "/"));
        }
    }
}

// ---------------------------------------------------------------------------
// Kernel toolchain
// ---------------------------------------------------------------------------

/// The rustc to build the kernels with, or `None` when there is none.
fn find_kernel_rustc() -> Option<PathBuf> {
    // An explicit choice that does not work is an error, not a silent fallback.
    if let Some(rustc) = env::var_os(KERNEL_RUSTC_VAR).filter(|v| !v.is_empty()) {
        let rustc = PathBuf::from(rustc);
        if !has_rust_src(&rustc) {
            panic!(
                "{KERNEL_RUSTC_VAR}={}: its sysroot has no lib/rustlib/src/rust/library \
                 (rust-src), which -Zbuild-std=core needs",
                rustc.display()
            );
        }
        return Some(rustc);
    }
    // Debian/Ubuntu `rustc-web` + `rust-web-src`, what the setup script installs.
    if Path::new(DEBIAN_RUST_SRC).is_dir() && Path::new(DEBIAN_RUSTC).is_file() {
        return Some(PathBuf::from(DEBIAN_RUSTC));
    }
    // The rustc building this crate, when it is a rustup toolchain with rust-src.
    let rustc = PathBuf::from(env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()));
    has_rust_src(&rustc).then_some(rustc)
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

fn rustc_version(rustc: &Path) -> String {
    let out = Command::new(rustc)
        .arg("-V")
        .output()
        .unwrap_or_else(|e| panic!("running {} -V: {e}", rustc.display()));
    assert!(out.status.success(), "{} -V failed", rustc.display());
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

// ---------------------------------------------------------------------------
// Building from source
// ---------------------------------------------------------------------------

fn build_from_source(root: &Path, out_dir: &Path, rustc: &Path, source_hash: &str) {
    // Another kernel rustc (say, after an apt upgrade) must rebuild the PTX.
    if rustc.is_absolute() {
        println!("cargo:rerun-if-changed={}", rustc.display());
    }
    // The architectures build in parallel: each nested build is mostly one
    // single-threaded compilation of `core` and of the (fat-LTO) kernel crate.
    let results: Vec<(&str, Result<String, String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = PtxArch::ALL
            .iter()
            .map(|&arch| {
                s.spawn(move || (arch.target_cpu(), build_arch(root, out_dir, rustc, arch)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let mut ptx = Vec::new();
    let mut failures = Vec::new();
    for (arch, result) in results {
        match result {
            Ok(text) => ptx.push((arch, text)),
            Err(report) => failures.push((arch, report)),
        }
    }
    // The architectures usually fail alike: show the first failure only.
    if let Some((arch, report)) = failures.first() {
        eprintln!("{report}");
        let failed: Vec<&str> = failures.iter().map(|(a, _)| *a).collect();
        panic!(
            "building the kernels from source with {} failed for {failed:?} (the nested \
             cargo's output for {arch} is above)",
            rustc.display()
        );
    }

    let mut ptx_sha256 = BTreeMap::new();
    for (arch, text) in &ptx {
        let name = ptx_file_name(arch);
        write(&out_dir.join(&name), text.as_bytes());
        ptx_sha256.insert(name, sha256_hex(text.as_bytes()));
    }
    let manifest = Manifest {
        source_hash: source_hash.to_string(),
        rustc: rustc_version(rustc),
        ptx_sha256,
    };
    write(&out_dir.join(OUT_MANIFEST), manifest.render().as_bytes());
    warn_if_committed_is_stale(root, source_hash);
}

/// Compiles the kernel crate to PTX for one architecture and post-processes it.
/// On failure, returns the nested cargo's output and command line.
fn build_arch(
    root: &Path,
    out_dir: &Path,
    rustc: &Path,
    ptx_arch: PtxArch,
) -> Result<String, String> {
    let arch = ptx_arch.target_cpu();
    // One target dir per architecture inside OUT_DIR: the nested cargo never
    // waits on the outer build's target-dir lock nor on the other
    // architecture's build (only, briefly, on CARGO_HOME's package cache lock).
    let target_dir = out_dir.join("kernels-target").join(arch);
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let linker = if Path::new("/bin/true").exists() {
        "/bin/true"
    } else {
        "true"
    };

    /// LLVM's default is 225.
    const INLINE_THRESHOLD: u32 = 10_000;
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(root.join(KERNEL_CRATE))
        .arg("rustc")
        .arg("--release")
        // Never touch kernels-gpu/Cargo.lock (the source tree is read-only here).
        .arg("--locked")
        .arg("--manifest-path")
        .arg(root.join(KERNEL_CRATE).join("Cargo.toml"))
        .args([
            "--target",
            PTX_TARGET,
            "-Zbuild-std=core",
            "--crate-type",
            "cdylib",
        ])
        .arg("--target-dir")
        .arg(&target_dir)
        .arg("--")
        .arg("--emit=asm")
        .arg(format!("-Ctarget-cpu={arch}"))
        // Every closure of the unrolled fragment loops must be inlined: one
        // left as a call takes the address of the warp's accumulator arrays,
        // which then live in local memory. LLVM's default threshold leaves
        // some calls in the largest kernels, depending on what else the module holds.
        .arg(format!("-Cllvm-args=-inline-threshold={INLINE_THRESHOLD}"))
        // Nothing is linked; `--emit=asm` output is all that is wanted.
        .arg(format!("-Clinker={linker}"));
    sanitize_env(&mut cmd);
    cmd.env("RUSTC", rustc).env("RUSTC_BOOTSTRAP", "1");

    let out: Output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cargo:?}: {e}"));
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
    let ptx = fs::read_to_string(&asm).unwrap_or_else(|e| panic!("reading {}: {e}", asm.display()));
    let target_line = format!(".target {arch}");
    assert!(
        ptx.lines().any(|l| l.trim() == target_line),
        "{} is not PTX for {arch} (no `{target_line}` line)",
        asm.display()
    );
    Ok(add_launch_bounds(&ptx, ptx_arch))
}

/// Variables of the outer build that must not leak into the nested cargo: its
/// flags, wrappers (`cargo clippy` sets `RUSTC_WORKSPACE_WRAPPER`), target,
/// profile, jobserver, and the build-script variables describing this package.
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
/// occupancy target it picks its own and may spill to reach it.
/// Everything else is kept byte for byte.
fn add_launch_bounds(ptx: &str, ptx_arch: PtxArch) -> String {
    let arch = ptx_arch.target_cpu();
    let mut out = String::with_capacity(ptx.len() + 32 * ENTRIES.len());
    let mut found: Vec<&str> = Vec::new();
    // The entry whose body has not started yet.
    let mut pending: Option<(&str, &Entry)> = None;
    for line in ptx.split_inclusive('\n') {
        let trimmed = line.trim();
        if let Some(name) = entry_name(trimmed) {
            let entry = ENTRIES.iter().find(|e| e.name == name).unwrap_or_else(|| {
                panic!("{arch} PTX has entry `{name}`, which is not in flash_attn_kernels::config::ENTRIES")
            });
            assert!(
                !found.contains(&name),
                "{arch} PTX defines entry `{name}` twice"
            );
            assert!(
                pending.is_none(),
                "{arch} PTX: entry without a body before `{name}`"
            );
            found.push(entry.name);
            pending = Some((entry.name, entry));
        } else if let Some((name, entry)) = pending {
            assert!(
                !trimmed.starts_with(".maxntid") && !trimmed.starts_with(".reqntid"),
                "{arch} PTX: entry `{name}` already declares its thread count"
            );
            if trimmed == "{" {
                out.push_str(&format!(".maxntid {}, 1, 1\n", entry.threads(ptx_arch)));
                if let Some(n) = entry.min_ctas_per_sm(ptx_arch) {
                    out.push_str(&format!(".minnctapersm {n}\n"));
                }
                pending = None;
            }
        }
        out.push_str(line);
    }
    assert!(
        pending.is_none(),
        "{arch} PTX ends inside an entry's parameter list"
    );
    let missing: Vec<&str> = ENTRIES
        .iter()
        .map(|e| e.name)
        .filter(|n| !found.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "{arch} PTX lacks the entries {missing:?} listed in config::ENTRIES"
    );
    out
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

// ---------------------------------------------------------------------------
// Committed cubins
// ---------------------------------------------------------------------------

/// Cubins assembled from the committed PTX by `scripts/update-cubins.sh`.
const CUBIN_DIR: &str = "kernels-gpu/cubin";
const CUBIN_MANIFEST: &str = "manifest.txt";
/// Every cubin the host's `include_bytes!` names.
const CUBINS: [&str; 5] = [
    "flash_attn_sm80.cubin",
    "flash_attn_sm86.cubin",
    "flash_attn_sm89.cubin",
    "flash_attn_sm90.cubin",
    "flash_attn_sm90.cu13.cubin",
];

/// Copies each committed cubin into OUT_DIR if it is intact and was
/// assembled from the PTX this build embeds (same sha256); otherwise writes
/// an empty file, and the host loads the PTX (JIT) for that GPU. A kernel
/// edit thus never runs stale machine code; `scripts/update-cubins.sh`
/// refreshes them.
fn embed_cubins(root: &Path, out_dir: &Path) {
    let dir = root.join(CUBIN_DIR);
    let manifest = fs::read_to_string(dir.join(CUBIN_MANIFEST)).unwrap_or_default();
    let mut stale = Vec::new();
    for name in CUBINS {
        let line = manifest
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() == 4 && f[0] == name);
        let bytes = line.and_then(|f| {
            let ptx = fs::read(out_dir.join(f[2])).ok()?;
            let cubin = fs::read(dir.join(name)).ok()?;
            (sha256_hex(&ptx) == f[3] && sha256_hex(&cubin) == f[1]).then_some(cubin)
        });
        if bytes.is_none() {
            stale.push(name);
        }
        write(&out_dir.join(name), &bytes.unwrap_or_default());
    }
    if !stale.is_empty() {
        println!(
            "cargo:warning=the committed cubins {stale:?} do not match the embedded PTX; those \
             GPUs will JIT-compile the PTX on first use (refresh: scripts/update-cubins.sh)"
        );
    }
}

// ---------------------------------------------------------------------------
// Committed PTX
// ---------------------------------------------------------------------------

/// Copies the committed PTX into OUT_DIR after checking that it was built from
/// the current sources and has not been altered since.
fn use_committed(root: &Path, out_dir: &Path, source_hash: &str) {
    let dir = root.join(COMMITTED_DIR);
    let manifest_text = fs::read_to_string(dir.join(COMMITTED_MANIFEST)).unwrap_or_else(|e| {
        panic!("no committed PTX manifest {COMMITTED_DIR}/{COMMITTED_MANIFEST} ({e}); {SETUP_HINT}")
    });
    let manifest = Manifest::parse(&manifest_text).unwrap_or_else(|e| {
        panic!("{COMMITTED_DIR}/{COMMITTED_MANIFEST} is corrupt ({e}); {SETUP_HINT}")
    });
    if manifest.source_hash != source_hash {
        panic!(
            "the committed PTX in {COMMITTED_DIR} is stale: it was built from kernel sources with \
             hash {}, but kernels-gpu/Cargo.toml, kernels-gpu/src and build.rs now hash to \
             {source_hash}; {SETUP_HINT}",
            manifest.source_hash
        );
    }
    for arch in PtxArch::ALL {
        let name = ptx_file_name(arch.target_cpu());
        let bytes = fs::read(dir.join(&name)).unwrap_or_else(|e| {
            panic!("committed PTX {COMMITTED_DIR}/{name} is missing ({e}); {SETUP_HINT}")
        });
        let actual = sha256_hex(&bytes);
        let recorded = manifest
            .ptx_sha256
            .get(&name)
            .map_or("none", String::as_str);
        if recorded != actual {
            panic!(
                "committed PTX {COMMITTED_DIR}/{name} is corrupt: its sha256 is {actual}, but \
                 {COMMITTED_MANIFEST} records {recorded}; {SETUP_HINT}"
            );
        }
        write(&out_dir.join(&name), &bytes);
    }
    write(&out_dir.join(OUT_MANIFEST), manifest_text.as_bytes());
}

/// After a source build, tells the developer when the committed PTX no longer
/// matches the sources (CI's `scripts/update-ptx.sh --check` would fail).
fn warn_if_committed_is_stale(root: &Path, source_hash: &str) {
    let path = root.join(COMMITTED_DIR).join(COMMITTED_MANIFEST);
    let committed = fs::read_to_string(path)
        .ok()
        .and_then(|t| Manifest::parse(&t).ok());
    if committed.is_none_or(|m| m.source_hash != source_hash) {
        println!(
            "cargo:warning=the committed PTX in {COMMITTED_DIR} does not match the kernel sources; \
             refresh it with scripts/update-ptx.sh"
        );
    }
}

impl Manifest {
    /// A small TOML document; the committed `manifest.toml` is a copy of it.
    fn render(&self) -> String {
        let mut s = String::from(
            "# PTX of kernels-gpu, generated by build.rs; refresh with scripts/update-ptx.sh.\n\
             # source_hash: sha256 over kernels-gpu/Cargo.toml, kernels-gpu/src/** and build.rs.\n",
        );
        s += &format!("source_hash = {}\n", toml_string(&self.source_hash));
        s += &format!("rustc = {}\n", toml_string(&self.rustc));
        s += "\n[ptx_sha256]\n";
        for (name, hash) in &self.ptx_sha256 {
            s += &format!("{} = {}\n", toml_string(name), toml_string(hash));
        }
        s
    }

    /// Parses what [`Manifest::render`] writes (`key = "string"` lines and the
    /// one table), not general TOML.
    fn parse(text: &str) -> Result<Manifest, String> {
        let mut section = String::new();
        let mut top = BTreeMap::new();
        let mut ptx_sha256 = BTreeMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.trim().to_string();
                continue;
            }
            let (key, value) = line
                .split_once('=')
                .ok_or(format!("line {}: expected `key = value`", i + 1))?;
            let key = unquote(key.trim()).unwrap_or_else(|| key.trim().to_string());
            let value =
                unquote(value.trim()).ok_or(format!("line {}: expected a string value", i + 1))?;
            match section.as_str() {
                "" => top.insert(key, value),
                "ptx_sha256" => ptx_sha256.insert(key, value),
                other => return Err(format!("unknown table [{other}]")),
            };
        }
        let mut field = |k: &str| top.remove(k).ok_or(format!("missing `{k}`"));
        Ok(Manifest {
            source_hash: field("source_hash")?,
            rustc: field("rustc")?,
            ptx_sha256,
        })
    }
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn unquote(s: &str) -> Option<String> {
    let inner = s.strip_prefix('"')?.strip_suffix('"')?;
    Some(inner.replace("\\\"", "\"").replace("\\\\", "\\"))
}

fn write(path: &Path, bytes: &[u8]) {
    fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}
