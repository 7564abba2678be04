//! `TmaRing`: the mbarrier pipeline between the Hopper forward's TMA
//! producer and its consumer warpgroups, one ring per tensor (K, V). Stage
//! `i % STAGES` holds block `i`; its `full` barrier completes when the
//! producer's one arrival and the TMA bytes have landed, its `empty` barrier
//! when every consumer warp has released it. Both are waited on by phase
//! parity, which the block counter gives: use `i / STAGES` of a stage.
use crate::arch::mbarrier;

/// Waits until the phase of parity `parity` of `bar` has completed.
#[inline(always)]
pub fn wait(bar: u32, parity: u32) {
    while !mbarrier::try_wait_parity(bar, parity) {}
}

#[derive(Clone, Copy)]
pub struct TmaRing<const STAGES: u32> {
    /// `.shared` address of stage 0's full barrier; stage s's at + 8s.
    full: u32,
    /// Likewise the empty barriers.
    empty: u32,
}

impl<const STAGES: u32> TmaRing<STAGES> {
    #[inline(always)]
    pub const fn new(full: u32, empty: u32) -> Self {
        TmaRing { full, empty }
    }

    /// One thread, before the CTA barrier that publishes the barriers:
    /// `releasers` arrivals free a stage.
    #[inline(always)]
    pub fn init(self, releasers: u32) {
        for s in 0..STAGES {
            mbarrier::init(self.full + 8 * s, 1);
            mbarrier::init(self.empty + 8 * s, releasers);
        }
    }

    #[inline(always)]
    const fn stage(i: u32) -> (u32, u32) {
        (i % STAGES, (i / STAGES) & 1)
    }

    /// The producer's turn for block `i`: waits until the stage's previous
    /// block was released, then announces `bytes` of TMA loads. Returns the
    /// stage and its full barrier, which the loads complete. A fresh
    /// barrier counts its (nonexistent) previous phase as complete, so the
    /// first `STAGES` blocks do not wait.
    #[inline(always)]
    pub fn acquire(self, i: u32, bytes: u32) -> (u32, u32) {
        let (s, full) = self.claim(i);
        mbarrier::arrive_expect_tx(full, bytes);
        (s, full)
    }

    /// [`Self::acquire`] without the arrival: the stage and its full
    /// barrier, once block `i - STAGES` has been released. The producer
    /// then writes what the consumers read with the block before it arrives
    /// (the arrival releases those writes to the waiters).
    #[inline(always)]
    pub fn claim(self, i: u32) -> (u32, u32) {
        let (s, use_) = Self::stage(i);
        wait(self.empty + 8 * s, use_ ^ 1);
        (s, self.full + 8 * s)
    }

    /// Block `i`'s stage and full barrier, for the threads that issue its
    /// loads after another claimed it with [`Self::acquire`].
    #[inline(always)]
    pub const fn slot(self, i: u32) -> (u32, u32) {
        let s = Self::stage(i).0;
        (s, self.full + 8 * s)
    }

    /// A consumer waits until block `i` has landed; returns its stage.
    #[inline(always)]
    pub fn wait_full(self, i: u32) -> u32 {
        let (s, use_) = Self::stage(i);
        wait(self.full + 8 * s, use_);
        s
    }

    /// One arrival that releases block `i`'s stage (after the reads of it
    /// have completed).
    #[inline(always)]
    pub fn release(self, i: u32) {
        mbarrier::arrive(self.empty + 8 * Self::stage(i).0);
    }
}
