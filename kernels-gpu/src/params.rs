//! `#[repr(C)]` launch parameters, passed by value to the kernels. The host fills
//! them; the device reads them; both compile this one definition.
use crate::index::{FastDiv, TileGrid};

/// Strides of a [batch, seq, head, dim] tensor whose last dim is contiguous,
/// in 16-bit units: an element's for f16/bf16, half an element's for f32
/// (whose strides the host doubles), so row addresses are `2 * offset` bytes
/// for every dtype.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BshStrides {
    /// Elements from one batch entry to the next (page to page in a paged cache).
    pub batch: i64,
    /// Elements from one token to the next along the sequence axis.
    pub row: i64,
    /// Elements from one head to the next.
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
    /// V, shaped like `k`.
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
    /// Element strides of `q`; the batch stride is unused for packed sequences.
    pub q_strides: BshStrides,
    /// Element strides of `k` (with a `block_table`, `batch` steps between pages).
    pub k_strides: BshStrides,
    /// Element strides of `v`, as `k_strides`.
    pub v_strides: BshStrides,
    /// Element strides of `o`; the batch stride is unused for packed sequences.
    pub o_strides: BshStrides,
    /// Sequences B: grid.z is `batch * num_splits`.
    pub batch: u32,
    /// Query heads H.
    pub heads: u32,
    /// K/V heads Hkv; query head `h` reads KV head `h / (heads / kv_heads)`.
    pub kv_heads: u32,
    /// Query tokens per sequence; with `cu_seqlens_q`, the longest one
    /// (max_seqlen_q), which only sizes the grid.
    pub seqlen_q: u32,
    /// Keys per sequence when `cache_seqlens` is 0; otherwise the cache capacity.
    pub seqlen_k: u32,
    /// Query heads packed into a CTA's rows: `heads / kv_heads` (decode), 1 (forward).
    pub pack: u32,
    /// Key splits per sequence (decode): above 1, each split writes its partials to
    /// `o_accum`/`lse_accum` for the combine kernel. 1 for the forward kernel.
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
    /// Pages per sequence: the row length of `block_table`.
    pub max_pages: u32,
    /// Tokens per page: a key position divides into (page, row in page).
    /// Unused without a `block_table`.
    pub page_size: FastDiv,
    /// Pages in the K/V pool; `block_table` entries are clamped to `[0, num_pages)`.
    pub num_pages: u32,
    /// Sliding window of the `Local` mask, in keys left and right of the
    /// bottom-right-aligned diagonal; negative = unbounded on that side.
    pub window_left: i32,
    /// Keys right of the diagonal (see `window_left`); negative = unbounded.
    pub window_right: i32,
    /// Softcap: S <- tanh(S * softcap_pre) with pre = scale / c, so that S
    /// times the logit factor c (in `scale_log2`) is c * tanh(scale * q·k /
    /// c). Folding c into `scale_log2` saves a multiply per score. 0 = off.
    pub softcap_pre: f32,
    /// 1: the forward softmax holds every row's m at
    /// `softmax::FIXED_MAX` instead of a running row max. Exact only where
    /// the logits are bounded and P is bf16 (f32's exponent range): the host
    /// sets it for bf16 softcaps without ALiBi whose cap bounds P
    /// (`flash_attn`'s `softmax_max_fixed`), and the kernels also require
    /// `Element::BF16`. 0 = the online max.
    pub fixed_max: u32,
    /// f32 ALiBi slopes: slope (b, h) at `alibi + (b * alibi_batch_stride + h) * 4`
    /// (`[heads]`: stride 0; `[batch, heads]`: stride heads). 0 = off.
    pub alibi: u64,
    /// Slopes from one batch entry of `alibi` to the next: 0 for `[heads]`,
    /// heads for `[batch, heads]`.
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
    /// Varlen: i32 [B + 1] starts of each sequence in the packed K/V rows, or with a
    /// `block_table` i32 `[B]` key counts (see `cu_seqlens_q`); 0 = dense.
    pub cu_seqlens_k: u64,
    /// Packed rows of Q and of K/V: the bounds the kernel clamps every
    /// `cu_seqlens` entry to.
    pub total_q: u32,
    /// Packed K/V rows, or with a `block_table` the capacity per sequence
    /// (max_pages x page_size); see `total_q`.
    pub total_k: u32,
    /// Head dim of V and O (the columns of V loaded and of O stored; at
    /// most the kernel's D; 0 = D). Smaller than D when V has its own head
    /// dim (DeepSeek's MLA prefill: Q·K over 192, V and O 128) or when a
    /// Hopper line serves a smaller head dim (`config::hopper_line_head_dim`):
    /// V's columns past it load as zeros, so O's are 0 and not stored. See
    /// [`AttnParams::v_chunks`].
    pub head_dim: u32,
    /// A persistent Hopper forward launch's tile order ([`TileGrid`]);
    /// unused by every other launch.
    pub tiles: TileGrid,
}

