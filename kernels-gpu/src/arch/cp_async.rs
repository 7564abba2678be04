//! Asynchronous global-to-shared copies (sm_80).
use core::arch::asm;

/// `cp.async.cg.shared.global [dst], [src], 16, src_bytes;`
///
/// Copies 16 bytes, bypassing L1. Only the first `src_bytes` (0 or 16 here) are
/// read from `src`; the rest of the 16 are zero-filled, so `src_bytes == 0`
/// writes zeros without touching global memory (out-of-range rows).
#[inline(always)]
pub fn cg_16(dst: u32, src: u64, src_bytes: u32) {
    unsafe {
        asm!(
            "cp.async.cg.shared.global [{d}], [{s}], 16, {n};",
            d = in(reg32) dst, s = in(reg64) src, n = in(reg32) src_bytes,
            options(nostack),
        );
    }
}

/// `cp.async.ca.shared.global [dst], [src], 4, src_bytes;`
///
/// Copies 4 bytes (through L1: `.cg` takes 16 only); `src_bytes == 0` writes
/// zeros without reading `src`, as [`cg_16`].
#[inline(always)]
pub fn ca_4(dst: u32, src: u64, src_bytes: u32) {
    unsafe {
        asm!(
            "cp.async.ca.shared.global [{d}], [{s}], 4, {n};",
            d = in(reg32) dst, s = in(reg64) src, n = in(reg32) src_bytes,
            options(nostack),
        );
    }
}

/// `cp.async.commit_group;` closes the group of copies issued so far.
#[inline(always)]
pub fn commit() {
    unsafe {
        asm!("cp.async.commit_group;", options(nostack));
    }
}

/// `cp.async.wait_group N;` waits until at most `N` committed groups are pending.
/// The waiting thread's copies are then visible to it; a barrier publishes them
/// to the CTA.
#[inline(always)]
pub fn wait_group<const N: u32>() {
    unsafe {
        asm!("cp.async.wait_group {n};", n = const N, options(nostack));
    }
}

/// [`wait_group`] for a pending count that is a constant only after inlining
/// (a tile's ring depth, which stable Rust cannot put in a const argument).
/// Counts above 7 wait for everything, which is always safe.
#[inline(always)]
pub fn wait_pending(n: u32) {
    match n {
        1 => wait_group::<1>(),
        2 => wait_group::<2>(),
        3 => wait_group::<3>(),
        4 => wait_group::<4>(),
        5 => wait_group::<5>(),
        6 => wait_group::<6>(),
        7 => wait_group::<7>(),
        _ => wait_group::<0>(),
    }
}
