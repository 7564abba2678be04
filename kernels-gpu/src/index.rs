//! Index arithmetic of the kernels that needs no GPU: visible key ranges of
//! every mask, the key blocks a CTA visits and their split partition, packed
//! (varlen) sequence ranges, the paged-cache lookup and the shared-memory
//! swizzle. Plain Rust that compiles for the host too, where `tests/cpu.rs`
//! property-tests it against the reference's definitions.
use crate::config::{HOPPER_TAIL_WAVES, SWIZZLE_ROWS};

/// Which keys each query row of one sequence sees: query `t` sits at key
/// position `t + diag` (the bottom-right alignment, `diag = Skv - Sq`) and
/// sees keys `[t + diag - left, t + diag + right]` within `[0, Skv)`; a
/// negative bound is unbounded on that side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyWindow {
    /// Query tokens of the sequence (Sq).
    pub seqlen_q: u32,
    /// Keys of the sequence (Skv).
    pub seqlen_k: u32,
    /// `Skv - Sq`: the key position of query 0 on the diagonal.
    pub diag: i32,
    /// Keys visible left of the diagonal; negative = unbounded.
    pub left: i32,
    /// Keys visible right of the diagonal; negative = unbounded.
    pub right: i32,
}

impl KeyWindow {
    /// The window of `seqlen_q` queries over `seqlen_k` keys, `diag` derived from them.
    #[inline(always)]
    pub fn new(seqlen_q: u32, seqlen_k: u32, left: i32, right: i32) -> KeyWindow {
        KeyWindow {
            seqlen_q,
            seqlen_k,
            diag: seqlen_k as i32 - seqlen_q as i32,
            left,
            right,
        }
    }

    /// Last key token `t` sees, in `[-1, Skv - 1]` (-1: none).
    #[inline(always)]
    pub fn last(&self, t: u32) -> i32 {
        let end = self.seqlen_k as i64 - 1;
        if self.right < 0 {
            return end as i32;
        }
        let hi = t as i64 + self.diag as i64 + self.right as i64;
        hi.clamp(-1, end) as i32
    }

    /// First key token `t` sees, in `[0, Skv]` (Skv: none).
    #[inline(always)]
    pub fn first(&self, t: u32) -> i32 {
        if self.left < 0 {
            return 0;
        }
        let lo = t as i64 + self.diag as i64 - self.left as i64;
        lo.clamp(0, self.seqlen_k as i64) as i32
    }

    /// Whether token `t` sees key `j`.
    #[inline(always)]
    pub fn sees(&self, t: u32, j: u32) -> bool {
        let j = j as i32;
        self.first(t) <= j && j <= self.last(t)
    }
}

/// Key blocks `[n_lo, n_hi)` of `block_n` keys that split `split` of `splits`
/// visits for query tokens `t_first..=t_last` (`t_last` may lie past the
/// sequence; it is clamped). The blocks any of those rows sees are cut into
/// `splits` consecutive ranges of equal length (the last ones may be empty).
#[inline(always)]
pub fn key_blocks(
    keys: &KeyWindow,
    t_first: u32,
    t_last: u32,
    block_n: u32,
    split: u32,
    splits: u32,
) -> (u32, u32) {
    let t_last = t_last.min(keys.seqlen_q.max(1) - 1);
    // Rows further down see keys further right, at both window ends.
    let n_max = ((keys.last(t_last) + 1) as u32).div_ceil(block_n);
    let n_min = (keys.first(t_first) as u32 / block_n).min(n_max);
    let per_split = (n_max - n_min).div_ceil(splits.max(1));
    let n_lo = (n_min + split * per_split).min(n_max);
    let n_hi = (n_lo + per_split).min(n_max);
    (n_lo, n_hi)
}

/// CTAs a backward launch aims for before it splits a KV head's query
/// heads across CTAs: the causal key blocks' uneven work evens out over
/// about four waves.
pub const BWD_TARGET_WAVES: u32 = 4;

