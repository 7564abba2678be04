//! The attention CTA: load Q once, stream K/V blocks through shared memory,
//! S = Q·Kᵀ and O += P·V on tensor cores, online softmax in between.
//!
//! Pipeline: a ring of `kv_stages` (K, V) stages; while block n is consumed,
//! the next `kv_stages - 1` blocks are in flight, and one barrier per block
//! both publishes the landed block and frees the stage consumed before it.
//! (FlashAttention-2's single K and V buffers, V(n) landing during Q·K(n)ᵀ and
//! K(n-1) during P·V(n), need two barriers per block and measured 2-9% slower;
//! docs/perf-notes.md, v8.) Key blocks are visited from the last to the first,
//! so the blocks that need a mask (the causal diagonal, the ragged end) come
//! first.
use super::block_info::BlockInfo;
use super::element::Element;
use super::epilogue;
use super::mask;
use super::smem_tile::{FragAddr, SmemTile};
use super::softmax::OnlineSoftmax;
use super::unroll::unroll;
use crate::arch::{barrier, cp_async, ldmatrix, smem, special};
use crate::config::{AttnTile, KernelKind, MMA_K, MMA_M, MMA_N, WARP_SIZE};
use crate::params::{AttnParams, BshStrides};

/// Per-lane fragment coordinates.
#[derive(Clone, Copy)]
pub struct Lane {
    pub tid: u32,
    pub warp: u32,
    pub lane: u32,
}

impl Lane {
    #[inline(always)]
    pub fn current() -> Lane {
        let tid = special::thread_idx_x();
        Lane {
            tid,
            warp: tid / WARP_SIZE as u32,
            lane: tid % WARP_SIZE as u32,
        }
    }
    /// Accumulator row group g (rows g and g + 8 of an m-tile).
    #[inline(always)]
    pub fn group(self) -> u32 {
        self.lane / 4
    }
    /// Accumulator column pair t (columns 2t, 2t + 1).
    #[inline(always)]
    pub fn pair(self) -> u32 {
        self.lane % 4
    }
    /// First CTA row of m-tile `mt` of this warp (a warp owns consecutive rows).
    #[inline(always)]
    pub fn tile_row(self, tile: AttnTile, mt: usize) -> u32 {
        (self.warp as usize * tile.warp_rows() + mt * MMA_M) as u32
    }
    /// CTA row of accumulator half `r` (0: row g, 1: row g + 8) of m-tile `mt`.
    #[inline(always)]
    pub fn acc_row(self, tile: AttnTile, mt: usize, r: usize) -> u32 {
        self.tile_row(tile, mt) + self.group() + 8 * r as u32
    }
}

/// Shared-memory tiles of one CTA, and the `ldmatrix` addressing they share.
struct Tiles<const D: usize> {
    base: u32,
    q: SmemTile<D>,
    k: SmemTile<D>,
    v: SmemTile<D>,
}

/// Per-warp register state: `MT` m-tiles of O accumulators and softmax
/// statistics, plus Q's A fragments when the tile keeps them in registers.
struct WarpState<const MT: usize, const QK: usize, const OT: usize> {
    q: [[[u32; 4]; QK]; MT],
    o: [[[f32; 4]; OT]; MT],
    softmax: [OnlineSoftmax; MT],
}

/// One attention CTA. `MT` = m-tiles per warp, `QK = D/16` (k-steps of Q·Kᵀ),
/// `OT = D/8` (n-tiles of O), `ST = block_n/8` (n-tiles of S); they are
/// separate parameters only because array lengths cannot be computed from the
/// tile on stable Rust, and are checked against it at compile time.
#[inline(always)]
pub fn attention<
    T: Element,
    const D: usize,
    const MT: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
    const CAUSAL: bool,
