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
//! per SM, each looping over tiles (`index::persistent_step`): Q has three
//! buffers in a ring of its own, and the K/V rings and the ping-pong turns
//! run on across tiles, so the producer loads the next tile's Q and first
//! K/V blocks while the consumers finish the current one. The dense lines
//! store O with TMA from the Q buffer it was computed from.
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
use crate::kernels::softmax::{pack_fragment, OnlineSoftmax};
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
/// Q buffers of a persistent CTA ([`HopperTile::q_buffers`]).
const Q_BUFFERS: u32 = 3;

/// `.shared` addresses of the CTA's tiles and barriers ([`HopperTile`]).
#[derive(Clone, Copy)]
struct Smem {
    q: u32,
    /// Stage 0's K tile; stage s at `k + s * kv_bytes`.
    k: u32,
    v: u32,
    q_full: u32,
    /// A persistent CTA's Q ring: buffer b at `q + b * q_bytes`, its
    /// barriers at `q_full + 8b` and `q_empty + 8b`.
    q_empty: u32,
}

impl Smem {
    #[inline(always)]
    fn q_ring(self) -> TmaRing<Q_BUFFERS> {
        TmaRing::new(self.q_full, self.q_empty)
    }
}

/// Where a tile's loads sit in the rings of a persistent CTA: the tiles
/// and K/V blocks before it (zero in a CTA of one tile), and its step of
/// `index::persistent_step`.
#[derive(Clone, Copy, Default)]
struct Cursor {
    tiles: u32,
    blocks: u32,
    step: u32,
}

impl Cursor {
    /// The next tile's, after `info`'s at this step; `next` is its step.
    #[inline(always)]
    fn after(self, info: &BlockInfo, next: u32) -> Cursor {
        Cursor {
            tiles: self.tiles + 1,
            blocks: self.blocks + (info.n_hi - info.n_lo),
            step: next,
        }
    }
}

/// A persistent CTA's tile at `step` ([`index::persistent_step`]; causal
/// masks pair heavy and light query blocks) and the step after it; `None`
/// past the last. Rebuilt from the parameters (and the host's divisors) at
/// each step: only the cursor is state through the mainloop.
#[inline(always)]
fn tile_at<M: Mask, L: Seq>(
    p: &AttnParams,
    tile: HopperTile,
    step: u32,
) -> Option<(BlockInfo, u32)> {
    let g = &p.tiles;
    let paired = matches!(M::KIND, MaskKind::Causal) && g.paired != 0;
    let pairs = (p.heads * p.batch).max(1);
    let (cta, grid) = (special::block_idx_x(), special::grid_dim_x());
    let (m_block, pair, next) = index::persistent_step(step, cta, grid, g, pairs, paired)?;
    let (batch, head) = g.heads.divmod(pair);
    let at = TileCoord {
        m_block,
        head,
        batch,
        kv_head: g.group.quotient(head),
    };
    Some((
        BlockInfo::at::<M, L>(p, tile.block_m, tile.block_n, at),
        next,
    ))
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
    const REGS: u32,
>(
    p: &AttnParams,
    maps: u64,
) {
    let tile = const { HopperTile::of(D, policies::<M, S, L>(), ROWS, LOOP, Some(ST * 8)) };
    const {
        let t = HopperTile::of(D, policies::<M, S, L>(), ROWS, LOOP, Some(ST * 8));
        assert!(!t.persistent || t.q_buffers() == Q_BUFFERS as usize);
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
        assert!(STAGES as usize == t.stages && t.block_m == t.consumers * WGMMA_M);
        assert!(REGS == t.consumer_regs() && (!t.pingpong || t.consumers == 2));
    }
    let a = SW128_ATOM_BYTES;
    let base = (smem::base() + a - 1) & !(a - 1);
    let at = |offset: usize| base + offset as u32;
    let sm = Smem {
        q: base,
        k: at(tile.k_offset(0)),
        v: at(tile.v_offset(0)),
        q_full: at(tile.barrier(HopperTile::Q_FULL)),
        q_empty: at(tile.barrier(tile.q_empty(0))),
    };
    let ring = |first: usize| {
        TmaRing::<STAGES>::new(
            at(tile.barrier(first)),
            at(tile.barrier(first + tile.stages)),
        )
    };
    let (k_ring, v_ring) = (ring(tile.k_ring()), ring(tile.k_ring() + 2 * tile.stages));
    let tid = special::thread_idx_x();
    if tid == 0 {
        // Every consumer warp releases a stage once its share of the
        // `wgmma`s that read it has completed.
        let releasers = (tile.consumers * WARPGROUP_THREADS / WARP_SIZE) as u32;
        if LOOP {
            // A Q buffer frees once each consumer's TMA store of the O it
            // holds has read it (`consume`).
            sm.q_ring().init(tile.consumers as u32);
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
        persistent::<T, M, S, L, D, ST, OT, QK, PK, STAGES, REGS>(
            p, tile, maps, sm, k_ring, v_ring,
        );
        return;
    }

    let heaviest_first = matches!(M::KIND, MaskKind::Causal);
    let info = BlockInfo::new::<M, L>(p, tile.block_m, tile.block_n, false, heaviest_first);
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
            produce::<L, D, STAGES>(p, tile, &info, maps, sm, k_ring, v_ring, Cursor::default());
        }
    } else {
        setmaxnreg::inc::<REGS>();
        let at = Cursor::default();
        consume::<T, M, S, L, D, ST, OT, QK, PK, STAGES>(
            p, tile, &info, maps, sm, k_ring, v_ring, at,
        );
    }
}

