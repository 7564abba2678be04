//! A row-major [rows][head_dim] tile of 16-bit elements in shared memory, its
//! 16-byte chunks XOR-swizzled within each group of 8 rows: chunk `c` of row `r`
//! is stored at chunk `c ^ (r % 8)` (`index::swizzle`). Rows are padded to a
//! whole group of 8 chunks (`config::smem_row_chunks`: D = 32 and 96), so the
//! swizzle stays within the row. An `ldmatrix` phase reads one logical chunk
//! of 8 consecutive rows, which the swizzle spreads over all 32 banks.
use super::element::Element;
use crate::arch::special;
use crate::config::{
    copy_row_lanes, smem_row_chunks, CHUNK_BYTES, CHUNK_ELEMS, ELEM_BYTES, SWIZZLE_ROWS,
};
use crate::index;

/// Swizzled `ldmatrix` addresses of one lane, shared by every tile of the CTA
/// (Q, K and V have the same row length and swizzle, and lie at compile-time
/// offsets). Every `ldmatrix.x4` here uses one lane pattern: lane `l` points at
/// row `block_row + l % 16` and chunk `chunk + l / 16` (block_row a multiple of
/// 16, chunk even), so matrix 0 is (rows 0-7, chunk), 1 is (rows 8-15, chunk),
/// 2 is (rows 0-7, chunk + 1) and 3 is (rows 8-15, chunk + 1). As block_row
/// does not change `row % 8`, the swizzled chunk is `8 * (chunk / 8) +
/// ((chunk % 8) ^ (row % 8 & 6)) + (l / 16 ^ (row & 1))`: four per-lane
/// offsets (one per `chunk % 8` pair) plus a compile-time immediate.
#[derive(Clone, Copy)]
pub struct FragAddr<const D: usize> {
    off: [u32; 4],
}

impl<const D: usize> FragAddr<D> {
    /// Offsets for lane `lane` relative to the shared-memory window `base`.
    /// The offsets pass through [`special::opaque_u32`] so LLVM rebuilds them
    /// where they are used instead of hoisting one register per address.
    #[inline(always)]
    pub fn new(base: u32, lane: u32) -> Self {
        let lane_row = lane % 16;
        let lr = lane_row % SWIZZLE_ROWS as u32;
        let low = (lane / 16) ^ (lr & 1);
        let mut off = [0u32; 4];
        let mut b = 0;
        while b < 4 {
            let chunk = ((2 * b as u32) ^ (lr & 6)) + low;
            off[b] = special::opaque_u32(
                base + lane_row * SmemTile::<D>::ROW_BYTES + chunk * CHUNK_BYTES as u32,
            );
            b += 1;
        }
        FragAddr { off }
    }

    /// Address for the `ldmatrix.x4` of rows `block_row..block_row + 16` and
    /// chunks `chunk, chunk + 1` of the tile at byte offset `tile_offset`.
    #[inline(always)]
    pub fn at(&self, tile_offset: usize, block_row: u32, chunk: u32) -> u32 {
        let group_bytes = (SWIZZLE_ROWS * CHUNK_BYTES) as u32;
        self.off[((chunk / 2) % 4) as usize]
            + tile_offset as u32
            + block_row * SmemTile::<D>::ROW_BYTES
            + (chunk / SWIZZLE_ROWS as u32) * group_bytes
    }
}

#[derive(Clone, Copy)]
pub struct SmemTile<const D: usize> {
    pub base: u32,
}

impl<const D: usize> SmemTile<D> {
    const ROW_BYTES: u32 = (smem_row_chunks(D) * CHUNK_BYTES) as u32;
    /// 16-byte chunks of data in a row (the padding excluded).
    const CHUNKS: usize = D * ELEM_BYTES / CHUNK_BYTES;

    /// Bytes of one chunk's elements in global memory (`T::BYTES` each).
    #[inline(always)]
    fn src_chunk_bytes<T: Element>() -> u64 {
        (CHUNK_ELEMS as u32 * T::BYTES) as u64
    }

    /// Address of 16-byte chunk `chunk` of row `row`.
    #[inline(always)]
    pub fn chunk_addr(self, row: u32, chunk: u32) -> u32 {
        self.base + row * Self::ROW_BYTES + index::swizzle(row, chunk) * CHUNK_BYTES as u32
    }

    /// Where chunk `chunk` of row `row` is stored. `ROW_PAIRS` (the K tile)
    /// swaps bit 3 of the row with bit 0 of the chunk, within each group of 16
    /// rows: an `ldmatrix.x4` in the A-fragment lane order of [`FragAddr`]
    /// (rows 0-7, rows 8-15 of one chunk, then of the next) then reads (keys
    /// 0-7, chunk), (keys 0-7, chunk + 1), (keys 8-15, chunk), (keys 8-15,
    /// chunk + 1): each register pair is the B fragment of one 8-key n-tile of
    /// S = Q·Kᵀ, as the `mma` operand wants it (an aligned pair). With K in the
    /// plain layout the pairs are registers 0, 2 and 1, 3, which costs moves
    /// and registers at every fragment, or a second set of lane addresses.
    #[inline(always)]
    pub fn store_addr<const ROW_PAIRS: bool>(self, row: u32, chunk: u32) -> u32 {
        if ROW_PAIRS {
            let (pair_row, pair_chunk) = index::row_pairs(row, chunk);
            self.chunk_addr(pair_row, pair_chunk)
        } else {
            self.chunk_addr(row, chunk)
        }
    }