/// The parts the backward splits each KV head's `group` query heads into
/// (`BwdParams::head_splits`), given `ctas` key-block CTAs without a split
/// and `slots` CTAs the GPU runs at once: the fewest parts (a divisor of
/// `group`) that reach [`BWD_TARGET_WAVES`] waves, or `group` if none
/// does. `forced` (a tuning override) is taken down to a divisor of
/// `group` instead. Always at least 1.
pub fn backward_head_splits(group: u32, ctas: u32, slots: u32, forced: Option<u32>) -> u32 {
    let group = group.max(1);
    let divisors = move || (1..=group).filter(move |s| group.is_multiple_of(*s));
    match forced {
        Some(f) => divisors().rev().find(|&s| s <= f.max(1)).unwrap_or(1),
        None => {
            let target = BWD_TARGET_WAVES as u64 * slots as u64;
            divisors()
                .find(|&s| ctas as u64 * s as u64 >= target)
                .unwrap_or(group)
        }
    }
}

/// Query blocks `[m_lo, m_hi)` of `block_m` tokens holding a token that
/// sees some key of key block `n` (`block_n` keys): the blocks a backward
/// CTA of key block `n` visits. Both ends of the visible range move right
/// with the token, so the tokens that see the block are one range.
#[inline(always)]
pub fn query_blocks(keys: &KeyWindow, n: u32, block_n: u32, block_m: u32) -> (u32, u32) {
    let (k_lo, k_hi) = (
        n as i64 * block_n as i64,
        (n as i64 + 1) * block_n as i64 - 1,
    );
    let k_hi = k_hi.min(keys.seqlen_k as i64 - 1);
    let diag = keys.diag as i64;
    // Token t sees a key of [k_lo, k_hi] when last(t) >= k_lo and first(t) <= k_hi.
    let t_lo = if keys.right < 0 {
        0
    } else {
        k_lo - diag - keys.right as i64
    };
    let t_hi = if keys.left < 0 {
        keys.seqlen_q as i64 - 1
    } else {
        k_hi - diag + keys.left as i64
    };
    let t_lo = t_lo.max(0);
    let t_hi = t_hi.min(keys.seqlen_q as i64 - 1);
    if k_lo > k_hi || t_lo > t_hi {
        return (0, 0);
    }
    (
        (t_lo / block_m as i64) as u32,
        (t_hi / block_m as i64) as u32 + 1,
    )
}

/// Whether key block `n` holds a key that some token of `t_first..=t_last`
/// does not see (or lies past the sequence's end), so that only those
/// blocks pay for the element-wise mask.
#[inline(always)]
pub fn block_needs_mask(keys: &KeyWindow, t_first: u32, t_last: u32, n: u32, block_n: u32) -> bool {
    let edges = mask_edges(keys, t_first, t_last, n, block_n);
    edges.right || edges.left
}

/// Which ends of the visible key ranges of tokens `t_first..=t_last` cut
/// key block `n`: a window's block usually has one cut (its left end, or
/// the diagonal), and testing only that end halves the mask's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskEdges {
    /// Some token's first visible key lies past the block's first key.
    pub left: bool,
    /// Some token's last visible key (or the sequence's end) lies before
    /// the block's last key.
    pub right: bool,
}

/// A row's visible keys `lo..=hi` as seen from a lane's first key `key0`:
/// whether the key at `key0 + offset` is cut takes one unsigned compare,
/// `offset - (lo - key0) > hi - lo` (a key left of `lo` wraps to a large
/// value). A row that sees nothing (`hi < lo`) starts at `i32::MIN`, so
/// that every offset lies past its empty span. Offsets and keys are below
/// 2^31, as `KeyWindow`'s are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySpan {
    first: i32,
    span: u32,
}

impl KeySpan {
    /// The span of `lo..=hi` from `key0`.
    #[inline(always)]
    pub fn new(lo: i32, hi: i32, key0: i32) -> KeySpan {
        let empty = hi < lo;
        KeySpan {
            first: if empty { i32::MIN } else { lo }.wrapping_sub(key0),
            span: if empty { 0 } else { (hi - lo) as u32 },
        }
    }

    /// Whether key `key0 + offset` lies outside `lo..=hi`.
    #[inline(always)]
    pub fn cuts(self, offset: i32) -> bool {
        offset.wrapping_sub(self.first) as u32 > self.span
    }
}

