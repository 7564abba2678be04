//! Which query rows and which key blocks one CTA owns, for every mask and
//! sequence layout. The index arithmetic lives in `crate::index` (plain Rust,
//! property-tested on the host); this module reads the launch parameters
//! and device-side lengths it needs.
use super::paging;
use super::policy::{policies, Mask, Scores, Seq};
use crate::arch::{global, special};
use crate::config::MaskKind;
use crate::index::{self, KeyWindow};
use crate::params::{AttnParams, BshStrides};

/// Which tile a persistent CTA works on: its query block, head and batch,
/// and the head's KV head.
#[derive(Clone, Copy)]
pub struct TileCoord {
    pub m_block: u32,
    pub head: u32,
    pub batch: u32,
    pub kv_head: u32,
}

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
    /// The rows' visible key ranges (window and sequence end).
    pub keys: KeyWindow,
    /// Token of the CTA's last row, clamped to the sequence.
    last_token: u32,
    /// Batch index used for addressing (0 for packed sequences) and the first
    /// row of the sequence in Q/O and in K/V.
    pub addr_batch: u32,
    pub q_start: u32,
    pub k_start: u32,
    /// Row (b, h, token) of the LSE is `lse_base + h * lse_head_stride + token`.
    lse_base: u64,
    lse_head_stride: u64,
}

#[inline(always)]
fn row_ptr(base: u64, s: &BshStrides, batch: u32, row: u32, head: u32) -> u64 {
    let off = batch as i64 * s.batch + row as i64 * s.row + head as i64 * s.head;
    base.wrapping_add((off * 2) as u64)
}

/// (start, length) of sequence `b` in a packed tensor of `total` rows, from
/// an i32 [B + 1] `cu_seqlens` on the device. Device data the host cannot
/// check is clamped: the start to `[0, total]` and the end to `[start,
/// total]`, so a bad entry shortens a sequence but never reaches outside the
/// tensor.
#[inline(always)]
pub(crate) fn packed_range(cu_seqlens: u64, b: u32, total: u32) -> (u32, u32) {
    let start = global::ld_nc_s32(cu_seqlens + b as u64 * 4);
    let end = global::ld_nc_s32(cu_seqlens + (b as u64 + 1) * 4);
    index::clamp_range(start, end, total)
}

/// (start, length) of sequence `b`'s keys. Packed K/V: rows
/// `cu_seqlens_k[b]..cu_seqlens_k[b + 1]`. A paged cache (`L::PAGED` and a
/// block table is set): `cu_seqlens_k` holds i32 [B] key counts and every sequence starts at
/// its own page 0. Either way the range is clamped by [`packed_range`]'s
/// rule to `[0, total_k]` (for a paged cache, its capacity per sequence).
/// Both entries are loaded and the start selected afterwards: a branch
/// around the load made the D=128 forward kernel spill on sm_90 (253 -> 255
/// registers and 4-16 bytes of stack); `b` < B, so entry `b` is in bounds for
/// either layout.
#[inline(always)]
fn key_range<L: Seq>(p: &AttnParams, b: u32) -> (u32, u32) {
    let counts = (L::PAGED && p.block_table != 0) as u64;
    let at = |i: u64| global::ld_nc_s32(p.cu_seqlens_k + i * 4);
    let (first, end) = (at(b as u64), at(b as u64 + 1 - counts));
    let start = if counts != 0 { 0 } else { first };
    index::clamp_range(start, end, p.total_k)
}

/// The KV head that query head `head` reads.
#[inline(always)]
fn kv_head_of(p: &AttnParams, head: u32) -> u32 {
    head / (p.heads / p.kv_heads.max(1)).max(1)
}

impl BlockInfo {
    /// `block_m` query rows per CTA, keys in blocks of `block_n`.
    /// `heaviest_first` visits query blocks in reverse: with a causal mask the
    /// last blocks see the most keys, and starting them first shortens the tail
    /// of the last wave.
    #[inline(always)]
    pub fn new<M: Mask, L: Seq>(
        p: &AttnParams,
        block_m: usize,
        block_n: usize,
        packed: bool,
        heaviest_first: bool,
    ) -> BlockInfo {
        Self::of::<M, L>(p, block_m, block_n, packed, heaviest_first, None)
    }

    /// Tile `at` of a persistent forward CTA (one head per tile, no splits).
    #[inline(always)]
    pub fn at<M: Mask, L: Seq>(
        p: &AttnParams,
        block_m: usize,
        block_n: usize,
        at: TileCoord,
    ) -> BlockInfo {
        Self::of::<M, L>(p, block_m, block_n, false, false, Some(at))
    }

