//! The backward pass (FlashAttention-2, Algorithm 2) in three kernels:
//! [`prep`] (`delta = rowsum(dO ∘ O)`), [`backward`]
//! (one CTA per key block accumulates dK and dV in registers over every query
//! block that sees its keys, and adds its dQ share to the f32 buffer) and
//! [`dq`] (the buffer, scaled, in the element type); with sinks whose
//! gradients are asked for, [`sinks`] after `prep`.
//!
//! A warp owns 16 keys of the block, so it computes Sᵀ = K·Qᵀ and dPᵀ =
//! V·dOᵀ with keys as rows: Pᵀ and dSᵀ are then, packed to 16 bits, the A
//! fragments of dV += Pᵀ·dO and dK += dSᵀ·Q (as P is in the forward's P·V).
//! dQ = dS·K needs dS with queries as rows, so dSᵀ goes through shared
//! memory and comes back transposed by `ldmatrix.trans`. At D = 192 and 256
//! several warps split the columns of the same keys' dK and dV, and Pᵀ
//! goes through shared memory too (`BwdTile::shared_p`). Tiles are row-major
//! with a padded row (`BwdTile`), not swizzled.
use super::block_info::packed_range;
use super::copy;
use super::element::Element;
use super::policy::{column, Modifiers, Scores};
use crate::arch::{barrier, global, ldmatrix, math, shfl, smem, special};
use crate::config::{
    BwdTile, PtxArch, BWD_THREADS, CHUNK_BYTES, CHUNK_ELEMS, MMA_K, MMA_M, WARP_SIZE,
};
use crate::index::{block_needs_mask, quad_of, query_blocks, KeyWindow};
use crate::params::{BshStrides, BwdParams};
use crate::unroll::unroll;

pub(crate) const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// Byte address of (`row`, 16-bit column `col`) of a padded row-major tile.
#[inline(always)]
fn at(tile: u32, row_bytes: u32, row: u32, col: u32) -> u32 {
    tile + row * row_bytes + col * 2
}

/// Global byte address of token `t`, head `h` of sequence `b`.
#[inline(always)]
pub(crate) fn row_ptr(base: u64, s: &BshStrides, b: u32, t: u32, h: u32) -> u64 {
    base + 2 * (b as i64 * s.batch + t as i64 * s.row + h as i64 * s.head) as u64
}

/// (B, S) of the f32 rows [B, H, S] (the LSE, `delta`, and times D the dQ
/// buffer): (B, Sq) dense, (1, total_q) varlen, whose rows are [H, total_q].
#[inline(always)]
fn stat_shape(p: &BwdParams) -> (u32, u32) {
    if p.cu_seqlens_q != 0 {
        (1, p.total_q)
    } else {
        (p.batch, p.seqlen_q)
    }
}

/// The index of query row (`b`, `h`, `t`) among the f32 rows, in the
/// tensors' coordinates (a packed row: `b` = 0, `t` its packed row).
#[inline(always)]
pub(crate) fn stat_row(p: &BwdParams, b: u32, h: u32, t: u32) -> u64 {
    (b as u64 * p.heads as u64 + h as u64) * stat_shape(p).1 as u64 + t as u64
}

/// Where sequence `b`'s rows lie: its batch index for the tensors' batch
/// strides (0 when packed), its first query and key rows (0 when dense) and
/// its lengths. Packed sequences come from `cu_seqlens`, clamped to the
/// packed rows (`block_info::packed_range`): a bad entry shortens a
/// sequence, never reaches past the tensors.
#[derive(Clone, Copy)]
pub(crate) struct SeqSpan {
    pub batch: u32,
    pub q_start: u32,
    pub seqlen_q: u32,
    pub k_start: u32,
    pub seqlen_k: u32,
}

impl SeqSpan {
    #[inline(always)]
    pub(crate) fn new(p: &BwdParams, b: u32) -> SeqSpan {
        if p.cu_seqlens_q != 0 {
            let (q_start, seqlen_q) = packed_range(p.cu_seqlens_q, b, p.total_q);
            let (k_start, seqlen_k) = packed_range(p.cu_seqlens_k, b, p.total_k);
            SeqSpan {
                batch: 0,
                q_start,
                seqlen_q,
                k_start,
                seqlen_k,
            }
        } else {
            SeqSpan {
                batch: b,
                q_start: 0,
                seqlen_q: p.seqlen_q,
                k_start: 0,
                seqlen_k: p.seqlen_k,
            }
        }
    }

    /// The f32 row of the sequence's query `t` of head `h`.
    #[inline(always)]
    pub(crate) fn stat_row(&self, p: &BwdParams, h: u32, t: u32) -> u64 {
        stat_row(p, self.batch, h, self.q_start + t)
    }

    /// The keys each of the sequence's queries sees.
    #[inline(always)]
    pub(crate) fn keys(&self, p: &BwdParams) -> KeyWindow {
        KeyWindow::new(self.seqlen_q, self.seqlen_k, p.window_left, p.window_right)
    }
}

/// Tokens `first..` of head `head` of sequence `batch` in a [B, S, H, D]
/// tensor; tokens at or past `limit` read as zeros.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub base: u64,
    pub strides: &'a BshStrides,
    pub batch: u32,
    pub head: u32,
    pub first: u32,
    pub limit: u32,
}