/// The [`MaskEdges`] of key block `n` for tokens `t_first..=t_last`. Both
/// ends of a row's range grow with the token, so `t_first` has the
/// earliest right end and `t_last` the latest left end.
#[inline(always)]
pub fn mask_edges(keys: &KeyWindow, t_first: u32, t_last: u32, n: u32, block_n: u32) -> MaskEdges {
    let start = (n * block_n) as i32;
    let end = start + block_n as i32;
    let past_end = end > keys.seqlen_k as i32;
    let right_cut = keys.right >= 0 && end - 1 > keys.last(t_first);
    MaskEdges {
        left: keys.left >= 0 && start < keys.first(t_last),
        right: past_end || right_cut,
    }
}

/// Where a key block lies relative to the ALiBi origins of a range of rows
/// (each token's key position `t + diag`), counting only the keys each row
/// sees: the bias `-slope · |pos - key|` is linear in the key on one side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OriginSide {
    /// Every visible key is at or left of its row's origin (every block of a
    /// causal mask): bias = `slope · (key - pos)`.
    Left,
    /// Every visible key is at or right of its row's origin.
    Right,
    /// Some row sees keys on both sides: `|pos - key|` per element.
    Both,
}

/// The [`OriginSide`] of key block `n` for tokens `t_first..=t_last`. Row
/// t's visible keys in the block end at `min(end, pos + right, Skv - 1)`, and
/// that minus `pos` never grows with t, so `t_first` decides `Left`;
/// likewise `max(start, pos - left, 0) - pos` never grows, so `t_last`
/// decides `Right`. The window bounds are taken unclamped, so a row that
/// sees nothing cannot make a later row's keys look one-sided.
#[inline(always)]
pub fn origin_side(
    keys: &KeyWindow,
    t_first: u32,
    t_last: u32,
    n: u32,
    block_n: u32,
) -> OriginSide {
    let start = n as i64 * block_n as i64;
    let end = start + block_n as i64 - 1;
    let pos = |t: u32| t as i64 + keys.diag as i64;
    let (first, last) = (pos(t_first), pos(t_last));
    let right_end = if keys.right >= 0 {
        first + keys.right as i64
    } else {
        i64::MAX
    };
    let left_start = if keys.left >= 0 {
        last - keys.left as i64
    } else {
        i64::MIN
    };
    if end.min(right_end).min(keys.seqlen_k as i64 - 1) <= first {
        OriginSide::Left
    } else if start.max(left_start).max(0) >= last {
        OriginSide::Right
    } else {
        OriginSide::Both
    }
}

/// (start, length) of a packed sequence whose device-side `cu_seqlens`
/// entries are `start` and `end`, in a tensor of `total` rows: the start is
/// clamped to `[0, total]` and the end to `[start, total]`.
#[inline(always)]
pub fn clamp_range(start: i32, end: i32, total: u32) -> (u32, u32) {
    let start = (start.max(0) as u32).min(total);
    let end = (end.max(0) as u32).clamp(start, total);
    (start, end - start)
}

/// The divisors of a persistent forward launch's tile order, which the
/// host computes once: a CTA finds each of its tiles with multiplies and
/// shifts, where `div.u32` sequences took ~3 % of a short-row launch's warp
/// samples (ncu, D = 128, S = 512).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileGrid {
    /// Query blocks M of each (batch, head) pair, at least 1.
    pub m_blocks: FastDiv,
    /// M / 2: the heavy-light units of one pair ([`persistent_step`]).
    pub half: FastDiv,
    /// Query heads H: pair p is batch p / H, head p % H.
    pub heads: FastDiv,
    /// Query heads per KV head: head h reads KV head h / group.
    pub group: FastDiv,
    /// 1: a causal launch's tiles go in heavy-light units
    /// ([`persistent_step`]'s `paired`). 0 where every tile has a CTA of
    /// its own: a unit would run two tiles (M + 1 key blocks) on one SM,
    /// where alone the heaviest runs M.
    pub paired: u32,
    /// Tiles of the launch: M x pairs ([`dynamic_tile`]'s order).
    pub tiles: u32,
    /// Tiles before the order's tail: the first pairs' tiles, pair by pair.
    pub tail_start: u32,
    /// Pairs in the tail, whose tiles go heaviest first across the pairs.
    pub tail_pairs: FastDiv,
    /// `.global` address of the launch's u32 tile counter, 0 for the
    /// static order of [`persistent_step`]. A CTA's first tile is its index;
    /// each further one is grid + `atom.inc`'s ticket, until a ticket past
    /// the tiles. That takes exactly `tiles` tickets per launch, and
    /// `atom.inc` wraps at `tiles - 1`, so the counter is 0 again for the
    /// next launch on it (the host gives concurrent launches different
    /// counters).
    pub counter: u64,
}

