//! The Hopper forward CTA (FlashAttention-3's roles; docs/hopper-plan.md):
//! one thread of the producer warpgroup loads Q once and streams K and V
//! blocks through two [`TmaRing`]s; each consumer warpgroup owns
//! [`WGMMA_M`] query rows and runs FlashAttention-2's loop on them with
//! `wgmma`: S = Q·Kᵀ with both operands in shared memory, the online
//! softmax in registers, O += P·V with P in registers. Key blocks are
//! visited from the last to the first, as in the sm_80 mainloop, so the
//! blocks that need a mask come first. Within a warpgroup the softmax of
//! block i runs while the tensor cores still compute P(i-1)·V(i-1)
//! (FlashAttention-3's intra-warpgroup overlap; see `consume`).
//!
//! A persistent line ([`HopperTile::persistent`]) launches at most one CTA
//! per SM, each looping over tiles: the producer claims them from a
//! counter (`index::dynamic_tile`'s order) or, without one, walks
//! `index::persistent_step`, and tells the consumers which through a slot
//! beside each Q buffer. Q has three or four buffers in a ring of its own,
//! and the K/V rings and the ping-pong turns run on across tiles, so the
//! producer loads the next tile's Q and first K/V blocks while the
//! consumers finish the current one. Without ping-pong the consumers run
//! all their tiles' key blocks as one pipeline ([`stream`]). The dense
//! lines store O with TMA from the Q buffer it was computed from.
//!
//! The `wgmma` accumulator of each warp is the `mma.sync` m16n8 C fragment
//! of its 16 rows, so the online softmax, the mask and P's packing are the
//! sm_80 kernel's own.
//!
//! Packed sequences (`Seq = Packed`, or `Ragged` against a paged cache,
//! whose K/V loads `produce` describes): the Q map spans all packed rows
//! (a batch of one), and a sequence's tiles start at its `cu_seqlens` rows.
//! A box that runs past the sequence's end reads the next sequence's rows
//! (TMA only zero-fills past the tensor): its queries give rows the
//! epilogue does not store, and its keys lie past `seqlen_k`: masked to
//! P = 0, and their V rows zeroed in shared memory before the first P·V
//! ([`zero_rows_past`]), so that a NaN or infinity in another sequence's V
//! (0 · inf = NaN) cannot reach this one, as the `mma.sync` kernels'
//! zero-filled loads guarantee.
use super::ring::{wait, TmaRing};
use crate::arch::{
    barrier, fence, global, ldmatrix, mbarrier, setmaxnreg, smem, special, tma, wgmma,
};
use crate::config::{HopperTile, MaskKind, SW128_ROW_ELEMS, WARPGROUP_THREADS, WARP_SIZE, WGMMA_M};
use crate::index::{
    self, k_major_desc, mn_major_desc, sw128_offset, OriginSide, SW128_ATOM_BYTES, SW128_ROW_BYTES,
};
use crate::kernels::block_info::{BlockInfo, TileCoord};
use crate::kernels::element::Element;
use crate::kernels::mask;
use crate::kernels::policy::{self, policies, Mask, Modifiers, Scores, Seq};
use crate::kernels::softmax::{merge_rows, pack_fragment, OnlineSoftmax};
use crate::params::{AttnParams, HopperFwdMaps};
use crate::unroll::unroll;

/// Named barrier of consumer warpgroup c's epilogue: 1 + c (0 is the CTA's;
/// at most three consumers).
const EPILOGUE_BARRIER: u32 = 1;
/// Named barrier that consumer warpgroup c waits on for its turn to issue
/// `wgmma`s: 4 + c ([`HopperTile::pingpong`]), past the epilogue's.
const TURN_BARRIER: u32 = 4;
/// Named barrier of every consumer thread once the V rows past a packed
/// sequence's keys are zeroed ([`zero_rows_past`]), past the turn barriers.
const ZEROED_BARRIER: u32 = 6;
/// Named barrier of both consumers of a split-key tile at its end
/// ([`Warpgroup::merge`]).
const MERGE_BARRIER: u32 = 7;
/// Rounds in which the consumers of a split-key tile exchange their halves
/// of O through the tile's Q buffer: a round moves a quarter of O's f32
/// columns per consumer, both consumers' together the buffer's bytes.
const MERGE_ROUNDS: usize = 2;

/// `.shared` addresses of the CTA's tiles and barriers ([`HopperTile`]).
/// `QB` is the tile's Q buffers ([`HopperTile::q_buffers`]).
#[derive(Clone, Copy)]
struct Smem<const QB: u32> {
    q: u32,
    /// Stage 0's K tile; stage s at `k + s * kv_bytes`.
    k: u32,
    v: u32,
    q_full: u32,
    /// A persistent CTA's Q ring: buffer b at `q + b * q_bytes`, its
    /// barriers at `q_full + 8b` and `q_empty + 8b`.
    q_empty: u32,
    /// A persistent CTA's tile slots: buffer b's at `tile_slot + 8b`
    /// ([`HopperTile::tile_slot`]).
    tile_slot: u32,
    /// A split-key tile's row states, consumer c's (m, l) of row r at
    /// `merge_rows + 8 (c block_m + r)` ([`HopperTile::merge_rows_offset`]).
    merge_rows: u32,
}

impl<const QB: u32> Smem<QB> {
    #[inline(always)]
    fn q_ring(self) -> TmaRing<QB> {
        TmaRing::new(self.q_full, self.q_empty)
    }
}

/// Where a tile's loads sit in the rings of a persistent CTA: the tiles
/// and K/V blocks before it (zero in a CTA of one tile).
#[derive(Clone, Copy, Default)]
struct Cursor {
    tiles: u32,
    blocks: u32,
}

impl Cursor {
    /// The next tile's, after `info`'s.
    #[inline(always)]
    fn after(self, info: &BlockInfo) -> Cursor {
        Cursor {
            tiles: self.tiles + 1,
            blocks: self.blocks + (info.n_hi - info.n_lo),
        }
    }
}

/// What a tile slot holds once the producer has no tile left.
const NO_TILE: u32 = u32::MAX;

/// Query block `m_block` of (batch, head) pair `pair`, rebuilt from the
/// parameters and the host's divisors: only the cursor is state through
/// the mainloop.
#[inline(always)]
fn tile_info<M: Mask, L: Seq>(
    p: &AttnParams,
    tile: HopperTile,
    m_block: u32,
    pair: u32,
) -> BlockInfo {
    let g = &p.tiles;
    let (batch, head) = g.heads.divmod(pair);
    let at = TileCoord {
        m_block,
        head,
        batch,
        kv_head: g.group.quotient(head),
    };
    BlockInfo::at::<M, L>(p, tile.block_m, tile.block_n, at)
}

/// The producer's next tile, the `tiles`-th of its CTA: `(query block,
/// pair)`, `None` past the last. With a counter (`TileGrid::counter`) the
/// CTA's first tile is its index and each later one a ticket's, taken once
/// the tile before has its loads issued; without one, `step` walks
/// [`index::persistent_step`] (causal masks pair heavy and light query
/// blocks).
#[inline(always)]
fn claim_tile<M: Mask>(
    p: &AttnParams,
    tile: HopperTile,
    tiles: u32,
    step: &mut u32,
) -> Option<(u32, u32)> {
    let g = &p.tiles;
    let (cta, grid) = (special::block_idx_x(), special::grid_dim_x());
    if !tile.claims_tiles(M::KIND) || g.counter == 0 {
        let paired = matches!(M::KIND, MaskKind::Causal) && g.paired != 0;
        let pairs = (p.heads * p.batch).max(1);
        let (m_block, pair, next) = index::persistent_step(*step, cta, grid, g, pairs, paired)?;
        *step = next;
        return Some((m_block, pair));
    }
    let i = if tiles == 0 {
        cta
    } else {
        grid + global::atom_inc_u32(g.counter, g.tiles - 1)
    };
    if i < g.tiles {
        Some(index::dynamic_tile(i, g))
    } else {
        None
    }
}

/// The tile a persistent CTA's consumers run at `at`, once its Q has
/// landed (the producer wrote the tile's slot before that barrier's
/// arrival); `None` past the last.
#[inline(always)]
fn next_tile<M: Mask, L: Seq, const QB: u32>(
    p: &AttnParams,
    tile: HopperTile,
    sm: Smem<QB>,
    at: Cursor,
) -> Option<BlockInfo> {
    sm.q_ring().wait_full(at.tiles);
    let (m_block, pair) = smem::ld_v2_b32(sm.tile_slot + 8 * (at.tiles % QB));
    if m_block == NO_TILE {
        return None;
    }
    Some(tile_info::<M, L>(p, tile, m_block, pair))
}