/// Stages `count` tokens of `src` into a tile whose chunk `c` (8 elements)
/// of row `r` sits at `dst(r, c)`, the CTA's `threads` threads taking a
/// chunk each in turn.
#[inline(always)]
pub(crate) fn stage_rows<T: Element, const D: usize>(
    count: u32,
    (tid, threads): (u32, u32),
    src: Rows,
    dst: impl Fn(u32, u32) -> u32,
) {
    let chunks = (D / CHUNK_ELEMS) as u32;
    let mut i = tid;
    while i < count * chunks {
        let (r, c) = (i / chunks, i % chunks);
        let t = src.first + r;
        let valid = t < src.limit;
        let from = if valid {
            row_ptr(src.base, src.strides, src.batch, t, src.head) + (c * CHUNK_BYTES as u32) as u64
        } else {
            src.base
        };
        T::stage(dst(r, c), from, valid);
        i += threads;
    }
}

/// Stages `count` tokens of `src` into a padded tile, thread `tid` of
/// `threads`.
#[inline(always)]
fn load_rows<T: Element, const D: usize>(tile: u32, count: u32, threads: (u32, u32), src: Rows) {
    let row_bytes = BwdTile::row_bytes(D) as u32;
    stage_rows::<T, D>(count, threads, src, |r, c| {
        at(tile, row_bytes, r, c * CHUNK_ELEMS as u32)
    });
}

/// The (query head, query block) steps of one key block: every query head
/// of its KV head's group, each over the query blocks holding a row that
/// sees one of the block's keys (`index::query_blocks`), as one sequence,
/// so that step i + 1's copies can be issued during step i.
#[derive(Clone, Copy)]
pub(crate) struct Steps {
    pub count: u32,
    first_head: u32,
    m_lo: u32,
    blocks: u32,
}

impl Steps {
    /// The steps of key block `n` (`block_n` keys) of `head`'s part of its
    /// KV head's query heads, in query blocks of `block_m` rows.
    #[inline(always)]
    pub(crate) fn new(
        p: &BwdParams,
        keys: &KeyWindow,
        (n, head): (u32, HeadPart),
        block_n: u32,
        block_m: u32,
    ) -> Steps {
        let (m_lo, m_hi) = query_blocks(keys, n, block_n, block_m);
        let heads = p.heads / p.kv_heads / head.splits;
        Steps {
            count: heads * (m_hi - m_lo),
            first_head: (head.kv_head * head.splits + head.part) * heads,
            m_lo,
            blocks: m_hi - m_lo,
        }
    }
    /// Step `i`'s query head and query block (`i < count`).
    #[inline(always)]
    pub(crate) fn at(&self, i: u32) -> (u32, u32) {
        (
            self.first_head + i / self.blocks,
            self.m_lo + i % self.blocks,
        )
    }
}

/// The KV head of the CTA (`blockIdx.y / head_splits`) and which part of
/// its query heads the CTA takes.
#[derive(Clone, Copy)]
pub(crate) struct HeadPart {
    pub kv_head: u32,
    pub part: u32,
    pub splits: u32,
}

impl HeadPart {
    #[inline(always)]
    pub(crate) fn of_cta(p: &BwdParams) -> HeadPart {
        let (y, splits) = (special::block_idx_y(), p.head_splits.max(1));
        HeadPart {
            kv_head: y / splits,
            part: y % splits,
            splits,
        }
    }
}

/// Stages the K and V rows of the key block from `key0` (`count` keys of
/// KV head `kv_head` of sequence `seq`) with `load(tile, count, rows)`.
#[inline(always)]
pub(crate) fn stage_keys(
    p: &BwdParams,
    seq: &SeqSpan,
    (kv_head, key0): (u32, u32),
    count: u32,
    (k_s, v_s): (u32, u32),
    load: impl Fn(u32, u32, Rows),
) {
    let rows = |base, strides| Rows {
        base,
        strides,
        batch: seq.batch,
        head: kv_head,
        first: seq.k_start + key0,
        limit: seq.k_start + seq.seqlen_k,
    };
    load(k_s, count, rows(p.k, &p.k_strides));
    load(v_s, count, rows(p.v, &p.v_strides));
}

/// Stages query rows `q0..q0 + count` of head `h` of sequence `seq`: Q and dO with
/// `load(tile, count, rows)` into `q_s` and `do_s`, and their LSE and
/// `delta` (f32, `count` each, LSE first) into `stats`, a word per thread
/// below 2·count. Rows past the sequence are zeros: with Q = dO = 0 they add
/// nothing to dV = Pᵀ·dO or to dS = P ∘ (dPᵀ - delta), whatever their P. A
/// row that saw no key (LSE = -inf) has every key of the block cut, so the
/// block's mask holds and its P is set to 0.
#[inline(always)]
pub(crate) fn stage_queries(
    p: &BwdParams,
    seq: &SeqSpan,
    (h, q0): (u32, u32),
    count: u32,
    tid: u32,
    (q_s, do_s, stats): (u32, u32, u32),
    load: impl Fn(u32, u32, Rows),
) {
    let rows = |base, strides| Rows {
        base,
        strides,
        batch: seq.batch,
        head: h,
        first: seq.q_start + q0,
        limit: seq.q_start + seq.seqlen_q,
    };
    load(q_s, count, rows(p.q, &p.q_strides));
    load(do_s, count, rows(p.d_o, &p.do_strides));
    if tid < 2 * count {
        let (r, src) = (tid % count, if tid < count { p.lse } else { p.delta });
        let valid = q0 + r < seq.seqlen_q;
        let row = if valid { seq.stat_row(p, h, q0 + r) } else { 0 };
        copy::word(stats + tid * 4, src + row * 4, valid);
    }
}