impl TileGrid {
    /// Tiles per launch must stay below this, so that every work unit a CTA
    /// computes (at most tiles + grid <= 2 tiles) is a valid dividend.
    pub const TILE_LIMIT: usize = (FastDiv::DIVIDEND_LIMIT / 2) as usize;

    /// The divisors of `m_blocks` query blocks per pair over `heads` query
    /// heads and `kv_heads` KV heads (a zero counts as 1), and whether a
    /// causal launch pairs its tiles.
    pub const fn new(m_blocks: u32, heads: u32, kv_heads: u32, paired: bool) -> TileGrid {
        let m_blocks = if m_blocks > 0 { m_blocks } else { 1 };
        let heads = if heads > 0 { heads } else { 1 };
        let kv_heads = if kv_heads > 0 { kv_heads } else { 1 };
        TileGrid {
            m_blocks: FastDiv::new(m_blocks),
            half: FastDiv::new(m_blocks / 2),
            heads: FastDiv::new(heads),
            group: FastDiv::new(heads / kv_heads),
            paired: paired as u32,
            tiles: 0,
            tail_start: 0,
            tail_pairs: FastDiv::new(1),
            counter: 0,
        }
    }

    /// The same grid scheduled through the u32 counter at `counter`
    /// ([`dynamic_tile`]'s order over `pairs` pairs, `tail_pairs` of them
    /// in the tail, at least 1).
    pub const fn dynamic(self, pairs: u32, tail_pairs: u32, counter: u64) -> TileGrid {
        let tail = if tail_pairs > pairs {
            pairs
        } else {
            tail_pairs
        };
        let tail = if tail > 0 { tail } else { 1 };
        let m_blocks = self.m_blocks.divisor;
        TileGrid {
            tiles: m_blocks * pairs,
            tail_start: m_blocks * (pairs - tail),
            tail_pairs: FastDiv::new(tail),
            counter,
            ..self
        }
    }
}

/// `[query block, head, batch]` of block `[x, y, z]` in a causal grid of
/// one CTA per tile, `dims` = (query blocks, heads, batches), where `wave`
/// CTAs run at once. The block scheduler starts CTAs in the order of their
/// linear index, each on the first SM free: greedy list scheduling. While
/// the grid fits in one wave, each (head, batch) pair's query blocks go in
/// reverse (the heaviest first). Past one wave, that order would start the
/// last pairs' heaviest tiles in the last wave; the grid then takes
/// [`dynamic_tile`]'s order, as the persistent lines claim their tiles:
/// pair by pair, then the last [`HOPPER_TAIL_WAVES`] waves' tiles (whole
/// pairs) heaviest first across their pairs. A bijection of the grid onto
/// itself. Only the tail's CTAs divide (three divisions).
#[inline(always)]
pub fn balanced_tile(block: [u32; 3], dims: [u32; 3], wave: u32) -> [u32; 3] {
    let [x, y, z] = block;
    let [m_blocks, heads, batches] = dims;
    let last = m_blocks - 1;
    let pairs = heads * batches;
    if m_blocks * pairs <= wave {
        return [last - x, y, z];
    }
    // The tail is the last `ceil(tail_tiles / m_blocks)` pairs, so a pair
    // is before it exactly when the pairs after it hold `tail_tiles`: a
    // test without the division, which the CTAs before the tail (most of
    // a long grid) would otherwise pay at their start.
    let tail_tiles = HOPPER_TAIL_WAVES as u32 * wave;
    let pair = y + heads * z;
    if m_blocks * (pairs - 1 - pair) >= tail_tiles {
        return [last - x, y, z];
    }
    // The divisors are at least 1 (a launched grid has no empty dim), as
    // the maxima tell LLVM: no division-by-zero panic is compiled in.
    let tail = tail_tiles.div_ceil(m_blocks.max(1));
    let first = pairs.saturating_sub(tail);
    let (tail, heads) = ((pairs - first).max(1), heads.max(1));
    let j = x + m_blocks * (pair - first);
    let pair = first + j % tail;
    [last - j / tail, pair % heads, pair / heads]
}