/// One Hopper forward CTA of `ROWS` query rows, persistent or not (`LOOP`),
/// over key blocks of `block_n = ST * 8` keys. `ST` (n-tiles of S), `OT = D / 8`
/// (of O), `QK = D / 16` (k-steps of Q·Kᵀ), `PK = block_n / 16` (of P·V)
/// `STAGES` and `REGS` (consumer registers) restate the tile because array
/// lengths and const arguments cannot be computed from it on stable Rust;
/// they are checked against it at compile time.
/// `maps` is the generic address of the [`HopperFwdMaps`] parameter.
#[inline(always)]
pub unsafe fn forward<
    T: Element,
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const ROWS: usize,
    const LOOP: bool,
    const ST: usize,
    const OT: usize,
    const QK: usize,
    const PK: usize,
    const STAGES: u32,
    const VSTAGES: u32,
    const QB: u32,
    const REGS: u32,
>(
    p: &AttnParams,
    maps: u64,
) {
    let tile = const { HopperTile::of(D, policies::<M, S, L>(), ROWS, LOOP, Some(ST * 8)) };
    const {
        let t = HopperTile::of(D, policies::<M, S, L>(), ROWS, LOOP, Some(ST * 8));
        assert!(t.q_buffers() == QB as usize);
        assert!(
            t.producer_regs()
                == if t.persistent {
                    HopperTile::PERSISTENT_PRODUCER_REGS
                } else {
                    HopperTile::PRODUCER_REGS
                }
        );
        assert!(t.consumers <= 3, "three epilogue barriers");
        assert!(ST * 8 == t.block_n && PK * 16 == t.block_n && OT * 8 == D && QK * 16 == D);
        assert!(STAGES as usize == t.stages && VSTAGES as usize == t.v_stages);
        let row_sets = if t.split_keys { 1 } else { t.consumers };
        assert!(t.block_m == row_sets * WGMMA_M);
        // Each stage holds one consumer's blocks (`HopperTile::split_keys`).
        assert!(
            !t.split_keys
                || t.consumers == 2 && !t.persistent && t.stages % 2 == 0 && t.v_stages % 2 == 0
        );
        assert!(REGS == t.consumer_regs() && (!t.pingpong || t.consumers == 2));
        // A serial tile's halves: two column groups each, O's columns in
        // two `wgmma`s of n = D / 2.
        assert!(!t.serial || OT == 2 * SERIAL_O_HALF && QK % 2 == 0 && D == 4 * SW128_ROW_ELEMS);
    }
    let a = SW128_ATOM_BYTES;
    let base = (smem::base() + a - 1) & !(a - 1);
    let at = |offset: usize| base + offset as u32;
    let sm = Smem::<QB> {
        q: base,
        k: at(tile.k_offset(0)),
        v: at(tile.v_offset(0)),
        q_full: at(tile.barrier(HopperTile::Q_FULL)),
        q_empty: at(tile.barrier(tile.q_empty(0))),
        tile_slot: at(tile.tile_slot(0)),
        merge_rows: at(tile.merge_rows_offset()),
    };
    let k_ring = TmaRing::<STAGES>::new(
        at(tile.barrier(tile.k_ring())),
        at(tile.barrier(tile.k_ring() + tile.stages)),
    );
    let v_ring = TmaRing::<VSTAGES>::new(
        at(tile.barrier(tile.v_ring())),
        at(tile.barrier(tile.v_ring() + tile.v_stages)),
    );
    let tid = special::thread_idx_x();
    if tid == 0 {
        // Every warp of the consumers that read a stage releases it once
        // its share of the `wgmma`s that read it has completed: one
        // consumer where they take alternate blocks.
        let readers = if tile.split_keys { 1 } else { tile.consumers };
        let releasers = (readers * WARPGROUP_THREADS / WARP_SIZE) as u32;
        if LOOP {
            // A Q buffer frees once every consumer thread is done with
            // its tile slot and each consumer's TMA store of the O it holds
            // has read it (`Warpgroup::release_q`).
            sm.q_ring()
                .init((tile.consumers * WARPGROUP_THREADS) as u32);
        } else {
            mbarrier::init(sm.q_full, 1);
        }
        k_ring.init(releasers);
        v_ring.init(releasers);
        mbarrier::fence_init();
        // O's map serves the dense lines' TMA stores (`consume`).
        let used = if L::RAGGED { 3 } else { 4 };
        for m in 0..used {
            tma::prefetch_map(maps + (m * size_of::<crate::params::TensorMap>()) as u64);
        }
    }
    barrier::sync_cta_divergent();
    if LOOP {
        persistent::<T, M, S, L, D, ST, OT, QK, PK, STAGES, VSTAGES, QB, REGS>(
            p, tile, maps, sm, k_ring, v_ring,
        );
        return;
    }

    // Causal grids in the balanced order: D = 256 causal, H200, 1.01x at
    // 512 keys, 1.04-1.09x at 1k-4k (docs/perf-notes.md, v48).
    let info = BlockInfo::of_grid::<M, S, L>(p, tile.block_m, tile.block_n, tile.ctas_per_sm);
    // The grid covers the longest packed sequence; the CTA returns as a
    // whole (`info` is uniform), with no load issued.
    if L::RAGGED && !info.has_rows() {
        return;
    }
    // One branch per role: ptxas applies `setmaxnreg` only so.
    if tid < WARPGROUP_THREADS as u32 {
        setmaxnreg::dec::<{ HopperTile::PRODUCER_REGS }>();
        // A paged cache takes the whole first warp: one page lookup and box
        // per lane (`produce`).
        if tid == 0 || (L::PAGED && tid < WARP_SIZE as u32) {
            if tid == 0 {
                mbarrier::arrive_expect_tx(sm.q_full, tile.q_bytes() as u32);
            }
            // An inline const, so that only the serial entries generate the
            // serial roles: behind `tile.serial` (folded by LLVM, not by
            // rustc) the dead code changed LLVM's code for every other line
            // (docs/perf-notes.md, v44).
            if const { HopperTile::of(D, policies::<M, S, L>(), ROWS, LOOP, Some(ST * 8)).serial } {
                produce_serial::<D, STAGES, VSTAGES, QB>(tile, &info, maps, sm, k_ring, v_ring);
            } else {
                let q = (sm.q, sm.q_full);
                produce::<L, D, STAGES, VSTAGES, QB>(
                    p,
                    tile,
                    &info,
                    maps,
                    sm,
                    k_ring,
                    v_ring,
                    Cursor::default(),
                    q,
                );
            }
        }
    } else {
        setmaxnreg::inc::<REGS>();
        let wg = Warpgroup::new::<T, S>(p, tile, sm, k_ring, v_ring);
        if const { HopperTile::of(D, policies::<M, S, L>(), ROWS, LOOP, Some(ST * 8)).serial } {
            consume_serial::<T, M, S, L, D, ST, OT, QK, PK, STAGES, VSTAGES, QB>(
                p, wg, &info, maps,
            );
        } else {
            consume::<T, M, S, L, D, ST, OT, QK, PK, STAGES, VSTAGES, QB>(
                p,
                wg,
                &info,
                maps,
                Cursor::default(),
                false,
            );
        }
    }
}

/// The roles of a persistent CTA: each runs its part of every tile the
/// producer claims ([`claim_tile`]) in turn: the consumers through
/// [`stream`] on the lines without ping-pong, else through [`consume`] per
/// tile. The ping-pong turns run on across tiles (both consumers take one
/// per key block), so the first hand-over and the last turn frame the
/// whole loop.
#[inline(always)]
fn persistent<
    T: Element,
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const ST: usize,
    const OT: usize,
    const QK: usize,
    const PK: usize,
    const STAGES: u32,
    const VSTAGES: u32,
    const QB: u32,
    const REGS: u32,
