//! Flash-decoding combine: O = Σ_s exp(lse_s - lse) · O_s with
//! lse = log Σ_s exp(lse_s) (+ exp(sink_h) with sinks, which carry no
//! value), for every (b, h, token) row.
use super::element::Element;
use crate::arch::{barrier, global, griddep, math, smem, special};
use crate::config::{combine_groups, COMBINE_ELEMS_PER_THREAD, COMBINE_SPLIT_GROUP};
use crate::params::CombineParams;
use crate::unroll::unroll;

const LOG2_E: f32 = core::f32::consts::LOG2_E;
const LN_2: f32 = core::f32::consts::LN_2;

/// A softmax state over some of a row's splits: the largest LSE m, the sum
/// of exp(lse_s - m) and this thread's columns of Σ exp(lse_s - m) · O_s.
struct Partial {
    m: f32,
    sum: f32,
    acc: [f32; COMBINE_ELEMS_PER_THREAD],
}

impl Partial {
    const EMPTY: Partial = Partial {
        m: f32::NEG_INFINITY,
        sum: 0.0,
        acc: [0.0; COMBINE_ELEMS_PER_THREAD],
    };

    /// Folds in a state `(m, sum, acc)` whose weights are relative to `m`.
    #[inline(always)]
    fn merge(&mut self, m: f32, sum: f32, acc: [f32; COMBINE_ELEMS_PER_THREAD]) {
        let new_m = self.m.max(m);
        // Until some state has seen a key every weight is 0: nothing to add.
        if new_m == f32::NEG_INFINITY {
            return;
        }
        let (old, add) = (
            math::ex2((self.m - new_m) * LOG2_E),
            math::ex2((m - new_m) * LOG2_E),
        );
        self.sum = math::fma(self.sum, old, sum * add);
        unroll::<COMBINE_ELEMS_PER_THREAD>(|e| {
            self.acc[e] = math::fma(self.acc[e], old, acc[e] * add)
        });
        self.m = new_m;
    }
}

#[inline(always)]
pub fn combine<T: Element, const D: usize>(p: &CombineParams) {
    let threads_per_row = (D / COMBINE_ELEMS_PER_THREAD) as u32;
    let groups = combine_groups(D) as u32;
    let tid = special::thread_idx_x();
    let rows = p.batch as u64 * p.heads as u64 * p.seqlen_q as u64;
    // The host's `combine_shape`; clamped so that a row's groups are in one CTA.
    let split_groups = p.split_groups.clamp(1, groups);
    let rows_per_cta = groups / split_groups;
    let group = tid / threads_per_row;
    let (row_in_cta, g) = (group / split_groups, group % split_groups);
    let row = special::block_idx_x() as u64 * rows_per_cta as u64 + row_in_cta as u64;
    let active = row_in_cta < rows_per_cta && row < rows;
    let col = ((tid % threads_per_row) as usize * COMBINE_ELEMS_PER_THREAD) as u64;
    let splits = p.num_splits as u64;
    // On sm_90 the host may launch this grid as a programmatic dependent of
    // the decode grid, scheduled at that grid's tail (`decode`): its CTAs
    // then wait here for the decode grid's partials.
    griddep::wait();

    // Group g of the row merges chunks g, g + split_groups, ... of
    // COMBINE_SPLIT_GROUP splits. A chunk's loads are all issued before any
    // is used (clamped to the last split, so every address is valid, and
    // masked after): one memory latency per chunk, not two per split.
    let last = splits.max(1) - 1;
    let mut part = Partial::EMPTY;
    let mut s0 = g as u64 * COMBINE_SPLIT_GROUP as u64;
    while active && s0 < splits {
        let mut lse = [0f32; COMBINE_SPLIT_GROUP];
        let mut o = [[0f32; COMBINE_ELEMS_PER_THREAD]; COMBINE_SPLIT_GROUP];
        unroll::<COMBINE_SPLIT_GROUP>(|i| {
            let s = (s0 + i as u64).min(last);
            lse[i] = global::ld_nc_f32(p.lse_accum + (s * rows + row) * 4);
            o[i] = global::ld_nc_v4_f32(p.o_accum + ((s * rows + row) * D as u64 + col) * 4);
        });
        let mut m = part.m;
        unroll::<COMBINE_SPLIT_GROUP>(|i| {
            if s0 + (i as u64) < splits {
                m = m.max(lse[i]);
            }
        });
        if m != f32::NEG_INFINITY {
            let scale = math::ex2((part.m - m) * LOG2_E);
            part.sum *= scale;
            unroll::<COMBINE_ELEMS_PER_THREAD>(|e| part.acc[e] *= scale);
            unroll::<COMBINE_SPLIT_GROUP>(|i| {
                if s0 + (i as u64) < splits {
                    let w = math::ex2((lse[i] - m) * LOG2_E);
                    part.sum += w;
                    unroll::<COMBINE_ELEMS_PER_THREAD>(|e| {
                        part.acc[e] = math::fma(w, o[i][e], part.acc[e])
                    });
                }
            });
            part.m = m;
        }
        s0 += split_groups as u64 * COMBINE_SPLIT_GROUP as u64;
    }

    // The row's groups meet in shared memory; its group 0 merges the others'
    // states into its own and writes the row. One group per row (a few
    // splits) needs neither (uniform: `split_groups` is the launch's).
    if split_groups > 1 {
        let base = smem::base();
        let acc_at = |grp: u32| base + (grp * D as u32 + col as u32) * 4;
        let state_at = |grp: u32| base + groups * D as u32 * 4 + grp * 8;
        if active {
            smem::st_v4_b32(acc_at(group), part.acc.map(f32::to_bits));
            if col == 0 {
                smem::st_v2_b32(state_at(group), part.m.to_bits(), part.sum.to_bits());
            }
        }
        barrier::sync_cta();
        if !active || g != 0 {
            return;
        }
        let mut other = group + 1;
        while other < group + split_groups {
            let (m, sum) = smem::ld_v2_b32(state_at(other));
            let acc = smem::ld_v4_b32(acc_at(other)).map(f32::from_bits);
            part.merge(f32::from_bits(m), f32::from_bits(sum), acc);
            other += 1;
        }
    } else if !active {
        return;
    }
    // 32-bit: the host keeps B·H·Sq rows below 2^32, and a 64-bit division
    // would be a ptxas subroutine with a stack frame.
    let (seqlen_q, heads) = (p.seqlen_q.max(1), p.heads.max(1));
    let (bh, token) = (row as u32 / seqlen_q, row as u32 % seqlen_q);
    let (b, h) = (bh / heads, bh % heads);
    // A sink carries no value: it joins the denominator only, as a state of
    // one key with LSE = sink.
    if p.sinks != 0 {
        part.merge(
            global::ld_nc_f32(p.sinks + h as u64 * 4),
            1.0,
            [0.0; COMBINE_ELEMS_PER_THREAD],
        );
    }
    let Partial { m, sum, acc } = part;
    let (inv, lse) = if sum > 0.0 {
        (math::rcp(sum), m + math::lg2(sum) * LN_2)
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
