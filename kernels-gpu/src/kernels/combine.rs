//! Flash-decoding combine: O = Σ_s exp(lse_s - lse) · O_s with
//! lse = log Σ_s exp(lse_s) (+ exp(sink_h) with sinks, which carry no
//! value), for every (b, h, token) row, run by the last decode CTA of a row
//! block to finish (`decode::combine_if_last`).
use super::unroll::unroll;
use crate::arch::{global, math};
use crate::config::COMBINE_ELEMS_PER_THREAD;

const LOG2_E: f32 = core::f32::consts::LOG2_E;
const LN_2: f32 = core::f32::consts::LN_2;
/// Splits whose partials are loaded together. One at a time, the split loop
/// waited a memory latency per split and pass: ~30 µs at 75 splits on H100
/// (SmolLM-135M decode, B=1, 16k keys), more than the decode kernel itself.
const SPLIT_GROUP: usize = 8;

/// The split partials of one decode launch: f32 O [splits, rows, D] and f32
/// LSE [splits, rows] (natural log), row = (b · H + h) · Sq + token.
pub struct Partials {
    pub o: u64,
    pub lse: u64,
    pub rows: u64,
    pub splits: u64,
}

/// One thread's `COMBINE_ELEMS_PER_THREAD` columns from `col` of the combined
/// O of `row` (normalised), and the row's LSE. `sink` is the row's sink logit
/// (natural log; -inf without sinks). With `from_peers` the partials were
/// written by other CTAs of the running kernel, so they are read through L2
/// (`ld.global.cg`) rather than the non-coherent path.
#[inline(always)]
pub fn combine_row<const D: usize>(
    src: &Partials,
    row: u64,
    col: u64,
    sink: f32,
    from_peers: bool,
) -> ([f32; COMBINE_ELEMS_PER_THREAD], f32) {
    let ld = |a: u64| {
        if from_peers {
            global::ld_cg_f32(a)
        } else {
            global::ld_nc_f32(a)
        }
    };
    let ld4 = |a: u64| {
        if from_peers {
            global::ld_cg_v4_f32(a)
        } else {
            global::ld_nc_v4_f32(a)
        }
    };
    // Splits are visited in groups whose loads are all issued before any is
    // used (clamped to the last split, so every address is valid, and masked
    // after): one memory latency per group instead of one per split.
    let splits = src.splits;
    let last = splits.max(1) - 1;
    let lse_at = |s: u64| src.lse + (s.min(last) * src.rows + row) * 4;
    let mut lse_max = f32::NEG_INFINITY;
    let mut s0 = 0;
    while s0 < splits {
        let mut lse = [0f32; SPLIT_GROUP];
        unroll::<SPLIT_GROUP>(|i| lse[i] = ld(lse_at(s0 + i as u64)));
        unroll::<SPLIT_GROUP>(|i| {
            if s0 + (i as u64) < splits {
                lse_max = lse_max.max(lse[i]);
            }
        });
        s0 += SPLIT_GROUP as u64;
    }
    lse_max = lse_max.max(sink);
    let mut acc = [0f32; COMBINE_ELEMS_PER_THREAD];
    let mut sum = 0.0;
    if lse_max != f32::NEG_INFINITY {
        let mut s0 = 0;
        while s0 < splits {
            let mut lse = [0f32; SPLIT_GROUP];
            let mut part = [[0f32; COMBINE_ELEMS_PER_THREAD]; SPLIT_GROUP];
            unroll::<SPLIT_GROUP>(|i| {
                let s = (s0 + i as u64).min(last);
                lse[i] = ld(lse_at(s));
                part[i] = ld4(src.o + ((s * src.rows + row) * D as u64 + col) * 4);
            });
            unroll::<SPLIT_GROUP>(|i| {
                if s0 + (i as u64) < splits {
                    let w = math::ex2((lse[i] - lse_max) * LOG2_E);
                    sum += w;
                    unroll::<COMBINE_ELEMS_PER_THREAD>(|e| {
                        acc[e] = math::fma(w, part[i][e], acc[e])
                    });
                }
            });
            s0 += SPLIT_GROUP as u64;
        }
        // A sink carries no value: it only joins the denominator.
        sum += math::ex2((sink - lse_max) * LOG2_E);
    }
    if sum > 0.0 {
        let inv = math::rcp(sum);
        unroll::<COMBINE_ELEMS_PER_THREAD>(|e| acc[e] *= inv);
        (acc, lse_max + math::lg2(sum) * LN_2)
    } else {
        (acc, f32::NEG_INFINITY)
    }
}