/// What a step's scores need besides Sᵀ and dPᵀ: the modifiers, the step
/// head's ALiBi slope (S units), the key window and whether the block needs
/// its mask.
#[derive(Clone, Copy)]
pub(crate) struct StepScores<'a> {
    pub mods: Modifiers,
    pub slope: f32,
    pub keys: &'a KeyWindow,
    pub masked: bool,
}

impl<'a> StepScores<'a> {
    /// The scores of step head `h` of sequence `b` for a block whose mask
    /// need is `masked`.
    #[inline(always)]
    pub(crate) fn new<T: Element, S: Scores>(
        p: &BwdParams,
        keys: &'a KeyWindow,
        (b, h): (u32, u32),
        masked: bool,
    ) -> Self {
        let mods = Modifiers::new::<T, S>(p);
        let slope = if mods.alibi {
            Modifiers::slope(p, b, h)
        } else {
            0.0
        };
        StepScores {
            mods,
            slope,
            keys,
            masked,
        }
    }

    /// Pᵀ = exp(logits - LSE) and dSᵀ = Pᵀ ∘ (dPᵀ - delta), in place of Sᵀ
    /// and dPᵀ (m16n8 C fragments with keys as rows: 16 keys from `key`, the
    /// lane's row-half-0 key, by `ST` n-tiles of queries from `q0`), with the
    /// step's LSE and `delta` rows at `stats`. Logits are the scores times
    /// the logit factor (in `scale_log2`) after the softcap's `t = tanh(S ·
    /// pre)` and the ALiBi bias; a softcap multiplies dS by `1 - t²`, the
    /// derivative of t (its factor `pre` times the logit factor c is the
    /// softmax scale, which dK and dQ take at their end). Masked pairs get
    /// P = dS = 0. The modifiers are tested once, outside the tile's loop:
    /// a test per score would cut the loop into blocks that the compiler
    /// schedules one by one (the `Modified` kernels ran 8-12 % slower than
    /// the plain ones with neither modifier on, H200).
    #[inline(always)]
    pub(crate) fn p_and_ds<const ST: usize>(
        &self,
        p: &BwdParams,
        tiles: (&mut [[f32; 4]; ST], &mut [[f32; 4]; ST]),
        stats: (u32, u32),
        at: (u32, u32),
        lane: u32,
    ) {
        match (self.mods.softcap, self.mods.alibi) {
            (false, false) => self.p_and_ds_as::<false, false, ST>(p, tiles, stats, at, lane),
            (true, false) => self.p_and_ds_as::<true, false, ST>(p, tiles, stats, at, lane),
            (false, true) => self.p_and_ds_as::<false, true, ST>(p, tiles, stats, at, lane),
            (true, true) => self.p_and_ds_as::<true, true, ST>(p, tiles, stats, at, lane),
        }
    }

    /// [`Self::p_and_ds`] with the softcap (`CAP`) and ALiBi (`ALIBI`) fixed.
    #[inline(always)]
    fn p_and_ds_as<const CAP: bool, const ALIBI: bool, const ST: usize>(
        &self,
        p: &BwdParams,
        (s, dp): (&mut [[f32; 4]; ST], &mut [[f32; 4]; ST]),
        (lse_s, delta_s): (u32, u32),
        (q0, key): (u32, u32),
        lane: u32,
    ) {
        let pair = lane % 4;
        // Key minus the lane's first query's diagonal position, per row half.
        let diag0 = (q0 + 2 * pair) as i32 + self.keys.diag;
        let dist0 = [0, 1].map(|r| (key as i32 + 8 * r - diag0) as f32);
        unroll::<ST>(|j| {
            let col = j as u32 * 8 + 2 * pair;
            let (l0, l1) = smem::ld_v2_b32(lse_s + col * 4);
            let (d0, d1) = smem::ld_v2_b32(delta_s + col * 4);
            unroll::<4>(|e| {
                let lse = f32::from_bits(if e % 2 == 0 { l0 } else { l1 }) * LOG2_E;
                let delta = f32::from_bits(if e % 2 == 0 { d0 } else { d1 });
                let t = if CAP {
                    math::tanh(s[j][e] * p.softcap_pre)
                } else {
                    s[j][e]
                };
                let logit = if ALIBI {
                    let dist = math::abs(dist0[e / 2] - column(j, e));
                    math::fma(-self.slope, dist, t)
                } else {
                    t
                };
                let mut pv = math::ex2(logit * p.scale_log2 - lse);
                let (query, k) = (q0 + col + (e % 2) as u32, key + 8 * (e / 2) as u32);
                if self.masked && !self.keys.sees(query, k) {
                    pv = 0.0;
                }
                s[j][e] = pv;
                let ds = pv * (dp[j][e] - delta);
                dp[j][e] = if CAP { ds * math::fma(-t, t, 1.0) } else { ds };
            });
        });
    }
}

/// A lane's `ldmatrix.x4` row and column (16-bit units) within a 16 x 16
/// block when matrix `i = lane / 8` sits at (8·(i % 2), 8·(i / 2)): the A
/// operand from row-major [m][k] storage, and (with `.trans`) two n-tiles of
/// the B operand from row-major [k][n] storage.
#[inline(always)]
fn rows_first(lane: u32) -> (u32, u32) {
    (8 * ((lane / 8) % 2) + lane % 8, 8 * (lane / 16))
}

