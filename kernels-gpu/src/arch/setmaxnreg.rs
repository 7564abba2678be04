//! Warpgroup register reallocation (sm_90a): `setmaxnreg`. A warp-specialised
//! kernel hands the registers its producer warpgroup does not need to the
//! warpgroups that hold accumulators. ptxas honours it only when the entry
//! has a register cap (`.maxntid` with `.minnctapersm`, which the PTX build
//! adds from the config) and each role is one arm of a single branch;
//! otherwise it warns (C7508) and ignores it.
use core::arch::asm;

/// `setmaxnreg.inc.sync.aligned.u32 N;` raises this warpgroup's per-thread
/// register limit to `N` (a multiple of 8 in 24..=256), waiting until other
/// warpgroups have released enough. Every thread of the warpgroup executes it.
#[inline(always)]
pub fn inc<const N: u32>() {
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}

/// `setmaxnreg.dec.sync.aligned.u32 N;` lowers this warpgroup's per-thread
/// register limit to `N` and releases the rest to the CTA's pool.
#[inline(always)]
pub fn dec<const N: u32>() {
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}
