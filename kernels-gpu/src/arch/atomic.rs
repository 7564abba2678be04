//! Global-memory atomics and the fences that order them across CTAs (PTX
//! memory model, sm_70+).
use core::arch::asm;

/// `fence.acq_rel.gpu;` orders this thread's memory accesses before the fence
/// against those after it, for every thread of the GPU that synchronises
/// with it (CUDA's `__threadfence()`).
#[inline(always)]
pub fn fence_acq_rel_gpu() {
    unsafe {
        asm!("fence.acq_rel.gpu;", options(nostack));
    }
}

/// `atom.acq_rel.gpu.global.add.u32 d, [p], v;` adds `v` to the u32 at `p`
/// and returns the old value; releases this thread's earlier accesses and
/// acquires those released by earlier atomics on the same address.
#[inline(always)]
pub fn add_acq_rel_gpu_u32(p: u64, v: u32) -> u32 {
    let old: u32;
    unsafe {
        asm!(
            "atom.acq_rel.gpu.global.add.u32 {old}, [{p}], {v};",
            old = out(reg32) old, p = in(reg64) p, v = in(reg32) v,
            options(nostack),
        );
    }
    old
}

/// `st.relaxed.gpu.global.u32 [p], v;` a store other CTAs (and later
/// kernels) observe without tearing.
#[inline(always)]
pub fn st_relaxed_gpu_u32(p: u64, v: u32) {
    unsafe {
        asm!("st.relaxed.gpu.global.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack));
    }
}
