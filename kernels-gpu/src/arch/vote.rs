//! Warp votes.
use core::arch::asm;

/// `vote.sync.any.pred d, p, 0xffffffff;` whether `p` holds in any lane, all
/// 32 lanes participating: a warp-uniform value, so a branch on it never
/// diverges.
#[inline(always)]
pub fn any(p: bool) -> bool {
    let r: u32;
    unsafe {
        asm!(
            "{{",
            ".reg .pred %p_in, %p_out;",
            "setp.ne.u32 %p_in, {p}, 0;",
            "vote.sync.any.pred %p_out, %p_in, 0xffffffff;",
            "selp.u32 {r}, 1, 0, %p_out;",
            "}}",
            r = out(reg32) r, p = in(reg32) p as u32,
            options(nostack, nomem),
        );
    }
    r != 0
}