impl AttnParams {
    /// The 16-byte chunks (8 elements) of a V or O row of a kernel of head
    /// dim `d`: `head_dim / 8`, clamped to `d / 8`, or `d / 8` for 0.
    #[inline(always)]
    pub fn v_chunks(&self, d: usize) -> u32 {
        let all = (d / 8) as u32;
        match self.head_dim / 8 {
            0 => all,
            n => n.min(all),
        }
    }
}

/// Parameters of the KV-cache append kernel: copies K/V_new [B, Snew, Hkv, D]
/// to positions `cache_seqlens[b]..+Snew` of the cache (contiguous or paged).
/// One thread per 16-byte chunk of a (b, t, h) row; positions at or past the
/// capacity are skipped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AppendParams {
    /// K_new [B, Snew, Hkv, D]: the tokens to append.
    pub k_new: u64,
    /// V_new [B, Snew, Hkv, D], shaped like `k_new`.
    pub v_new: u64,
    /// K cache [B, capacity, Hkv, D], or with a `block_table` the page pool
    /// [num_pages, page_size, Hkv, D]; written in place.
    pub k_cache: u64,
    /// V cache, shaped like `k_cache`; written in place.
    pub v_cache: u64,
    /// i32 `[B]` tokens already cached per sequence: sequence `b`'s new tokens go
    /// to positions `cache_seqlens[b]..` (negative entries read as 0).
    pub cache_seqlens: u64,
    /// As in [`AttnParams::block_table`]; 0 for a contiguous cache.
    pub block_table: u64,
    /// Element strides of `k_new`.
    pub k_new_strides: BshStrides,
    /// Element strides of `v_new`.
    pub v_new_strides: BshStrides,
    /// Element strides of `k_cache` (with a `block_table`, `batch` steps between pages).
    pub k_cache_strides: BshStrides,
    /// Element strides of `v_cache`, as `k_cache_strides`.
    pub v_cache_strides: BshStrides,
    /// Sequences B.
    pub batch: u32,
    /// New tokens per sequence (Snew).
    pub seqlen_new: u32,
    /// K/V heads Hkv.
    pub kv_heads: u32,
    /// 16-byte chunks per row (head_dim / 8).
    pub row_chunks: u32,
    /// Tokens the cache can hold per sequence.
    pub capacity: u32,
    /// Pages per sequence: the row length of `block_table`.
    pub max_pages: u32,
    /// Tokens per page; unused without a `block_table`.
    pub page_size: FastDiv,
    /// Pages in the pool; `block_table` entries are clamped to `[0, num_pages)`.
    pub num_pages: u32,
    /// Nonzero: a programmatic dependent grid (sm_90) may start at once,
    /// not only when every chunk is stored (`append_kv`).
    pub early_dependents: u32,
}

