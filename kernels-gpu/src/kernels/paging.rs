//! Paged KV cache: where a sequence's token lives in the page pool.
use crate::arch::global;
use crate::index;

/// Pool page and row within it of token `pos` of sequence `batch`, from an
/// i32 [B, max_pages] block table. The page index is clamped to the pool, so a
/// bad table entry (device data, which the host cannot check) cannot make a
/// kernel read or write outside it.
#[inline(always)]
pub fn locate(
    table: u64,
    max_pages: u32,
    page_size: u32,
    num_pages: u32,
    batch: u64,
    pos: u64,
) -> (u64, u64) {
    let entry = batch * max_pages as u64 + pos / page_size.max(1) as u64;
    index::page_slot(
        global::ld_nc_s32(table + entry * 4),
        num_pages,
        pos,
        page_size,
    )
}
