//! Global -> shared copies of 16-byte chunks, and the only place that knows
//! how the GPU does them. sm_80+: `cp.async`, asynchronous, in commit groups
//! that the K/V ring waits for. sm_75 has no `cp.async`: a chunk goes through
//! registers (`ld.global.nc.v4` then `st.shared.v4`) and has landed when the
//! call returns, so committing and waiting do nothing there. Either way a
//! CTA barrier after the wait publishes a stage, as every caller does.
use crate::arch::{cp_async, global, smem};

/// Whether this module's copies are `cp.async` (sm_80+).
pub const ASYNC: bool = cfg!(target_feature = "sm_80");

/// Copies the 16 bytes at `src` to `dst`, or zeros when `src_bytes` is 0
/// (rows past the end; `src` is then not read).
#[inline(always)]
pub fn chunk(dst: u32, src: u64, src_bytes: u32) {
    if ASYNC {
        cp_async::cg_16(dst, src, src_bytes);
    } else {
        let v = if src_bytes != 0 {
            global::ld_nc_v4_b32(src)
        } else {
            [0; 4]
        };
        smem::st_v4_b32(dst, v);
    }
}

/// Copies the 4 bytes at `src` to `dst`, or zeros when `valid` is false
/// (`src` is then not read).
#[inline(always)]
pub fn word(dst: u32, src: u64, valid: bool) {
    if ASYNC {
        cp_async::ca_4(dst, src, if valid { 4 } else { 0 });
    } else {
        smem::st_b32(dst, if valid { global::ld_nc_b32(src) } else { 0 });
    }
}

/// Closes the group of copies issued so far.
#[inline(always)]
pub fn commit() {
    if ASYNC {
        cp_async::commit();
    }
}

/// Waits until at most `n` committed groups are pending (a constant after
/// inlining; see [`cp_async::wait_pending`]).
#[inline(always)]
pub fn wait_pending(n: u32) {
    if ASYNC {
        cp_async::wait_pending(n);
    }
}

/// [`wait_pending`] for a count known to lie in `lo..=hi` (constants after
/// inlining): one compare per count above `lo`. A count of any value compiles
/// to a jump table, an indirect branch at every key block of a ring whose
/// depth the launch picks.
#[inline(always)]
pub fn wait_pending_in(n: u32, lo: u32, hi: u32) {
    let mut k = lo;
    while k < hi {
        if n == k {
            wait_pending(k);
            return;
        }
        k += 1;
    }
    wait_pending(hi);
}

/// Waits for every committed group.
#[inline(always)]
pub fn wait_all() {
    if ASYNC {
        cp_async::wait_group::<0>();
    }
}