/// As [`rows_first`] with matrix `i` at (8·(i / 2), 8·(i % 2)): two n-tiles
/// of the B operand from row-major [n][k] storage, and (with `.trans`) the A
/// operand from row-major [k][m] storage.
#[inline(always)]
fn cols_first(lane: u32) -> (u32, u32) {
    (8 * (lane / 16) + lane % 8, 8 * ((lane / 8) % 2))
}

/// Packs the C fragments of n-tiles `lo` and `hi` (16 columns) into the A
/// fragment whose k runs over those columns.
#[inline(always)]
pub(crate) fn a_fragment<T: Element>(lo: &[f32; 4], hi: &[f32; 4]) -> [u32; 4] {
    [
        T::pack(lo[0], lo[1]),
        T::pack(lo[2], lo[3]),
        T::pack(hi[0], hi[1]),
        T::pack(hi[2], hi[3]),
    ]
}

/// Lanes 2k and 2k + 1 swap halves of their C fragments (rows g and g + 8,
/// columns 2t and 2t + 1), so that each holds four consecutive columns of
/// one row (`index::quad_of`): one 16-byte vector atomic instead of four scalar
/// ones. Every lane of the warp takes part.
#[inline(always)]
pub(crate) fn quad_swap(f: [f32; 4], lane: u32) -> [f32; 4] {
    let odd = lane % 2 == 1;
    let (s0, s1) = if odd { (f[0], f[1]) } else { (f[2], f[3]) };
    let (r0, r1) = (shfl::bfly_f32(s0, 1), shfl::bfly_f32(s1, 1));
    if odd {
        [r0, r1, f[2], f[3]]
    } else {
        [f[0], f[1], r0, r1]
    }
}

/// One backward CTA: key block `blockIdx.x` of a part of KV head
/// `blockIdx.y / head_splits`'s query heads ([`HeadPart`]) of sequence
/// `blockIdx.z`; the warps' shares are [`BwdTile`]'s. `QK = D/16`, `OT` =
/// the n-tiles of dK and dV a warp holds for each of its `MT` 16-key
/// m-tiles, `ST` = the query n-tiles of the warp's Sᵀ, `QOT` = the n-tiles
/// of dQ a warp computes for each of its `QMT` 16-query m-tiles, `KS` =
/// the key block's 16-key groups, `QS` = the query block's 16-row groups;
/// checked against the tile at compile time.
#[inline(always)]
pub fn backward<
    T: Element,
    S: Scores,
    const D: usize,
    const BM: usize,
    const QK: usize,
    const OT: usize,
    const ST: usize,
    const QOT: usize,
    const KS: usize,
    const QS: usize,
    const MT: usize,
    const QMT: usize,
