//! The flash-decoding CTA: a few query rows (the query heads of one KV head
//! times the new tokens, packed), many keys, so the kernel is bound by HBM
//! reads of K and V.
//!
//! All warps share the CTA's 16 rows; each takes its own 16-key slice of every
//! 64-key block, so no warp computes on rows it does not have and the MMA work
//! per byte stays small. K/V blocks stream through a ring of `kv_stages`
//! shared-memory stages with `kv_stages - 1` blocks in flight (one barrier per
//! block). At the end the warps' softmax states (m, l, O) are merged through
//! shared memory and written as the final O or as this split's partial.
use super::block_info::BlockInfo;
use super::copy;
use super::element::Element;
use super::kv_ring::{self, KvRing};
use super::lane::Lane;
use super::mask;
use super::policy::{Dense, Mask, Modifiers, Scores, Seq};
use super::smem_tile::{FragAddr, SmemTile};
use super::softmax::OnlineSoftmax;
use crate::arch::{barrier, global, ldmatrix, math, smem};
use crate::config::{
    AttnTile, KernelKind, PtxArch, WarpSplit, CHUNK_ELEMS, MMA_K, MMA_N, WARP_KEYS,
};
use crate::params::AttnParams;
use crate::unroll::unroll;

/// ln(2): converts the log2-domain LSE back to natural log.
const LN_2: f32 = core::f32::consts::LN_2;
const LOG2_E: f32 = core::f32::consts::LOG2_E;
/// 8-key n-tiles of S in one warp's slice.
const SLICE_TILES: usize = WARP_KEYS / MMA_N;

/// One decode CTA. `QK = D/16` (k-steps of Q·Kᵀ), `OT = D/8` (n-tiles of O).
/// `L`: `Dense` (a dense or paged cache), or `Folded`, whose D is twice the
/// cache's head dim: two adjacent KV heads read as one (`SeqKind::Folded`).
#[inline(always)]
pub fn decode<
    T: Element,
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const QK: usize,
    const OT: usize,
