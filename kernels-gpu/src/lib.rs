//! Device code of flash-attn, plus the configuration the host shares with it.
//!
//! `config` and `params` are plain Rust that compiles for every target: the host
//! crate uses the very same tile sizes, thread counts, shared-memory sizes and
//! launch-parameter layouts as the kernels, so launch geometry cannot drift.
//! Everything under `arch` and `kernels` exists only on `nvptx64`; `artifacts`
//! (feature `build`) only on the host, for flash-attn's build script.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, asm_experimental_arch))]
#![warn(missing_docs)]
// The sm_90a module compiles the primitives and kernel pieces it shares with
// the sm_80 kernels, of which its Hopper kernels use only some; the sm_75
// module has no bf16 kernels.
#![cfg_attr(
    any(target_feature = "sm_90a", not(target_feature = "sm_80")),
    allow(dead_code)
)]

pub mod config;
pub mod index;
pub mod params;

#[cfg(all(feature = "build", not(target_arch = "nvptx64")))]
pub mod artifacts;

#[cfg(target_arch = "nvptx64")]
mod arch;
#[cfg(target_arch = "nvptx64")]
mod kernels;
#[cfg(target_arch = "nvptx64")]
mod unroll;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    arch::special::trap()
}