/// Tile `i` of a dynamically scheduled persistent launch ([`TileGrid::dynamic`]):
/// `(query block, pair)`. The CTAs claim tiles in this order, each its next
/// once it has a Q buffer for it, so an SM that finishes early takes more
/// (greedy list scheduling). Before the tail the order goes pair by pair,
/// heaviest block first (causal: block m sees m + 1 key blocks), so the
/// tiles running at one time share their pairs' K/V in L2. The tail's tiles
/// go heaviest first across its pairs (longest processing time first), so
/// the last tiles claimed are the lightest and the SMs finish close
/// together; without a mask all tiles weigh the same and the tail's order
/// changes nothing.
#[inline(always)]
pub const fn dynamic_tile(i: u32, g: &TileGrid) -> (u32, u32) {
    let last = g.m_blocks.divisor - 1;
    if i < g.tail_start {
        let (pair, r) = g.m_blocks.divmod(i);
        (last - r, pair)
    } else {
        let (r, k) = g.tail_pairs.divmod(i - g.tail_start);
        (last - r, g.m_blocks.quotient(g.tail_start) + k)
    }
}

/// Step `step` of CTA `cta` in a persistent launch of `grid` CTAs over
/// `g.m_blocks` query blocks of each of `pairs` (batch, head) pairs: `(query
/// block, pair, next step)`, or `None` past the CTA's last tile. The CTA
/// takes work units `cta, cta + grid, ...`, so the units running at one
/// time are consecutive, and consecutive units belong to one pair (the CTAs
/// of a wave share its K/V in L2). Without `paired` a unit is one query
/// block (`step` counts them). With it (causal: block m sees m + 1 key
/// blocks) a unit is two blocks, heavy first, whose key blocks add up to
/// M + 1 for every unit (FlashAttention's causal balancing, which a static
/// stride needs): blocks M - 1 - j and j of one pair, and for an odd M,
/// after all of those, the middle blocks of pairs 2i and 2i + 1. Steps 2i
/// and 2i + 1 are a CTA's i-th unit; a unit of one block (the last middle
/// of an odd count of pairs) skips its second step. Every tile is some
/// CTA's step exactly once (for fewer than [`TileGrid::TILE_LIMIT`] tiles).
#[inline(always)]
pub const fn persistent_step(
    step: u32,
    cta: u32,
    grid: u32,
    g: &TileGrid,
    pairs: u32,
    paired: bool,
) -> Option<(u32, u32, u32)> {
    let m_blocks = g.m_blocks.divisor;
    if !paired {
        let unit = cta + step * grid;
        if unit >= m_blocks * pairs {
            return None;
        }
        let (pair, m) = g.m_blocks.divmod(unit);
        return Some((m, pair, step + 1));
    }
    let unit = cta + step / 2 * grid;
    let second = step % 2 == 1;
    let half = g.half.divisor;
    let twins = half * pairs;
    if unit < twins {
        let (pair, j) = g.half.divmod(unit);
        let m = if second { j } else { m_blocks - 1 - j };
        return Some((m, pair, step + 1));
    }
    let pair = 2 * (unit - twins) + second as u32;
    if m_blocks.is_multiple_of(2) || pair >= pairs {
        return None;
    }
    let alone = !second && pair + 1 == pairs;
    Some((half, pair, step + 1 + alone as u32))
}