    /// Address of element `col` (even) of row `row`: a 4-byte pair within a chunk.
    #[inline(always)]
    pub fn pair_addr(self, row: u32, col: u32) -> u32 {
        let elems_per_chunk = (CHUNK_BYTES / ELEM_BYTES) as u32;
        self.chunk_addr(row, col / elems_per_chunk) + (col % elems_per_chunk) * ELEM_BYTES as u32
    }

    /// Issues copies (`Element::stage`) of `rows` rows that are evenly spaced in global
    /// memory: row `r` starts at `src + r * stride_bytes`; rows `r >= valid`,
    /// and chunks from `valid_chunks` on, are zero-filled with a 0-byte read
    /// of `src`, or with `zero_fill_in_place` of their own address (which may
    /// lie past the tensor's end; 0 bytes are read): one `cp.async` per chunk,
    /// its size selected, instead of a copy and a zero-filling twin. The
    /// threads split into
    /// whole rows of [`copy_row_lanes`] chunk lanes (lanes past the row's
    /// chunks copy nothing), so each thread keeps one chunk column and its
    /// shared and global addresses advance by constants. `ROW_PAIRS`: see
    /// [`Self::store_addr`].
    #[inline(always)]
    pub fn load_rows_async<T: Element, const ROW_PAIRS: bool>(
        self,
        rows: usize,
        threads: usize,
        tid: u32,
        src: u64,
        stride_bytes: u64,
        valid: u32,
        valid_chunks: u32,
        zero_fill_in_place: bool,
    ) {
        let lanes = copy_row_lanes(D);
        let rows_per_pass = threads / lanes;
        // Through `opaque_u32`, the thread's first row and its offsets are
        // rebuilt at each call: hoisted out of the key loop they would hold a
        // 64-bit source offset and a shared address per tile in registers. The
        // `% threads` tells LLVM the bounds of row0, so the swizzle of each
        // copy's row folds to row0's.
        let tid = special::opaque_u32(tid) % threads as u32;
        let row0 = tid / lanes as u32;
        let chunk = tid % lanes as u32;
        if chunk as usize >= Self::CHUNKS {
            return;
        }
        let mut src_row = src
            .wrapping_add(row0 as u64 * stride_bytes + chunk as u64 * Self::src_chunk_bytes::<T>());
        let step = stride_bytes * rows_per_pass as u64;
        // Rows left for this thread from its first row on: each copy compares
        // it with a compile-time row offset. Comparing `row0 + offset < valid`
        // instead lets LLVM hoist every `row0 + offset` out of the key loop,
        // one register per copy.
        // A chunk past `valid_chunks` (V's own head dim) is zero in every row.
        let rows_valid = if chunk < valid_chunks { valid } else { 0 };
        let remaining = rows_valid as i32 - row0 as i32;
        let mut i = 0;
        while i < rows / rows_per_pass {
            let dst = self.store_addr::<ROW_PAIRS>(row0 + (i * rows_per_pass) as u32, chunk);
            let row_ok = ((i * rows_per_pass) as i32) < remaining;
            if zero_fill_in_place {
                T::stage(dst, src_row, row_ok);
            } else if row_ok {
                T::stage(dst, src_row, true);
            } else {
                T::stage(dst, src, false);
            }
            src_row = src_row.wrapping_add(step);
            i += 1;
        }
    }

    /// Issues copies (`Element::stage`) of `rows` rows into the tile. Row `r` comes from
    /// `src(r)`; rows for which it returns `None` are zero-filled with a 0-byte
    /// read of `fallback`, a valid address that keeps memory checkers quiet.
    /// Every thread of the CTA calls this with its own `tid`. `ROW_PAIRS`: see
    /// [`Self::store_addr`].
    #[inline(always)]
    pub fn load_async<T: Element, const ROW_PAIRS: bool>(
        self,
        rows: usize,
        threads: usize,
        tid: u32,
        fallback: u64,
        src: impl Fn(u32) -> Option<u64>,
    ) {
        self.load_chunks_async::<T, ROW_PAIRS>(rows, threads, tid, fallback, |r, c| {
            src(r).map(|p| p + c as u64 * Self::src_chunk_bytes::<T>())
        })
    }

    /// [`Self::load_async`] with each chunk's source: `src(row, chunk)`,
    /// `None` for a zero chunk.
    #[inline(always)]
    pub fn load_chunks_async<T: Element, const ROW_PAIRS: bool>(
        self,
        rows: usize,
        threads: usize,
        tid: u32,
        fallback: u64,
        src: impl Fn(u32, u32) -> Option<u64>,
    ) {
        let chunks = Self::CHUNKS as u32;
        let total = rows * Self::CHUNKS;
        let mut i = 0;
        while i < total.div_ceil(threads) {
            let idx = tid + (i * threads) as u32;
            if total % threads == 0 || (idx as usize) < total {
                let row = idx / chunks;
                let chunk = idx % chunks;
                let (addr, valid) = match src(row, chunk) {
                    Some(p) => (p, true),
                    None => (fallback, false),
                };
                T::stage(self.store_addr::<ROW_PAIRS>(row, chunk), addr, valid);
            }
            i += 1;
        }
    }
}