>(
    p: &BwdParams,
) {
    let tile = const { BwdTile::of(D, PtxArch::TARGET) };
    const {
        let t = BwdTile::of(D, PtxArch::TARGET);
        assert!(BM == t.block_m && QK * MMA_K == D && OT * 8 * t.col_parts() == D);
        assert!(ST * 8 * t.s_parts() == BM && KS * MMA_M == t.block_n && QS * MMA_M == BM);
        assert!(MT * MMA_M == t.dkv_keys() && QMT * MMA_M == t.dq_rows());
        assert!(QOT * 8 * t.dq_parts() == D && QOT % 2 == 0 && OT % 2 == 0);
        // The warps split evenly into dK/dV key groups and dQ query tiles.
        assert!(t.warps().is_multiple_of(t.col_parts()));
        assert!(t.warps().is_multiple_of(BM / t.dq_rows()));
        // Sᵀ's n-tiles come in pairs when P stays in registers (A
        // fragments), which then cover the warp's own 16 keys.
        assert!(t.shared_p || (ST % 2 == 0 && MT == 1));
        assert!(t.smem_bytes() <= PtxArch::TARGET.max_smem_bytes());
    }
    let shared_p = tile.shared_p;
    let threads = tile.threads() as u32;
    let tid = special::thread_idx_x();
    let (warp, lane) = (tid / WARP_SIZE as u32, tid % WARP_SIZE as u32);
    let (g, pair) = (lane / 4, lane % 4);
    let (n, head, b) = (
        special::block_idx_x(),
        HeadPart::of_cta(p),
        special::block_idx_z(),
    );
    let base = smem::base();
    let rb = BwdTile::row_bytes(D) as u32;
    let ds_rb = BwdTile::row_bytes(BM) as u32;
    let (k_s, v_s) = (base, base + tile.v_offset() as u32);
    let (ds_s, p_s) = (
        base + tile.ds_offset() as u32,
        base + tile.p_offset() as u32,
    );

    let bn = tile.block_n as u32;
    let key0 = n * bn;
    let seq = SeqSpan::new(p, b);
    // The grid covers the longest sequence's keys (varlen).
    if key0 >= seq.seqlen_k {
        return;
    }
    let load = |tile: u32, count: u32, rows: Rows<'_>| {
        load_rows::<T, D>(tile, count, (tid, threads), rows)
    };
    stage_keys(p, &seq, (head.kv_head, key0), bn, (k_s, v_s), load);
    copy::commit();

    let keys = seq.keys(p);
    let steps = Steps::new(p, &keys, (n, head), bn, BM as u32);
    let stages = tile.q_stages as u32;
    // Step i's Q, dO, LSE and `delta` rows into `stage`.
    let issue = |i: u32, stage: u32| {
        let (h, m) = steps.at(i);
        let q_s = base + tile.q_offset(stage as usize) as u32;
        let do_s = q_s + (BM * BwdTile::row_bytes(D)) as u32;
        let stats = base + tile.stats_offset(stage as usize) as u32;
        stage_queries(
            p,
            &seq,
            (h, m * BM as u32),
            BM as u32,
            tid,
            (q_s, do_s, stats),
            load,
        );
    };
    if steps.count > 0 && stages > 1 {
        issue(0, 0);
        copy::commit();
    }
    let (a_row, a_col) = rows_first(lane);
    let (b_row, b_col) = cols_first(lane);
    // The warp's keys and queries of Sᵀ (relative to the block), and its
    // keys and columns of dK and dV. Without `shared_p` the CTA has KS
    // warps, each with the whole rows of its own 16 keys.
    let (warp_key, warp_q, kv_key, kv_d) = if shared_p {
        let kv_groups = (tile.warps() / tile.col_parts()) as u32;
        (
            (warp % KS as u32) * MMA_M as u32,
            (warp / KS as u32) * (ST * 8) as u32,
            (warp % kv_groups) * (MT * MMA_M) as u32,
            (warp / kv_groups) * (OT * 8) as u32,
        )
    } else {
        (warp * MMA_M as u32, 0, warp * MMA_M as u32, 0)
    };
    let mut dk = [[[0f32; 4]; OT]; MT];
    let mut dv = [[[0f32; 4]; OT]; MT];

    let mut i = 0;
    while i < steps.count {
        let (h, m) = steps.at(i);
        let q0 = m * BM as u32;
        let stage = i % stages;
        // Every warp is done with the stage the next copies overwrite
        // (step i - 1's with two stages, this one's with one) and with dSᵀ
        // and Pᵀ.
        barrier::sync_cta();
        if stages > 1 {
            if i + 1 < steps.count {
                issue(i + 1, (i + 1) % stages);
            }
            copy::commit();
            copy::wait_pending(1);
        } else {
            issue(i, 0);
            copy::commit();
            copy::wait_all();
        }
        barrier::sync_cta();
        let q_s = base + tile.q_offset(stage as usize) as u32;
        let do_s = q_s + (BM * BwdTile::row_bytes(D)) as u32;
        let lse_s = base + tile.stats_offset(stage as usize) as u32;
        let delta_s = lse_s + BM as u32 * 4;

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ over the warp's 16 keys and queries.
        let mut s = [[0f32; 4]; ST];
        let mut dp = [[0f32; 4]; ST];
        unroll::<QK>(|kk| {
            let col = kk as u32 * MMA_K as u32;
            let ak = ldmatrix::x4(at(k_s, rb, warp_key + a_row, col + a_col));
            let av = ldmatrix::x4(at(v_s, rb, warp_key + a_row, col + a_col));
            unroll::<ST>(|j| {
                if j % 2 == 0 {
                    // A lone last n-tile (ST odd) loads its 8 rows twice
                    // rather than rows past the warp's queries.
                    let lone = j + 1 == ST;
                    let row = warp_q + j as u32 * 8 + if lone { b_row % 8 } else { b_row };
                    let bq = ldmatrix::x4(at(q_s, rb, row, col + b_col));
                    T::mma(&mut s[j], &ak, bq[0], bq[1]);
                    if !lone {
                        T::mma(&mut s[j + 1], &ak, bq[2], bq[3]);
                    }
                    let bo = ldmatrix::x4(at(do_s, rb, row, col + b_col));
                    T::mma(&mut dp[j], &av, bo[0], bo[1]);
                    if !lone {
                        T::mma(&mut dp[j + 1], &av, bo[2], bo[3]);
                    }
                }
            });
        });

        // Pᵀ = exp(S - LSE) and dSᵀ = Pᵀ ∘ (dPᵀ - delta), masked.
        let masked = block_needs_mask(&keys, q0, q0 + BM as u32 - 1, n, bn);
        StepScores::new::<T, S>(p, &keys, (b, h), masked).p_and_ds(
            p,
            (&mut s, &mut dp),
            (lse_s + warp_q * 4, delta_s + warp_q * 4),
            (q0 + warp_q, key0 + warp_key + g),
            lane,
        );

        if shared_p {
            // The warps that accumulate dK and dV for these keys hold other
            // columns over all of the block's queries.
            store_scores::<T, ST>(p_s, ds_rb, (warp_key + g, warp_q + 2 * pair), &s);
        } else {
            // Pᵀ and dSᵀ as computed are the A fragments of the warp's own keys.
            unroll::<ST>(|j| {
                if j % 2 == 0 {
                    let ap = [a_fragment::<T>(&s[j], &s[j + 1]); MT];
                    let ads = [a_fragment::<T>(&dp[j], &dp[j + 1]); MT];
                    accumulate_dk_dv::<T, OT, MT>(
                        (q_s, do_s, rb),
                        (j as u32 * 8 + a_row, a_col),
                        (&ap, &ads),
                        (&mut dk, &mut dv),
                    );
                }
            });
        }
        // dSᵀ to shared memory, keys as rows.
        store_scores::<T, ST>(ds_s, ds_rb, (warp_key + g, warp_q + 2 * pair), &dp);
        barrier::sync_cta();

        if shared_p {
            // Pᵀ and dSᵀ of the warp's 32 keys, whose Sᵀ two other warps
            // computed, back from shared memory.
            unroll::<QS>(|kq| {
                let q = kq as u32 * MMA_K as u32;
                let (mut ap, mut ads) = ([[0u32; 4]; MT], [[0u32; 4]; MT]);
                unroll::<MT>(|m| {
                    let row = kv_key + (m * MMA_M) as u32 + a_row;
                    ap[m] = ldmatrix::x4(at(p_s, ds_rb, row, q + a_col));
                    ads[m] = ldmatrix::x4(at(ds_s, ds_rb, row, q + a_col));
                });
                accumulate_dk_dv::<T, OT, MT>(
                    (q_s, do_s, rb),
                    (q + a_row, kv_d + a_col),
                    (&ap, &ads),
                    (&mut dk, &mut dv),
                );
            });
        }

        // dQ share = dS·K: warp w takes query tile w % (BM / rows) of
        // `QMT` m-tiles and the (w / (BM / rows))-th of dQ's column parts,
        // over all the block's keys.
        let q_tiles = (BM / (QMT * MMA_M)) as u32;
        let q_row = (warp % q_tiles) * (QMT * MMA_M) as u32;
        let d0 = (warp / q_tiles) * (QOT * 8) as u32;
        let mut dq = [[[0f32; 4]; QOT]; QMT];
        unroll::<KS>(|kk| {
            let key = kk as u32 * MMA_K as u32;
            let mut a = [[0u32; 4]; QMT];
            unroll::<QMT>(|m| {
                let col = q_row + (m * MMA_M) as u32 + b_col;
                a[m] = ldmatrix::x4_trans(at(ds_s, ds_rb, key + b_row, col));
            });
            unroll::<QOT>(|d| {
                if d % 2 == 0 {
                    let bk =
                        ldmatrix::x4_trans(at(k_s, rb, key + a_row, d0 + d as u32 * 8 + a_col));
                    unroll::<QMT>(|m| {
                        T::mma(&mut dq[m][d], &a[m], bk[0], bk[1]);
                        T::mma(&mut dq[m][d + 1], &a[m], bk[2], bk[3]);
                    });
                }
            });
        });
        let row_at = |t: u32| p.dq_accum + seq.stat_row(p, h, t) * D as u64 * 4;
        unroll::<QMT>(|m| {
            let row0 = q0 + q_row + (m * MMA_M) as u32;
            if matches!(PtxArch::TARGET, PtxArch::Sm90) {
                let (r, c) = quad_of(lane);
                let t = row0 + r;
                let dst = row_at(t) + (d0 + c) as u64 * 4;
                unroll::<QOT>(|d| {
                    let v = quad_swap(dq[m][d], lane);
                    if t < seq.seqlen_q {
                        global::red_add_v4_f32(dst + d as u64 * 32, v);
                    }
                });
            } else {
                unroll::<2>(|r| {
                    let t = row0 + g + 8 * r as u32;
                    if t < seq.seqlen_q {
                        let dst = row_at(t) + (d0 + 2 * pair) as u64 * 4;
                        unroll::<QOT>(|d| {
                            global::red_add_f32(dst + d as u64 * 32, dq[m][d][2 * r]);
                            global::red_add_f32(dst + d as u64 * 32 + 4, dq[m][d][2 * r + 1]);
                        });
                    }
                });
            }
        });
        i += 1;
    }
    // A CTA that visits no query block still has its K/V copies in flight.
    copy::wait_all();

    unroll::<MT>(|m| {
        let key = key0 + kv_key + (m * MMA_M) as u32;
        store_dk_dv::<T, OT>(p, &seq, head, (key, kv_d), lane, (&dk[m], &dv[m]));
    });
}