/// The roles of a persistent CTA: each runs its part of every tile of
/// [`tile_at`] in turn. The ping-pong turns run on across tiles (both
/// consumers take one per key block), so the first hand-over and the last
/// turn (see `consume`) frame the whole loop.
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
    const REGS: u32,
>(
    p: &AttnParams,
    tile: HopperTile,
    maps: u64,
    sm: Smem,
    k_ring: TmaRing<STAGES>,
    v_ring: TmaRing<STAGES>,
) {
    let tid = special::thread_idx_x();
    let mut at = Cursor::default();
    if tid < WARPGROUP_THREADS as u32 {
        setmaxnreg::dec::<{ HopperTile::PERSISTENT_PRODUCER_REGS }>();
        if tid == 0 {
            while let Some((info, next)) = tile_at::<M, L>(p, tile, at.step) {
                produce::<L, D, STAGES>(p, tile, &info, maps, sm, k_ring, v_ring, at);
                at = at.after(&info, next);
            }
        }
    } else {
        setmaxnreg::inc::<REGS>();
        let c = tid / WARPGROUP_THREADS as u32 - 1;
        let turn_threads = 2 * WARPGROUP_THREADS as u32;
        if tile.pingpong && c == 1 {
            barrier::arrive_named(TURN_BARRIER, turn_threads);
        }
        while let Some((info, next)) = tile_at::<M, L>(p, tile, at.step) {
            consume::<T, M, S, L, D, ST, OT, QK, PK, STAGES>(
                p, tile, &info, maps, sm, k_ring, v_ring, at,
            );
            at = at.after(&info, next);
        }
        if tile.pingpong && c == 0 {
            barrier::sync_named(TURN_BARRIER, turn_threads);
        }
        // The last tile's O store must read its shared memory before the
        // CTA exits.
        if special::thread_idx_x() % WARPGROUP_THREADS as u32 == 0 {
            tma::store_wait_read();
        }
    }
}

/// The load loop: Q once, then K(n) and V(n) for n from `n_hi - 1` down,
/// by thread 0; `at` places a persistent CTA's tile in the rings. From a paged cache (`L::PAGED` and a block table) the first
/// warp loads each block as boxes of `index::paged_box_rows` rows, which
/// never straddle a page: lane j looks up box j's page (the table reads of
/// a block overlap), thread 0 claims the K stage, the lanes issue their K
/// boxes, and likewise V. A box whose first key lies past the sequence
/// reads page 0 (masked, and its V rows zeroed by the consumers).
#[inline(always)]
fn produce<L: Seq, const D: usize, const STAGES: u32>(
    p: &AttnParams,
    tile: HopperTile,
    info: &BlockInfo,
    maps: u64,
    sm: Smem,
    k_ring: TmaRing<STAGES>,
    v_ring: TmaRing<STAGES>,
    at: Cursor,
) {
    let map = |offset: usize| maps + offset as u64;
    let (q_map, k_map, v_map) = (
        map(core::mem::offset_of!(HopperFwdMaps, q)),
        map(core::mem::offset_of!(HopperFwdMaps, k)),
        map(core::mem::offset_of!(HopperFwdMaps, v)),
    );
    let groups = (D / SW128_ROW_ELEMS) as u32;
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
        // A persistent CTA's Q buffer frees once the tile that used it has
        // stored its O through it (`consume`).
        let (q, full) = if tile.persistent {
            let (b, full) = sm.q_ring().acquire(at.tiles, tile.q_bytes() as u32);
            (sm.q + b * tile.q_bytes() as u32, full)
        } else {
            mbarrier::arrive_expect_tx(sm.q_full, tile.q_bytes() as u32);
            (sm.q, sm.q_full)
        };
        let q_row = info.q_start + info.m0;
        let batch = info.addr_batch;
        load(q, tile.block_m, q_map, q_row, info.head_base, batch, full);
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
            for (ring, base, map) in [(k_ring, sm.k, k_map), (v_ring, sm.v, v_map)] {
                if leader {
                    ring.acquire(slot(i), bytes);
                }
                barrier::sync_warp();
                if lane < boxes {
                    let (s, full) = ring.slot(slot(i));
                    let dst = base + s * bytes + offset;
                    load(dst, tile.block_n, map, row, info.kv_head, page, full);
                }
            }
        }
        return;
    }
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

