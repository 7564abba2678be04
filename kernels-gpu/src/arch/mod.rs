//! Thin wrappers over PTX instructions, one module per hardware primitive
//! family and one `#[inline(always)]` function per instruction. This is the only
//! place in the crate that contains `asm!`.
//!
//! Shared-memory addresses are 32-bit `.shared` window addresses (what
//! `cvta.to.shared` yields), which is what `ldmatrix`, `cp.async` and
//! `ld/st.shared` take. The Hopper families (`fence`, `mbarrier`,
//! `setmaxnreg`, `tma`, `wgmma`) are compiled into the `sm_90a` module only.

pub mod barrier;
pub mod cp_async;
#[cfg(target_feature = "sm_90a")]
pub mod fence;
pub mod global;
pub mod griddep;
pub mod ldmatrix;
pub mod math;
#[cfg(target_feature = "sm_90a")]
pub mod mbarrier;
pub mod mma;
#[cfg(target_feature = "sm_90a")]
pub mod setmaxnreg;
pub mod shfl;
pub mod smem;
pub mod special;
#[cfg(target_feature = "sm_90a")]
pub mod tma;
pub mod vote;
#[cfg(target_feature = "sm_90a")]
pub mod wgmma;
