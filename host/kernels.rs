//! The PTX embedded at build time (see build.rs): built from `kernels-gpu` when
//! a kernel toolchain is present, otherwise the committed, hash-checked copy.

/// `"source"` when this build compiled the kernels, `"committed"` when it used
/// the PTX committed under `kernels-gpu/ptx/`.
pub const PTX_SOURCE: &str = env!("FLASH_ATTN_PTX_ORIGIN");

const PTX_SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_attn_sm80.ptx"));
const PTX_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_attn_sm90.ptx"));

/// The PTX module for a device of compute capability `major.minor`: the newest
/// build it can run (PTX JIT-compiles forward), `None` below sm_80.
pub fn ptx_for_arch(major: i32, minor: i32) -> Option<&'static str> {
    match (major, minor) {
        (m, _) if m >= 9 => Some(PTX_SM90),
        (8, _) => Some(PTX_SM80),
        _ => None,
    }
}
