//! Memory fences between the generic proxy (ordinary loads and stores) and
//! the async proxy (TMA, `wgmma` operand reads) (sm_90).
use core::arch::asm;

/// `fence.proxy.async.shared::cta;` makes this thread's earlier ordinary
/// shared-memory writes visible to later async-proxy reads (a `wgmma`
/// descriptor operand, a TMA store). Each writing thread fences, then a
/// barrier hands the data over.
#[inline(always)]
pub fn proxy_async_shared() {
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}