/// Division by a run-time constant with a multiply and a shift: the page
/// size is the same for a whole launch, and `div.u32` is a ~20-instruction
/// sequence the paged copies would run per row. The host computes the magic
/// number (Granlund-Montgomery, as CUTLASS's `FastDivmod`); exact for every
/// dividend below 2^31, which all key positions are (cache capacities are
/// at most `i32::MAX` keys).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastDiv {
    /// The divisor d (in the kernels: the page size in tokens).
    pub divisor: u32,
    /// ceil(2^(31 + ceil(log2 d)) / d); 0 for d <= 1 (the quotient is n).
    pub mul: u32,
    /// ceil(log2 d) - 1, the shift after the high half of the product.
    pub shift: u32,
}

impl FastDiv {
    /// Dividends must stay below this bound.
    pub const DIVIDEND_LIMIT: u32 = 1 << 31;

    /// Precomputes `mul` and `shift` for `divisor`; the host does it once per launch.
    pub const fn new(divisor: u32) -> FastDiv {
        if divisor <= 1 {
            return FastDiv {
                divisor,
                mul: 0,
                shift: 0,
            };
        }
        let log2 = 32 - (divisor - 1).leading_zeros();
        let p = 31 + log2;
        let mul = (1u64 << p).div_ceil(divisor as u64);
        FastDiv {
            divisor,
            mul: mul as u32,
            shift: p - 32,
        }
    }

    /// `n / divisor` for `n` < [`Self::DIVIDEND_LIMIT`].
    #[inline(always)]
    pub const fn quotient(self, n: u32) -> u32 {
        let q = ((n as u64 * self.mul as u64) >> 32) as u32 >> self.shift;
        if self.mul == 0 {
            n
        } else {
            q
        }
    }

    /// (`n / divisor`, `n % divisor`) for `n` < [`Self::DIVIDEND_LIMIT`].
    #[inline(always)]
    pub const fn divmod(self, n: u32) -> (u32, u32) {
        let q = self.quotient(n);
        (q, n - q * self.divisor)
    }
}

/// The chunks of a folded decode row (`SeqKind::Folded`: two adjacent KV
/// heads read as one row of `chunks` 16-byte chunks) that belong
/// to the row of query head `head_in_pack` of the folded head's `pack`: the
/// first `pack / 2` heads are the first KV head's. (first, count).
#[inline(always)]
pub const fn fold_chunks(head_in_pack: u32, pack: u32, chunks: u32) -> (u32, u32) {
    let half = chunks / 2;
    if head_in_pack >= pack / 2 {
        (half, half)
    } else {
        (0, half)
    }
}

/// Pool page of a block-table entry read on the device: clamped to
/// `[0, num_pages)`.
#[inline(always)]
pub fn page_slot(entry: i32, num_pages: u32) -> u64 {
    entry.max(0).min(num_pages.max(1) as i32 - 1) as u64
}