>(
    p: &AttnParams,
    tile: HopperTile,
    maps: u64,
    sm: Smem<QB>,
    k_ring: TmaRing<STAGES>,
    v_ring: TmaRing<VSTAGES>,
) {
    let tid = special::thread_idx_x();
    let mut at = Cursor::default();
    if tid < WARPGROUP_THREADS as u32 {
        setmaxnreg::dec::<{ HopperTile::PERSISTENT_PRODUCER_REGS }>();
        let mut step = 0;
        if tid == 0 && !tile.claims_tiles(M::KIND) {
            while let Some((m_block, pair)) = claim_tile::<M>(p, tile, at.tiles, &mut step) {
                let info = tile_info::<M, L>(p, tile, m_block, pair);
                let (b, full) = sm.q_ring().acquire(at.tiles, tile.q_bytes() as u32);
                let q = (sm.q + b * tile.q_bytes() as u32, full);
                produce::<L, D, STAGES, VSTAGES, QB>(
                    p, tile, &info, maps, sm, k_ring, v_ring, at, q,
                );
                at = at.after(&info);
            }
        } else if tid == 0 {
            loop {
                // The tile's geometry first: it runs while the Q buffer
                // frees.
                let next = claim_tile::<M>(p, tile, at.tiles, &mut step);
                let info = next.map(|(m_block, pair)| tile_info::<M, L>(p, tile, m_block, pair));
                let (b, full) = sm.q_ring().claim(at.tiles);
                let slot = sm.tile_slot + 8 * b;
                let (Some((m_block, pair)), Some(info)) = (next, info) else {
                    smem::st_v2_b32(slot, NO_TILE, 0);
                    mbarrier::arrive(full);
                    break;
                };
                smem::st_v2_b32(slot, m_block, pair);
                mbarrier::arrive_expect_tx(full, tile.q_bytes() as u32);
                let q = (sm.q + b * tile.q_bytes() as u32, full);
                produce::<L, D, STAGES, VSTAGES, QB>(
                    p, tile, &info, maps, sm, k_ring, v_ring, at, q,
                );
                at = at.after(&info);
            }
        }
    } else {
        setmaxnreg::inc::<REGS>();
        let wg = Warpgroup::new::<T, S>(p, tile, sm, k_ring, v_ring);
        // Persistent lines serve dense sequences (`HopperTile::for_head_dim`):
        // the stream's epilogue has no packed rows to guard.
        if !tile.pingpong && !L::RAGGED {
            stream::<T, M, S, L, D, ST, OT, QK, PK, STAGES, VSTAGES, QB>(p, wg, maps);
        } else {
            wg.hand_over_first();
            if tile.claims_tiles(M::KIND) && p.tiles.counter != 0 {
                let mut upcoming = next_tile::<M, L, QB>(p, tile, sm, at);
                while let Some(info) = upcoming {
                    upcoming = consume::<T, M, S, L, D, ST, OT, QK, PK, STAGES, VSTAGES, QB>(
                        p, wg, &info, maps, at, true,
                    );
                    at = at.after(&info);
                }
            } else {
                // The static order: each consumer walks it too.
                let mut step = 0;
                while let Some((m_block, pair)) = claim_tile::<M>(p, tile, at.tiles, &mut step) {
                    let info = tile_info::<M, L>(p, tile, m_block, pair);
                    consume::<T, M, S, L, D, ST, OT, QK, PK, STAGES, VSTAGES, QB>(
                        p, wg, &info, maps, at, false,
                    );
                    at = at.after(&info);
                }
            }
            wg.take_last_turn();
        }
        // The last tile's O store must read its shared memory before the
        // CTA exits.
        wg.store_read();
    }
}

/// The load loop: Q once into `q` = (buffer, full barrier), whose bytes
/// thread 0 has announced, then K(n) and V(n) for n from `n_hi - 1` down,
/// by thread 0; `at` places a persistent CTA's tile in the rings. From a paged cache (`L::PAGED` and a block table) the first
/// warp loads each block as boxes of `index::paged_box_rows` rows, which
/// never straddle a page: lane j looks up box j's page (the table reads of
/// a block overlap), thread 0 claims the K stage, the lanes issue their K
/// boxes, and likewise V. A box whose first key lies past the sequence
/// reads page 0 (masked, and its V rows zeroed by the consumers).
#[inline(always)]
fn produce<L: Seq, const D: usize, const STAGES: u32, const VSTAGES: u32, const QB: u32>(
    p: &AttnParams,
    tile: HopperTile,
    info: &BlockInfo,
    maps: u64,
    sm: Smem<QB>,
    k_ring: TmaRing<STAGES>,
    v_ring: TmaRing<VSTAGES>,
    at: Cursor,
    q: (u32, u32),
) {
    let map = |offset: usize| maps + offset as u64;
    let (q_map, k_map, v_map) = (
        map(core::mem::offset_of!(HopperFwdMaps, q)),
        map(core::mem::offset_of!(HopperFwdMaps, k)),
        map(core::mem::offset_of!(HopperFwdMaps, v)),
    );
    let groups = const { D.div_ceil(SW128_ROW_ELEMS) as u32 };
    // One box per 64-column group: `rows` rows of 128 bytes at `dst`, the
    // groups `stride` rows apart.
    let load = |dst: u32, stride: usize, map: u64, row: u32, head: u32, batch: u32, bar: u32| {
        for c in 0..groups {
            let coord = [
                (c as usize * SW128_ROW_ELEMS) as i32,
                row as i32,
                head as i32,
                batch as i32,
            ];
            tma::load_4d(dst + c * stride as u32 * SW128_ROW_BYTES, map, coord, bar);
        }
    };
    // Only a paged cache's loads use more than thread 0.
    let lane = if L::PAGED { special::thread_idx_x() } else { 0 };
    let leader = lane == 0;
    let (bn, bytes) = (tile.block_n as u32, tile.kv_bytes() as u32);
    if leader {
        let q_row = info.q_start + info.m0;
        let batch = info.addr_batch;
        load(q.0, tile.block_m, q_map, q_row, info.head_base, batch, q.1);
    }

    let blocks = info.n_hi - info.n_lo;
    // Block i's place in the K/V rings.
    let slot = |i: u32| at.blocks + i;
    if L::PAGED && p.block_table != 0 {
        let box_rows = index::paged_box_rows(p.page_size.divisor, bn);
        let boxes = bn / box_rows;
        for i in 0..blocks {
            // The lookup first: its latency overlaps the wait for the stages.
            let key = (info.n_hi - 1 - i) * bn + lane * box_rows;
            let (page, row) = if lane < boxes && key < info.seqlen_k {
                let (page, row) = info.locate_key(p, key);
                (page as u32, row as u32)
            } else {
                (0, 0)
            };
            let offset = lane * box_rows * SW128_ROW_BYTES;
            // K, then V, each once its stage is claimed: V's stage frees
            // only after an earlier P·V, which K(i) must not wait for.
            let issue = |base: u32, map: u64| {
                move |s: u32, full: u32| {
                    let dst = base + s * bytes + offset;
                    load(dst, tile.block_n, map, row, info.kv_head, page, full);
                }
            };
            let lane_loads = lane < boxes;
            paged_block(
                k_ring,
                slot(i),
                bytes,
                leader,
                lane_loads,
                issue(sm.k, k_map),
            );
            paged_block(
                v_ring,
                slot(i),
                bytes,
                leader,
                lane_loads,
                issue(sm.v, v_map),
            );
        }
        return;
    }
    // In a grid of one wave every CTA starts at once, and the K and V
    // blocks (mostly L2 hits) take the SMs' load bandwidth while Q's DRAM
    // misses wait, so the first S = Q·Kᵀ waits for Q: such a CTA loads V(0)
    // and the later blocks once Q has landed (H100, 8 heads x 512 keys at
    // D = 256: 1.08x). Over several waves the CTAs start apart and the later
    // V(0) costs 2 % (docs/perf-notes.md, v39). `sm_ids` may exceed the SM
    // count: a grid just over one wave can take this order too.
    let q_first = !tile.persistent
        && special::grid_dim_x() * special::grid_dim_y() * special::grid_dim_z()
            <= special::sm_ids();
    for i in 0..blocks {
        let row = info.k_start + (info.n_hi - 1 - i) * bn;
        let batch = info.addr_batch;
        let (s, full) = k_ring.acquire(slot(i), bytes);
        load(
            sm.k + s * bytes,
            tile.block_n,
            k_map,
            row,
            info.kv_head,
            batch,
            full,
        );
        if i == 0 && q_first {
            wait(q.1, 0);
        }
        let (s, full) = v_ring.acquire(slot(i), bytes);
        load(
            sm.v + s * bytes,
            tile.block_n,
            v_map,
            row,
            info.kv_head,
            batch,
            full,
        );
    }
}

/// One tensor's part of a paged block: `leader` claims ring block `i`'s
/// stage and announces its `bytes`, then each lane with boxes issues them.
#[inline(always)]
fn paged_block<const N: u32>(
    ring: TmaRing<N>,
    i: u32,
    bytes: u32,
    leader: bool,
    lane_loads: bool,
    issue: impl Fn(u32, u32),
) {
    if leader {
        ring.acquire(i, bytes);
    }
    barrier::sync_warp();
    if lane_loads {
        let (s, full) = ring.slot(i);
        issue(s, full);
    }
}

/// A consumer warpgroup's place in the CTA, the CTA's pipes, and the steps
/// of the loop over a tile's key blocks, which [`consume`] (one tile) and
/// [`stream`] (a persistent CTA's tiles, one pipeline) put in order.
#[derive(Clone, Copy)]
struct Warpgroup<const STAGES: u32, const VSTAGES: u32, const QB: u32> {
    tile: HopperTile,
    sm: Smem<QB>,
    k_ring: TmaRing<STAGES>,
    v_ring: TmaRing<VSTAGES>,
    mods: Modifiers,
    /// Consumer index: warpgroup c + 1 of the CTA.
    c: u32,
    wg_tid: u32,
    lane: u32,
    /// The lane's row in its warp's 8 (g) and its column pair (t) in the
    /// accumulator fragments.
    g: u32,
    t: u32,
    /// The CTA row of the lane's first accumulator half (the second is + 8).
    row0: u32,
}

