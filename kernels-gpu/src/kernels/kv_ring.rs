//! The K/V pipeline every mainloop streams key blocks through: a ring of
//! `kv_stages` shared-memory stages, each one (K, V) block. While block `i`
//! is consumed, blocks `i + 1 .. i + stages - 1` are in flight; one barrier
//! per block both publishes the landed block and frees the stage consumed
//! before it, which is refilled right after. (FlashAttention-2's single K and
//! V buffers need two barriers per block and measured 2-9% slower;
//! docs/perf-notes.md, v8.)
use super::block_info::BlockInfo;
use super::copy;
use super::element::Element;
use super::smem_tile::SmemTile;
use crate::arch::barrier;
use crate::config::{AttnTile, WarpSplit, CHUNK_ELEMS};
use crate::params::AttnParams;
use crate::unroll::unroll;

/// Rows whose block-table reads are in flight together in the row-by-row
/// paged copy; each holds its (page, row) until its copies are issued, and
/// 4 fit beside the D = 256 decode kernel's accumulators without a spill.
const PAGED_LOOKUP_GROUP: usize = 4;

pub struct KvRing {
    /// Shared-memory address of stage 0.
    base: u32,
    stages: u32,
    /// Bounds of `stages`, compile-time constants (a decode launch picks
    /// the depth: `AttnTile::with_stages`).
    min_stages: u32,
    max_stages: u32,
    stage_bytes: u32,
    /// Stage of the block being consumed, and the stage refilled next.
    read: u32,
    write: u32,
}

impl KvRing {
    /// The ring of `tile`, whose depth lies in `tile.busy_stages..=max_stages`
    /// (`max_stages` a compile-time constant: the depth of the tile before
    /// `AttnTile::with_stages`).
    #[inline(always)]
    pub fn new(tile: AttnTile, smem_base: u32, max_stages: usize) -> KvRing {
        KvRing {
            base: smem_base + tile.ring_offset() as u32,
            stages: tile.kv_stages as u32,
            min_stages: tile.busy_stages.min(max_stages) as u32,
            max_stages: max_stages as u32,
            stage_bytes: tile.stage_bytes() as u32,
            read: 0,
            write: tile.kv_stages as u32 - 1,
        }
    }

    /// Issues blocks `0 .. stages - 1` of the `blocks` to visit, one commit
    /// group per stage (empty past the last block), after whatever group the
    /// caller committed before (Q's).
    #[inline(always)]
    pub fn prologue(&self, blocks: u32, mut load: impl FnMut(u32, u32)) {
        let mut i = 0;
        while i + 1 < self.stages {
            if i < blocks {
                load(self.base + i * self.stage_bytes, i);
            }
            copy::commit();
            i += 1;
        }
    }

    /// Waits until the next block has landed and every thread is done with
    /// the stage consumed before it, then issues block `i + stages - 1` (if
    /// any) into that stage. Call once per block `i`, before consuming it.
    #[inline(always)]
    pub fn advance_to(&self, i: u32, blocks: u32, mut load: impl FnMut(u32, u32)) {
        self.wait_pending(2);
        barrier::sync_cta();
        let ahead = i + self.stages - 1;
        if ahead < blocks {
            load(self.base + self.write * self.stage_bytes, ahead);
        }
        copy::commit();
    }

    /// Waits for the group committed before [`Self::prologue`] (Q's): it
    /// has landed once only the ring's groups are pending.
    #[inline(always)]
    pub fn wait_before_prologue(&self) {
        self.wait_pending(1);
    }

    /// Waits until at most `stages - back` groups are pending.
    #[inline(always)]
    fn wait_pending(&self, back: u32) {
        copy::wait_pending_in(
            self.stages - back,
            self.min_stages - back,
            self.max_stages - back,
        );
    }

    /// Offset of the stage being consumed, relative to stage 0.
    #[inline(always)]
    pub fn read_offset(&self) -> u32 {
        self.read * self.stage_bytes
    }

    /// Moves on after a block is consumed.
    #[inline(always)]
    pub fn rotate(&mut self) {
        self.read = if self.read + 1 == self.stages {
            0
        } else {
            self.read + 1
        };
        self.write = if self.write + 1 == self.stages {
            0
        } else {
            self.write + 1
        };
    }
}

