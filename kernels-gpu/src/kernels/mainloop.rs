//! The forward attention CTA (FlashAttention-2, Algorithm 1): load Q once,
//! stream K/V blocks through the [`KvRing`], S = Q·Kᵀ and O += P·V on tensor
//! cores, the online softmax in between, and the policies of `policy` at
//! their places: score modifiers and the mask on S, sinks in the final
//! normalisation, the sequence layout in [`BlockInfo`]. Key blocks are
//! visited from the last to the first, so the blocks that need a mask (the
//! causal diagonal, the ragged end) come first.
use super::block_info::BlockInfo;
use super::copy;
use super::element::Element;
use super::epilogue;
use super::kv_ring::{self, KvRing};
use super::lane::Lane;
use super::mask;
use super::policy::{policies, Mask, Modifiers, Scores, Seq};
use super::smem_tile::{FragAddr, SmemTile};
use super::softmax::OnlineSoftmax;
use crate::arch::{global, ldmatrix, smem, special};
use crate::config::{AttnTile, KernelKind, MaskKind, PtxArch, MMA_K, MMA_M, MMA_N};
use crate::params::AttnParams;
use crate::unroll::unroll;

const LOG2_E: f32 = core::f32::consts::LOG2_E;

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
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const MT: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
>(
    p: &AttnParams,
) {
    let tile = const {
        AttnTile::of_variant(
            KernelKind::Forward,
            D,
            policies::<M, S, L>(),
            PtxArch::TARGET,
        )
    };
    const {
        let t = AttnTile::of_variant(
            KernelKind::Forward,
            D,
            policies::<M, S, L>(),
            PtxArch::TARGET,
        );
        assert!(MT == t.m_tiles && QK * MMA_K == D && OT * MMA_N == D && ST * MMA_N == t.block_n);
        assert!(t.kv_stages >= 2, "the ring needs a stage in flight");
    }
    let lane = Lane::current();
    let info = grid_tile::<M, S, L>(p, tile);
    if L::RAGGED && !info.has_rows() {
        // A packed sequence shorter than the grid's max_seqlen_q.
        return;
    }
    let base = smem::base();
    let q_tile = SmemTile::<D> {
        base: base + tile.q_smem_offset() as u32,
    };
    q_tile.load_async::<T, false>(tile.block_m, tile.threads(), lane.tid, p.q, |r| {
        info.q_row_ptr(p.q, &p.q_strides, r)
    });
    copy::commit();
    let blocks = info.n_hi - info.n_lo;
    let block = |i: u32| info.n_hi - 1 - i;
    let load = |stage: u32, i: u32| {
        kv_ring::load_block::<T, D>(p, &info, tile, stage, block(i), lane.tid, L::RAGGED)
    };
    let mut ring = KvRing::new(tile, base, tile.kv_stages);
    ring.prologue(blocks, load);
    ring.wait_before_prologue();
    crate::arch::barrier::sync_cta();

    let frag = FragAddr::<D>::new(base, lane.lane);
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
    let mods = Modifiers::new::<T, S>(p);
    // The CTA's one head: its ALiBi slope is uniform.
    let slope = if mods.alibi {
        Modifiers::slope(p, info.batch, info.head_base)
    } else {
        0.0
    };

    let mut i = 0;
    while i < blocks {
        ring.advance_to(i, blocks, load);
        let n = block(i);
        let slot = ring.read_offset();
        // Causal and local: one loop body whose mask is a uniform branch (the
        // diagonal blocks are interleaved with the rest, and a second body
        // costs registers D=128 does not have). Otherwise only the ragged
        // last block needs a mask, so the hot body is compiled without one.
        // Both choices were measured (docs/perf-notes.md, v3/v4).
        let masked = info.block_needs_mask(n, tile.block_n as u32);
        if !matches!(M::KIND, MaskKind::Full) || S::MODIFIED {
            kv_block::<T, M, S, L, D, MT, QK, OT, ST>(
                p, &info, base, lane, &mut w, n, slot, masked, mods, slope,
            );
        } else if masked {
            kv_block::<T, M, S, L, D, MT, QK, OT, ST>(
                p, &info, base, lane, &mut w, n, slot, true, mods, slope,
            );
        } else {
            kv_block::<T, M, S, L, D, MT, QK, OT, ST>(
                p, &info, base, lane, &mut w, n, slot, false, mods, slope,
            );
        }
        ring.rotate();
        i += 1;
    }

    // The epilogue rebuilds the block info from the CTA coordinates rather than
    // keeping it live through the loop, which would cost registers there.
    let info = grid_tile::<M, S, L>(p, tile);
    // Likewise the lane: the O staging addresses are then not the Q load's,
    // kept from the prologue.
    let lane = Lane::current();
    let mut inv_l = [[0f32; 2]; MT];
    let mut lse = [[0f32; 2]; MT];
    let sink = if S::MODIFIED && p.sinks != 0 {
        Some(global::ld_nc_f32(p.sinks + info.head_base as u64 * 4) * LOG2_E)
    } else {
        None
    };
    unroll::<MT>(|mt| (inv_l[mt], lse[mt]) = w.softmax[mt].finalize(sink.map(|s| [s, s])));
    epilogue::write_output::<T, D, MT, OT>(p, &info, tile, q_tile, lane, &w.o, inv_l, lse);
}

