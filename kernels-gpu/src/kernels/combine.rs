//! Flash-decoding combine: O = Σ_s exp(lse_s - lse) · O_s with
//! lse = log Σ_s exp(lse_s) (+ exp(sink_h) with sinks, which carry no
//! value), for every (b, h, token) row.
use super::element::Element;
use crate::arch::{global, math, special};
use crate::config::{combine_rows_per_cta, COMBINE_ELEMS_PER_THREAD, COMBINE_SPLIT_GROUP};
use crate::params::CombineParams;
use crate::unroll::unroll;

const LOG2_E: f32 = core::f32::consts::LOG2_E;
const LN_2: f32 = core::f32::consts::LN_2;

#[inline(always)]
pub fn combine<T: Element, const D: usize>(p: &CombineParams) {
    let threads_per_row = (D / COMBINE_ELEMS_PER_THREAD) as u32;
    let tid = special::thread_idx_x();
    let rows = p.batch as u64 * p.heads as u64 * p.seqlen_q as u64;
    let row_in_cta = tid / threads_per_row;
    let row = special::block_idx_x() as u64 * combine_rows_per_cta(D) as u64 + row_in_cta as u64;
    if row_in_cta as usize >= combine_rows_per_cta(D) || row >= rows {
        return;
    }
    // 32-bit: the host keeps B·H·Sq rows below 2^32, and a 64-bit division
    // would be a ptxas subroutine with a stack frame.
    let (seqlen_q, heads) = (p.seqlen_q.max(1), p.heads.max(1));
    let (bh, token) = (row as u32 / seqlen_q, row as u32 % seqlen_q);
    let (b, h) = (bh / heads, bh % heads);
    let col = ((tid % threads_per_row) as usize * COMBINE_ELEMS_PER_THREAD) as u64;
    let splits = p.num_splits as u64;

    // One pass over the splits in groups whose loads are all issued before
    // any is used (clamped to the last split, so every address is valid, and
    // masked after): one memory latency per group instead of two per split.
    // The running max moves per group (online softmax): acc and sum are
    // rescaled when it grows.
    let last = splits.max(1) - 1;
    let mut lse_max = f32::NEG_INFINITY;
    let mut acc = [0f32; COMBINE_ELEMS_PER_THREAD];
    let mut sum = 0.0;
    let mut s0 = 0;
    while s0 < splits {
        let mut lse = [0f32; COMBINE_SPLIT_GROUP];
        let mut part = [[0f32; COMBINE_ELEMS_PER_THREAD]; COMBINE_SPLIT_GROUP];
        unroll::<COMBINE_SPLIT_GROUP>(|i| {
            let s = (s0 + i as u64).min(last);
            lse[i] = global::ld_nc_f32(p.lse_accum + (s * rows + row) * 4);
            part[i] = global::ld_nc_v4_f32(p.o_accum + ((s * rows + row) * D as u64 + col) * 4);
        });
        let mut m = lse_max;
        unroll::<COMBINE_SPLIT_GROUP>(|i| {
            if s0 + (i as u64) < splits {
                m = m.max(lse[i]);
            }
        });
        // Until some split has seen a key every weight is 0: nothing to add.
        if m != f32::NEG_INFINITY {
            let scale = math::ex2((lse_max - m) * LOG2_E);
            sum *= scale;
            unroll::<COMBINE_ELEMS_PER_THREAD>(|e| acc[e] *= scale);
            unroll::<COMBINE_SPLIT_GROUP>(|i| {
                if s0 + (i as u64) < splits {
                    let w = math::ex2((lse[i] - m) * LOG2_E);
                    sum += w;
                    unroll::<COMBINE_ELEMS_PER_THREAD>(|e| {
                        acc[e] = math::fma(w, part[i][e], acc[e])
                    });
                }
            });
            lse_max = m;
        }
        s0 += COMBINE_SPLIT_GROUP as u64;
    }
    // A sink carries no value: it joins the denominator only.
    if p.sinks != 0 {
        let sink = global::ld_nc_f32(p.sinks + h as u64 * 4);
        let m = lse_max.max(sink);
        if m != f32::NEG_INFINITY {
            let scale = math::ex2((lse_max - m) * LOG2_E);
            sum = math::fma(sum, scale, math::ex2((sink - m) * LOG2_E));
            unroll::<COMBINE_ELEMS_PER_THREAD>(|e| acc[e] *= scale);
            lse_max = m;
        }
    }
    let (inv, lse) = if sum > 0.0 {
        (math::rcp(sum), lse_max + math::lg2(sum) * LN_2)
    } else {
        (0.0, f32::NEG_INFINITY)
    };

    let s = &p.o_strides;
    // Strides and `off` in 16-bit units (an f32 column is two).
    let col_units = col as i64 * (T::BYTES / 2) as i64;
    let off = b as i64 * s.batch + token as i64 * s.row + h as i64 * s.head + col_units;
    let dst = p.o.wrapping_add((off * 2) as u64);
    if T::BYTES == 4 {
        global::st_v4_b32(dst, acc.map(|a| (a * inv).to_bits()));
    } else {
        global::st_v2_b32(
            dst,
            T::pack(acc[0] * inv, acc[1] * inv),
            T::pack(acc[2] * inv, acc[3] * inv),
        );
    }
    if p.lse != 0 && col == 0 {
        global::st_f32(p.lse + row * 4, lse);
    }
}
