//! Special registers and control.
use core::arch::asm;

// The thread and CTA coordinates are read with non-pure `mov`s: LLVM then
// re-reads them where they are needed (a cheap S2R) instead of keeping them,
// or addresses built from them, live in registers across the whole key loop
// for the epilogue.

/// `mov.u32 %r, %tid.x;`
#[inline(always)]
pub fn thread_idx_x() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %tid.x;", r = out(reg32) r, options(nomem, nostack)) };
    r
}

/// `mov.u32 %r, %ctaid.x;`
#[inline(always)]
pub fn block_idx_x() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %ctaid.x;", r = out(reg32) r, options(nomem, nostack)) };
    r
}
/// `mov.u32 %r, %nctaid.x;`
#[inline(always)]
pub fn grid_dim_x() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %nctaid.x;", r = out(reg32) r, options(nomem, nostack)) };
    r
}
/// `mov.u32 %r, %ctaid.y;`
#[inline(always)]
pub fn block_idx_y() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %ctaid.y;", r = out(reg32) r, options(nomem, nostack)) };
    r
}
/// `mov.u32 %r, %ctaid.z;`
#[inline(always)]
pub fn block_idx_z() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %ctaid.z;", r = out(reg32) r, options(nomem, nostack)) };
    r
}

/// `mov.u32 %r, %nctaid.y;`
#[inline(always)]
pub fn grid_dim_y() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %nctaid.y;", r = out(reg32) r, options(nomem, nostack)) };
    r
}
/// `mov.u32 %r, %nctaid.z;`
#[inline(always)]
pub fn grid_dim_z() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %nctaid.z;", r = out(reg32) r, options(nomem, nostack)) };
    r
}
/// `mov.u32 %r, %nsmid;`: one more than the largest SM identifier, at least
/// the number of SMs (identifiers need not be contiguous).
#[inline(always)]
pub fn sm_ids() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %nsmid;", r = out(reg32) r, options(nomem, nostack)) };
    r
}

/// `trap;` aborts the kernel; the launch then reports an error.
#[inline(always)]
pub fn trap() -> ! {
    unsafe {
        asm!("trap;", options(noreturn, nostack));
    }
}

/// `mov.b32 d, x;` as an optimisation barrier. The asm is not `pure`, so LLVM
/// can neither hoist it out of a loop nor see through it: address arithmetic
/// built on the result stays next to its use, where ptxas folds constant
/// offsets into the instruction's immediate, instead of living in one register
/// per address for the whole loop.
#[inline(always)]
pub fn opaque_u32(x: u32) -> u32 {
    let r: u32;
    unsafe {
        asm!("mov.b32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(nomem, nostack));
    }
    r
}