/// One tile as a consumer works on it: where it lies, its loads' places in
/// the rings, its Q buffer, and its head's ALiBi slope (uniform: one head
/// per CTA tile).
struct Work<'a> {
    info: &'a BlockInfo,
    at: Cursor,
    q_buf: u32,
    /// This warpgroup's rows of the Q buffer: the A operand of S = Q·Kᵀ.
    q_rows: u32,
    slope: f32,
}

impl<const STAGES: u32, const VSTAGES: u32, const QB: u32> Warpgroup<STAGES, VSTAGES, QB> {
    #[inline(always)]
    fn new<T: Element, S: Scores>(
        p: &AttnParams,
        tile: HopperTile,
        sm: Smem<QB>,
        k_ring: TmaRing<STAGES>,
        v_ring: TmaRing<VSTAGES>,
    ) -> Self {
        let tid = special::thread_idx_x();
        let c = tid / WARPGROUP_THREADS as u32 - 1;
        let wg_tid = tid % WARPGROUP_THREADS as u32;
        let lane = tid % WARP_SIZE as u32;
        Warpgroup {
            tile,
            sm,
            k_ring,
            v_ring,
            mods: Modifiers::new::<T, S>(p),
            c,
            wg_tid,
            lane,
            g: lane / 4,
            t: lane % 4,
            row0: tile.first_row(c) + wg_tid / WARP_SIZE as u32 * 16 + lane / 4,
        }
    }

