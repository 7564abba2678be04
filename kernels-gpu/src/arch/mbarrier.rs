//! Shared-memory transaction barriers (sm_90): `mbarrier`.
//!
//! A barrier is 8 bytes of shared memory (8-byte aligned). It completes a
//! phase when its expected arrivals have arrived and the transaction bytes
//! it was told to expect (`arrive_expect_tx`) have landed (TMA counts them
//! down); waiters test a phase by its parity, 0 for the first.
use core::arch::asm;

/// `mbarrier.init.shared::cta.b64 [bar], count;` one thread, before any use;
/// then [`fence_init`] and a CTA barrier.
#[inline(always)]
pub fn init(bar: u32, count: u32) {
    unsafe {
        asm!(
            "mbarrier.init.shared::cta.b64 [{b}], {c};",
            b = in(reg32) bar, c = in(reg32) count,
            options(nostack),
        )
    };
}

/// `fence.mbarrier_init.release.cluster;` publishes the initialised barriers
/// to the async proxy (TMA's complete_tx).
#[inline(always)]
pub fn fence_init() {
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}

/// `mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], bytes;` arrives once
/// and adds `bytes` to the transactions the current phase waits for.
#[inline(always)]
pub fn arrive_expect_tx(bar: u32, bytes: u32) {
    unsafe {
        asm!(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};",
            b = in(reg32) bar, n = in(reg32) bytes,
            options(nostack),
        )
    };
}

/// `mbarrier.arrive.shared::cta.b64 _, [bar];` one arrival (release
/// semantics: this thread's earlier shared-memory reads are done).
#[inline(always)]
pub fn arrive(bar: u32) {
    unsafe {
        asm!("mbarrier.arrive.shared::cta.b64 _, [{b}];", b = in(reg32) bar, options(nostack))
    };
}

/// `mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity;` whether the
/// phase of parity `parity` has completed (acquire: then its TMA data is
/// visible). The hardware suspends the thread a while before answering no.
#[inline(always)]
pub fn try_wait_parity(bar: u32, parity: u32) -> bool {
    let done: u32;
    unsafe {
        asm!(
            "{{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {ph};\nselp.u32 {d}, 1, 0, p;\n}}",
            d = out(reg32) done, b = in(reg32) bar, ph = in(reg32) parity,
            options(nostack),
        )
    };
    done != 0
}
