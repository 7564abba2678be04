//! Special registers and control.
use core::arch::asm;
use core::arch::nvptx;

/// `%tid.x`
#[inline(always)]
pub fn thread_idx_x() -> u32 {
    unsafe { nvptx::_thread_idx_x() as u32 }
}
/// `%ctaid.x`
#[inline(always)]
pub fn block_idx_x() -> u32 {
    unsafe { nvptx::_block_idx_x() as u32 }
}
/// `%ctaid.y`
#[inline(always)]
pub fn block_idx_y() -> u32 {
    unsafe { nvptx::_block_idx_y() as u32 }
}
/// `%ctaid.z`
#[inline(always)]
pub fn block_idx_z() -> u32 {
    unsafe { nvptx::_block_idx_z() as u32 }
}

/// `trap;` aborts the kernel; the launch then reports an error.
#[inline(always)]
pub fn trap() -> ! {
    unsafe {
        asm!("trap;", options(noreturn, nostack));
    }
}
