//! CTA barriers.
use core::arch::asm;

/// `bar.sync 0;` every thread of the CTA waits here; orders shared-memory
/// accesses before it against those after it.
#[inline(always)]
pub fn sync_cta() {
    unsafe {
        asm!("bar.sync 0;", options(nostack));
    }
}