/// Writes a warp's m16n8 C fragments of Pᵀ or dSᵀ (16 keys by `ST` query
/// n-tiles) packed to 16 bits into a padded keys x queries tile, the lane's
/// first element at (`row`, `col`).
#[inline(always)]
fn store_scores<T: Element, const ST: usize>(
    tile: u32,
    row_bytes: u32,
    (row, col): (u32, u32),
    c: &[[f32; 4]; ST],
) {
    unroll::<ST>(|j| {
        let col = col + j as u32 * 8;
        smem::st_b32(at(tile, row_bytes, row, col), T::pack(c[j][0], c[j][1]));
        smem::st_b32(at(tile, row_bytes, row + 8, col), T::pack(c[j][2], c[j][3]));
    });
}

/// dV += Pᵀ·dO and dK += dSᵀ·Q for 16 queries (the k of these GEMMs): `ap`
/// and `ads` are the A fragments of `M` m-tiles of 16 keys by those
/// queries, whose dO and Q rows (`ldmatrix.trans` B fragments, each read
/// once for the `M` m-tiles) the lane reads from row `row`, column `col`
/// on, for `N` n-tiles of dK's and dV's columns.
#[inline(always)]
fn accumulate_dk_dv<T: Element, const N: usize, const M: usize>(
    (q_s, do_s, rb): (u32, u32, u32),
    (row, col): (u32, u32),
    (ap, ads): (&[[u32; 4]; M], &[[u32; 4]; M]),
    (dk, dv): (&mut [[[f32; 4]; N]; M], &mut [[[f32; 4]; N]; M]),
) {
    unroll::<N>(|d| {
        if d % 2 == 0 {
            let col = col + d as u32 * 8;
            let bo = ldmatrix::x4_trans(at(do_s, rb, row, col));
            unroll::<M>(|m| {
                T::mma(&mut dv[m][d], &ap[m], bo[0], bo[1]);
                T::mma(&mut dv[m][d + 1], &ap[m], bo[2], bo[3]);
            });
            let bq = ldmatrix::x4_trans(at(q_s, rb, row, col));
            unroll::<M>(|m| {
                T::mma(&mut dk[m][d], &ads[m], bq[0], bq[1]);
                T::mma(&mut dk[m][d + 1], &ads[m], bq[2], bq[3]);
            });
        }
    });
}

