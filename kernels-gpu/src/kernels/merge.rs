//! Merging two attention states over disjoint key sets (ring attention,
//! context parallelism, shared-prefix attention): lse = log(e^lse_a +
//! e^lse_b), O = e^(lse_a - lse)·O_a + e^(lse_b - lse)·O_b. A state whose
//! LSE is -inf saw no key and contributes nothing; both -inf give O = 0.
use super::element::Element;
use crate::arch::{global, math, special};
use crate::config::MERGE_THREADS;
use crate::params::{BshStrides, MergeParams};
use crate::unroll::unroll;

const LOG2_E: f32 = core::f32::consts::LOG2_E;
const LN_2: f32 = core::f32::consts::LN_2;

#[inline(always)]
fn chunk_ptr(base: u64, s: &BshStrides, (b, t, h): (u64, u64, u64), chunk: u64) -> u64 {
    let off = b as i64 * s.batch + t as i64 * s.row + h as i64 * s.head + chunk as i64 * 8;
    base.wrapping_add((off * 2) as u64)
}

/// One thread per 16-byte chunk (8 elements) of a (b, t, h) row.
#[inline(always)]
pub fn merge<T: Element>(p: &MergeParams) {
    let idx = special::block_idx_x() as u64 * MERGE_THREADS as u64 + special::thread_idx_x() as u64;
    let chunks = p.row_chunks.max(1) as u64;
    let (s, h) = (p.seqlen.max(1) as u64, p.heads.max(1) as u64);
    if idx >= p.batch as u64 * s * h * chunks {
        return;
    }
    let (row, chunk) = (idx / chunks, idx % chunks);
    let (bt, head) = (row / h, row % h);
    let (b, t) = (bt / s, bt % s);
    let lse_row = (b * h + head) * s + t;
    let (la, lb) = (
        global::ld_nc_f32(p.lse_a + lse_row * 4),
        global::ld_nc_f32(p.lse_b + lse_row * 4),
    );
    let m = la.max(lb);
    let (wa, wb, lse) = if m == f32::NEG_INFINITY {
        (0.0, 0.0, f32::NEG_INFINITY)
    } else {
        let (ea, eb) = (math::ex2((la - m) * LOG2_E), math::ex2((lb - m) * LOG2_E));
        let inv = math::rcp(ea + eb);
        (ea * inv, eb * inv, m + math::lg2(ea + eb) * LN_2)
    };
    let at = (b, t, head);
    let a = global::ld_nc_v4_b32(chunk_ptr(p.o_a, &p.o_a_strides, at, chunk));
    let bv = global::ld_nc_v4_b32(chunk_ptr(p.o_b, &p.o_b_strides, at, chunk));
    let mut out = [0u32; 4];
    unroll::<4>(|e| {
        let (a0, a1) = T::unpack(a[e]);
        let (b0, b1) = T::unpack(bv[e]);
        out[e] = T::pack(math::fma(wa, a0, wb * b0), math::fma(wa, a1, wb * b1));
    });
    global::st_v4_b32(chunk_ptr(p.o, &p.o_strides, at, chunk), out);
    if p.lse != 0 && chunk == 0 {
        global::st_f32(p.lse + lse_row * 4, lse);
    }
}