/// Parameters of the split-KV combine kernel. `split_groups` thread groups
/// per (b, h, token) row of O merge `num_splits` partial rows from
/// [`AttnParams::o_accum`] (`config::combine_shape`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CombineParams {
    /// f32 partial outputs [num_splits, B, H, Sq, D] the decode kernel wrote.
    pub o_accum: u64,
    /// f32 partial LSEs [num_splits, B, H, Sq] (natural log) the decode kernel wrote.
    pub lse_accum: u64,
    /// O [B, Sq, H, D]: the merged output.
    pub o: u64,
    /// Optional f32 LSE [B, H, Sq] (natural log) of the merged rows; 0 when not requested.
    pub lse: u64,
    /// Element strides of `o`.
    pub o_strides: BshStrides,
    /// Sequences B.
    pub batch: u32,
    /// Query heads H.
    pub heads: u32,
    /// Query tokens per sequence (Sq).
    pub seqlen_q: u32,
    /// Partials per row to merge: the decode launch's `num_splits`.
    pub num_splits: u32,
    /// As in [`AttnParams::sinks`]: added once here, not in the partials.
    pub sinks: u64,
    /// Groups of a CTA that share one row (`config::CombineShape`); the
    /// kernel clamps it to `[1, config::combine_groups(D)]`.
    pub split_groups: u32,
}

/// Parameters of the merge-states kernel: (O, LSE) = merge((O_a, LSE_a),
/// (O_b, LSE_b)) for states over disjoint key sets. O tensors are
/// [B, S, H, D] (any strides, last dim contiguous), LSEs f32 [B, H, S]
/// contiguous. One thread per 16-byte chunk of a row; `o` may be `o_a` or
/// `o_b` (each thread reads its chunk before writing it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MergeParams {
    /// O_a [B, S, H, D].
    pub o_a: u64,
    /// f32 LSE_a [B, H, S] (natural log; -inf: the state saw no key).
    pub lse_a: u64,
    /// O_b [B, S, H, D].
    pub o_b: u64,
    /// f32 LSE_b [B, H, S], as `lse_a`.
    pub lse_b: u64,
    /// Merged O [B, S, H, D]; may be `o_a` or `o_b`.
    pub o: u64,
    /// 0: the merged LSE is not written.
    pub lse: u64,
    /// Element strides of `o_a`.
    pub o_a_strides: BshStrides,
    /// Element strides of `o_b`.
    pub o_b_strides: BshStrides,
    /// Element strides of `o`.
    pub o_strides: BshStrides,
    /// Sequences B.
    pub batch: u32,
    /// Tokens per sequence (S).
    pub seqlen: u32,
    /// Heads H.
    pub heads: u32,
    /// 16-byte chunks per row (head_dim / 8).
    pub row_chunks: u32,
}