/// Issues the copies (`Element::stage`) of key block `n` of K (row-pairs layout,
/// `SmemTile::store_addr`) and V into the stage at `stage`, as one group
/// (committed by the caller). With `may_page` (a compile-time constant of the
/// kernel) and a block table in the launch parameters, rows come from the
/// page pool: one lookup per block when the block lies in one page, else one
/// per row.
#[inline(always)]
pub fn load_block<T: Element, const D: usize>(
    p: &AttnParams,
    info: &BlockInfo,
    tile: AttnTile,
    stage: u32,
    n: u32,
    tid: u32,
    may_page: bool,
) {
    let k_tile = SmemTile::<D> {
        base: stage + (tile.k_smem_offset() - tile.ring_offset()) as u32,
    };
    let v_tile = SmemTile::<D> {
        base: stage + (tile.v_smem_offset() - tile.ring_offset()) as u32,
    };
    let first = n * tile.block_n as u32;
    let paged = may_page && p.block_table != 0;
    // V's own head dim: its chunks past it load as zeros.
    let (chunks_all, v_chunks) = (tile.row_chunks() as u32, p.v_chunks(D));
    if paged && p.page_size.divisor % tile.block_n as u32 != 0 {
        // Row by row. The table reads of a group are all issued before its
        // copies, so their latencies overlap instead of adding up: one read
        // at a time, each before its own copy, made page-16 decode 1.2x
        // slower than contiguous (docs/perf-notes.md, v11).
        let chunks = tile.row_chunks() as u32;
        let per_thread = (tile.block_n * tile.row_chunks() / tile.threads()) as u32;
        let mut c0 = 0;
        while c0 < per_thread {
            let cell = |g: usize| {
                let idx = tid + (c0 + g as u32) * tile.threads() as u32;
                (idx / chunks, idx % chunks)
            };
            let mut slot = [(0u64, 0u64); PAGED_LOOKUP_GROUP];
            unroll::<PAGED_LOOKUP_GROUP>(|g| {
                let key = first + cell(g).0;
                if c0 + (g as u32) < per_thread && key < info.seqlen_k {
                    slot[g] = info.locate_key(p, key);
                }
            });
            unroll::<PAGED_LOOKUP_GROUP>(|g| {
                if c0 + (g as u32) < per_thread {
                    let (row, chunk) = cell(g);
                    let (k_dst, v_dst) = (
                        k_tile.store_addr::<true>(row, chunk),
                        v_tile.store_addr::<false>(row, chunk),
                    );
                    let (page, in_page) = slot[g];
                    let chunk_off = chunk as u64 * (CHUNK_ELEMS as u32 * T::BYTES) as u64;
                    let row_ok = first + row < info.seqlen_k;
                    if row_ok {
                        let k = info.page_row_ptr(p.k, &p.k_strides, page, in_page) + chunk_off;
                        T::stage(k_dst, k, true);
                    } else {
                        T::stage(k_dst, p.k, false);
                    }
                    // V's chunks past its own head dim are zeros, like rows
                    // past the keys: one copy, its source and size selected,
                    // and the test reads the parameter itself (a derived
                    // value kept live made the sm_90 kernels spill).
                    let v_ok =
                        row_ok && (p.head_dim == 0 || chunk * (CHUNK_ELEMS as u32) < p.head_dim);
                    let v = info.page_row_ptr(p.v, &p.v_strides, page, in_page) + chunk_off;
                    T::stage(v_dst, if v_ok { v } else { p.v }, v_ok);
                }
            });
            c0 += PAGED_LOOKUP_GROUP as u32;
        }
        return;
    }
    // Contiguous, or a whole block inside one page: rows evenly strided.
    let (k, v) = if paged {
        let (page, row) = info.locate_key(p, first);
        (
            info.page_row_ptr(p.k, &p.k_strides, page, row),
            info.page_row_ptr(p.v, &p.v_strides, page, row),
        )
    } else {
        (
            info.kv_row_ptr(p.k, &p.k_strides, first),
            info.kv_row_ptr(p.v, &p.v_strides, first),
        )
    };
    let valid = info.seqlen_k.saturating_sub(first);
    let (rows, threads) = (tile.block_n, tile.threads());
    let (k_stride, v_stride) = (p.k_strides.row as u64 * 2, p.v_strides.row as u64 * 2);
    // A decode step's block copies are a quarter of a short step's
    // instructions (docs/perf-notes.md, v62-v63). Elsewhere the twin stays:
    // without it the mma.sync forward, and f32's and sm_75's register copies,
    // take more registers, and some spill.
    let in_place = tile.split == WarpSplit::Keys && T::BYTES == 2 && copy::ASYNC;
    k_tile.load_rows_async::<T, true>(rows, threads, tid, k, k_stride, valid, chunks_all, in_place);
    v_tile.load_rows_async::<T, false>(rows, threads, tid, v, v_stride, valid, v_chunks, in_place);
}
