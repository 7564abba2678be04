//! The PTX embedded at build time (see build.rs): built from `kernels-gpu` when
//! a kernel toolchain is present, otherwise the committed, hash-checked copy.

/// `"source"` when this build compiled the kernels, `"committed"` when it used
/// the PTX committed under `kernels-gpu/ptx/`.
pub const PTX_SOURCE: &str = env!("FLASH_ATTN_PTX_ORIGIN");

use flash_attn_kernels::config::PtxArch;

const PTX_SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_attn_sm80.ptx"));
const PTX_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_attn_sm90.ptx"));

/// The PTX text of a module; [`PtxArch::for_device`] picks the module.
pub fn ptx_text(arch: PtxArch) -> &'static str {
    match arch {
        PtxArch::Sm80 => PTX_SM80,
        PtxArch::Sm90 => PTX_SM90,
    }
}
