//! The Tensor Memory Accelerator (sm_90): bulk tensor copies between global
//! and shared memory described by a tensor map (`CUtensorMap`).
//!
//! Coordinates are elements, innermost first: {column, row, head, batch}
//! for our [B, S, H, D] tensors seen as the 4-D tensor {D, S, H, B}. Rows
//! outside the tensor read as zeros and are not written. The map's 128-byte
//! swizzle puts the 16-byte chunk c of box row r at chunk c ^ (r % 8) of
//! that row (`index::swizzle`), the destination being 1024-byte aligned.
use core::arch::asm;

/// `cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes
/// [dst], [map, {c0, c1, c2, c3}], [bar];` loads one box into `dst`; its
/// bytes count down `bar`'s expected transactions. `map` is the generic
/// address of the tensor map (param or global). The `.shared::cluster`
/// destination (a CTA's own `.shared` address is valid in it) is the form of
/// PTX ISA 8.0; `.shared::cta` needs 8.6.
#[inline(always)]
pub fn load_4d(dst: u32, map: u64, c: [i32; 4], bar: u32) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c0}, {c1}, {c2}, {c3}}}], [{b}];",
            d = in(reg32) dst, m = in(reg64) map,
            c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
            b = in(reg32) bar,
            options(nostack),
        )
    };
}

/// `cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [map, {c0, c1, c2,
/// c3}], [src];` stores one box from `src`; rows outside the tensor are
/// skipped. Shared memory written by ordinary stores needs
/// `fence::proxy_async_shared` first. Completion: [`store_commit`], [`store_wait_read`].
#[inline(always)]
pub fn store_4d(map: u64, c: [i32; 4], src: u32) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [{m}, {{{c0}, {c1}, {c2}, {c3}}}], [{s}];",
            m = in(reg64) map,
            c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
            s = in(reg32) src,
            options(nostack),
        )
    };
}

/// `cp.async.bulk.commit_group;` closes this thread's group of bulk stores.
#[inline(always)]
pub fn store_commit() {
    unsafe { asm!("cp.async.bulk.commit_group;", options(nostack)) };
}

/// `cp.async.bulk.wait_group.read 0;` waits until this thread's committed
/// bulk stores have read their shared memory (which may then be reused).
#[inline(always)]
pub fn store_wait_read() {
    unsafe { asm!("cp.async.bulk.wait_group.read 0;", options(nostack)) };
}

/// `cp.async.bulk.wait_group 0;` waits until this thread's committed bulk
/// stores are complete (written to global memory).
#[inline(always)]
pub fn store_wait() {
    unsafe { asm!("cp.async.bulk.wait_group 0;", options(nostack)) };
}

/// `prefetch.tensormap [map];` fetches a tensor map into the TMA unit's cache.
#[inline(always)]
pub fn prefetch_map(map: u64) {
    unsafe { asm!("prefetch.tensormap [{m}];", m = in(reg64) map, options(nostack)) };
}

/// The generic address of an entry's first kernel parameter, for a tensor
/// map passed by value: `mov.b64 %rd, ENTRY_param_0; cvta.param.u64 %rd, %rd;`.
/// Taking `&param` in Rust would copy the map to local memory, which TMA
/// cannot read. `$entry` is the entry's exported name (a string literal).
macro_rules! param0_address {
    ($entry:expr) => {{
        let a: u64;
        // SAFETY: names a parameter of the entry this code is compiled into.
        unsafe {
            core::arch::asm!(
                concat!("mov.b64 {a}, ", $entry, "_param_0;\ncvta.param.u64 {a}, {a};"),
                a = out(reg64) a,
                options(pure, nomem, nostack),
            )
        };
        a
    }};
}
pub(crate) use param0_address;