>(
    p: &AttnParams,
) {
    let tile = const { AttnTile::of(KernelKind::Decode, D, PtxArch::TARGET) };
    const {
        let t = AttnTile::of(KernelKind::Decode, D, PtxArch::TARGET);
        assert!(QK * MMA_K == D && OT * MMA_N == D);
        assert!(matches!(t.split, WarpSplit::Keys) && t.m_tiles == 1 && t.block_m == 16);
        assert!(t.block_n == t.warps * WARP_KEYS && t.kv_stages >= 2);
        assert!(SLICE_TILES == 2);
    }
    // The ring depth is the launch's (uniform): the host sizes shared memory for it.
    let max_stages = tile.kv_stages;
    let tile = tile.with_stages(p.kv_stages as usize);
    let lane = Lane::current();
    let info = BlockInfo::new::<M, Dense>(p, tile.block_m, tile.block_n, true, false);
    let base = smem::base();
    let blocks = info.n_hi - info.n_lo;
    // Blocks are visited from the last to the first, so the one that may need
    // the ragged-end or causal mask comes first.
    let block = |i: u32| info.n_hi - 1 - i;
    let load = |stage: u32, i: u32| {
        kv_ring::load_block::<T, D>(p, &info, tile, stage, block(i), lane.tid, true)
    };

    let q_tile = SmemTile::<D> {
        base: base + tile.q_smem_offset() as u32,
    };
    // Folded KV heads (`SeqKind::Folded`): a row's query fills its own
    // head's half of the folded row, the other half is zeros, so each row's
    // S is its own head's q·k.
    let q_row = |r: u32| info.q_row_ptr(p.q, &p.q_strides, r);
    if L::FOLDED {
        let chunk_bytes = (CHUNK_ELEMS as u32 * T::BYTES) as u64;
        let chunks = tile.row_chunks() as u32;
        q_tile.load_chunks_async::<T, false>(
            tile.block_m,
            tile.threads(),
            lane.tid,
            p.q,
            |r, c| {
                let (first, count) = info.fold_chunks(r, chunks);
                let own = c.wrapping_sub(first);
                q_row(r)
                    .filter(|_| own < count)
                    .map(|row| row + own as u64 * chunk_bytes)
            },
        );
    } else {
        q_tile.load_async::<T, false>(tile.block_m, tile.threads(), lane.tid, p.q, q_row);
    }
    copy::commit();
    // After an append (`seqlen_new` > 0 exactly then) the host may launch
    // this grid on sm_90 as a programmatic dependent, started before the
    // append grid completes; Q, the lengths and the block table are not the
    // append's output, the cache is. Other launches have nothing to wait for.
    #[cfg(target_feature = "sm_90")]
    if p.seqlen_new != 0 {
        crate::arch::griddep::wait();
    }
    let mut ring = KvRing::new(tile, base, max_stages);
    ring.prologue(blocks, load);
    // When Q borrows the last stage, that stage is first refilled after the
    // loop's first barrier, when every warp holds Q in registers.
    ring.wait_before_prologue();
    barrier::sync_cta();
    let frag = FragAddr::<D>::new(base, lane.lane);
    let q_frag = |kk: usize| ldmatrix::x4(frag.at(tile.q_smem_offset(), 0, kk as u32 * 2));
    let mut q = [[0u32; 4]; QK];
    if tile.q_in_regs {
        unroll::<QK>(|kk| q[kk] = q_frag(kk));
    }
    let rows = [0, 1].map(|r| lane.group() + 8 * r);
    let mods = Modifiers::new::<T, S>(p);
    // Rows hold different heads (the packed query heads of the KV head).
    let slopes = if mods.alibi {
        rows.map(|r| Modifiers::slope(p, info.batch, info.head(r)))
    } else {
        [0.0; 2]
    };

    let mut o = [[0f32; 4]; OT];
    let mut softmax = OnlineSoftmax::new();
    let slice = lane.warp * (WARP_KEYS * tile.smem_row_bytes()) as u32;
    let mut i = 0;
    while i < blocks {
        ring.advance_to(i, blocks, load);
        let n = block(i);
        let kv = ring.read_offset() + slice;
        // S = Q·K_sliceᵀ: one ldmatrix.x4 of K (row-pairs layout,
        // `SmemTile::store_addr`) gives both 8-key n-tiles of a k-step.
        // The even and odd k-steps accumulate apart, halving the chain of
        // dependent MMAs that a warp, alone on its scheduler in a short
        // step, waits through (docs/perf-notes.md, v62). Not in the f32
        // D = 256 entries (Q re-read, f32 staging): the window one spilled.
        let split = tile.q_in_regs || T::BYTES == 2;
        let mut s = [[0f32; 4]; SLICE_TILES];
        let mut s_odd = [[0f32; 4]; SLICE_TILES];
        unroll::<QK>(|kk| {
            let b = ldmatrix::x4(frag.at(tile.k_smem_offset(), 0, kk as u32 * 2) + kv);
            let a = if tile.q_in_regs { q[kk] } else { q_frag(kk) };
            let acc = if split && kk % 2 == 1 {
                &mut s_odd
            } else {
                &mut s
            };
            T::mma(&mut acc[0], &a, b[0], b[1]);
            T::mma(&mut acc[1], &a, b[2], b[3]);
        });
        if split {
            unroll::<SLICE_TILES>(|t| unroll::<4>(|e| s[t][e] += s_odd[t][e]));
        }
        let key0 =
            (n * tile.block_n as u32 + lane.warp * WARP_KEYS as u32 + 2 * lane.pair()) as i32;
        if S::MODIFIED && (mods.softcap || mods.alibi) {
            mods.apply(p, &mut s, key0, rows.map(|r| info.key_pos(r)), slopes);
        }
        if info.block_needs_mask(n, tile.block_n as u32) {
            let edges = info.mask_edges(n, tile.block_n as u32);
            mask::apply_rows::<M, SLICE_TILES>(&mut s, key0, &info, rows, edges);
        }
        softmax.rescale(&s, &mut o, p.scale_log2);
        // O += P·V_slice: the slice is exactly one k-step, P its A fragment.
        let a = softmax.p_fragment::<T>(&s[0], &s[1], p.scale_log2);
        unroll::<OT>(|d| {
            if d % 2 == 0 {
                let b = ldmatrix::x4_trans(frag.at(tile.v_smem_offset(), 0, d as u32) + kv);
                T::mma(&mut o[d], &a, b[0], b[1]);
                T::mma(&mut o[d + 1], &a, b[2], b[3]);
            }
        });
        ring.rotate();
        i += 1;
    }

    // The combine grid (a programmatic dependent launch on sm_90) may be
    // scheduled once every decode CTA is past its key blocks: it waits for
    // this grid's completion itself, and by then most SMs have room for it.
    // Only where the instruction exists: the empty call alone reordered the
    // sm_75 / sm_80 modules' blocks.
    #[cfg(target_feature = "sm_90")]
    crate::arch::griddep::launch_dependents();
    // Sinks join the final normalisation only; split partials leave them to
    // the combine kernel, which adds each row's once.
    let sinks = S::MODIFIED && p.sinks != 0 && p.num_splits <= 1;
    merge_warps::<D, OT>(p, &info, tile, lane, base, &softmax, &o, sinks);
    write_rows::<T, L>(p, &info, tile, lane, base, sinks);
}

