//! Thin wrappers over PTX instructions, one module per hardware primitive
//! family and one `#[inline(always)]` function per instruction. This is the only
//! place in the crate that contains `asm!`.
//!
//! Shared-memory addresses are 32-bit `.shared` window addresses (what
//! `cvta.to.shared` yields), which is what `ldmatrix`, `cp.async` and
//! `ld/st.shared` take.

pub mod barrier;
pub mod cp_async;
pub mod global;
pub mod ldmatrix;
pub mod math;
pub mod mma;
pub mod shfl;
pub mod smem;
pub mod special;
pub mod vote;