/// Rows of one TMA box of a paged K/V block on the Hopper path: the
/// largest count that divides both the page size and the block's keys
/// (their gcd), so a box never straddles a page and a block is whole boxes.
/// Page sizes and blocks are multiples of 16 keys, so boxes are too.
#[inline(always)]
pub const fn paged_box_rows(page_size: u32, block_n: u32) -> u32 {
    let (mut a, mut b) = (page_size, block_n);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The row (g or g + 8) and first column (0 or 4) of the four consecutive
/// columns of a 16 x 8 `mma` C fragment that `lane` holds once lanes 2k and
/// 2k + 1 have swapped halves (the backward's `quad_swap`: the even lane
/// gives its row g + 8 pair and takes its partner's row g pair, the odd lane
/// the reverse).
#[inline(always)]
pub const fn quad_of(lane: u32) -> (u32, u32) {
    let pair = lane % 4;
    (lane / 4 + 8 * (pair % 2), 4 * (pair / 2))
}

/// Physical 16-byte chunk of logical chunk `chunk` in row `row` of a
/// swizzled shared-memory tile: XOR with the row within its group of
/// [`SWIZZLE_ROWS`], so the 8 rows an `ldmatrix` phase reads hit 8 different
/// chunks (all 32 banks). A bijection on each row's `smem_row_chunks` chunks.
#[inline(always)]
pub const fn swizzle(row: u32, chunk: u32) -> u32 {
    chunk ^ (row % SWIZZLE_ROWS as u32)
}

/// The row-pairs layout of K (see `SmemTile::store_addr`): swaps bit 3 of
/// the row with bit 0 of the chunk, within each group of 16 rows.
#[inline(always)]
pub const fn row_pairs(row: u32, chunk: u32) -> (u32, u32) {
    (
        (row & !8) | ((chunk & 1) << 3),
        (chunk & !1) | ((row >> 3) & 1),
    )
}

/// [`config::SW128_ROW_BYTES`](crate::config::SW128_ROW_BYTES) as the u32 of
/// shared-memory addresses.
pub const SW128_ROW_BYTES: u32 = crate::config::SW128_ROW_BYTES as u32;
/// [`config::SWIZZLE_ATOM_BYTES`](crate::config::SWIZZLE_ATOM_BYTES) (the
/// period of the XOR pattern, to which a tile must be aligned) as a u32.
pub const SW128_ATOM_BYTES: u32 = crate::config::SWIZZLE_ATOM_BYTES as u32;

/// Byte offset of 16-byte chunk `chunk` (elements 8·chunk..) of row `row` in
/// an SW128 tile of `rows` rows, the layout TMA writes with
/// `CU_TENSOR_MAP_SWIZZLE_128B` and `wgmma` reads: the row's 64-element
/// column groups are stored one after the other, each as `rows` rows of 128
/// bytes, and within each 8-row atom chunk c of row r sits at c ^ (r % 8).
#[inline(always)]
pub const fn sw128_offset(row: u32, chunk: u32, rows: u32) -> u32 {
    (chunk / 8) * rows * SW128_ROW_BYTES + row * SW128_ROW_BYTES + swizzle(row, chunk % 8) * 16
}

/// A `wgmma` shared-memory matrix descriptor of an SW128 tile at `.shared`
/// address `addr` (1024-byte aligned atoms, base offset 0): bits 0-13
/// `addr >> 4`, 16-29 the leading-dimension byte offset >> 4, 32-45 the
/// stride-dimension byte offset >> 4, 62-63 = 1 (128-byte swizzle).
#[inline(always)]
pub const fn gmma_desc(addr: u32, leading_bytes: u32, stride_bytes: u32) -> u64 {
    ((addr as u64 & 0x3_ffff) >> 4)
        | (((leading_bytes as u64 >> 4) & 0x3fff) << 16)
        | (((stride_bytes as u64 >> 4) & 0x3fff) << 32)
        | (1 << 62)
}

/// Descriptor of k-step `kk` (elements 16·kk..16·kk+15 of the contracted
/// dimension) of a K-major SW128 tile of `rows` rows at `tile` (Q as A and K
/// as B of Q·Kᵀ): 16 elements are 32 bytes within the 128-byte row, and every
/// 4 steps the next column group. LBO is unused for swizzled K-major tiles;
/// SBO is the 8-row atom.
#[inline(always)]
pub const fn k_major_desc(tile: u32, rows: u32, kk: u32) -> u64 {
    let start = tile + (kk / 4) * rows * SW128_ROW_BYTES + (kk % 4) * 32;
    gmma_desc(start, 16, SW128_ATOM_BYTES)
}

/// Descriptor of k-step `kk` (rows 16·kk..16·kk+15) of an MN-major SW128
/// tile of `rows` rows at `tile` (V as B of P·V, stored as TMA loads it):
/// the N dimension steps 64 columns at LBO = one column group (`rows` rows),
/// the k dimension 8 rows at SBO = one atom; a k-step is two atoms.
#[inline(always)]
pub const fn mn_major_desc(tile: u32, rows: u32, kk: u32) -> u64 {
    gmma_desc(
        tile + kk * 2 * SW128_ATOM_BYTES,
        rows * SW128_ROW_BYTES,
        SW128_ATOM_BYTES,
    )
}