/// Shared-memory address of warp `w`'s statistic `stat` (0: m, 1: l) of row `row`.
#[inline(always)]
fn stat_addr(tile: AttnTile, base: u32, stat: u32, w: u32, row: u32) -> u32 {
    let (warps, rows) = (tile.warps as u32, tile.block_m as u32);
    base + tile.merge_stats_offset() as u32 + ((stat * warps + w) * rows + row) * 4
}

/// Address of element `col` of row `row` of warp `w`'s f32 O in the merge tile.
#[inline(always)]
fn merge_addr(tile: AttnTile, base: u32, w: u32, row: u32, col: u32) -> u32 {
    let row_bytes = tile.merge_row_bytes() as u32;
    base + tile.ring_offset() as u32 + (w * tile.block_m as u32 + row) * row_bytes + col * 4
}

/// The merged statistics of `row` over all warps: M = max m_w (log2 domain)
/// and L = Σ l_w·2^(m_w - M). L = 0 for a row that saw no key (every m_w is
/// then the finite "no key" value and every l_w 0). With `sink` (log2
/// units), M also covers the sink and L holds 2^(sink - M).
#[inline(always)]
fn merged_stats(tile: AttnTile, base: u32, row: u32, sink: Option<f32>) -> (f32, f32) {
    let stat = |s, w| f32::from_bits(smem::ld_b32(stat_addr(tile, base, s, w, row)));
    let warps = tile.warps as u32;
    let mut m = stat(0, 0);
    for w in 1..warps {
        m = m.max(stat(0, w));
    }
    let mut l = 0.0;
    if let Some(sink) = sink {
        m = m.max(sink);
        l = math::ex2(sink - m);
    }
    for w in 0..warps {
        l = math::fma(stat(1, w), math::ex2(stat(0, w) - m), l);
    }
    (m, l)
}

/// Sink logit of CTA row `row` in log2 units, when the final normalisation
/// includes sinks.
#[inline(always)]
fn row_sink(p: &AttnParams, info: &BlockInfo, row: u32, sinks: bool) -> Option<f32> {
    if sinks {
        Some(global::ld_nc_f32(p.sinks + info.head(row) as u64 * 4) * LOG2_E)
    } else {
        None
    }
}

/// Publishes each warp's (m, l) and its O scaled by 2^(m_w - M) / L, so the
/// CTA's O is the plain sum of the warps' tiles.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn merge_warps<const D: usize, const OT: usize>(
    p: &AttnParams,
    info: &BlockInfo,
    tile: AttnTile,
    lane: Lane,
    base: u32,
    softmax: &OnlineSoftmax,
    o: &[[f32; 4]; OT],
    sinks: bool,
) {
    // The ring is reused: no copy may still be landing and no warp reading it.
    copy::wait_all();
    barrier::sync_cta();
    let rows = [0, 1].map(|r| lane.group() + 8 * r);
    let (m_w, l_w) = softmax.row_stats();
    if lane.pair() == 0 {
        unroll::<2>(|r| {
            smem::st_b32(
                stat_addr(tile, base, 0, lane.warp, rows[r]),
                m_w[r].to_bits(),
            );
            smem::st_b32(
                stat_addr(tile, base, 1, lane.warp, rows[r]),
                l_w[r].to_bits(),
            );
        });
    }
    barrier::sync_cta();
    unroll::<2>(|r| {
        let (m, l) = merged_stats(tile, base, rows[r], row_sink(p, info, rows[r], sinks));
        let weight = if l > 0.0 {
            math::ex2(m_w[r] - m) * math::rcp(l)
        } else {
            0.0
        };
        unroll::<OT>(|d| {
            let col = d as u32 * MMA_N as u32 + 2 * lane.pair();
            smem::st_v2_b32(
                merge_addr(tile, base, lane.warp, rows[r], col),
                (o[d][2 * r] * weight).to_bits(),
                (o[d][2 * r + 1] * weight).to_bits(),
            );
        });
    });
    barrier::sync_cta();
}

