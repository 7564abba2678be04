//! `#[repr(C)]` launch parameters, passed by value to the kernels. The host fills
//! them; the device reads them; both compile this one definition.
use crate::index::FastDiv;

/// Element strides of a [batch, seq, head, dim] tensor whose last dim is contiguous.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BshStrides {
    pub batch: i64,
    pub row: i64,
    pub head: i64,
}

/// Parameters of the forward and decode attention kernels.
///
/// Rows of a CTA: the forward kernel gives each CTA `block_m` query tokens of one
/// head (`pack == 1`, grid.y = heads). The decode kernel packs the `pack = heads /
/// kv_heads` query heads that share a KV head into the rows (row `r` is token
/// `r / pack`, head `grid.y * pack + r % pack`), so each K/V byte is read once per
/// sequence. grid.z = batch * num_splits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnParams {
    /// Q [B, Sq, H, D]
    pub q: u64,
    /// K [B, Skv, Hkv, D] (forward) or the K cache [B, Lmax, Hkv, D] (decode)
    pub k: u64,
    pub v: u64,
    /// O [B, Sq, H, D]
    pub o: u64,
    /// Optional f32 LSE [B, H, Sq] (natural log); 0 when not requested.
    pub lse: u64,
    /// f32 partial outputs [num_splits, B, H, Sq, D], used when `num_splits > 1`.
    pub o_accum: u64,
    /// f32 partial LSEs [num_splits, B, H, Sq], used when `num_splits > 1`.
    pub lse_accum: u64,
    /// Optional i32 `[B]` key counts on the device (decode); 0 means `seqlen_k` for all.
    pub cache_seqlens: u64,
    pub q_strides: BshStrides,
    pub k_strides: BshStrides,
    pub v_strides: BshStrides,
    pub o_strides: BshStrides,
    pub batch: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub seqlen_q: u32,
    /// Keys per sequence when `cache_seqlens` is 0; otherwise the cache capacity.
    pub seqlen_k: u32,
    pub pack: u32,
    pub num_splits: u32,
    /// Decode: K/V ring stages this launch uses, at most the tile's (whose
    /// shared memory the launch sizes); 0 or out of range = the tile's.
    pub kv_stages: u32,
    /// log2(e) times the factor that turns S into logits: softmax_scale, or
    /// the softcap c when a softcap is set (S is then tanh(scale * q·k / c)).
    /// The kernels work in the exp2 domain.
    pub scale_log2: f32,
    /// Tokens appended to the cache just before this launch: sequence `b`
    /// attends to `cache_seqlens[b] + seqlen_new` keys (decode).
    pub seqlen_new: u32,
    /// Paged cache (decode and ragged forward): [B, max_pages] i32 page indices, 0 for a
    /// contiguous cache. K/V are then [num_pages, page_size, Hkv, D] and the
    /// `batch` strides of `k_strides`/`v_strides` step from page to page.
    pub block_table: u64,
    pub max_pages: u32,
    pub page_size: FastDiv,
    pub num_pages: u32,
    /// Sliding window of the `Local` mask, in keys left and right of the
    /// bottom-right-aligned diagonal; negative = unbounded on that side.
    pub window_left: i32,
    pub window_right: i32,
    /// Softcap: S <- tanh(S * softcap_pre) with pre = scale / c, so that S
    /// times the logit factor c (in `scale_log2`) is c * tanh(scale * q·k /
    /// c). Folding c into `scale_log2` saves a multiply per score. 0 = off.
    pub softcap_pre: f32,
    /// f32 ALiBi slopes: slope (b, h) at `alibi + (b * alibi_batch_stride + h) * 4`
    /// (`[heads]`: stride 0; `[batch, heads]`: stride heads). 0 = off.
    pub alibi: u64,
    pub alibi_batch_stride: u32,
    /// 1 / the logit factor of `scale_log2` (softmax_scale, or c): the
    /// ALiBi bias enters S in S's own units.
    pub inv_scale: f32,
    /// f32 `[heads]` attention-sink logits (natural log); 0 = none.
    pub sinks: u64,
    /// Varlen: i32 [B + 1] starts of each sequence in the packed Q/O and K/V
    /// rows; 0 = the dense [B, S, ...] layout. Q/O are then [total_q, H, D]
    /// (batch strides unused), K/V [total_k, Hkv, D], the LSE [H, total_q].
    /// With a `block_table`, K/V are a paged cache instead and `cu_seqlens_k`
    /// holds i32 `[B]` key counts, clamped to `total_k` = the capacity per
    /// sequence (chunked prefill).
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    /// Packed rows of Q and of K/V: the bounds the kernel clamps every
    /// `cu_seqlens` entry to.
    pub total_q: u32,
    pub total_k: u32,
}

/// Parameters of the KV-cache append kernel: copies K/V_new [B, Snew, Hkv, D]
/// to positions `cache_seqlens[b]..+Snew` of the cache (contiguous or paged).
/// One thread per 16-byte chunk of a (b, t, h) row; positions at or past the
/// capacity are skipped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AppendParams {
    pub k_new: u64,
    pub v_new: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub cache_seqlens: u64,
    /// As in [`AttnParams::block_table`]; 0 for a contiguous cache.
    pub block_table: u64,
    pub k_new_strides: BshStrides,
    pub v_new_strides: BshStrides,
    pub k_cache_strides: BshStrides,
    pub v_cache_strides: BshStrides,
    pub batch: u32,
    pub seqlen_new: u32,
    pub kv_heads: u32,
    /// 16-byte chunks per row (head_dim / 8).
    pub row_chunks: u32,
    /// Tokens the cache can hold per sequence.
    pub capacity: u32,
    pub max_pages: u32,
    pub page_size: FastDiv,
    pub num_pages: u32,
}

/// Parameters of the split-KV combine kernel. One thread group per (b, h, token)
/// row of O merges `num_splits` partial rows from [`AttnParams::o_accum`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CombineParams {
    pub o_accum: u64,
    pub lse_accum: u64,
    pub o: u64,
    pub lse: u64,
    pub o_strides: BshStrides,
    pub batch: u32,
    pub heads: u32,
    pub seqlen_q: u32,
    pub num_splits: u32,
    /// As in [`AttnParams::sinks`]: added once here, not in the partials.
    pub sinks: u64,
}

/// Parameters of the merge-states kernel: (O, LSE) = merge((O_a, LSE_a),
/// (O_b, LSE_b)) for states over disjoint key sets. O tensors are
/// [B, S, H, D] (any strides, last dim contiguous), LSEs f32 [B, H, S]
/// contiguous. One thread per 16-byte chunk of a row; `o` may be `o_a` or
/// `o_b` (each thread reads its chunk before writing it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MergeParams {
    pub o_a: u64,
    pub lse_a: u64,
    pub o_b: u64,
    pub lse_b: u64,
    pub o: u64,
    /// 0: the merged LSE is not written.
    pub lse: u64,
    pub o_a_strides: BshStrides,
    pub o_b_strides: BshStrides,
    pub o_strides: BshStrides,
    pub batch: u32,
    pub seqlen: u32,
    pub heads: u32,
    /// 16-byte chunks per row (head_dim / 8).
    pub row_chunks: u32,
}
