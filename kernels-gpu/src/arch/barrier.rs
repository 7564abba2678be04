//! CTA and warp barriers.
use core::arch::asm;

/// `bar.sync 0;` every thread of the CTA waits here; orders shared-memory
/// accesses before it against those after it.
#[inline(always)]
pub fn sync_cta() {
    unsafe {
        asm!("bar.sync 0;", options(nostack));
    }
}

/// `bar.warp.sync 0xffffffff;` every lane of the warp waits here; orders
/// their memory accesses before it against those after it.
#[inline(always)]
pub fn sync_warp() {
    unsafe {
        asm!("bar.warp.sync 0xffffffff;", options(nostack));
    }
}

/// `barrier.sync 0;` as [`sync_cta`] without `.aligned`: the threads may
/// reach it through different instructions. LLVM may copy a barrier that
/// follows a one-thread block (barrier set-up) into both arms of the branch;
/// `bar.sync` is `barrier.sync.aligned`, which must be one instruction for
/// all threads, and so copied it hung the TMA probe on H100.
#[inline(always)]
pub fn sync_cta_divergent() {
    unsafe {
        asm!("barrier.sync 0;", options(nostack));
    }
}

/// `barrier.sync id, threads;` the `threads` threads (a multiple of 32) that
/// name barrier `id` (1..=15; 0 is the CTA's) wait for each other. Not
/// `.aligned`, for the reason of [`sync_cta_divergent`]: the Hopper kernels
/// reach their named barriers inside warpgroup role branches.
#[inline(always)]
pub fn sync_named(id: u32, threads: u32) {
    unsafe {
        asm!("barrier.sync {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack));
    }
}

/// `barrier.arrive id, threads;` counts this thread in barrier `id`'s
/// `threads` without waiting; the barrier completes when the others have
/// reached [`sync_named`] on it. Not `.aligned`, as [`sync_named`].
#[inline(always)]
pub fn arrive_named(id: u32, threads: u32) {
    unsafe {
        asm!("barrier.arrive {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack));
    }
}