/// Sums the warps' merged O tiles and writes each valid row: the final O in
/// the output dtype (and its LSE if requested), or this split's f32 partial
/// and LSE for the combine kernel. 16-byte stores. With folded KV heads
/// (`L::FOLDED`), a row's own head's half only: O's, and `o_accum` rows of
/// D / 2.
#[inline(always)]
fn write_rows<T: Element, L: Seq>(
    p: &AttnParams,
    info: &BlockInfo,
    tile: AttnTile,
    lane: Lane,
    base: u32,
    sinks: bool,
) {
    const { assert!(CHUNK_ELEMS == 8) };
    let chunks = tile.row_chunks() as u32;
    let total = tile.block_m * tile.row_chunks();
    let split = p.num_splits > 1;
    let rows_per_split = p.batch as u64 * p.heads as u64 * p.seqlen_q as u64;
    for c in 0..total.div_ceil(tile.threads()) {
        let idx = lane.tid + (c * tile.threads()) as u32;
        if total % tile.threads() != 0 && idx as usize >= total {
            continue;
        }
        let (row, chunk) = (idx / chunks, idx % chunks);
        let Some(token) = info.token(row) else {
            continue;
        };
        let (first, count) = if L::FOLDED {
            info.fold_chunks(row, chunks)
        } else {
            (0, chunks)
        };
        let out_chunk = chunk.wrapping_sub(first);
        if out_chunk >= count {
            continue;
        }
        let mut acc = [0f32; CHUNK_ELEMS];
        for w in 0..tile.warps as u32 {
            let addr = merge_addr(tile, base, w, row, chunk * CHUNK_ELEMS as u32);
            let (lo, hi) = (smem::ld_v4_b32(addr), smem::ld_v4_b32(addr + 16));
            unroll::<4>(|e| {
                acc[e] += f32::from_bits(lo[e]);
                acc[e + 4] += f32::from_bits(hi[e]);
            });
        }
        let lse_index = info.lse_index(row, token);
        if split {
            let index = info.split as u64 * rows_per_split + lse_index;
            let row_elems = (count * CHUNK_ELEMS as u32) as u64;
            let dst = p.o_accum + (index * row_elems + (out_chunk * CHUNK_ELEMS as u32) as u64) * 4;
            let (mut lo, mut hi) = ([0u32; 4], [0u32; 4]);
            unroll::<4>(|e| {
                lo[e] = acc[e].to_bits();
                hi[e] = acc[e + 4].to_bits();
            });
            global::st_v4_b32(dst, lo);
            global::st_v4_b32(dst + 16, hi);
        } else if let Some(dst) = info.q_row_ptr(p.o, &p.o_strides, row) {
            T::store_chunk(
                dst + out_chunk as u64 * (CHUNK_ELEMS as u32 * T::BYTES) as u64,
                acc,
            );
        }
        if out_chunk == 0 && (split || p.lse != 0) {
            let (m, l) = merged_stats(tile, base, row, row_sink(p, info, row, sinks));
            let lse = if l > 0.0 {
                (m + math::lg2(l)) * LN_2
            } else {
                f32::NEG_INFINITY
            };
            if split {
                global::st_f32(
                    p.lse_accum + (info.split as u64 * rows_per_split + lse_index) * 4,
                    lse,
                );
            } else {
                global::st_f32(p.lse + lse_index * 4, lse);
            }
        }
    }
}
