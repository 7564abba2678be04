//! The Hopper backward CTA: FlashAttention-2's Algorithm 2 (as
//! `kernels::backward`) with its five GEMMs on `wgmma`. The CTA's
//! warpgroups ([`HopperBwdTile`]) own [`WGMMA_M`] keys each of its key
//! block, and keep dK and dV of their keys in registers over every (query
//! head, query block) step that sees them:
//!
//! - Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, keys as rows, both operands in shared
//!   memory (K-major, as Q·Kᵀ in the forward);
//! - Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ - delta) in registers, which are (packed) the A
//!   fragments of dV += Pᵀ·dO and dK += dSᵀ·Q, with dO and Q as MN-major B
//!   (as V in the forward's P·V);
//! - dSᵀ to shared memory, where dQ = dS·K reads it as an MN-major A; each
//!   warpgroup takes its share of dQ's columns over all the block's keys,
//!   and adds them to the f32 buffer with vector atomics.
//!
//! Every 16-bit tile is in the SW128 layout (`index::sw128_offset`), staged
//! by `cp.async` (no tensor maps: the steps' query blocks jump between
//! heads), and the next step's Q, dO, LSE and `delta` copies run under the
//! current step's GEMMs, as in the `mma.sync` kernel.
use crate::arch::{barrier, fence, global, math, smem, special, wgmma};
use crate::config::{
    HopperBwdTile, CHUNK_ELEMS, HOPPER_BWD_BLOCK_M, WARPGROUP_THREADS, WARP_SIZE, WGMMA_M,
};
use crate::index::{
    block_needs_mask, k_major_desc, mn_major_desc, quad_of, sw128_offset, SW128_ATOM_BYTES,
    SW128_ROW_BYTES,
};
use crate::kernels::backward::{
    a_fragment, quad_swap, stage_keys, stage_queries, stage_rows, store_dk_dv, HeadPart, Rows,
    SeqSpan, StepScores, Steps,
};
use crate::kernels::copy;
use crate::kernels::element::Element;
use crate::kernels::policy::Scores;
use crate::params::BwdParams;
use crate::unroll::unroll;

/// Query n-tiles of Sᵀ and dPᵀ: one `wgmma` of n = [`HOPPER_BWD_BLOCK_M`].
const ST: usize = HOPPER_BWD_BLOCK_M / 8;
/// k-steps of dV += Pᵀ·dO and dK += dSᵀ·Q: the step's query rows.
const PK: usize = HOPPER_BWD_BLOCK_M / 16;

/// Stages `count` tokens of `src` into an SW128 tile of `count` rows.
#[inline(always)]
fn load_rows<T: Element, const D: usize>(tile: u32, count: u32, threads: (u32, u32), src: Rows) {
    stage_rows::<T, D>(count, threads, src, |r, c| tile + sw128_offset(r, c, count));
}

/// One Hopper backward CTA: key block `blockIdx.x` of a part of KV head
/// `blockIdx.y / head_splits`'s query heads ([`HeadPart`]) of sequence
/// `blockIdx.z`. `W` warpgroups, `DT = D/8` (n-tiles of dK and
/// dV), `QK = D/16` (k-steps of Sᵀ), `QT = DT/W` (n-tiles of a warpgroup's
/// share of dQ), `KK` = keys/16 (k-steps of dQ); checked against the tile
/// at compile time.
#[inline(always)]
pub fn backward<
    T: Element,
    S: Scores,
    const D: usize,
    const W: usize,
    const DT: usize,
    const QK: usize,
    const QT: usize,
    const KK: usize,