    /// The tile of a forward CTA in a grid of one CTA per tile, (query
    /// block, head, batch). A causal grid over a fixed batch would start
    /// the last pairs' heaviest tiles in its last wave; where the policies
    /// weigh tiles unevenly so ([`Policies::orders_grid`]) the grid takes
    /// [`index::balanced_tile`]'s order, whose tail goes heaviest first
    /// across pairs as the persistent lines claim theirs, a wave being
    /// `%nsmid` x `ctas_per_sm` CTAs. Otherwise each pair's query blocks,
    /// heaviest first under a causal mask.
    ///
    /// [`Policies::orders_grid`]: crate::config::Policies::orders_grid
    #[inline(always)]
    pub fn of_grid<M: Mask, S: Scores, L: Seq>(
        p: &AttnParams,
        block_m: usize,
        block_n: usize,
        ctas_per_sm: usize,
    ) -> BlockInfo {
        if const { !policies::<M, S, L>().orders_grid() } {
            let heaviest_first = matches!(M::KIND, MaskKind::Causal);
            return Self::new::<M, L>(p, block_m, block_n, false, heaviest_first);
        }
        let wave = special::sm_ids() * ctas_per_sm as u32;
        let dims = [
            special::grid_dim_x(),
            special::grid_dim_y(),
            special::grid_dim_z(),
        ];
        let block = [
            special::block_idx_x(),
            special::block_idx_y(),
            special::block_idx_z(),
        ];
        let [m_block, head, batch] = index::balanced_tile(block, dims, wave);
        let at = TileCoord {
            m_block,
            head,
            batch,
            kv_head: kv_head_of(p, head),
        };
        Self::of::<M, L>(p, block_m, block_n, false, false, Some(at))
    }

    /// The grid's tile, or `at`'s.
    #[inline(always)]
    fn of<M: Mask, L: Seq>(
        p: &AttnParams,
        block_m: usize,
        block_n: usize,
        packed: bool,
        heaviest_first: bool,
        at: Option<TileCoord>,
    ) -> BlockInfo {
        let bm = block_m as u32;
        let bn = block_n as u32;
        let pack = if packed { p.pack.max(1) } else { 1 };
        let splits = p.num_splits.max(1);
        let group = |head_base: u32| kv_head_of(p, head_base);
        let (batch, split, head_base, kv_head, m_block) = match at {
            Some(at) => (at.batch, 0, at.head, at.kv_head, at.m_block),
            None => {
                let z = special::block_idx_z();
                let batch = z / splits;
                let split = z % splits;
                let head_base = special::block_idx_y() * pack;
                let kv_head = group(head_base);
                let m_block = if heaviest_first {
                    special::grid_dim_x() - 1 - special::block_idx_x()
                } else {
                    special::block_idx_x()
                };
                (batch, split, head_base, kv_head, m_block)
            }
        };
        let m0 = m_block * bm;
        let varlen = L::RAGGED && p.cu_seqlens_q != 0;
        let (addr_batch, q_start, seqlen_q, k_start, mut seqlen_k) = if varlen {
            let (q_start, seqlen_q) = packed_range(p.cu_seqlens_q, batch, p.total_q);
            let (k_start, seqlen_k) = key_range::<L>(p, batch);
            (0, q_start, seqlen_q, k_start, seqlen_k)
        } else {
            (batch, 0, p.seqlen_q, 0, p.seqlen_k)
        };
        // Device-side lengths are clamped to the cache capacity so a bad entry
        // cannot make the kernel read outside the cache. Only decode reads a
        // KV cache this way (`packed` is true exactly for it); compiling the
        // load out of the forward kernel keeps seqlen_k a launch parameter
        // (uniform register) instead of a per-thread register live through
        // the loop.
        if packed && p.cache_seqlens != 0 {
            let n = global::ld_nc_s32(p.cache_seqlens + batch as u64 * 4);
            seqlen_k = (n.max(0) as u32)
                .saturating_add(p.seqlen_new)
                .min(p.seqlen_k);
        }
        let (left, right) = M::window(p);
        let keys = KeyWindow::new(seqlen_q, seqlen_k, left, right);
        let last_token = ((m0 + bm - 1) / pack).min(seqlen_q.max(1) - 1);
        let (n_lo, n_hi) = index::key_blocks(&keys, m0 / pack, last_token, bn, split, splits);
        let (lse_base, lse_head_stride) = if varlen {
            (q_start as u64, p.total_q as u64)
        } else {
            (
                batch as u64 * p.heads as u64 * seqlen_q as u64,
                seqlen_q as u64,
            )
        };
        BlockInfo {
            batch,
            split,
            head_base,
            kv_head,
            m0,
            pack,
            packed,
            seqlen_q,
            seqlen_k,
            n_lo,
            n_hi,
            keys,
            last_token,
            addr_batch,
            q_start,
            k_start,
            lse_base,
            lse_head_stride,
        }
    }