/// The CTA's tile. The wave of the balanced order is estimated from the
/// entry's `min_ctas_per_sm` (v49): where more CTAs fit, the tail spans
/// fewer real waves, and the order is still a permutation of the grid.
#[inline(always)]
fn grid_tile<M: Mask, S: Scores, L: Seq>(p: &AttnParams, tile: AttnTile) -> BlockInfo {
    BlockInfo::of_grid::<M, S, L>(p, tile.block_m, tile.block_n, tile.min_ctas_per_sm)
}

/// One key block: S = Q·K(n)ᵀ, score modifiers, mask (if `masked`), softmax
/// update, O += P·V(n).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn kv_block<
    T: Element,
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const MT: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
>(
    p: &AttnParams,
    info: &BlockInfo,
    base: u32,
    lane: Lane,
    w: &mut WarpState<MT, QK, OT>,
    n: u32,
    slot: u32,
    masked: bool,
    mods: Modifiers,
    slope: f32,
) {
    let tile = const {
        AttnTile::of_variant(
            KernelKind::Forward,
            D,
            policies::<M, S, L>(),
            PtxArch::TARGET,
        )
    };
    let bn = tile.block_n as u32;

    // S = Q·K(n)ᵀ. Per k-step: one A fragment per m-tile, and one ldmatrix.x4
    // of K gives the B fragments of two 8-key n-tiles, shared by all m-tiles.
    let mut s = [[[0f32; 4]; ST]; MT];
    let frag = FragAddr::<D>::new(base, lane.lane);
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
    let key0 = (n * bn + 2 * lane.pair()) as i32;
    // A capped block with no mask and no bias takes its row max from the raw
    // scores and caps each score right before its exponential
    // (`OnlineSoftmax::rescale_capped`). Not in the window entries: their
    // mask variants beside a second P·V loop spilled on sm_90 (ptxas 13.0,
    // D = 128; docs/perf-notes.md, v53).
    if S::MODIFIED && !M::LEFT && mods.softcap && !mods.alibi && !mods.fixed_max && !masked {
        unroll::<MT>(|mt| {
            w.softmax[mt].rescale_capped(&s[mt], &mut w.o[mt], p.scale_log2, p.softcap_pre)
        });
        p_times_v::<T, D, MT, QK, OT, ST>(
            frag,
            tile,
            w,
            &s,
            slot,
            p.scale_log2,
            Some(p.softcap_pre),
        );
        return;
    }
    if S::MODIFIED && (mods.softcap || mods.alibi) {
        let row0 = special::opaque_u32(lane.acc_row(tile, 0, 0));
        unroll::<MT>(|mt| {
            let pos = [0, 1].map(|r| info.key_pos(row0 + (mt * MMA_M + 8 * r) as u32));
            mods.apply(p, &mut s[mt], key0, pos, [slope; 2]);
        });
    }
    if masked {
        // The lane's first accumulator row passes through `opaque_u32` so the
        // visible keys of each of its rows are rebuilt here; LLVM would
        // otherwise hoist all 2 x MT limits out of the loop, live through
        // every key block.
        let row0 = special::opaque_u32(lane.acc_row(tile, 0, 0));
        let edges = info.mask_edges(n, bn);
        unroll::<MT>(|mt| {
            let rows = [0, 1].map(|r| row0 + (mt * MMA_M + 8 * r) as u32);
            if T::BYTES == 4 {
                mask::apply_rows_both::<M, ST>(&mut s[mt], key0, info, rows);
            } else {
                mask::apply_rows::<M, ST>(&mut s[mt], key0, info, rows, edges);
            }
        });
    }

    if mods.fixed_max {
        unroll::<MT>(|mt| w.softmax[mt].hold_fixed_max());
    } else {
        unroll::<MT>(|mt| w.softmax[mt].rescale(&s[mt], &mut w.o[mt], p.scale_log2));
    }

    p_times_v::<T, D, MT, QK, OT, ST>(frag, tile, w, &s, slot, p.scale_log2, None);
}

/// O += P·V(n). The P of n-tiles 2kk and 2kk+1 is exactly the A fragment of
/// k-step kk once packed to 16 bits: P never leaves registers, and is
/// computed k-step by k-step so that S dies as P is consumed. With
/// `cap_pre`, S is raw and each score is capped on the way
/// (`OnlineSoftmax::p_fragment_capped`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn p_times_v<
    T: Element,
    const D: usize,
    const MT: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
>(
    frag: FragAddr<D>,
    tile: AttnTile,
    w: &mut WarpState<MT, QK, OT>,
    s: &[[[f32; 4]; ST]; MT],
    slot: u32,
    scale_log2: f32,
    cap_pre: Option<f32>,
) {
    unroll::<ST>(|j| {
        if j % 2 == 0 {
            let kk = j / 2;
            let mut a = [[0u32; 4]; MT];
            unroll::<MT>(|mt| {
                let (lo, hi) = (&s[mt][j], &s[mt][j + 1]);
                a[mt] = match cap_pre {
                    Some(pre) => w.softmax[mt].p_fragment_capped::<T>(lo, hi, scale_log2, pre),
                    None => w.softmax[mt].p_fragment::<T>(lo, hi, scale_log2),
                };
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
