//! Which query rows and which key blocks one CTA owns.
use super::paging;
use crate::arch::{global, special};
use crate::config::AttnTile;
use crate::params::{AttnParams, BshStrides};

pub struct BlockInfo {
    pub batch: u32,
    pub split: u32,
    /// First query head of the CTA; row `r` is head `head_base + (m0 + r) % pack`.
    pub head_base: u32,
    pub kv_head: u32,
    /// First packed row: row `r` is token `(m0 + r) / pack`.
    pub m0: u32,
    pub pack: u32,
    /// `pack` may exceed 1 (decode). The forward kernel knows it is 1 at
    /// compile time and skips the divisions.
    pub packed: bool,
    pub seqlen_q: u32,
    /// Keys of this sequence (the cache length in decode).
    pub seqlen_k: u32,
    /// Key blocks `[n_lo, n_hi)` of `block_n` keys, processed from `n_hi - 1` down.
    pub n_lo: u32,
    pub n_hi: u32,
    /// `seqlen_k - seqlen_q`: with a causal mask aligned to the bottom-right,
    /// token `i` sees keys `j <= i + causal_offset`.
    pub causal_offset: i32,
}

#[inline(always)]
fn ceil_div(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

#[inline(always)]
fn row_ptr(base: u64, s: &BshStrides, batch: u32, row: u32, head: u32) -> u64 {
    let off = batch as i64 * s.batch + row as i64 * s.row + head as i64 * s.head;
    base.wrapping_add((off * 2) as u64)
}

impl BlockInfo {
    /// `heaviest_first` visits query blocks in reverse: with a causal mask the
    /// last blocks see the most keys, and starting them first shortens the tail
    /// of the last wave.
    #[inline(always)]
    pub fn new<const CAUSAL: bool>(
        p: &AttnParams,
        tile: AttnTile,
        packed: bool,
        heaviest_first: bool,
    ) -> BlockInfo {
        let bm = tile.block_m as u32;
        let bn = tile.block_n as u32;
        let pack = if packed { p.pack.max(1) } else { 1 };
        let splits = p.num_splits.max(1);
        let z = special::block_idx_z();
        let batch = z / splits;
        let split = z % splits;
        let head_base = special::block_idx_y() * pack;
        let group = (p.heads / p.kv_heads.max(1)).max(1);
        let kv_head = head_base / group;
        let m_block = if heaviest_first {
            special::grid_dim_x() - 1 - special::block_idx_x()
        } else {
            special::block_idx_x()
        };
        let m0 = m_block * bm;
        // Device-side lengths are clamped to the cache capacity so a bad entry
        // cannot make the kernel read outside the cache. Only decode reads a
        // KV cache (`packed` is true exactly for it); compiling the load out of
        // the forward kernel keeps seqlen_k a launch parameter (uniform
        // register) instead of a per-thread register live through the loop.
        let seqlen_k = if packed && p.cache_seqlens != 0 {
            let n = global::ld_nc_s32(p.cache_seqlens + batch as u64 * 4);
            (n.max(0) as u32)
                .saturating_add(p.seqlen_new)
                .min(p.seqlen_k)
        } else {
            p.seqlen_k
        };
        let causal_offset = seqlen_k as i32 - p.seqlen_q as i32;
        let mut n_max = ceil_div(seqlen_k, bn);
        if CAUSAL {
            let last_token = ((m0 + bm - 1) / pack).min(p.seqlen_q.max(1) - 1);
            let visible = last_token as i32 + causal_offset + 1;
            n_max = n_max.min(ceil_div(visible.max(0) as u32, bn));
        }
        let per_split = ceil_div(n_max, splits);
        let n_lo = (split * per_split).min(n_max);
        let n_hi = (n_lo + per_split).min(n_max);
        BlockInfo {
            batch,
            split,
            head_base,
            kv_head,
            m0,
            pack,
            packed,
            seqlen_q: p.seqlen_q,
            seqlen_k,
            n_lo,
            n_hi,
            causal_offset,
        }
    }

    /// Query token of CTA row `r`, which may lie past the sequence's end.
    #[inline(always)]
    fn token_unchecked(&self, r: u32) -> u32 {
        if self.packed {
            (self.m0 + r) / self.pack
        } else {
            self.m0 + r
        }
    }

    /// Query token of CTA row `r`; `None` past the end of the sequence.
    #[inline(always)]
    pub fn token(&self, r: u32) -> Option<u32> {
        let t = self.token_unchecked(r);
        if t < self.seqlen_q {
            Some(t)
        } else {
            None
        }
    }

    #[inline(always)]
    pub fn head(&self, r: u32) -> u32 {
        if self.packed {
            self.head_base + (self.m0 + r) % self.pack
        } else {
            self.head_base
        }
    }

    /// Start of CTA row `r` in a [B, Sq, H, D] tensor (Q or O).
    #[inline(always)]
    pub fn q_row_ptr(&self, base: u64, s: &BshStrides, r: u32) -> Option<u64> {
        self.token(r)
            .map(|t| row_ptr(base, s, self.batch, t, self.head(r)))
    }

    /// Start of key `key` of this CTA's sequence and KV head in a
    /// [B, Skv, Hkv, D] tensor (K or V).
    #[inline(always)]
    pub fn kv_row_ptr(&self, base: u64, s: &BshStrides, key: u32) -> u64 {
        row_ptr(base, s, self.batch, key, self.kv_head)
    }

    /// Start of key `key` of this CTA's sequence and KV head in a paged
    /// [num_pages, page_size, Hkv, D] cache (see [`paging::locate`]).
    #[inline(always)]
    pub fn paged_row_ptr(&self, p: &AttnParams, base: u64, s: &BshStrides, key: u32) -> u64 {
        let (page, row) = paging::locate(
            p.block_table,
            p.max_pages,
            p.page_size,
            p.num_pages,
            self.batch as u64,
            key as u64,
        );
        self.page_row_ptr(base, s, page, row)
    }

    /// Start of row `row` of page `page` for this CTA's KV head.
    #[inline(always)]
    pub fn page_row_ptr(&self, base: u64, s: &BshStrides, page: u64, row: u64) -> u64 {
        let off = page as i64 * s.batch + row as i64 * s.row + self.kv_head as i64 * s.head;
        base.wrapping_add((off * 2) as u64)
    }

    /// Largest key index CTA row `r` may attend to (negative: none).
    #[inline(always)]
    pub fn key_limit<const CAUSAL: bool>(&self, r: u32) -> i32 {
        let last_key = self.seqlen_k as i32 - 1;
        if CAUSAL {
            (self.token_unchecked(r) as i32 + self.causal_offset).min(last_key)
        } else {
            last_key
        }
    }

    /// Whether key block `n` has any element that the mask removes for some
    /// row of the CTA, so only those blocks pay for masking.
    #[inline(always)]
    pub fn block_needs_mask<const CAUSAL: bool>(&self, n: u32, block_n: u32) -> bool {
        let end = (n + 1) * block_n;
        let past_end = end > self.seqlen_k;
        let first_row_limit = self.token_unchecked(0) as i32 + self.causal_offset;
        past_end || (CAUSAL && end as i32 - 1 > first_row_limit)
    }

    /// Row `(b, head, token)` of the [B, H, Sq] LSE layout.
    #[inline(always)]
    pub fn lse_index(&self, heads: u32, r: u32, token: u32) -> u64 {
        ((self.batch as u64 * heads as u64 + self.head(r) as u64) * self.seqlen_q as u64)
            + token as u64
    }
}