/// Parameters of the backward kernels (`BackwardPrep`, `Backward`,
/// `BackwardDq`, `BackwardDkv`, `BackwardSinks`), FlashAttention-2's Algorithm 2 over a
/// fixed batch. With logits `S = scale · Q·Kᵀ`, `P = exp(S - LSE)` and
/// `delta = rowsum(dO ∘ O)`: `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ - delta)`,
/// `dQ = scale · dS·K`, `dK = scale · dSᵀ·Q`; query head `h` adds its share
/// to KV head `h / (heads / kv_heads)`. A softcap c makes the logits
/// `c · t` with `t = tanh(scale · q·k / c)` and multiplies dS by their
/// derivative `1 - t²`; ALiBi moves the logits, not the gradients; a sink
/// is in the LSE already, and its own gradient is `-Σ_rows exp(sink - LSE) ·
/// delta` (`BackwardSinks`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BwdParams {
    /// Q [B, Sq, H, D].
    pub q: u64,
    /// K [B, Skv, Hkv, D].
    pub k: u64,
    /// V [B, Skv, Hkv, D].
    pub v: u64,
    /// The forward's O [B, Sq, H, D].
    pub o: u64,
    /// dO [B, Sq, H, D]: the gradient of the loss with respect to O.
    pub d_o: u64,
    /// The forward's f32 LSE [B, H, Sq] (natural log; -inf: the row saw no key).
    pub lse: u64,
    /// dQ [B, Sq, H, D], written by `BackwardDq`.
    pub dq: u64,
    /// dK [B, Skv, Hkv, D].
    pub dk: u64,
    /// dV [B, Skv, Hkv, D].
    pub dv: u64,
    /// f32 [B, H, Sq, D] workspace, zeroed by the host: every `Backward`
    /// CTA adds its dS·K to it.
    pub dq_accum: u64,
    /// f32 [B, H, Sq] workspace: each row's `delta`.
    pub delta: u64,
    /// Element strides of `q`.
    pub q_strides: BshStrides,
    /// Element strides of `k`.
    pub k_strides: BshStrides,
    /// Element strides of `v`.
    pub v_strides: BshStrides,
    /// Element strides of `o`.
    pub o_strides: BshStrides,
    /// Element strides of `d_o`.
    pub do_strides: BshStrides,
    /// Element strides of `dq`.
    pub dq_strides: BshStrides,
    /// Element strides of `dk`.
    pub dk_strides: BshStrides,
    /// Element strides of `dv`.
    pub dv_strides: BshStrides,
    /// Sequences B.
    pub batch: u32,
    /// Query heads H.
    pub heads: u32,
    /// K/V heads Hkv (divides `heads`).
    pub kv_heads: u32,
    /// Query tokens per sequence.
    pub seqlen_q: u32,
    /// Keys per sequence.
    pub seqlen_k: u32,
    /// Head dim D (a multiple of 8): the row length of `BackwardPrep` and
    /// `BackwardDq`, which serve every head dim.
    pub head_dim: u32,
    /// The softmax scale applied to q·k.
    pub scale: f32,
    /// The logit factor (`scale`, or the softcap c: as
    /// [`AttnParams::softcap_pre`]) times log2(e): the kernels work in the
    /// exp2 domain.
    pub scale_log2: f32,
    /// As [`AttnParams::window_left`].
    pub window_left: i32,
    /// As [`AttnParams::window_right`].
    pub window_right: i32,
    /// As [`AttnParams::softcap_pre`]; 0 = off.
    pub softcap_pre: f32,
    /// As [`AttnParams::inv_scale`].
    pub inv_scale: f32,
    /// As [`AttnParams::alibi`]; 0 = off.
    pub alibi: u64,
    /// As [`AttnParams::alibi_batch_stride`].
    pub alibi_batch_stride: u32,
    /// As [`AttnParams::sinks`]: read by `BackwardSinks` only.
    pub sinks: u64,
    /// f32 `[heads]`: the sinks' gradients, written by `BackwardSinks`.
    pub d_sinks: u64,
    /// Varlen: i32 [B + 1] starts of each sequence in the packed rows of Q,
    /// O, dO and dQ (`cu_seqlens_q`) and of K, V, dK and dV (`cu_seqlens_k`),
    /// clamped to `total_q` / `total_k` as in [`AttnParams::cu_seqlens_q`];
    /// 0 = the dense layout. With them, `seqlen_q` and `seqlen_k` are the
    /// longest sequences (the grid's), the tensors' batch strides are
    /// unused, and the LSE, `delta` and the dQ buffer are [H, total_q] rows.
    pub cu_seqlens_q: u64,
    /// See `cu_seqlens_q`.
    pub cu_seqlens_k: u64,
    /// Packed query rows (varlen).
    pub total_q: u32,
    /// Packed key rows (varlen).
    pub total_k: u32,
    /// Parts each KV head's group of query heads is split into, a CTA each
    /// (grid.y = `kv_heads · head_splits`, 1 = none): more CTAs when the
    /// key blocks alone do not fill the GPU (GQA with a small batch). With
    /// more than one, each part writes dK and dV of its query heads to
    /// `dkv_parts` and `BackwardDkv` sums them.
    pub head_splits: u32,
    /// f32 [2, head_splits, key rows, Hkv, D] workspace (dK's parts, then
    /// dV's; key rows B · Skv, or `total_k` when packed), used when
    /// `head_splits > 1`.
    pub dkv_parts: u64,
}