/// Writes dK (times `softmax_scale`) and dV of a warp's 16 keys of
/// sequence `seq`, from first key `key` on, columns `col..` (`N` n-tiles),
/// out of their accumulators (m16n8 C fragments); keys past the sequence
/// are not written.
#[inline(always)]
pub(crate) fn store_dk_dv<T: Element, const N: usize>(
    p: &BwdParams,
    seq: &SeqSpan,
    head: HeadPart,
    (key, col): (u32, u32),
    lane: u32,
    (dk, dv): (&[[f32; 4]; N], &[[f32; 4]; N]),
) {
    let (g, pair) = (lane / 4, lane % 4);
    unroll::<2>(|r| {
        let key = key + g + 8 * r as u32;
        if key < seq.seqlen_k {
            let (b, row) = (seq.batch, seq.k_start + key);
            if head.splits > 1 {
                // f32 parts for `BackwardDkv`, which sums them in order.
                let (dk_part, dv_part) = dkv_part_rows(p, seq, head, key);
                let off = 4 * (col + 2 * pair) as u64;
                let (dk_part, dv_part) = (dk_part + off, dv_part + off);
                unroll::<N>(|d| {
                    let (c0, c1) = (dk[d][2 * r] * p.scale, dk[d][2 * r + 1] * p.scale);
                    global::st_v2_b32(dk_part + d as u64 * 32, c0.to_bits(), c1.to_bits());
                    let (c0, c1) = (dv[d][2 * r], dv[d][2 * r + 1]);
                    global::st_v2_b32(dv_part + d as u64 * 32, c0.to_bits(), c1.to_bits());
                });
                return;
            }
            let off = 2 * (col + 2 * pair) as u64;
            let dk_row = row_ptr(p.dk, &p.dk_strides, b, row, head.kv_head) + off;
            let dv_row = row_ptr(p.dv, &p.dv_strides, b, row, head.kv_head) + off;
            unroll::<N>(|d| {
                let (c0, c1) = (dk[d][2 * r], dk[d][2 * r + 1]);
                global::st_b32(dk_row + d as u64 * 16, T::pack(c0 * p.scale, c1 * p.scale));
                global::st_b32(
                    dv_row + d as u64 * 16,
                    T::pack(dv[d][2 * r], dv[d][2 * r + 1]),
                );
            });
        }
    });
}

/// The addresses of key `key`'s dK and dV rows of part `head.part` in
/// `dkv_parts` ([2, head_splits, key rows, Hkv, D] f32).
#[inline(always)]
fn dkv_part_rows(p: &BwdParams, seq: &SeqSpan, head: HeadPart, key: u32) -> (u64, u64) {
    let key_rows = if p.cu_seqlens_k != 0 {
        p.total_k as u64
    } else {
        p.batch as u64 * p.seqlen_k as u64
    };
    let key_row = seq.batch as u64 * p.seqlen_k as u64 + (seq.k_start + key) as u64;
    let part_elems = key_rows * p.kv_heads as u64 * p.head_dim as u64;
    let within = (key_row * p.kv_heads as u64 + head.kv_head as u64) * p.head_dim as u64;
    let dk = p.dkv_parts + (head.part as u64 * part_elems + within) * 4;
    (dk, dk + head.splits as u64 * part_elems * 4)
}

/// dK and dV of one 8-column chunk of one key row per thread, from the
/// `head_splits` parts in `dkv_parts` summed in order (so the same bits on
/// every run): grid.x covers the longest sequence's keys times Hkv times
/// D / 8, grid.y the sequences. Packed rows no sequence owns keep their dK
/// and dV.
#[inline(always)]
pub fn dkv<T: Element>(p: &BwdParams) {
    let chunks = p.head_dim / CHUNK_ELEMS as u32;
    let i = special::block_idx_x() * BWD_THREADS as u32 + special::thread_idx_x();
    let seq = SeqSpan::new(p, special::block_idx_y());
    let (key, rest) = (i / (p.kv_heads * chunks), i % (p.kv_heads * chunks));
    if key >= seq.seqlen_k {
        return;
    }
    let (kv_head, c) = (rest / chunks, rest % chunks);
    let mut sums = [[0f32; CHUNK_ELEMS]; 2];
    let mut part = 0;
    while part < p.head_splits {
        let head = HeadPart {
            kv_head,
            part,
            splits: p.head_splits,
        };
        let rows = dkv_part_rows(p, &seq, head, key);
        unroll::<2>(|w| {
            let src = [rows.0, rows.1][w] + (c * CHUNK_ELEMS as u32) as u64 * 4;
            let (lo, hi) = (global::ld_nc_v4_f32(src), global::ld_nc_v4_f32(src + 16));
            unroll::<4>(|e| {
                sums[w][e] += lo[e];
                sums[w][4 + e] += hi[e];
            });
        });
        part += 1;
    }
    let (b, row) = (seq.batch, seq.k_start + key);
    let off = (c * CHUNK_BYTES as u32) as u64;
    T::store_chunk(row_ptr(p.dk, &p.dk_strides, b, row, kv_head) + off, sums[0]);
    T::store_chunk(row_ptr(p.dv, &p.dv_strides, b, row, kv_head) + off, sums[1]);
}

