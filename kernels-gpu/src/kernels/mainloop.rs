//! The attention CTA: load Q once, stream K/V blocks through shared memory,
//! S = Q·Kᵀ and O += P·V on tensor cores, online softmax in between.
//!
//! Pipeline (FlashAttention-2's, single K and V buffers): while S = Q·K(n)ᵀ is
//! computed, V(n) is in flight; while the softmax and O += P·V(n) run, K(n-1) is.
//! Key blocks are visited from the last to the first, so the blocks that need a
//! mask (the causal diagonal, the ragged end) come first.
use super::block_info::BlockInfo;
use super::element::Element;
use super::epilogue;
use super::mask;
use super::smem_tile::SmemTile;
use super::softmax::OnlineSoftmax;
use super::unroll::unroll;
use crate::arch::{barrier, cp_async, ldmatrix, smem, special};
use crate::config::{AttnTile, MMA_K, MMA_M, MMA_N, WARP_SIZE};
use crate::params::AttnParams;

/// Per-lane fragment coordinates inside the warp's 16-row slice.
#[derive(Clone, Copy)]
pub struct Lane {
    pub tid: u32,
    pub warp: u32,
    pub lane: u32,
}

impl Lane {
    #[inline(always)]
    fn current() -> Lane {
        let tid = special::thread_idx_x();
        Lane {
            tid,
            warp: tid / WARP_SIZE as u32,
            lane: tid % WARP_SIZE as u32,
        }
    }
    /// Accumulator row group g (rows g and g + 8).
    #[inline(always)]
    pub fn group(self) -> u32 {
        self.lane / 4
    }
    /// Accumulator column pair t (columns 2t, 2t + 1).
    #[inline(always)]
    pub fn pair(self) -> u32 {
        self.lane % 4
    }
    /// First CTA row of this warp.
    #[inline(always)]
    pub fn warp_row(self) -> u32 {
        self.warp * MMA_M as u32
    }
}

/// Shared-memory tiles of one CTA.
struct Tiles<const D: usize> {
    q: SmemTile<D>,
    k: SmemTile<D>,
    v: SmemTile<D>,
}

/// One attention CTA. `QK = D/16` (k-steps of Q·Kᵀ), `OT = D/8` (n-tiles of O),
/// `ST = block_n/8` (n-tiles of S); they are separate parameters only because
/// array lengths cannot be computed from `D` on stable Rust.
#[inline(always)]
pub fn attention<
    T: Element,
    const D: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
    const CAUSAL: bool,
    const DECODE: bool,
>(
    p: &AttnParams,
) {
    let tile = const { AttnTile::of(D) };
    const {
        assert!(QK * MMA_K == D && OT * MMA_N == D && ST * MMA_N == AttnTile::of(D).block_n);
    }
    let lane = Lane::current();
    let info = BlockInfo::new::<CAUSAL>(p, tile);
    let base = smem::base();
    let t = Tiles::<D> {
        q: SmemTile {
            base: base + tile.q_smem_offset() as u32,
        },
        k: SmemTile {
            base: base + tile.k_smem_offset() as u32,
        },
        v: SmemTile {
            base: base + tile.v_smem_offset() as u32,
        },
    };

    let q_fallback = p.q;
    t.q.load_async(tile.block_m, tile.threads(), lane.tid, q_fallback, |r| {
        info.q_row_ptr(p.q, &p.q_strides, r)
    });
    cp_async::commit();
    if info.n_lo < info.n_hi {
        load_kv::<D>(t.k, &info, p.k, &p.k_strides, info.n_hi - 1, lane.tid);
    }
    cp_async::wait_group::<0>();
    barrier::sync_cta();

    // Q stays in registers for the whole CTA: one A fragment per k-step.
    let mut q = [[0u32; 4]; QK];
    let q_addr = t.q.frag_addr(lane.lane % 16, lane.lane / 16);
    unroll::<QK>(|kk| q[kk] = ldmatrix::x4(q_addr.at(lane.warp_row(), kk as u32 * 2)));

    let row0 = lane.warp_row() + lane.group();
    let limits = [
        info.key_limit::<CAUSAL>(row0),
        info.key_limit::<CAUSAL>(row0 + 8),
    ];
    let mut o = [[0f32; 4]; OT];
    let mut softmax = OnlineSoftmax::new();
    let mut n = info.n_hi;
    while n > info.n_lo {
        n -= 1;
        if info.block_needs_mask::<CAUSAL>(n, tile.block_n as u32) {
            kv_block::<T, D, QK, OT, ST, true>(
                p,
                &info,
                &t,
                lane,
                &q,
                &mut o,
                &mut softmax,
                limits,
                n,
            );
        } else {
            kv_block::<T, D, QK, OT, ST, false>(
                p,
                &info,
                &t,
                lane,
                &q,
                &mut o,
                &mut softmax,
                limits,
                n,
            );
        }
    }

    let (inv_l, lse) = softmax.finalize(p.scale_log2);
    if DECODE && p.num_splits > 1 {
        epilogue::write_partial::<D, OT>(p, &info, lane, &o, inv_l, lse);
    } else {
        epilogue::write_output::<T, D, OT>(p, &info, t.q, lane, &o, inv_l, lse);
    }
}