/// A TMA tensor map (`CUtensorMap`), as `cuTensorMapEncodeTiled` writes it:
/// 128 opaque bytes. TMA needs it 64-byte aligned (CUDA 13's header declares
/// 128, and nvcc's PTX says `.align 128`); rustc's nvptx calling convention
/// rejects `align(64)` on a by-value kernel parameter (an internal compiler
/// error), so it is declared with 16 and the PTX build raises the
/// parameter's alignment (`artifacts::align_tensor_map_params`). The `tma`
/// probe reads maps both so and from a copy in global memory.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorMap(pub [u64; 16]);

/// Parameters of a `wgmma` probe: C = A·B in f32 for one 64 x K by K x N tile.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeGemmParams {
    /// A [64, K] row-major (K contiguous), f16 or bf16.
    pub a: u64,
    /// B: [N, K] row-major (K-major, as K in Q·Kᵀ) when `mode` is
    /// [`ProbeGemmParams::SS_K_MAJOR`]; [K, N] row-major (MN-major, as V in
    /// P·V) when it is [`ProbeGemmParams::RS_MN_MAJOR`].
    pub b: u64,
    /// f32 C [64, N] row-major.
    pub c: u64,
    /// Which `wgmma` form the probe runs.
    pub mode: u32,
}

impl ProbeGemmParams {
    /// A and B from shared memory, B K-major.
    pub const SS_K_MAJOR: u32 = 0;
    /// A from registers, B from shared memory, MN-major (`tnspB = 1`).
    pub const RS_MN_MAJOR: u32 = 1;
}

/// The tensor maps of a `tma` probe, its first (by-value) kernel parameter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeTmaMaps {
    /// Loads: `src` [S, H, D] as the 4-D tensor {D, S, H, 1}, box {64, rows, 1, 1}, 128-byte swizzle.
    pub load: TensorMap,
    /// Stores: `stored` [S, H, D], the same geometry.
    pub store: TensorMap,
}

/// Parameters of a `tma` probe; grid.x = H, one CTA per head.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeTmaParams {
    /// A copy of the maps in global memory (64-byte aligned), read when
    /// `map_source` is [`ProbeTmaParams::MAPS_GLOBAL`].
    pub maps_global: u64,
    /// [ceil(S / rows) * rows, H, D]: every tile as the threads read it from
    /// shared memory (un-swizzled), rows past S included (TMA fills them with zeros).
    pub copied: u64,
    /// Tokens S.
    pub seqlen: u32,
    /// Heads H.
    pub heads: u32,
    /// Rows per TMA box and tile (1..=256).
    pub rows: u32,
    /// Where the kernel reads the maps: one of the `MAPS_*` constants.
    pub map_source: u32,
}

impl ProbeTmaParams {
    /// The by-value parameter, through its generic address (`cvta.param`;
    /// its `.param` state-space address faults with a misaligned address).
    pub const MAPS_PARAM: u32 = 0;
    /// The copy at `maps_global`.
    pub const MAPS_GLOBAL: u32 = 1;
}

/// The tensor maps of a Hopper forward launch, its first (by-value) kernel
/// parameter: Q, K, V and O as 4-D tensors {D, S, H, B} (innermost first;
/// for packed sequences {D, total, H, 1}), boxes of {64, rows, 1, 1} with
/// the 128-byte swizzle, Q's box `block_m` rows, K's and V's `block_n` and
/// O's `WGMMA_M` (a consumer warpgroup's rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HopperFwdMaps {
    /// Q [B, Sq, H, D].
    pub q: TensorMap,
    /// K [B, Skv, Hkv, D].
    pub k: TensorMap,
    /// V [B, Skv, Hkv, D].
    pub v: TensorMap,
    /// O [B, Sq, H, Dv]: the dense lines store O with TMA (the map's bounds
    /// clip the rows past the sequence); zero and unused on the packed
    /// lines, which store row by row.
    pub o: TensorMap,
}
