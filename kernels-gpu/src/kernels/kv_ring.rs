//! The K/V pipeline every mainloop streams key blocks through: a ring of
//! `kv_stages` shared-memory stages, each one (K, V) block. While block `i`
//! is consumed, blocks `i + 1 .. i + stages - 1` are in flight; one barrier
//! per block both publishes the landed block and frees the stage consumed
//! before it, which is refilled right after. (FlashAttention-2's single K and
//! V buffers need two barriers per block and measured 2-9% slower;
//! docs/perf-notes.md, v8.)
use super::block_info::BlockInfo;
use super::paging;
use super::smem_tile::SmemTile;
use crate::arch::{barrier, cp_async};
use crate::config::{AttnTile, CHUNK_BYTES};
use crate::params::AttnParams;

pub struct KvRing {
    /// Shared-memory address of stage 0.
    base: u32,
    stages: u32,
    stage_bytes: u32,
    /// Stage of the block being consumed, and the stage refilled next.
    read: u32,
    write: u32,
}

impl KvRing {
    #[inline(always)]
    pub fn new(tile: AttnTile, smem_base: u32) -> KvRing {
        KvRing {
            base: smem_base + tile.ring_offset() as u32,
            stages: tile.kv_stages as u32,
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
            cp_async::commit();
            i += 1;
        }
    }

    /// Waits until the next block has landed and every thread is done with
    /// the stage consumed before it, then issues block `i + stages - 1` (if
    /// any) into that stage. Call once per block `i`, before consuming it.
    #[inline(always)]
    pub fn advance_to(&self, i: u32, blocks: u32, mut load: impl FnMut(u32, u32)) {
        cp_async::wait_pending(self.stages - 2);
        barrier::sync_cta();
        let ahead = i + self.stages - 1;
        if ahead < blocks {
            load(self.base + self.write * self.stage_bytes, ahead);
        }
        cp_async::commit();
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

/// Issues the `cp.async` copies of key block `n` of K (row-pairs layout,
/// `SmemTile::store_addr`) and V into the stage at `stage`, as one group
/// (committed by the caller). With `may_page` (a compile-time constant of the
/// kernel) and a block table in the launch parameters, rows come from the
/// page pool: one lookup per block when the block lies in one page, else one
/// per row.
#[inline(always)]
pub fn load_block<const D: usize>(
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
    if paged && p.page_size % tile.block_n as u32 != 0 {
        let chunks = tile.row_chunks() as u32;
        let per_thread = tile.block_n * tile.row_chunks() / tile.threads();
        let mut c = 0;
        while c < per_thread {
            let idx = tid + (c * tile.threads()) as u32;
            let (row, chunk) = (idx / chunks, idx % chunks);
            let key = first + row;
            let chunk_off = chunk as u64 * CHUNK_BYTES as u64;
            if key < info.seqlen_k {
                let k = info.paged_row_ptr(p, p.k, &p.k_strides, key) + chunk_off;
                let v = info.paged_row_ptr(p, p.v, &p.v_strides, key) + chunk_off;
                cp_async::cg_16(k_tile.store_addr::<true>(row, chunk), k, CHUNK_BYTES as u32);
                cp_async::cg_16(
                    v_tile.store_addr::<false>(row, chunk),
                    v,
                    CHUNK_BYTES as u32,
                );
            } else {
                cp_async::cg_16(k_tile.store_addr::<true>(row, chunk), p.k, 0);
                cp_async::cg_16(v_tile.store_addr::<false>(row, chunk), p.v, 0);
            }
            c += 1;
        }
        return;
    }
    // Contiguous, or a whole block inside one page: rows evenly strided.
    let (k, v) = if paged {
        let (page, row) = paging::locate(
            p.block_table,
            p.max_pages,
            p.page_size,
            p.num_pages,
            info.batch as u64,
            first as u64,
        );
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
    k_tile.load_rows_async::<true>(rows, threads, tid, k, p.k_strides.row as u64 * 2, valid);
    v_tile.load_rows_async::<false>(rows, threads, tid, v, p.v_strides.row as u64 * 2, valid);
}