    /// Whether the CTA has any row inside its sequence (a packed sequence
    /// may be shorter than the grid's `max_seqlen_q`).
    #[inline(always)]
    pub fn has_rows(&self) -> bool {
        self.token_unchecked(0) < self.seqlen_q
    }

    /// Query token of CTA row `r`, which may lie past the sequence's end.
    #[inline(always)]
    pub fn token_unchecked(&self, r: u32) -> u32 {
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

    /// The chunks of a folded row of `chunks` that hold CTA row `r`'s own
    /// KV head (`index::fold_chunks`): (first, count). From the row's head,
    /// whose remainder its token's division already has.
    #[inline(always)]
    pub fn fold_chunks(&self, r: u32, chunks: u32) -> (u32, u32) {
        index::fold_chunks(self.head(r) - self.head_base, self.pack, chunks)
    }

    /// Start of CTA row `r` in a [B, Sq, H, D] tensor (Q or O).
    #[inline(always)]
    pub fn q_row_ptr(&self, base: u64, s: &BshStrides, r: u32) -> Option<u64> {
        self.token(r)
            .map(|t| row_ptr(base, s, self.addr_batch, self.q_start + t, self.head(r)))
    }

    /// Start of key `key` of this CTA's sequence and KV head in a
    /// [B, Skv, Hkv, D] tensor (K or V).
    #[inline(always)]
    pub fn kv_row_ptr(&self, base: u64, s: &BshStrides, key: u32) -> u64 {
        row_ptr(base, s, self.addr_batch, self.k_start + key, self.kv_head)
    }

    /// Pool page and row of key `key` of this CTA's sequence in a paged
    /// cache (`paging::locate`; `key` below the sequence's capacity).
    #[inline(always)]
    pub fn locate_key(&self, p: &AttnParams, key: u32) -> (u64, u64) {
        paging::locate(
            p.block_table,
            p.max_pages,
            p.page_size,
            p.num_pages,
            self.batch as u64,
            key,
        )
    }

    /// Start of row `row` of page `page` (see `Self::locate_key`) for this
    /// CTA's KV head.
    #[inline(always)]
    pub fn page_row_ptr(&self, base: u64, s: &BshStrides, page: u64, row: u64) -> u64 {
        let off = page as i64 * s.batch + row as i64 * s.row + self.kv_head as i64 * s.head;
        base.wrapping_add((off * 2) as u64)
    }

    /// Largest key index CTA row `r` may attend to (negative: none).
    #[inline(always)]
    pub fn key_limit(&self, r: u32) -> i32 {
        self.keys.last(self.token_unchecked(r))
    }

    /// Smallest key index CTA row `r` may attend to.
    #[inline(always)]
    pub fn key_floor(&self, r: u32) -> i32 {
        self.keys.first(self.token_unchecked(r))
    }

    /// The row's position on the key axis (token + Skv - Sq), ALiBi's origin.
    #[inline(always)]
    pub fn key_pos(&self, r: u32) -> i32 {
        self.token_unchecked(r) as i32 + self.keys.diag
    }

    /// Whether key block `n` has any element that the mask removes for some
    /// row of the CTA, so only those blocks pay for masking.
    #[inline(always)]
    pub fn block_needs_mask(&self, n: u32, block_n: u32) -> bool {
        index::block_needs_mask(
            &self.keys,
            self.token_unchecked(0),
            self.last_token,
            n,
            block_n,
        )
    }

    /// Which ends of the rows' key ranges cut key block `n`
    /// (`index::mask_edges`).
    #[inline(always)]
    pub fn mask_edges(&self, n: u32, block_n: u32) -> index::MaskEdges {
        index::mask_edges(
            &self.keys,
            self.token_unchecked(0),
            self.last_token,
            n,
            block_n,
        )
    }

    /// Where key block `n` lies relative to the ALiBi origins of the CTA's
    /// rows (`index::origin_side`).
    #[inline(always)]
    pub fn origin_side(&self, n: u32, block_n: u32) -> index::OriginSide {
        index::origin_side(
            &self.keys,
            self.token_unchecked(0),
            self.last_token,
            n,
            block_n,
        )
    }

    /// Row `(b, head, token)` of the LSE: [B, H, Sq], or [H, total_q] for
    /// packed sequences.
    #[inline(always)]
    pub fn lse_index(&self, r: u32, token: u32) -> u64 {
        self.lse_base + self.head(r) as u64 * self.lse_head_stride + token as u64
    }
}