/// Issues and commits the `cp.async` copies of key block `n` of K or V.
#[inline(always)]
fn load_kv<const D: usize>(
    dst: SmemTile<D>,
    info: &BlockInfo,
    base: u64,
    strides: &crate::params::BshStrides,
    n: u32,
    tid: u32,
) {
    const {
        let tile = AttnTile::of(D);
        assert!((tile.threads() / tile.row_chunks()) % crate::config::SWIZZLE_ROWS == 0);
    }
    let tile = const { AttnTile::of(D) };
    let first = n * tile.block_n as u32;
    let src = info.kv_row_ptr(base, strides, first);
    let valid = info.seqlen_k.saturating_sub(first);
    dst.load_rows_async(
        tile.block_n,
        tile.threads(),
        tid,
        src,
        strides.row as u64 * 2,
        valid,
    );
    cp_async::commit();
}

/// One key block: S = Q·K(n)ᵀ, mask, softmax update, O += P·V(n).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn kv_block<
    T: Element,
    const D: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
    const MASK: bool,
>(
    p: &AttnParams,
    info: &BlockInfo,
    t: &Tiles<D>,
    lane: Lane,
    q: &[[u32; 4]; QK],
    o: &mut [[f32; 4]; OT],
    softmax: &mut OnlineSoftmax,
    limits: [i32; 2],
    n: u32,
) {
    let bn = const { AttnTile::of(D).block_n } as u32;
    // K(n) has landed and every warp is done with V(n+1): V(n) may be overwritten.
    cp_async::wait_group::<0>();
    barrier::sync_cta();
    load_kv::<D>(t.v, info, p.v, &p.v_strides, n, lane.tid);

    // S = Q·K(n)ᵀ. One ldmatrix.x4 of K gives the B fragments of two 8-key n-tiles.
    let mut s = [[0f32; 4]; ST];
    let k_addr =
        t.k.frag_addr(lane.lane % 8 + (lane.lane / 16) * 8, (lane.lane / 8) % 2);
    unroll::<ST>(|j| {
        let nn = j / 2;
        if j % 2 == 0 {
            unroll::<QK>(|kk| {
                let b = ldmatrix::x4(k_addr.at(nn as u32 * 16, kk as u32 * 2));
                T::mma(&mut s[2 * nn], &q[kk], b[0], b[1]);
                T::mma(&mut s[2 * nn + 1], &q[kk], b[2], b[3]);
            });
        }
    });
    if MASK {
        mask::apply(&mut s, (n * bn + 2 * lane.pair()) as i32, limits);
    }

    // V(n) has landed and every warp is done with K(n): prefetch K(n-1).
    cp_async::wait_group::<0>();
    barrier::sync_cta();
    if n > info.n_lo {
        load_kv::<D>(t.k, info, p.k, &p.k_strides, n - 1, lane.tid);
    }

    softmax.update(&mut s, o, p.scale_log2);

    // O += P·V(n). The S accumulators of n-tiles 2kk and 2kk+1 are exactly the
    // A fragment of k-step kk once packed to 16 bits: P never leaves registers.
    let v_addr =
        t.v.frag_addr(lane.lane % 8 + ((lane.lane / 8) % 2) * 8, lane.lane / 16);
    unroll::<ST>(|j| {
        if j % 2 == 0 {
            let kk = j / 2;
            let (lo, hi) = (&s[2 * kk], &s[2 * kk + 1]);
            let a = [
                T::pack(lo[0], lo[1]),
                T::pack(lo[2], lo[3]),
                T::pack(hi[0], hi[1]),
                T::pack(hi[2], hi[3]),
            ];
            unroll::<OT>(|d| {
                if d % 2 == 0 {
                    let dd = d / 2;
                    let b = ldmatrix::x4_trans(v_addr.at(kk as u32 * 16, dd as u32 * 2));
                    T::mma(&mut o[2 * dd], &a, b[0], b[1]);
                    T::mma(&mut o[2 * dd + 1], &a, b[2], b[3]);
                }
            });
        }
    });
}
