//! Warp shuffles.
use core::arch::asm;

/// `shfl.sync.bfly.b32 d, v, lane_mask, 0x1f, 0xffffffff;` the value of lane
/// `lane ^ lane_mask`, all 32 lanes participating.
#[inline(always)]
pub fn bfly_f32(v: f32, lane_mask: u32) -> f32 {
    let r: f32;
    unsafe {
        asm!(
            "shfl.sync.bfly.b32 {r}, {v}, {m}, 0x1f, 0xffffffff;",
            r = out(reg32) r, v = in(reg32) v, m = in(reg32) lane_mask,
            options(nostack, nomem),
        );
    }
    r
}
