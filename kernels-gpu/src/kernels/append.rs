//! Appends new K/V tokens to the KV cache in place, before a decode step
//! attends to them (as `flash_attn_with_kvcache` does with `k`/`v`).
use super::paging;
use crate::arch::{global, special};
use crate::config::{APPEND_THREADS, CHUNK_BYTES};
use crate::params::{AppendParams, BshStrides};

#[inline(always)]
fn offset(s: &BshStrides, outer: u64, row: u64, head: u64) -> i64 {
    outer as i64 * s.batch + row as i64 * s.row + head as i64 * s.head
}

/// One thread per 16-byte chunk of a (b, t, h) row of K_new and V_new.
#[inline(always)]
pub fn append_kv(p: &AppendParams) {
    // On sm_90 the decode grid after this one may be a programmatic dependent
    // launch: it waits (`griddepcontrol.wait`) for this grid's completion
    // before it reads the cache. Where the host says both grids fit on the
    // GPU at once, it is let in at the start (its CTAs load Q meanwhile);
    // else once every chunk is stored, so that no decode CTA takes a place
    // the grid would not have given it on an idle GPU.
    #[cfg(target_feature = "sm_90")]
    if p.early_dependents != 0 {
        crate::arch::griddep::launch_dependents();
    }
    append_chunk(p);
    #[cfg(target_feature = "sm_90")]
    crate::arch::griddep::launch_dependents();
}

#[inline(always)]
fn append_chunk(p: &AppendParams) {
    let idx =
        special::block_idx_x() as u64 * APPEND_THREADS as u64 + special::thread_idx_x() as u64;
    let chunks = p.row_chunks.max(1) as u64;
    let (heads, new) = (p.kv_heads.max(1) as u64, p.seqlen_new.max(1) as u64);
    if idx >= p.batch as u64 * new * heads * chunks {
        return;
    }
    let (row, chunk) = (idx / chunks, idx % chunks);
    let (row, head) = (row / heads, row % heads);
    let (b, t) = (row / new, row % new);
    let bytes = chunk * CHUNK_BYTES as u64;
    // The new tokens' chunks are read before the length that places them, so
    // that the two loads' latencies overlap.
    let src =
        |base: u64, s: &BshStrides| base.wrapping_add((offset(s, b, t, head) * 2) as u64) + bytes;
    let k = global::ld_nc_v4_b32(src(p.k_new, &p.k_new_strides));
    let v = global::ld_nc_v4_b32(src(p.v_new, &p.v_new_strides));
    let start = global::ld_nc_s32(p.cache_seqlens + b * 4).max(0) as u64;
    let pos = start + t;
    if pos >= p.capacity as u64 {
        return;
    }
    // (outer index, row within it) of the cache slot: batch entry and position,
    // or page and row within the page.
    let (outer, slot) = if p.block_table != 0 {
        // pos < capacity <= i32::MAX (host-checked), as `locate` needs.
        paging::locate(
            p.block_table,
            p.max_pages,
            p.page_size,
            p.num_pages,
            b,
            pos as u32,
        )
    } else {
        (b, pos)
    };
    let dst = |base: u64, s: &BshStrides| {
        base.wrapping_add((offset(s, outer, slot, head) * 2) as u64) + bytes
    };
    global::st_v4_b32(dst(p.k_cache, &p.k_cache_strides), k);
    global::st_v4_b32(dst(p.v_cache, &p.v_cache_strides), v);
}