/// One consumer warpgroup: its 64 rows of O over every key block, then
/// the epilogue; `at` places a persistent CTA's tile in the rings.
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
>(
    p: &AttnParams,
    tile: HopperTile,
    info: &BlockInfo,
    maps: u64,
    sm: Smem,
    k_ring: TmaRing<STAGES>,
    v_ring: TmaRing<STAGES>,
    at: Cursor,
) {
    let tid = special::thread_idx_x();
    let c = tid / WARPGROUP_THREADS as u32 - 1;
    let wg_tid = tid % WARPGROUP_THREADS as u32;
    let lane = tid % WARP_SIZE as u32;
    let (g, t) = (lane / 4, lane % 4);
    // The CTA row of the lane's first accumulator half (the second is + 8).
    let row0 = c * WGMMA_M as u32 + wg_tid / WARP_SIZE as u32 * 16 + g;
    let (bm, bn) = (tile.block_m as u32, tile.block_n as u32);
    let kv_bytes = tile.kv_bytes() as u32;
    // The tile's Q buffer, and this warpgroup's rows of it: the A operand of
    // S = Q·Kᵀ.
    let q_buf = if tile.persistent {
        sm.q + (at.tiles % Q_BUFFERS) * tile.q_bytes() as u32
    } else {
        sm.q
    };
    let q_rows = q_buf + c * WGMMA_M as u32 * SW128_ROW_BYTES;

    // S = Q·K(i)ᵀ and O += P·V(i) are issued as groups of `wgmma`s, each one
    // straight run of fence, wgmmas, commit (a register write or a branch
    // inside it makes ptxas serialise them).
    let issue_s = |s: &mut [[f32; 4]; ST], k_tile: u32| {
        wgmma::fence_operands(s);
        wgmma::fence();
        unroll::<QK>(|kk| {
            let (a, b) = (
                k_major_desc(q_rows, bm, kk as u32),
                k_major_desc(k_tile, bn, kk as u32),
            );
            wgmma::ss::<ST, 0>(T::BF16, s, a, b, (kk > 0) as u32);
        });
        wgmma::commit_group();
    };
    // V is MN-major, as TMA stored it; P is all in registers before the fence.
    let issue_pv = |o: &mut [[f32; 4]; OT], pf: &mut [[u32; 4]; PK], v_tile: u32| {
        wgmma::fence_operands(o);
        wgmma::fence_fragments(pf);
        wgmma::fence();
        unroll::<PK>(|kk| {
            let b = mn_major_desc(v_tile, bn, kk as u32);
            wgmma::rs::<OT, 1>(T::BF16, o, &pf[kk], b, 1);
        });
        wgmma::commit_group();
    };
    let mods = Modifiers::new::<S>(p);
    // The CTA's one head: its ALiBi slope is uniform.
    let slope = if mods.alibi {
        Modifiers::slope(p, info.batch, info.head_base)
    } else {
        0.0
    };
    // Score modifiers, then the mask, as the sm_80 mainloop applies them;
    // returns the rows' ALiBi part that the softmax adds (one-sided blocks).
    let mask_scores = |s: &mut [[f32; 4]; ST], n: u32| {
        let key0 = (n * bn + 2 * t) as i32;
        let mut row_bias = None;
        if S::MODIFIED {
            mods.softcap(p, s);
            if mods.alibi {
                let r0 = special::opaque_u32(row0);
                let pos = [r0, r0 + 8].map(|r| info.key_pos(r));
                match info.origin_side(n, bn) {
                    OriginSide::Both => policy::alibi(s, key0, pos, [slope; 2]),
                    side => {
                        let left = side == OriginSide::Left;
                        row_bias = Some(policy::alibi_one_sided(s, key0, pos, [slope; 2], left));
                    }
                }
            }
        }
        if info.block_needs_mask(n, bn) {
            // Rebuilt per block (see the sm_80 mainloop): kept live, the
            // rows' key limits would cost registers through the loop.
            let r0 = special::opaque_u32(row0);
            mask::apply_rows::<M, ST>(s, key0, info, [r0, r0 + 8]);
        }
        row_bias
    };
    let pack = |s: &[[f32; 4]; ST]| {
        let mut pf = [[0u32; 4]; PK];
        unroll::<PK>(|kk| pf[kk] = pack_fragment::<T>(&s[2 * kk], &s[2 * kk + 1]));
        pf
    };

    // Ping-pong: a warpgroup waits for its turn, issues its GEMMs and hands
    // the turn to the other; warpgroup 1 hands warpgroup 0 the first turn.
    // Every turn taken is one handed over, so warpgroup 0 takes one more
    // turn than it is handed back, after its last GEMM (the barrier then
    // ends the CTA with no arrival pending). A persistent CTA does the
    // first and last once around its tiles ([`persistent`]).
    let turn_threads = 2 * WARPGROUP_THREADS as u32;
    let take_turn = || {
        if tile.pingpong {
            barrier::sync_named(TURN_BARRIER + c, turn_threads);
        }
    };
    let hand_over = || {
        if tile.pingpong {
            barrier::arrive_named(TURN_BARRIER + (1 - c), turn_threads);
        }
    };
    if tile.pingpong && c == 1 && !tile.persistent {
        hand_over();
    }

    // A persistent CTA's previous tile stored its O from its own Q buffer
    // with TMA (below); the store has read it by the time this tile's first
    // softmax is done, so its wait costs nothing there, and the producer
    // has the next tile's time to load that buffer's next Q (three
    // buffers: `HopperTile::q_buffers`).
    let release_previous_q = || {
        if tile.persistent && at.tiles > 0 && wg_tid == 0 {
            tma::store_wait_read();
            sm.q_ring().release(at.tiles - 1);
        }
    };
    if tile.persistent {
        sm.q_ring().wait_full(at.tiles);
    } else {
        wait(sm.q_full, 0);
    }
    let mut o = [[0f32; 4]; OT];
    let mut softmax = OnlineSoftmax::new();
    let blocks = info.n_hi - info.n_lo;
    let block = |i: u32| info.n_hi - 1 - i;
    // Block i's place in the K/V rings.
    let slot = |i: u32| at.blocks + i;
    // P of the block whose P·V is issued next.
    let mut pf = [[0u32; 4]; PK];
    if blocks > 0 {
        let mut s = [[0f32; 4]; ST];
        let k_tile = sm.k + k_ring.wait_full(slot(0)) * kv_bytes;
        take_turn();
        issue_s(&mut s, k_tile);
        hand_over();
        wgmma::wait_group::<0>();
        wgmma::fence_operands(&mut s);
        if lane == 0 {
            k_ring.release(slot(0));
        }
        let row_bias = mask_scores(&mut s, block(0));
        // O is still 0: nothing to rescale.
        let _ = match row_bias {
            Some(b) => softmax.advance_biased(&mut s, p.scale_log2, b),
            None => softmax.advance(&mut s, p.scale_log2),
        };
        pf = pack(&s);
        release_previous_q();
        if L::RAGGED {
            // Uniform: the first block visited is the sequence's last.
            let keys_in_block = info.seqlen_k.saturating_sub(block(0) * bn);
            if keys_in_block < bn {
                let v_tile = sm.v + v_ring.wait_full(slot(0)) * kv_bytes;
                zero_rows_past::<D>(v_tile, bn, keys_in_block, tile.consumers as u32);
            }
        }
    }
    if blocks == 0 {
        release_previous_q();
    }
    // FlashAttention-3's intra-warpgroup overlap: S(i) and then P(i-1)·V(i-1)
    // are in flight together, and the softmax of S(i) runs while the
    // tensor cores still work on the P·V.
    let mut i = 1;
    while i < blocks {
        let k_tile = sm.k + k_ring.wait_full(slot(i)) * kv_bytes;
        let v_tile = sm.v + v_ring.wait_full(slot(i - 1)) * kv_bytes;
        let mut s = [[0f32; 4]; ST];
        take_turn();
        issue_s(&mut s, k_tile);
        issue_pv(&mut o, &mut pf, v_tile);
        hand_over();
        // Groups complete in order: S(i) has, P·V may still be running.
        wgmma::wait_group::<1>();
        wgmma::fence_operands(&mut s);
        if lane == 0 {
            k_ring.release(slot(i));
        }
        let row_bias = mask_scores(&mut s, block(i));
        let correction = match row_bias {
            Some(b) => softmax.advance_biased(&mut s, p.scale_log2, b),
            None => softmax.advance(&mut s, p.scale_log2),
        };
        wgmma::wait_group::<0>();
        wgmma::fence_operands(&mut o);
        wgmma::fence_fragments(&mut pf);
        if lane == 0 {
            v_ring.release(slot(i - 1));
        }
        if let Some(c) = correction {
            unroll::<OT>(|j| unroll::<4>(|e| o[j][e] *= c[e / 2]));
        }
        pf = pack(&s);
        i += 1;
    }
    if blocks > 0 {
        issue_pv(
            &mut o,
            &mut pf,
            sm.v + v_ring.wait_full(slot(blocks - 1)) * kv_bytes,
        );
        wgmma::wait_group::<0>();
        wgmma::fence_operands(&mut o);
        wgmma::fence_fragments(&mut pf);
        if lane == 0 {
            v_ring.release(slot(blocks - 1));
        }
    }
    if tile.pingpong && c == 0 && !tile.persistent {
        take_turn();
    }

    // A sink adds exp(sink) to every row's denominator (policy.rs).
    let sink = if S::MODIFIED && p.sinks != 0 {
        Some(global::ld_nc_f32(p.sinks + info.head_base as u64 * 4) * core::f32::consts::LOG2_E)
    } else {
        None
    };
    let (inv_l, lse) = softmax.finalize(sink.map(|s| [s, s]));
    if p.lse != 0 && t == 0 {
        unroll::<2>(|r| {
            let row = row0 + 8 * r as u32;
            if let Some(token) = info.token(row) {
                global::st_f32(p.lse + info.lse_index(row, token) * 4, lse[r]);
            }
        });
    }
    // O / l through this warpgroup's own Q rows (its last S = Q·Kᵀ has
    // completed): each `stmatrix` stores chunks j and j + 1 (8 columns
    // each) of the warp's 16 rows; lane l addresses row (l / 8 % 2) * 8 +
    // l % 8 of chunk j + l / 16.
    let warp_row0 = row0 - g;
    let (m_row, m_chunk) = ((lane / 8 % 2) * 8 + lane % 8, lane / 16);
    unroll::<OT>(|j| {
        if j % 2 == 1 {
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
        // map's bounds drop the rows past the sequence and O's columns past
        // its head dim (a packed sequence's rows past its end would be the
        // next one's: those lines store row by row, below). A persistent
        // CTA releases the buffer after the next tile's first softmax
        // (`release_previous_q`); another must not exit before the store
        // has read it.
        fence::proxy_async_shared();
        barrier::sync_named(EPILOGUE_BARRIER + c, WARPGROUP_THREADS as u32);
        if wg_tid == 0 {
            let o_map = maps + core::mem::offset_of!(HopperFwdMaps, o) as u64;
            let row = info.q_start + info.m0 + c * WGMMA_M as u32;
            for group in 0..(D / SW128_ROW_ELEMS) as u32 {
                let coord = [
                    (group as usize * SW128_ROW_ELEMS) as i32,
                    row as i32,
                    info.head_base as i32,
                    info.addr_batch as i32,
                ];
                tma::store_4d(o_map, coord, q_rows + group * bm * SW128_ROW_BYTES);
            }
            tma::store_commit();
            if !tile.persistent {
                tma::store_wait_read();
            }
        }
        return;
    }
    barrier::sync_named(EPILOGUE_BARRIER + c, WARPGROUP_THREADS as u32);
    let chunks = (D / 8) as u32;
    // A smaller V/O head dim: O's columns past it are TMA's zero columns of
    // V, and O has no room for them.
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
    let groups = (D / SW128_ROW_ELEMS) as u32;
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