    #[inline(always)]
    fn work<'a>(self, p: &AttnParams, info: &'a BlockInfo, at: Cursor) -> Work<'a> {
        let q_buf = if self.tile.persistent {
            self.sm.q + (at.tiles % QB) * self.tile.q_bytes() as u32
        } else {
            self.sm.q
        };
        let slope = if self.mods.alibi {
            Modifiers::slope(p, info.batch, info.head_base)
        } else {
            0.0
        };
        Work {
            info,
            at,
            q_buf,
            q_rows: q_buf + self.tile.first_row(self.c) * SW128_ROW_BYTES,
            slope,
        }
    }

    /// K of the tile's `i`-th block, once it has landed.
    #[inline(always)]
    fn k_tile(self, w: &Work, i: u32) -> u32 {
        self.sm.k + self.k_ring.wait_full(w.at.blocks + i) * self.tile.kv_bytes() as u32
    }

    /// Likewise V.
    #[inline(always)]
    fn v_tile(self, w: &Work, i: u32) -> u32 {
        self.sm.v + self.v_ring.wait_full(w.at.blocks + i) * self.tile.kv_bytes() as u32
    }

    /// Every warp releases the K stage of the tile's `i`-th block once its
    /// S has completed.
    #[inline(always)]
    fn release_k(self, w: &Work, i: u32) {
        if self.lane == 0 {
            self.k_ring.release(w.at.blocks + i);
        }
    }

    /// Likewise V, once its P·V has.
    #[inline(always)]
    fn release_v(self, w: &Work, i: u32) {
        if self.lane == 0 {
            self.v_ring.release(w.at.blocks + i);
        }
    }

    /// Ring slot of half `h` of the tile's `i`-th block on a serial tile
    /// ([`HopperTile::stage_bytes`]).
    #[inline(always)]
    fn half_slot(w: &Work, i: u32, h: u32) -> u32 {
        2 * (w.at.blocks + i) + h
    }

    /// Half `h` of K of the tile's `i`-th block (a serial tile), once it has
    /// landed. Opaque: with few stages the same addresses recur, and LLVM
    /// and ptxas would hoist every `wgmma` descriptor built on them out of
    /// the loop into registers (ptxas spilled 140 bytes so).
    #[inline(always)]
    fn k_half(self, w: &Work, i: u32, h: u32) -> u32 {
        let s = self.k_ring.wait_full(Self::half_slot(w, i, h));
        special::opaque_u32(self.sm.k + s * self.tile.stage_bytes() as u32)
    }

    /// Likewise V.
    #[inline(always)]
    fn v_half(self, w: &Work, i: u32, h: u32) -> u32 {
        let s = self.v_ring.wait_full(Self::half_slot(w, i, h));
        special::opaque_u32(self.sm.v + s * self.tile.stage_bytes() as u32)
    }

    /// S = Q·Kᵀ of a serial tile's `i`-th block in one turn: a group of
    /// `wgmma`s per K half, each issued once its half has landed, and each
    /// half's stage released once its group has completed, so that the
    /// producer refills it while the other half is still read.
    #[inline(always)]
    fn serial_s<T: Element, const ST: usize, const QK: usize>(
        self,
        s: &mut [[f32; 4]; ST],
        w: &Work,
        i: u32,
    ) {
        let (bm, bn) = (self.tile.block_m as u32, self.tile.block_n as u32);
        let q_rows = special::opaque_u32(w.q_rows);
        let k_lo = self.k_half(w, i, 0);
        self.take_turn();
        unroll::<2>(|h| {
            let k = if h == 0 { k_lo } else { self.k_half(w, i, 1) };
            wgmma::fence_operands(s);
            wgmma::fence();
            unroll::<QK>(|kk| {
                if kk / (QK / 2) == h {
                    let a = k_major_desc(q_rows, bm, kk as u32);
                    let b = k_major_desc(k, bn, (kk % (QK / 2)) as u32);
                    wgmma::ss::<ST, 0, 0>(T::BF16, s, a, b, (kk > 0) as u32);
                }
            });
            wgmma::commit_group();
        });
        self.hand_over();
        wgmma::wait_group::<1>();
        self.release_half(self.k_ring, w, i, 0);
        wgmma::wait_group::<0>();
        wgmma::fence_operands(s);
        self.release_half(self.k_ring, w, i, 1);
    }

    /// O += P·V of a serial tile's `i`-th block in one turn: a group per V
    /// half (O's columns of that half, an n = D / 2 `wgmma` per k-step),
    /// each issued once its half has landed and released once done.
    #[inline(always)]
    fn serial_pv<T: Element, const OT: usize, const PK: usize>(
        self,
        o: &mut [[f32; 4]; OT],
        pf: &mut [[u32; 4]; PK],
        w: &Work,
        i: u32,
    ) {
        let bn = self.tile.block_n as u32;
        let v_lo = self.v_half(w, i, 0);
        self.take_turn();
        unroll::<2>(|h| {
            let v = if h == 0 { v_lo } else { self.v_half(w, i, 1) };
            wgmma::fence_operands(o);
            wgmma::fence_fragments(pf);
            wgmma::fence();
            let oh = o_half(o, h);
            unroll::<PK>(|kk| {
                let b = mn_major_desc(v, bn, kk as u32);
                wgmma::rs::<SERIAL_O_HALF, 1>(T::BF16, oh, &pf[kk], b, 1);
            });
            wgmma::commit_group();
        });
        self.hand_over();
        wgmma::wait_group::<1>();
        self.release_half(self.v_ring, w, i, 0);
        wgmma::wait_group::<0>();
        wgmma::fence_operands(o);
        wgmma::fence_fragments(pf);
        self.release_half(self.v_ring, w, i, 1);
    }

    /// Every warp releases its half's stage.
    #[inline(always)]
    fn release_half<const N: u32>(self, ring: TmaRing<N>, w: &Work, i: u32, h: u32) {
        if self.lane == 0 {
            ring.release(Self::half_slot(w, i, h));
        }
    }

    /// Ping-pong: a warpgroup waits for its turn, issues its GEMMs and hands
    /// the turn to the other.
    #[inline(always)]
    fn take_turn(self) {
        if self.tile.pingpong {
            barrier::sync_named(TURN_BARRIER + self.c, 2 * WARPGROUP_THREADS as u32);
        }
    }

    #[inline(always)]
    fn hand_over(self) {
        if self.tile.pingpong {
            barrier::arrive_named(TURN_BARRIER + (1 - self.c), 2 * WARPGROUP_THREADS as u32);
        }
    }

    /// Warpgroup 1 hands warpgroup 0 the first turn. Every turn taken is
    /// one handed over, so warpgroup 0 takes one more turn than it is
    /// handed back, after its last GEMM ([`Self::take_last_turn`]: the
    /// barrier then ends the CTA with no arrival pending). A persistent CTA
    /// does the first and last once around its tiles ([`persistent`]).
    #[inline(always)]
    fn hand_over_first(self) {
        if self.c == 1 {
            self.hand_over();
        }
    }

    #[inline(always)]
    fn take_last_turn(self) {
        if self.c == 0 {
            self.take_turn();
        }
    }

    /// S = Q·Kᵀ as one group of `wgmma`s: one straight run of fence, wgmmas,
    /// commit (a register write or a branch inside it makes ptxas serialise
    /// them).
    #[inline(always)]
    fn issue_s<T: Element, const ST: usize, const QK: usize>(
        self,
        s: &mut [[f32; 4]; ST],
        q_rows: u32,
        k_tile: u32,
    ) {
        let (bm, bn) = (self.tile.block_m as u32, self.tile.block_n as u32);
        wgmma::fence_operands(s);
        wgmma::fence();
        unroll::<QK>(|kk| {
            let (a, b) = (
                k_major_desc(q_rows, bm, kk as u32),
                k_major_desc(k_tile, bn, kk as u32),
            );
            wgmma::ss::<ST, 0, 0>(T::BF16, s, a, b, (kk > 0) as u32);
        });
        wgmma::commit_group();
    }

    /// O += P·V as one group of `wgmma`s. V is MN-major, as TMA stored it; P
    /// is all in registers before the fence.
    #[inline(always)]
    fn issue_pv<T: Element, const OT: usize, const PK: usize>(
        self,
        o: &mut [[f32; 4]; OT],
        pf: &mut [[u32; 4]; PK],
        v_tile: u32,
    ) {
        let bn = self.tile.block_n as u32;
        wgmma::fence_operands(o);
        wgmma::fence_fragments(pf);
        wgmma::fence();
        unroll::<PK>(|kk| {
            let b = mn_major_desc(v_tile, bn, kk as u32);
            wgmma::rs::<OT, 1>(T::BF16, o, &pf[kk], b, 1);
        });
        wgmma::commit_group();
    }

    /// Waits until S, the older of two groups in flight, has completed
    /// (groups complete in order), and releases its K stage.
    #[inline(always)]
    fn s_done<const ST: usize>(self, s: &mut [[f32; 4]; ST], w: &Work, i: u32, in_flight: u32) {
        if in_flight == 2 {
            wgmma::wait_group::<1>();
        } else {
            wgmma::wait_group::<0>();
        }
        wgmma::fence_operands(s);
        self.release_k(w, i);
    }

    /// Waits for every group in flight (the P·V of the tile's `i`-th block
    /// last) and releases the block's V stage.
    #[inline(always)]
    fn pv_done<const OT: usize, const PK: usize>(
        self,
        o: &mut [[f32; 4]; OT],
        pf: &mut [[u32; 4]; PK],
        w: &Work,
        i: u32,
    ) {
        wgmma::wait_group::<0>();
        wgmma::fence_operands(o);
        wgmma::fence_fragments(pf);
        self.release_v(w, i);
    }

    /// Score modifiers, then the mask, as the sm_80 mainloop applies them,
    /// then the online softmax of the tile's `i`-th block (visited from the
    /// last key block down), left as P in `s`; returns the factor O must
    /// take when the row maxima moved.
    #[inline(always)]
    fn softmax<M: Mask, S: Scores, const ST: usize>(
        self,
        p: &AttnParams,
        w: &Work,
        softmax: &mut OnlineSoftmax,
        s: &mut [[f32; 4]; ST],
        i: u32,
    ) -> Option<[f32; 2]> {
        let (info, bn) = (w.info, self.tile.block_n as u32);
        let n = info.n_hi - 1 - i;
        let key0 = (n * bn + 2 * self.t) as i32;
        // The softcap's row max from the raw scores where it measured faster:
        // D = 256 (H100, Gemma 2 9B: 1.09x); at D = 128 the tanh ops then
        // wait for the max chain (0.96x; docs/perf-notes.md, v31).
        if S::MODIFIED
            && self.tile.head_dim == 256
            && self.mods.softcap
            && !self.mods.alibi
            && !self.mods.fixed_max
            && !info.block_needs_mask(n, bn)
        {
            return softmax.advance_capped::<ST>(s, p.scale_log2, p.softcap_pre);
        }
        let mut row_bias = None;
        if S::MODIFIED {
            self.mods.softcap(p, s);
            if self.mods.alibi {
                let r0 = special::opaque_u32(self.row0);
                let pos = [r0, r0 + 8].map(|r| info.key_pos(r));
                let slope = [w.slope; 2];
                match info.origin_side(n, bn) {
                    OriginSide::Both => policy::alibi(s, key0, pos, slope),
                    side => {
                        let left = side == OriginSide::Left;
                        row_bias = Some(policy::alibi_one_sided(s, key0, pos, slope, left));
                    }
                }
            }
        }
        if info.block_needs_mask(n, bn) {
            // Rebuilt per block (see the sm_80 mainloop): kept live, the
            // rows' key limits would cost registers through the loop.
            let r0 = special::opaque_u32(self.row0);
            let edges = info.mask_edges(n, bn);
            mask::apply_rows::<M, ST>(s, key0, info, [r0, r0 + 8], edges);
        }
        if self.mods.fixed_max {
            return softmax.advance_fixed::<ST>(s, p.scale_log2);
        }
        // The row max in four chains where it measured faster: the D = 64
        // causal persistent line (H100: 1.04x at 512 keys, 1.02x at 1k,
        // 1.01-1.03x at 2k); on the other D = 64 causal lines (4k-16k keys)
        // and the other head dims 0.98-1.00x (docs/perf-notes.md, v30).
        if self.tile.head_dim == 64 && self.tile.persistent && matches!(M::KIND, MaskKind::Causal) {
            match row_bias {
                Some(b) => softmax.advance_biased::<ST, 4>(s, p.scale_log2, b),
                None => softmax.advance::<ST, 4>(s, p.scale_log2),
            }
        } else {
            match row_bias {
                Some(b) => softmax.advance_biased::<ST, 1>(s, p.scale_log2, b),
                None => softmax.advance::<ST, 1>(s, p.scale_log2),
            }
        }
    }

    /// The first block of a tile this warpgroup visits, the tile's `i`-th:
    /// S alone, its softmax (O is still 0: nothing to rescale), P packed
    /// for its P·V.
    #[inline(always)]
    fn first_block<
        T: Element,
        M: Mask,
        S: Scores,
        const ST: usize,
        const QK: usize,
        const PK: usize,
    >(
        self,
        p: &AttnParams,
        w: &Work,
        softmax: &mut OnlineSoftmax,
        i: u32,
    ) -> [[u32; 4]; PK] {
        let mut s = [[0f32; 4]; ST];
        let k_tile = self.k_tile(w, i);
        self.take_turn();
        self.issue_s::<T, ST, QK>(&mut s, w.q_rows, k_tile);
        self.hand_over();
        self.s_done(&mut s, w, i, 1);
        let _ = self.softmax::<M, S, ST>(p, w, softmax, &mut s, i);
        pack::<T, ST, PK>(&s)
    }

    /// The blocks `first + STEP`, `first + 2 STEP`, ... of a tile, P of
    /// block `first` in `pf`: FlashAttention-3's intra-warpgroup overlap.
    /// S(i) and then the P·V of the block before it are in flight together,
    /// and the softmax of S(i) runs while the tensor cores still work on
    /// the P·V. Leaves the last block's P in `pf` and returns its index.
    #[inline(always)]
    fn later_blocks<
        T: Element,
        M: Mask,
        S: Scores,
        const ST: usize,
        const OT: usize,
        const QK: usize,
        const PK: usize,
        const STEP: u32,
    >(
        self,
        p: &AttnParams,
        w: &Work,
        softmax: &mut OnlineSoftmax,
        o: &mut [[f32; 4]; OT],
        pf: &mut [[u32; 4]; PK],
        first: u32,
    ) -> u32 {
        let blocks = w.info.n_hi - w.info.n_lo;
        let mut i = first + STEP;
        while i < blocks {
            let k_tile = self.k_tile(w, i);
            let v_tile = self.v_tile(w, i - STEP);
            let mut s = [[0f32; 4]; ST];
            self.take_turn();
            self.issue_s::<T, ST, QK>(&mut s, w.q_rows, k_tile);
            self.issue_pv::<T, OT, PK>(o, pf, v_tile);
            self.hand_over();
            self.s_done(&mut s, w, i, 2);
            let correction = self.softmax::<M, S, ST>(p, w, softmax, &mut s, i);
            self.pv_done(o, pf, w, i - STEP);
            if let Some(c) = correction {
                unroll::<OT>(|j| unroll::<4>(|e| o[j][e] *= c[e / 2]));
            }
            *pf = pack::<T, ST, PK>(&s);
            i += STEP;
        }
        i - STEP
    }

    /// The blocks after the tile's first, one GEMM per turn
    /// ([`HopperTile::serial`]), P of the first block in `pf`: P(i-1)·V,
    /// its wait, then S(i), so that P and S never hold registers together
    /// beside O. The consumers' turns alternate per GEMM (the tensor cores
    /// see P·V, P·V, S, S), so that one consumer's wait for its P·V runs
    /// under the other's, and each softmax under the other's S or P·V.
    /// Leaves the last block's P in `pf`.
    #[inline(always)]
    fn serial_blocks<
        T: Element,
        M: Mask,
        S: Scores,
        const ST: usize,
        const OT: usize,
        const QK: usize,
        const PK: usize,
    >(
        self,
        p: &AttnParams,
        w: &Work,
        softmax: &mut OnlineSoftmax,
        o: &mut [[f32; 4]; OT],
        pf: &mut [[u32; 4]; PK],
    ) {
        let blocks = w.info.n_hi - w.info.n_lo;
        let mut i = 1;
        while i < blocks {
            self.serial_pv::<T, OT, PK>(o, pf, w, i - 1);
            let mut s = [[0f32; 4]; ST];
            self.serial_s::<T, ST, QK>(&mut s, w, i);
            if let Some(c) = self.softmax::<M, S, ST>(p, w, softmax, &mut s, i) {
                unroll::<OT>(|j| unroll::<4>(|e| o[j][e] *= c[e / 2]));
            }
            *pf = pack::<T, ST, PK>(&s);
            i += 1;
        }
    }

    /// The P·V of the tile's last block, alone (no next S to pair it with),
    /// if the tile has a block.
    #[inline(always)]
    fn last_pv<T: Element, const OT: usize, const PK: usize>(
        self,
        w: &Work,
        o: &mut [[f32; 4]; OT],
        pf: &mut [[u32; 4]; PK],
    ) {
        let blocks = w.info.n_hi - w.info.n_lo;
        if blocks > 0 {
            let v_tile = self.v_tile(w, blocks - 1);
            self.issue_pv::<T, OT, PK>(o, pf, v_tile);
            self.pv_done(o, pf, w, blocks - 1);
        }
    }

    /// The epilogue: LSE, then O / l through this warpgroup's own rows of
    /// the tile's Q buffer (its last S = Q·Kᵀ has completed), stored with
    /// TMA (dense) or row by row (packed). A TMA store is committed and left
    /// in flight: the buffer is reused, or the CTA exits, only after
    /// [`Self::store_read`].
    #[inline(always)]
    fn epilogue<T: Element, L: Seq, const D: usize, const OT: usize>(
        self,
        p: &AttnParams,
        maps: u64,
        w: &Work,
        o: &[[f32; 4]; OT],
        (inv_l, lse): ([f32; 2], [f32; 2]),
    ) {
        let (info, q_buf) = (w.info, w.q_buf);
        let (c, wg_tid, lane) = (self.c, self.wg_tid, self.lane);
        let bm = self.tile.block_m as u32;
        let split = self.tile.split_keys;
        // A split-key tile's consumers hold the same rows: consumer c
        // stores the c-th half of O's columns, consumer 0 the LSE.
        let own_half = |j: usize| !split || (j / (OT / 2)) as u32 == c;
        if p.lse != 0 && self.t == 0 && (!split || c == 0) {
            unroll::<2>(|r| {
                let row = self.row0 + 8 * r as u32;
                if let Some(token) = info.token(row) {
                    global::st_f32(p.lse + info.lse_index(row, token) * 4, lse[r]);
                }
            });
        }
        // Each `stmatrix` stores chunks j and j + 1 (8 columns each) of the
        // warp's 16 rows; lane l addresses row (l / 8 % 2) * 8 + l % 8 of
        // chunk j + l / 16.
        let warp_row0 = self.row0 - self.g;
        let (m_row, m_chunk) = ((lane / 8 % 2) * 8 + lane % 8, lane / 16);
        unroll::<OT>(|j| {
            if j % 2 == 1 || !own_half(j) {
                return;
            }
            let pair = |j: usize| {
                let p = |r: usize| T::pack(o[j][2 * r] * inv_l[r], o[j][2 * r + 1] * inv_l[r]);
                [p(0), p(1)]
            };
            let ([a, b], [c, d]) = (pair(j), pair(j + 1));
            let chunk = j as u32 + m_chunk;
            ldmatrix::store_x4(
                q_buf + sw128_offset(warp_row0 + m_row, chunk, bm),
                [a, b, c, d],
            );
        });
        if !L::RAGGED {
            // One TMA store per 64-column group of the warpgroup's rows; the
            // map's bounds drop the rows past the sequence and O's columns
            // past its head dim (a packed sequence's rows past its end would
            // be the next one's: those lines store row by row, below).
            fence::proxy_async_shared();
            barrier::sync_named(EPILOGUE_BARRIER + c, WARPGROUP_THREADS as u32);
            if wg_tid == 0 {
                let o_map = maps + core::mem::offset_of!(HopperFwdMaps, o) as u64;
                let groups = const { D.div_ceil(SW128_ROW_ELEMS) as u32 };
                let row = info.q_start + info.m0 + self.tile.first_row(c);
                let own = if split {
                    c * groups / 2..(c + 1) * groups / 2
                } else {
                    0..groups
                };
                for group in own {
                    let coord = [
                        (group as usize * SW128_ROW_ELEMS) as i32,
                        row as i32,
                        info.head_base as i32,
                        info.addr_batch as i32,
                    ];
                    let src = w.q_rows + group * bm * SW128_ROW_BYTES;
                    tma::store_4d(o_map, coord, src);
                }
                tma::store_commit();
            }
            return;
        }
        barrier::sync_named(EPILOGUE_BARRIER + c, WARPGROUP_THREADS as u32);
        let chunks = (D / 8) as u32;
        // A smaller V/O head dim: O's columns past it are TMA's zero columns
        // of V, and O has no room for them.
        let stored = p.v_chunks(D);
        for k in 0..(WGMMA_M * D / 8 / WARPGROUP_THREADS) as u32 {
            let idx = wg_tid + k * WARPGROUP_THREADS as u32;
            let row = c * WGMMA_M as u32 + idx / chunks;
            let chunk = idx % chunks;
            if chunk >= stored {
                continue;
            }
            if let Some(dst) = info.q_row_ptr(p.o, &p.o_strides, row) {
                let v = smem::ld_v4_b32(q_buf + sw128_offset(row, chunk, bm));
                global::st_v4_b32(dst + chunk as u64 * 16, v);
            }
        }
    }

    /// The end of a split-key tile ([`HopperTile::split_keys`]): the two
    /// consumers' states over their halves of the key blocks become one
    /// state over all of them ([`merge_rows`]), of which consumer c keeps
    /// O's c-th half of columns. Each consumer's rows' (m, l) cross through
    /// `merge_rows`, the halves of O (unscaled f32) in [`MERGE_ROUNDS`]
    /// rounds through the tile's Q buffer, which is free once both
    /// consumers' last S has completed (the first barrier). Fragment n-tile
    /// j crosses as thread t's 16 bytes at slot (k, t) of its sender's part
    /// of the round, read back by the other consumer's thread t, which
    /// holds the same rows and columns: no bank conflicts. Returns the
    /// merged rows' (m, l); this consumer's half of `o` is the merged O.
    #[inline(always)]
    fn merge<const OT: usize>(
        self,
        w: &Work,
        o: &mut [[f32; 4]; OT],
        softmax: &OnlineSoftmax,
    ) -> ([f32; 2], [f32; 2]) {
        let half = OT / 2;
        let per_round = half / MERGE_ROUNDS;
        const { assert!(OT % (2 * MERGE_ROUNDS) == 0) };
        let sync = || barrier::sync_named(MERGE_BARRIER, 2 * WARPGROUP_THREADS as u32);
        let (c, t) = (self.c, self.wg_tid);
        let slot = |from: u32, k: usize| {
            w.q_buf + ((from as usize * per_round + k) * WARPGROUP_THREADS) as u32 * 16 + 16 * t
        };
        let row_state = |from: u32, r: u32| {
            self.sm.merge_rows + 8 * (from * self.tile.block_m as u32 + self.row0 + 8 * r)
        };
        let own = (softmax.m, softmax.row_sums());
        sync();
        if self.t == 0 {
            unroll::<2>(|r| {
                let (m, l) = (own.0[r].to_bits(), own.1[r].to_bits());
                smem::st_v2_b32(row_state(c, r as u32), m, l);
            });
        }
        let mut merged = own;
        let mut weights = ([1.0f32; 2], [0.0f32; 2]);
        unroll::<MERGE_ROUNDS>(|round| {
            unroll::<OT>(|j| {
                let (owner, k) = ((j / half) as u32, j % half);
                if owner != c && k / per_round == round {
                    smem::st_v4_b32(slot(c, k % per_round), o[j].map(f32::to_bits));
                }
            });
            sync();
            if round == 0 {
                let mut other = ([0f32; 2], [0f32; 2]);
                unroll::<2>(|r| {
                    let (m, l) = smem::ld_v2_b32(row_state(1 - c, r as u32));
                    (other.0[r], other.1[r]) = (f32::from_bits(m), f32::from_bits(l));
                });
                let (m_l, a, b) = merge_rows(own, other);
                merged = m_l;
                weights = (a, b);
            }
            let (a, b) = weights;
            unroll::<OT>(|j| {
                let (owner, k) = ((j / half) as u32, j % half);
                if owner == c && k / per_round == round {
                    let x = smem::ld_v4_b32(slot(1 - c, k % per_round));
                    unroll::<4>(|e| {
                        o[j][e] = o[j][e] * a[e / 2] + f32::from_bits(x[e]) * b[e / 2];
                    });
                }
            });
            // The round's reads precede the next round's writes and the
            // epilogue's.
            sync();
        });
        merged
    }

    /// Waits until this warpgroup's O store (the TMA store its thread 0
    /// issued last) has read its Q buffer.
    #[inline(always)]
    fn store_read(self) {
        if self.wg_tid == 0 {
            tma::store_wait_read();
        }
    }

    /// Frees the Q buffer of a persistent CTA's tile `tiles` once its O
    /// store has read it. Every consumer thread arrives, thread 0 of each
    /// warpgroup after its store's read: each thread's reads of the
    /// buffer's tile slot are then ordered before the producer's next
    /// write by that thread's own arrival, not only through the epilogue's
    /// named barrier (with one arrival per warpgroup, racecheck reported
    /// the slot reads against the producer's rewrite; H100,
    /// docs/perf-notes.md v36).
    #[inline(always)]
    fn release_q(self, tiles: u32) {
        if self.wg_tid == 0 {
            tma::store_wait_read();
        }
        self.sm.q_ring().release(tiles);
    }
}