>(
    p: &BwdParams,
) {
    let tile = const { HopperBwdTile::of(D) };
    const {
        let t = HopperBwdTile::of(D);
        assert!(W == t.warpgroups && DT * 8 == D && QK * 16 == D);
        assert!(QT * W == DT && KK * 16 == t.block_n());
    }
    let tid = special::thread_idx_x();
    let (wg, warp, lane) = (
        tid / WARPGROUP_THREADS as u32,
        tid % WARPGROUP_THREADS as u32 / WARP_SIZE as u32,
        tid % WARP_SIZE as u32,
    );
    let (g, pair) = (lane / 4, lane % 4);
    let (n, head, b) = (
        special::block_idx_x(),
        HeadPart::of_cta(p),
        special::block_idx_z(),
    );
    let a = SW128_ATOM_BYTES;
    let base = (smem::base() + a - 1) & !(a - 1);
    let at = |offset: usize| base + offset as u32;
    let (k_s, v_s, ds_s) = (
        at(tile.k_offset()),
        at(tile.v_offset()),
        at(tile.ds_offset()),
    );
    let (bn, bm) = (tile.block_n() as u32, HOPPER_BWD_BLOCK_M as u32);
    let threads = (tid, tile.threads() as u32);

    let key0 = n * bn;
    let seq = SeqSpan::new(p, b);
    // The grid covers the longest sequence's keys (varlen).
    if key0 >= seq.seqlen_k {
        return;
    }
    let load =
        |tile: u32, count: u32, rows: Rows<'_>| load_rows::<T, D>(tile, count, threads, rows);
    stage_keys(p, &seq, (head.kv_head, key0), bn, (k_s, v_s), load);
    copy::commit();

    let keys = seq.keys(p);
    let steps = Steps::new(p, &keys, (n, head), bn, bm);
    let issue = |i: u32, stage: usize| {
        let (h, m) = steps.at(i);
        let tiles = (
            at(tile.q_offset(stage)),
            at(tile.do_offset(stage)),
            at(tile.stats_offset(stage)),
        );
        stage_queries(p, &seq, (h, m * bm), bm, tid, tiles, load);
    };
    if steps.count > 0 {
        issue(0, 0);
        copy::commit();
    }

    // This warpgroup's keys as the rows of an SW128 tile of the block's.
    let (k_rows, v_rows) = (
        k_s + wg * WGMMA_M as u32 * SW128_ROW_BYTES,
        v_s + wg * WGMMA_M as u32 * SW128_ROW_BYTES,
    );
    // Its share of dQ's columns: as K's columns, the B operand of dQ = dS·K.
    let dq_cols = wg * (D / W) as u32;
    let k_cols = k_s + sw128_offset(0, dq_cols / CHUNK_ELEMS as u32, bn);
    let warp_row = warp * 16;
    let mut dk = [[0f32; 4]; DT];
    let mut dv = [[0f32; 4]; DT];

    let mut i = 0;
    while i < steps.count {
        let (h, m) = steps.at(i);
        let q0 = m * bm;
        let stage = (i % 2) as usize;
        // Every thread is done with step i - 1, whose stage the next copies
        // overwrite, and whose dSᵀ the dQ GEMMs have read.
        barrier::sync_cta();
        if i + 1 < steps.count {
            issue(i + 1, 1 - stage);
        }
        copy::commit();
        copy::wait_pending(1);
        fence::proxy_async_shared();
        barrier::sync_cta();
        let (q_s, do_s) = (at(tile.q_offset(stage)), at(tile.do_offset(stage)));
        let lse_s = at(tile.stats_offset(stage));
        let delta_s = lse_s + bm * 4;

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ over the warpgroup's keys.
        let mut s = [[0f32; 4]; ST];
        let mut dp = [[0f32; 4]; ST];
        wgmma::fence_operands(&mut s);
        wgmma::fence_operands(&mut dp);
        wgmma::fence();
        unroll::<QK>(|kk| {
            let (ka, qb) = (
                k_major_desc(k_rows, bn, kk as u32),
                k_major_desc(q_s, bm, kk as u32),
            );
            wgmma::ss::<ST, 0, 0>(T::BF16, &mut s, ka, qb, (kk > 0) as u32);
        });
        unroll::<QK>(|kk| {
            let (va, ob) = (
                k_major_desc(v_rows, bn, kk as u32),
                k_major_desc(do_s, bm, kk as u32),
            );
            wgmma::ss::<ST, 0, 0>(T::BF16, &mut dp, va, ob, (kk > 0) as u32);
        });
        wgmma::commit_group();
        wgmma::wait_group::<0>();
        wgmma::fence_operands(&mut s);
        wgmma::fence_operands(&mut dp);

        // Pᵀ = exp(S - LSE) and dSᵀ = Pᵀ ∘ (dPᵀ - delta), masked.
        let masked = block_needs_mask(&keys, q0, q0 + bm - 1, n, bn);
        StepScores::new::<T, S>(p, &keys, (b, h), masked).p_and_ds(
            p,
            (&mut s, &mut dp),
            (lse_s, delta_s),
            (q0, key0 + wg * WGMMA_M as u32 + warp_row + g),
            lane,
        );
        let mut pf = [[0u32; 4]; PK];
        let mut dsf = [[0u32; 4]; PK];
        unroll::<PK>(|kk| {
            pf[kk] = a_fragment::<T>(&s[2 * kk], &s[2 * kk + 1]);
            dsf[kk] = a_fragment::<T>(&dp[2 * kk], &dp[2 * kk + 1]);
        });

        // dV += Pᵀ·dO and dK += dSᵀ·Q.
        wgmma::fence_operands(&mut dv);
        wgmma::fence_operands(&mut dk);
        wgmma::fence_fragments(&mut pf);
        wgmma::fence_fragments(&mut dsf);
        wgmma::fence();
        unroll::<PK>(|kk| {
            wgmma::rs::<DT, 1>(
                T::BF16,
                &mut dv,
                &pf[kk],
                mn_major_desc(do_s, bm, kk as u32),
                1,
            );
        });
        unroll::<PK>(|kk| {
            wgmma::rs::<DT, 1>(
                T::BF16,
                &mut dk,
                &dsf[kk],
                mn_major_desc(q_s, bm, kk as u32),
                1,
            );
        });
        wgmma::commit_group();

        // dSᵀ to shared memory (keys as rows), from its packed fragments:
        // fragment kk holds query chunks 2kk and 2kk + 1.
        unroll::<PK>(|kk| {
            unroll::<2>(|half| {
                let row = wg * WGMMA_M as u32 + warp_row + g + 8 * half as u32;
                unroll::<2>(|c| {
                    let chunk = 2 * kk as u32 + c as u32;
                    smem::st_b32(
                        ds_s + sw128_offset(row, chunk, bn) + 4 * pair,
                        dsf[kk][2 * c + half],
                    );
                });
            });
        });
        // Pᵀ and dSᵀ are free once dV and dK are done (the stores above ran
        // under them).
        wgmma::wait_group::<0>();
        wgmma::fence_operands(&mut dv);
        wgmma::fence_operands(&mut dk);
        wgmma::fence_fragments(&mut pf);
        wgmma::fence_fragments(&mut dsf);
        fence::proxy_async_shared();
        barrier::sync_cta();

        // The warpgroup's share of dQ = dS·K over all the block's keys.
        let mut dq = [[0f32; 4]; QT];
        wgmma::fence_operands(&mut dq);
        wgmma::fence();
        unroll::<KK>(|kk| {
            let (dsa, kb) = (
                mn_major_desc(ds_s, bn, kk as u32),
                mn_major_desc(k_cols, bn, kk as u32),
            );
            wgmma::ss::<QT, 1, 1>(T::BF16, &mut dq, dsa, kb, (kk > 0) as u32);
        });
        wgmma::commit_group();
        wgmma::wait_group::<0>();
        wgmma::fence_operands(&mut dq);

        let (r, c) = quad_of(lane);
        let t = q0 + warp_row + r;
        let dst = p.dq_accum + (seq.stat_row(p, h, t) * D as u64 + (dq_cols + c) as u64) * 4;
        unroll::<QT>(|d| {
            let v = quad_swap(dq[d], lane);
            if t < seq.seqlen_q {
                global::red_add_v4_f32(dst + d as u64 * 32, v);
            }
        });
        i += 1;
    }
    // A CTA that visits no query block still has its K/V copies in flight.
    copy::wait_all();

    let warp_key = key0 + wg * WGMMA_M as u32 + warp_row;
    store_dk_dv::<T, DT>(p, &seq, head, (warp_key, 0), lane, (&dk, &dv));
}
