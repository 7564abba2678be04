//! Paged KV cache: where a sequence's token lives in the page pool.
use crate::arch::global;
use crate::index::{self, FastDiv};

/// Pool page and row within it of token `pos` of sequence `batch`, from an
/// i32 [B, max_pages] block table. The page index is clamped to the pool, so a
/// bad table entry (device data, which the host cannot check) cannot make a
/// kernel read or write outside it. `pos` < 2^31 (see [`FastDiv`]).
#[inline(always)]
pub fn locate(
    table: u64,
    max_pages: u32,
    page_size: FastDiv,
    num_pages: u32,
    batch: u64,
    pos: u32,
) -> (u64, u64) {
    let (index, row) = page_size.divmod(pos);
    let at = batch * max_pages as u64 + index as u64;
    let page = index::page_slot(global::ld_nc_s32(table + at * 4), num_pages);
    (page, row as u64)
}