/// l and LSE of the finished rows; a sink adds exp(sink) to every row's
/// denominator (policy.rs).
#[inline(always)]
fn finalize<S: Scores>(
    p: &AttnParams,
    info: &BlockInfo,
    softmax: &OnlineSoftmax,
) -> ([f32; 2], [f32; 2]) {
    softmax.finalize(sink_logits::<S>(p, info))
}

/// [`finalize`] of rows whose max and l are `(m, l)`.
#[inline(always)]
fn finalize_rows<S: Scores>(
    p: &AttnParams,
    info: &BlockInfo,
    (m, l): ([f32; 2], [f32; 2]),
) -> ([f32; 2], [f32; 2]) {
    OnlineSoftmax::finalize_rows(m, l, sink_logits::<S>(p, info))
}

/// The row's sink logit in log2 units, for both of a lane's rows.
#[inline(always)]
fn sink_logits<S: Scores>(p: &AttnParams, info: &BlockInfo) -> Option<[f32; 2]> {
    if S::MODIFIED && p.sinks != 0 {
        let logit = global::ld_nc_f32(p.sinks + info.head_base as u64 * 4);
        let s = logit * core::f32::consts::LOG2_E;
        Some([s, s])
    } else {
        None
    }
}

/// Two consecutive 8-column n-tiles of S at a time, as P's A fragments.
#[inline(always)]
fn pack<T: Element, const ST: usize, const PK: usize>(s: &[[f32; 4]; ST]) -> [[u32; 4]; PK] {
    let mut pf = [[0u32; 4]; PK];
    unroll::<PK>(|kk| pf[kk] = pack_fragment::<T>(&s[2 * kk], &s[2 * kk + 1]));
    pf
}