/// A query row in the f32 rows' order (`stat_shape`): its index there, and
/// its coordinates in the tensors (packed: batch 0, token = packed row).
struct QueryRow {
    index: u64,
    batch: u32,
    head: u32,
    token: u32,
}

/// Thread `blockIdx.x · BWD_THREADS + threadIdx.x` of a grid of `per_row`
/// threads per query row: its row and its part of the row, or `None` past
/// the last row.
#[inline(always)]
fn thread_row(p: &BwdParams, per_row: u32) -> Option<(QueryRow, u32)> {
    let i = special::block_idx_x() as u64 * BWD_THREADS as u64 + special::thread_idx_x() as u64;
    let (batches, seqlen) = stat_shape(p);
    let rows = batches as u64 * p.heads as u64 * seqlen as u64;
    if i >= rows * per_row as u64 {
        return None;
    }
    let (index, part) = (i / per_row as u64, (i % per_row as u64) as u32);
    let bh = index / seqlen as u64;
    let row = QueryRow {
        index,
        batch: (bh / p.heads as u64) as u32,
        head: (bh % p.heads as u64) as u32,
        token: (index % seqlen as u64) as u32,
    };
    Some((row, part))
}

/// `delta` of one query row per thread.
#[inline(always)]
pub fn prep<T: Element>(p: &BwdParams) {
    let Some((r, _)) = thread_row(p, 1) else {
        return;
    };
    let (o, d_o) = (
        row_ptr(p.o, &p.o_strides, r.batch, r.token, r.head),
        row_ptr(p.d_o, &p.do_strides, r.batch, r.token, r.head),
    );
    let mut delta = 0f32;
    let mut c = 0;
    while c < p.head_dim / CHUNK_ELEMS as u32 {
        let off = (c * CHUNK_BYTES as u32) as u64;
        let (x, y) = (
            global::ld_nc_v4_b32(o + off),
            global::ld_nc_v4_b32(d_o + off),
        );
        unroll::<4>(|e| {
            let ((x0, x1), (y0, y1)) = (T::unpack(x[e]), T::unpack(y[e]));
            delta = math::fma(x0, y0, math::fma(x1, y1, delta));
        });
        c += 1;
    }
    global::st_f32(p.delta + r.index * 4, delta);
}

/// One 8-column chunk of dQ per thread: `scale` times the dQ buffer.
#[inline(always)]
pub fn dq<T: Element>(p: &BwdParams) {
    let chunks = p.head_dim / CHUNK_ELEMS as u32;
    let Some((r, c)) = thread_row(p, chunks) else {
        return;
    };
    let src = p.dq_accum + (r.index * p.head_dim as u64 + (c * CHUNK_ELEMS as u32) as u64) * 4;
    let (lo, hi) = (global::ld_nc_v4_f32(src), global::ld_nc_v4_f32(src + 16));
    let v = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]].map(|x| x * p.scale);
    T::store_chunk(
        row_ptr(p.dq, &p.dq_strides, r.batch, r.token, r.head) + (c * CHUNK_BYTES as u32) as u64,
        v,
    );
}

/// The gradient of head `blockIdx.x`'s sink, `-Σ exp(sink - LSE) · delta`
/// over its rows of every sequence (the sink's softmax share of each row
/// times the row's `delta`, as dS of a logit whose value is 0): thread `t`
/// sums rows `t, t + BWD_THREADS, ...` of each sequence, then the warps'
/// sums in warp order, so the result is the same on every run (no
/// atomics).
#[inline(always)]
pub fn sinks(p: &BwdParams) {
    let (h, tid) = (special::block_idx_x(), special::thread_idx_x());
    let sink = global::ld_nc_f32(p.sinks + h as u64 * 4) * LOG2_E;
    let mut sum = 0f32;
    // Sequence by sequence: packed rows that no sequence owns hold no LSE.
    let mut b = 0;
    while b < p.batch {
        let seq = SeqSpan::new(p, b);
        let mut t = tid;
        while t < seq.seqlen_q {
            let row = seq.stat_row(p, h, t) * 4;
            let (lse, delta) = (
                global::ld_nc_f32(p.lse + row),
                global::ld_nc_f32(p.delta + row),
            );
            sum = math::fma(math::ex2(sink - lse * LOG2_E), delta, sum);
            t += BWD_THREADS as u32;
        }
        b += 1;
    }
    unroll::<5>(|i| sum += shfl::bfly_f32(sum, 16 >> i));
    let sums = smem::base();
    let warp = tid / WARP_SIZE as u32;
    if tid % WARP_SIZE as u32 == 0 {
        smem::st_b32(sums + warp * 4, sum.to_bits());
    }
    barrier::sync_cta();
    if tid == 0 {
        let mut total = 0f32;
        unroll::<{ BWD_THREADS / WARP_SIZE }>(|w| {
            total += f32::from_bits(smem::ld_b32(sums + w as u32 * 4));
        });
        global::st_f32(p.d_sinks + h as u64 * 4, -total);
    }
}