>(
    p: &AttnParams,
) {
    let tile = const { AttnTile::of(KernelKind::Forward, D) };
    const {
        let t = AttnTile::of(KernelKind::Forward, D);
        assert!(MT == t.m_tiles && QK * MMA_K == D && OT * MMA_N == D && ST * MMA_N == t.block_n);
        assert!(t.kv_stages >= 2, "the ring needs a stage in flight");
    }
    let lane = Lane::current();
    let info = BlockInfo::new::<CAUSAL>(p, tile, false, CAUSAL);
    let base = smem::base();
    let t = Tiles::<D> {
        base,
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

    t.q.load_async::<false>(tile.block_m, tile.threads(), lane.tid, p.q, |r| {
        info.q_row_ptr(p.q, &p.q_strides, r)
    });
    cp_async::commit();
    let stages = tile.kv_stages as u32;
    let stage_bytes = tile.stage_bytes() as u32;
    // The first kv_stages - 1 blocks (the last ones of the sequence) in flight.
    let mut s = 0;
    while s + 1 < stages {
        if info.n_lo + s < info.n_hi {
            load_stage::<D>(p, &t, &info, s * stage_bytes, info.n_hi - 1 - s, lane.tid);
        }
        cp_async::commit();
        s += 1;
    }
    cp_async::wait_pending(stages - 1);
    barrier::sync_cta();

    let frag = FragAddr::<D>::new(t.base, lane.lane);
    let mut w = WarpState::<MT, QK, OT> {
        q: [[[0u32; 4]; QK]; MT],
        o: [[[0f32; 4]; OT]; MT],
        softmax: [const { OnlineSoftmax::new() }; MT],
    };
    unroll::<MT>(|mt| {
        if tile.q_in_regs {
            unroll::<QK>(|kk| {
                w.q[mt][kk] = ldmatrix::x4(frag.at(
                    tile.q_smem_offset(),
                    lane.tile_row(tile, mt),
                    kk as u32 * 2,
                ))
            });
        }
    });

    let (mut read, mut write) = (0, stages - 1);
    let mut n = info.n_hi;
    while n > info.n_lo {
        n -= 1;
        // Block n has landed and every warp is done with the stage read
        // last, which is refilled now.
        cp_async::wait_pending(stages - 2);
        barrier::sync_cta();
        if n >= info.n_lo + stages - 1 {
            let ahead = n - (stages - 1);
            load_stage::<D>(p, &t, &info, write * stage_bytes, ahead, lane.tid);
        }
        cp_async::commit();
        let slot = read * stage_bytes;
        // Causal: one loop body whose mask is a uniform branch (the diagonal
        // blocks are interleaved with the rest, and a second body costs
        // registers D=128 does not have). Otherwise only the ragged last block
        // needs a mask, so the hot body is compiled without one. Both choices
        // were measured (docs/perf-notes.md, v3/v4).
        if CAUSAL {
            let masked = info.block_needs_mask::<CAUSAL>(n, tile.block_n as u32);
            kv_block::<T, D, MT, QK, OT, ST, CAUSAL>(p, &info, &t, lane, &mut w, n, slot, masked);
        } else if info.block_needs_mask::<CAUSAL>(n, tile.block_n as u32) {
            kv_block::<T, D, MT, QK, OT, ST, CAUSAL>(p, &info, &t, lane, &mut w, n, slot, true);
        } else {
            kv_block::<T, D, MT, QK, OT, ST, CAUSAL>(p, &info, &t, lane, &mut w, n, slot, false);
        }
        read = if read + 1 == stages { 0 } else { read + 1 };
        write = if write + 1 == stages { 0 } else { write + 1 };
    }

    let mut inv_l = [[0f32; 2]; MT];
    let mut lse = [[0f32; 2]; MT];
    unroll::<MT>(|mt| (inv_l[mt], lse[mt]) = w.softmax[mt].finalize());
    // The epilogue rebuilds the block info from the CTA coordinates rather than
    // keeping it live through the loop, which would cost registers there.
    let info = BlockInfo::new::<CAUSAL>(p, tile, false, CAUSAL);
    // Likewise the lane: the O staging addresses are then not the Q load's,
    // kept from the prologue.
    let lane = Lane::current();
    epilogue::write_output::<T, D, MT, OT>(p, &info, tile, t.q, lane, &w.o, inv_l, lse);
}

/// Issues the `cp.async` copies of key block `n` of K and V into the ring
/// stage at byte offset `slot`, as one group (committed by the caller).
#[inline(always)]
fn load_stage<const D: usize>(
    p: &AttnParams,
    t: &Tiles<D>,
    info: &BlockInfo,
    slot: u32,
    n: u32,
    tid: u32,
) {
    let k = SmemTile::<D> {
        base: t.k.base + slot,
    };
    let v = SmemTile::<D> {
        base: t.v.base + slot,
    };
    load_kv::<D, true>(k, info, p.k, &p.k_strides, n, tid);
    load_kv::<D, false>(v, info, p.v, &p.v_strides, n, tid);
}

/// Issues the `cp.async` copies of key block `n` of K or V, K in the
/// row-pairs layout (`ROW_PAIRS`, see `SmemTile::store_addr`).
#[inline(always)]
fn load_kv<const D: usize, const ROW_PAIRS: bool>(
    dst: SmemTile<D>,
    info: &BlockInfo,
    base: u64,
    strides: &BshStrides,
    n: u32,
    tid: u32,
) {
    const {
        let tile = AttnTile::of(KernelKind::Forward, D);
        assert!((tile.threads() / tile.row_chunks()) % crate::config::SWIZZLE_ROWS == 0);
    }
    let tile = const { AttnTile::of(KernelKind::Forward, D) };
    let first = n * tile.block_n as u32;
    dst.load_rows_async::<ROW_PAIRS>(
        tile.block_n,
        tile.threads(),
        tid,
        info.kv_row_ptr(base, strides, first),
        strides.row as u64 * 2,
        info.seqlen_k.saturating_sub(first),
    );
}

/// One key block: S = Q·K(n)ᵀ, mask (if `masked`), softmax update, O += P·V(n).
#[inline(always)]
fn kv_block<
    T: Element,
    const D: usize,
    const MT: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
    const CAUSAL: bool,
>(
    p: &AttnParams,
    info: &BlockInfo,
    t: &Tiles<D>,
    lane: Lane,
    w: &mut WarpState<MT, QK, OT>,
    n: u32,
    slot: u32,
    masked: bool,
) {
    let tile = const { AttnTile::of(KernelKind::Forward, D) };
    let bn = tile.block_n as u32;

    // S = Q·K(n)ᵀ. Per k-step: one A fragment per m-tile, and one ldmatrix.x4
    // of K gives the B fragments of two 8-key n-tiles, shared by all m-tiles.
    let mut s = [[[0f32; 4]; ST]; MT];
    let frag = FragAddr::<D>::new(t.base, lane.lane);
    unroll::<QK>(|kk| {
        let mut a = [[0u32; 4]; MT];
        unroll::<MT>(|mt| {
            a[mt] = if tile.q_in_regs {
                w.q[mt][kk]
            } else {
                ldmatrix::x4(frag.at(tile.q_smem_offset(), lane.tile_row(tile, mt), kk as u32 * 2))
            };
        });
        unroll::<ST>(|j| {
            if j % 2 == 0 {
                // Matrices, from K's row-pairs layout (`SmemTile::store_addr`):
                // (keys j*8.., dims 0-7), (keys j*8.., dims 8-15),
                // (keys j*8+8.., dims 0-7), (keys j*8+8.., dims 8-15).
                let b =
                    ldmatrix::x4(frag.at(tile.k_smem_offset(), j as u32 * 8, kk as u32 * 2) + slot);
                unroll::<MT>(|mt| {
                    T::mma(&mut s[mt][j], &a[mt], b[0], b[1]);
                    T::mma(&mut s[mt][j + 1], &a[mt], b[2], b[3]);
                });
            }
        });
    });
    if masked {
        // The lane's first accumulator row passes through `opaque_u32` so the
        // largest visible key of each of its rows is rebuilt here; LLVM would
        // otherwise hoist all 2 x MT limits out of the loop, live through
        // every key block.
        let row0 = special::opaque_u32(lane.acc_row(tile, 0, 0));
        unroll::<MT>(|mt| {
            let limits =
                [0, 1].map(|r| info.key_limit::<CAUSAL>(row0 + (mt * MMA_M + 8 * r) as u32));
            mask::apply(&mut s[mt], (n * bn + 2 * lane.pair()) as i32, limits);
        });
    }

    unroll::<MT>(|mt| w.softmax[mt].rescale(&s[mt], &mut w.o[mt], p.scale_log2));

    // O += P·V(n). The P of n-tiles 2kk and 2kk+1 is exactly the A fragment of
    // k-step kk once packed to 16 bits: P never leaves registers, and is
    // computed k-step by k-step so that S dies as P is consumed.
    unroll::<ST>(|j| {
        if j % 2 == 0 {
            let kk = j / 2;
            let mut a = [[0u32; 4]; MT];
            unroll::<MT>(|mt| {
                a[mt] = w.softmax[mt].p_fragment::<T>(&s[mt][j], &s[mt][j + 1], p.scale_log2);
            });
            unroll::<OT>(|d| {
                if d % 2 == 0 {
                    let b = ldmatrix::x4_trans(
                        frag.at(tile.v_smem_offset(), kk as u32 * 16, d as u32) + slot,
                    );
                    unroll::<MT>(|mt| {
                        T::mma(&mut w.o[mt][d], &a[mt], b[0], b[1]);
                        T::mma(&mut w.o[mt][d + 1], &a[mt], b[2], b[3]);
                    });
                }
            });
        }
    });
}