/// Accumulator quads of half of O's columns on a serial tile (n = 128 at
/// D = 256, the one head dim with such a tile).
const SERIAL_O_HALF: usize = 16;

/// O's columns of half `h` as the accumulator of one n = D / 2 `wgmma`:
/// quad j holds the columns 8j..8j + 7 of the lane's rows.
#[inline(always)]
fn o_half<const OT: usize>(o: &mut [[f32; 4]; OT], h: usize) -> &mut [[f32; 4]; SERIAL_O_HALF] {
    if OT != 2 * SERIAL_O_HALF || h > 1 {
        special::trap();
    }
    // SAFETY: OT = 2 SERIAL_O_HALF and h <= 1 (checked): the quads
    // h SERIAL_O_HALF.. are in `o`, an array of the same element type.
    unsafe {
        &mut *o
            .as_mut_ptr()
            .add(h * SERIAL_O_HALF)
            .cast::<[[f32; 4]; SERIAL_O_HALF]>()
    }
}

/// One consumer warpgroup: its 64 rows of O over every key block, then
/// the epilogue; `at` places a persistent CTA's tile in the rings. With
/// `slots` (the tiles come from the producer's slots) it returns the next
/// tile ([`next_tile`], read while its last P·V runs, so that the tile's
/// geometry is worked out in that wait).
#[inline(always)]
fn consume<
    T: Element,
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const ST: usize,
    const OT: usize,
    const QK: usize,
    const PK: usize,
    const STAGES: u32,
    const VSTAGES: u32,
    const QB: u32,
>(
    p: &AttnParams,
    wg: Warpgroup<STAGES, VSTAGES, QB>,
    info: &BlockInfo,
    maps: u64,
    at: Cursor,
    slots: bool,
) -> Option<BlockInfo> {
    let tile = wg.tile;
    let w = wg.work(p, info, at);
    if !tile.persistent {
        wg.hand_over_first();
    }
    // A persistent CTA's previous tile stored its O from its own Q buffer
    // with TMA (below); the store has read it by the time this tile's first
    // softmax is done, so its wait costs nothing there, and the producer
    // has the next tile's time to load that buffer's next Q (three
    // buffers: `HopperTile::q_buffers`).
    let release_previous_q = || {
        if tile.persistent && at.tiles > 0 {
            wg.release_q(at.tiles - 1);
        }
    };
    // Read from its slot, a persistent CTA's tile has its Q: [`next_tile`]
    // waited for it.
    if !tile.persistent {
        wait(wg.sm.q_full, 0);
    } else if !slots {
        wg.sm.q_ring().wait_full(at.tiles);
    }
    let mut o = [[0f32; 4]; OT];
    let mut softmax = OnlineSoftmax::new();
    let blocks = info.n_hi - info.n_lo;
    // A split-key tile's consumer c takes the blocks c, c + 2, ...
    // (`HopperTile::split_keys`).
    let first = if tile.split_keys { wg.c } else { 0 };
    // P of the block whose P·V is issued next.
    let mut pf = [[0u32; 4]; PK];
    if first < blocks {
        pf = wg.first_block::<T, M, S, ST, QK, PK>(p, &w, &mut softmax, first);
        release_previous_q();
        if L::RAGGED {
            // Uniform: the first block visited is the sequence's last.
            let bn = tile.block_n as u32;
            let keys_in_block = info.seqlen_k.saturating_sub((info.n_hi - 1) * bn);
            if keys_in_block < bn {
                let v_tile = wg.v_tile(&w, 0);
                zero_rows_past::<D>(v_tile, bn, keys_in_block, tile.consumers as u32);
            }
        }
    }
    if first >= blocks {
        release_previous_q();
    }
    let last = if tile.split_keys {
        wg.later_blocks::<T, M, S, ST, OT, QK, PK, 2>(p, &w, &mut softmax, &mut o, &mut pf, first)
    } else {
        // Recomputed rather than the loop's counter kept past the loop,
        // as these lines always did.
        wg.later_blocks::<T, M, S, ST, OT, QK, PK, 1>(p, &w, &mut softmax, &mut o, &mut pf, 0);
        blocks.wrapping_sub(1)
    };
    let upcoming = || {
        if tile.persistent && slots {
            next_tile::<M, L, QB>(p, tile, wg.sm, at.after(info))
        } else {
            None
        }
    };
    let next = if first < blocks {
        let v_tile = wg.v_tile(&w, last);
        wg.issue_pv::<T, OT, PK>(&mut o, &mut pf, v_tile);
        let next = upcoming();
        wg.pv_done(&mut o, &mut pf, &w, last);
        next
    } else {
        upcoming()
    };
    if !tile.persistent {
        wg.take_last_turn();
    }
    let finished = if tile.split_keys {
        finalize_rows::<S>(p, info, wg.merge(&w, &mut o, &softmax))
    } else {
        finalize::<S>(p, info, &softmax)
    };
    wg.epilogue::<T, L, D, OT>(p, maps, &w, &o, finished);
    // A persistent CTA frees the buffer after the next tile's first
    // softmax (`release_previous_q`); another must not exit before the
    // store has read it.
    if !L::RAGGED && !tile.persistent {
        wg.store_read();
    }
    next
}

/// A consumer warpgroup of a serial tile ([`HopperTile::serial`]: one CTA
/// per tile, dense): the first block's S alone, then one GEMM per turn
/// ([`Warpgroup::serial_blocks`]), the last block's P·V, the epilogue.
/// Apart from [`consume`], whose lines' code does not change with it.
#[inline(always)]
fn consume_serial<
    T: Element,
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const ST: usize,
    const OT: usize,
    const QK: usize,
    const PK: usize,
    const STAGES: u32,
    const VSTAGES: u32,
    const QB: u32,
>(
    p: &AttnParams,
    wg: Warpgroup<STAGES, VSTAGES, QB>,
    info: &BlockInfo,
    maps: u64,
) {
    let w = wg.work(p, info, Cursor::default());
    wg.hand_over_first();
    wait(wg.sm.q_full, 0);
    let mut o = [[0f32; 4]; OT];
    let mut softmax = OnlineSoftmax::new();
    let blocks = info.n_hi - info.n_lo;
    if blocks > 0 {
        let mut s = [[0f32; 4]; ST];
        wg.serial_s::<T, ST, QK>(&mut s, &w, 0);
        let _ = wg.softmax::<M, S, ST>(p, &w, &mut softmax, &mut s, 0);
        let mut pf = pack::<T, ST, PK>(&s);
        wg.serial_blocks::<T, M, S, ST, OT, QK, PK>(p, &w, &mut softmax, &mut o, &mut pf);
        wg.serial_pv::<T, OT, PK>(&mut o, &mut pf, &w, blocks - 1);
    }
    wg.take_last_turn();
    let finished = finalize::<S>(p, info, &softmax);
    wg.epilogue::<T, L, D, OT>(p, maps, &w, &o, finished);
    wg.store_read();
}

/// The producer of a serial tile: Q, then each block's K and V as two
/// halves each ([`HopperTile::stage_bytes`]: half h is the column groups
/// 2h and 2h + 1, ring slot 2 block + h), in the order the consumers read
/// them.
#[inline(always)]
fn produce_serial<const D: usize, const STAGES: u32, const VSTAGES: u32, const QB: u32>(
    tile: HopperTile,
    info: &BlockInfo,
    maps: u64,
    sm: Smem<QB>,
    k_ring: TmaRing<STAGES>,
    v_ring: TmaRing<VSTAGES>,
) {
    let map = |offset: usize| maps + offset as u64;
    let (q_map, k_map, v_map) = (
        map(core::mem::offset_of!(HopperFwdMaps, q)),
        map(core::mem::offset_of!(HopperFwdMaps, k)),
        map(core::mem::offset_of!(HopperFwdMaps, v)),
    );
    let groups = const { D.div_ceil(SW128_ROW_ELEMS) as u32 };
    // `count` boxes of 64 columns from group `first` on, `rows` rows of
    // 128 bytes each at `dst`, the groups `rows` rows apart.
    let load =
        |dst: u32, rows: usize, map: u64, row: u32, head: u32, bar: u32, first: u32, count: u32| {
            for c in 0..count {
                let col = ((first + c) as usize * SW128_ROW_ELEMS) as i32;
                let coord = [col, row as i32, head as i32, info.addr_batch as i32];
                tma::load_4d(dst + c * rows as u32 * SW128_ROW_BYTES, map, coord, bar);
            }
        };
    let q_row = info.q_start + info.m0;
    load(
        sm.q,
        tile.block_m,
        q_map,
        q_row,
        info.head_base,
        sm.q_full,
        0,
        groups,
    );
    // As in [`produce`]: a grid of one wave loads V(0) once Q has landed.
    let q_first =
        special::grid_dim_x() * special::grid_dim_y() * special::grid_dim_z() <= special::sm_ids();
    let (bn, half) = (tile.block_n as u32, tile.stage_bytes() as u32);
    for i in 0..info.n_hi - info.n_lo {
        let row = info.k_start + (info.n_hi - 1 - i) * bn;
        for h in 0..2 {
            let (s, full) = k_ring.acquire(2 * i + h, half);
            load(
                sm.k + s * half,
                tile.block_n,
                k_map,
                row,
                info.kv_head,
                full,
                2 * h,
                2,
            );
        }
        if i == 0 && q_first {
            wait(sm.q_full, 0);
        }
        for h in 0..2 {
            let (s, full) = v_ring.acquire(2 * i + h, half);
            load(
                sm.v + s * half,
                tile.block_n,
                v_map,
                row,
                info.kv_head,
                full,
                2 * h,
                2,
            );
        }
    }
}

/// A persistent consumer without turns ([`HopperTile::pingpong`]): one
/// pipeline over the key blocks of all its tiles. Where a tile ends, the
/// next tile's first S = Q·Kᵀ is issued with the last P·V, so that the
/// first softmax of a tile runs while the tensor cores finish the tile
/// before; its epilogue follows. The S latency, the first softmax and the
/// last P·V are a tile's fixed cost otherwise, which short rows pay once
/// per few key blocks (docs/perf-notes.md, v29).
#[inline(always)]
fn stream<
    T: Element,
    M: Mask,
    S: Scores,
    L: Seq,
    const D: usize,
    const ST: usize,
    const OT: usize,
    const QK: usize,
    const PK: usize,
    const STAGES: u32,
    const VSTAGES: u32,
    const QB: u32,
>(
    p: &AttnParams,
    wg: Warpgroup<STAGES, VSTAGES, QB>,
    maps: u64,
) {
    let tile = wg.tile;
    let mut at = Cursor::default();
    let Some(mut info) = next_tile::<M, L, QB>(p, tile, wg.sm, at) else {
        return;
    };
    let mut o = [[0f32; 4]; OT];
    let mut softmax = OnlineSoftmax::new();
    // P of the block whose P·V is issued next.
    let mut pf = [[0u32; 4]; PK];
    // Whether the tile's first block was done under the previous tile.
    let mut begun = false;
    loop {
        let w = wg.work(p, &info, at);
        let blocks = info.n_hi - info.n_lo;
        if !begun {
            if blocks > 0 {
                pf = wg.first_block::<T, M, S, ST, QK, PK>(p, &w, &mut softmax, 0);
            }
        }
        wg.later_blocks::<T, M, S, ST, OT, QK, PK, 1>(p, &w, &mut softmax, &mut o, &mut pf, 0);
        let after = at.after(&info);
        match next_tile::<M, L, QB>(p, tile, wg.sm, after) {
            Some(u) if blocks > 0 && u.n_hi > u.n_lo => {
                let uw = wg.work(p, &u, after);
                let k_tile = wg.k_tile(&uw, 0);
                let v_tile = wg.v_tile(&w, blocks - 1);
                let mut s = [[0f32; 4]; ST];
                wg.issue_s::<T, ST, QK>(&mut s, uw.q_rows, k_tile);
                wg.issue_pv::<T, OT, PK>(&mut o, &mut pf, v_tile);
                release_before(wg, at);
                let finished = finalize::<S>(p, &info, &softmax);
                softmax = OnlineSoftmax::new();
                wg.s_done(&mut s, &uw, 0, 2);
                let _ = wg.softmax::<M, S, ST>(p, &uw, &mut softmax, &mut s, 0);
                wg.pv_done(&mut o, &mut pf, &w, blocks - 1);
                wg.epilogue::<T, L, D, OT>(p, maps, &w, &o, finished);
                pf = pack::<T, ST, PK>(&s);
                begun = true;
                info = u;
            }
            upcoming => {
                wg.last_pv::<T, OT, PK>(&w, &mut o, &mut pf);
                let finished = finalize::<S>(p, &info, &softmax);
                release_before(wg, at);
                wg.epilogue::<T, L, D, OT>(p, maps, &w, &o, finished);
                let Some(u) = upcoming else {
                    break;
                };
                softmax = OnlineSoftmax::new();
                begun = false;
                info = u;
            }
        }
        o = [[0f32; 4]; OT];
        at = after;
    }
}

/// Frees the Q buffer of the tile before the one at `at`, before this
/// tile's O store: that tile's store (the last one issued) was issued at
/// the start of this tile and has read its buffer by now; the producer has
/// the next two tiles' time to load the buffer again (four buffers:
/// `HopperTile::q_buffers`).
#[inline(always)]
fn release_before<const STAGES: u32, const VSTAGES: u32, const QB: u32>(
    wg: Warpgroup<STAGES, VSTAGES, QB>,
    at: Cursor,
) {
    if at.tiles > 0 {
        wg.release_q(at.tiles - 1);
    }
}

/// Zeroes rows `first..rows` of the V tile at `v_tile` (`rows` rows, SW128
/// in 64-column groups: each row is 128 contiguous bytes of a group,
/// whatever the swizzle does inside it) with every consumer thread, then
/// makes the writes visible to `wgmma` (the async proxy) and waits for
/// all consumers: they all read the whole tile.
#[inline(always)]
fn zero_rows_past<const D: usize>(v_tile: u32, rows: u32, first: u32, consumers: u32) {
    const CHUNKS_PER_ROW: u32 = SW128_ROW_BYTES / 16;
    let threads = consumers * WARPGROUP_THREADS as u32;
    let tid = special::thread_idx_x() - WARPGROUP_THREADS as u32;
    let per_group = (rows - first) * CHUNKS_PER_ROW;
    let groups = const { D.div_ceil(SW128_ROW_ELEMS) as u32 };
    let mut idx = tid;
    while idx < per_group * groups {
        let (group, chunk) = (idx / per_group, idx % per_group);
        let row_start = v_tile + group * rows * SW128_ROW_BYTES + first * SW128_ROW_BYTES;
        smem::st_v4_b32(row_start + chunk * 16, [0; 4]);
        idx += threads;
    }
    fence::proxy_async_shared();
    barrier::sync_named(ZEROED_BARRIER, threads);
}
