//! The host API: one [`FlashAttention`] per context loads the PTX once, caches
//! every entry point, and launches after validation.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use cudarc::nvrtc::Ptx;
use flash_attn_kernels::config::{
    combine_groups, combine_shape, find_entry, find_hopper_backward, find_hopper_entry, AttnTile,
    BwdTile, Dtype, Entry, HopperBwdTile, HopperCall, HopperPick, KernelKind, MaskKind, Policies,
    PtxArch, ScoreKind, SeqKind, APPEND_THREADS, BWD_THREADS, CHUNK_ELEMS, COMBINE_SPLIT_GROUP,
    HOPPER_TAIL_WAVES, MAX_SPLITS, MERGE_THREADS, WGMMA_M,
};
use flash_attn_kernels::index::{backward_head_splits, paged_box_rows, FastDiv, TileGrid};
use flash_attn_kernels::params::{
    AppendParams, AttnParams, BshStrides, BwdParams, CombineParams, HopperFwdMaps, MergeParams,
    TensorMap,
};

use crate::error::FlashAttnError;
use crate::hopper::{self, encode_tensor_map, HopperModule, TiledTensor};
use crate::kernels::{cubins_for, ptx_text};
use crate::tensor::{AttnElement, Layout, TensorMut, TensorRef};
use crate::validate::{
    check_backward, check_backward_varlen, check_decode, check_dtype, check_forward, check_kvcache,
    check_merge, check_varlen, check_varlen_paged, AlibiSlopes, AttnOptions, BackwardOperands,
    DecodeShape, ForwardShape, KvCacheShape, Operands, Paging, TensorInfo, VarlenShape, Window,
};

/// Set to `sm_75` or `sm_80`, [`FlashAttention::new`] loads that module
/// instead of the GPU's own on any GPU that runs it (the driver JIT-compiles
/// its PTX on newer ones), without the Hopper module: how the GPU suite
/// checks the Turing module and the sm_80 module's 99 KB tiles on an H100.
/// It says nothing about a T4's or an A100's speed. Another value, or a
/// module newer than the GPU's own, is refused ([`module_for`]).
pub const MODULE_ENV: &str = "FLASH_ATTN_MODULE";

/// The module to load on a GPU whose own is `native`, given the value of
/// [`MODULE_ENV`]: `native` when unset, else the module it names if the GPU
/// runs it.
pub fn module_for(native: PtxArch, env: Option<&str>) -> Result<PtxArch, FlashAttnError> {
    let refused = FlashAttnError::Unsupported {
        what: "FLASH_ATTN_MODULE other than sm_75 or sm_80 (not newer than the GPU's own)",
        entry: "new",
    };
    let forced = match env {
        None => return Ok(native),
        Some("sm_75") => PtxArch::Sm75,
        Some("sm_80") => PtxArch::Sm80,
        Some(_) => return Err(refused),
    };
    match (forced, native) {
        (PtxArch::Sm80, PtxArch::Sm75) => Err(refused),
        _ => Ok(forced),
    }
}

/// Kernel parameters travel by value; the newtype lets cudarc push them.
#[repr(transparent)]
pub(crate) struct ByValue<T>(pub(crate) T);
// SAFETY: both parameter structs are #[repr(C)] plain data that the kernels
// declare as their single by-value parameter.
unsafe impl DeviceRepr for ByValue<AttnParams> {}
unsafe impl DeviceRepr for ByValue<CombineParams> {}
unsafe impl DeviceRepr for ByValue<AppendParams> {}
unsafe impl DeviceRepr for ByValue<MergeParams> {}
unsafe impl DeviceRepr for ByValue<BwdParams> {}

/// Shared memory a CTA may use without opting in.
const DEFAULT_SMEM_LIMIT: usize = 48 * 1024;
/// Each split should stream at least this many key blocks, or the partial
/// writes and the combine cost more than the parallelism gains.
const MIN_BLOCKS_PER_SPLIT: usize = 2;
/// Caches of fewer key blocks are not split: at 4 blocks one CTA per (batch,
/// KV head) beat 2 splits plus the combine by 5-24% (H100, v11).
const MIN_BLOCKS_TO_SPLIT: usize = 8;
/// The split model's constants, fitted to the H100 sweep of 1-64 splits
/// (docs/perf-notes.md, v11). Decode CTAs in flight per SM that saturate
/// HBM: more only add combine work.
const SATURATING_CTAS_PER_SM: f64 = 1.5;
/// Bytes per µs one decode CTA streams while HBM is not the limit.
const CTA_BYTES_PER_US: f64 = 20_000.0;
/// The combine kernel's launch gap, and the memory latency each row pays per
/// round of chunks of [`COMBINE_SPLIT_GROUP`] splits (a round: one chunk for
/// each of the row's thread groups, `config::combine_shape`).
const COMBINE_LAUNCH_US: f64 = 1.0;
const COMBINE_GROUP_US: f64 = 2.0;
/// The least predicted gain that pays for more splits. Each split adds CTAs,
/// partial writes and combine reads that the model does not charge: on the
/// H200 sweeps (v57, v58) the least-time count put SmolLM 9/3 (D = 64) at 128
/// splits for B = 1 L = 16k and 32 for B = 4 L = 4k, predicted 1.6 % faster
/// than half as many and measured 1.05-1.08x slower. This margin moves
/// those four cells (with 4 new tokens too) and no other of the sweeps.
const SPLIT_MIN_GAIN: f64 = 0.02;
const MAX_GRID_YZ: usize = 65_535;
/// Key blocks per CTA up to which a grid whose CTAs are all resident at the
/// deepest ring's footprint takes that ring, though its K/V streams
/// outnumber the SMs: such a CTA's time is mostly its first blocks' round
/// trips, which the busy ring (one block in flight at two stages) pays one
/// after another. H200 (v65): the 256-key rows of 256 CTAs at 2 per SM
/// (B = 32 GQA 32/8 at D = 128 and 256, MHA at B = 8) 1.02-1.035x at three
/// stages; at 1k keys (16-32 blocks) 0.996-1.003x, at 4k-64k 0.986-0.996x.
const SHORT_CTA_BLOCKS: usize = 8;

/// KV heads a decode CTA folds into one where [`kv_fold`] allows it.
const KV_FOLD: usize = 2;
/// Head dims whose decode folds: `KV_FOLD` x each is a compiled decode head
/// dim, and the fold measured faster (v68).
const FOLD_HEAD_DIMS: [usize; 3] = [32, 64, 96];

/// Whether decode launches fold pairs of adjacent KV heads into one
/// ([`FlashAttention::set_kv_fold`]): each CTA then reads two heads' K/V
/// rows as one row of twice the head dim, its query rows zero in the other
/// head's half. The result is the same; the reads are longer (faster from
/// HBM at head dims up to 96 in full grids, v68). One difference: a
/// non-finite K element (inf or NaN) of one head of a pair also makes the
/// other head's scores of that key NaN (zero times it), where unfolded only
/// its own head's; [`KvFold::Off`] keeps the heads apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum KvFold {
    /// On the `sm_90` module (where it was measured), for calls with at
    /// least one K/V stream (batch x KV head) per two SMs, among those that
    /// allow it: 16-bit, heads adjacent (head stride = head dim), a head dim
    /// of 32, 64 or 96, an even KV head count, and at most 8 query rows (new
    /// tokens x query heads) per KV head.
    #[default]
    Auto,
    /// Never.
    Off,
    /// Wherever the call allows it: the rule's other conditions waived.
    On,
}

struct Kernel {
    function: CudaFunction,
    entry: &'static Entry,
    /// The module it was loaded from, which sizes its tile.
    arch: PtxArch,
    /// Resident CTAs per SM at the entry's threads and shared memory.
    ctas_per_sm: usize,
}

impl Kernel {
    /// The attention tile (forward and decode entries only).
    fn tile(&self) -> AttnTile {
        self.entry.tile(self.arch)
    }
    fn threads(&self) -> usize {
        self.entry.threads(self.arch)
    }
    fn smem_bytes(&self) -> usize {
        self.entry.smem_bytes(self.arch)
    }
}

/// Loaded kernels for one CUDA context.
pub struct FlashAttention {
    ctx: Arc<CudaContext>,
    kernels: HashMap<&'static str, Kernel>,
    num_sms: usize,
    compute_capability: (i32, i32),
    arch: PtxArch,
    loaded: LoadedCode,
    /// The `Sm90a` module, on compute capability 9.0 unless
    /// [`hopper::FORCE_SM80_ENV`] is set.
    hopper: Option<HopperModule>,
    /// Whether forward calls that a Hopper entry covers use it.
    hopper_forward: AtomicBool,
    /// Whether backward calls that a Hopper entry covers use it.
    hopper_backward: AtomicBool,
    /// Whether persistent Hopper launches walk the static tile order
    /// instead of claiming tiles from a counter.
    static_tiles: AtomicBool,
    /// Whether a decode step's later kernels (decode after an append, the
    /// split-KV combine) are programmatic dependent launches.
    programmatic_launch: AtomicBool,
    /// A [`KvFold`] as its `u8`.
    kv_fold: AtomicU8,
    /// The backward's forced head splits; 0 = chosen per call.
    bwd_head_splits: AtomicU32,
}

/// How a decode launch is split and buffered.
struct DecodePlan {
    /// KV heads each CTA reads as one ([`kv_fold`]); the other fields are
    /// the folded launch's.
    fold: usize,
    splits: usize,
    stages: usize,
    /// Whether the combine may be a programmatic dependent launch: not where
    /// one KV head's rows take several row tiles, whose CTAs read the same
    /// K/V; there it measured 0.935-0.965x on short split rows (Qwen 28/4
    /// with 4 new tokens, H200, v58), as the solo ring did in v57.
    programmatic_combine: bool,
    /// CTAs of the decode grid, and how many of them one SM holds.
    grid_ctas: usize,
    ctas_per_sm: usize,
}

/// The code [`FlashAttention`] loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadedCode {
    /// An embedded cubin: `sm_XY/ptxas-VERSION`.
    Cubin(&'static str),
    /// The PTX module for this `target-cpu`, JIT-compiled by the driver.
    Ptx(&'static str),
}

/// The append kernel's name; it is dtype and head-dim agnostic.
const APPEND_ENTRY: &str = "flash_append_kv";

/// The tensors an attention call reads. `k` and `v` may be the same tensor
/// (a fused KV buffer seen through two layouts, or one tensor twice).
pub struct Qkv<'a, T> {
    /// [B, Sq, H, D]; [`Layout::packed`] [total_q, H, D] for the varlen calls.
    pub q: &'a TensorRef<'a, T>,
    /// [B, Skv, Hkv, D]: the keys, the K cache of [`FlashAttention::decode`],
    /// packed [total_k, Hkv, D] for [`FlashAttention::forward_varlen`], a page
    /// pool for [`FlashAttention::forward_varlen_paged`].
    pub k: &'a TensorRef<'a, T>,
    /// Like `k`, with V's head dim.
    pub v: &'a TensorRef<'a, T>,
}

// Clone and Copy by hand here and below: a derive would ask `T: Copy`, and
// the fields are references.
impl<T> Clone for Qkv<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Qkv<'_, T> {}

/// What an attention call writes: O and, when asked for, the f32
/// log-sum-exp (natural log) of each query row. A call refused by
/// validation leaves both untouched.
pub struct Out<'a, T> {
    /// Q's shape with V's head dim.
    pub o: TensorMut<'a, T>,
    /// [B, H, Sq] ([H, total_q] for the varlen calls), or `None`.
    pub lse: Option<CudaViewMut<'a, f32>>,
}

impl<'a, T> Out<'a, T> {
    /// O alone.
    pub fn new(o: TensorMut<'a, T>) -> Self {
        Self { o, lse: None }
    }

    /// O and the log-sum-exp.
    pub fn with_lse(o: TensorMut<'a, T>, lse: CudaViewMut<'a, f32>) -> Self {
        Self { o, lse: Some(lse) }
    }
}

/// What [`FlashAttention::backward`] reads besides Q, K and V: the forward
/// call's O and LSE (asked for with [`Out::with_lse`]), and dO.
pub struct BackwardInputs<'a, T> {
    /// The forward's O [B, Sq, H, D].
    pub o: &'a TensorRef<'a, T>,
    /// The forward's f32 LSE [B, H, Sq] (natural log).
    pub lse: &'a CudaView<'a, f32>,
    /// dO [B, Sq, H, D]: the gradient of the loss with respect to O.
    pub d_o: &'a TensorRef<'a, T>,
}

impl<T> Clone for BackwardInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for BackwardInputs<'_, T> {}

/// What [`FlashAttention::backward`] writes: the gradients of Q, K and V,
/// each shaped (any one-to-one strides) like its tensor, and optionally the
/// sinks'.
pub struct Grads<'a, T> {
    /// dQ [B, Sq, H, D].
    pub dq: TensorMut<'a, T>,
    /// dK [B, Skv, Hkv, D].
    pub dk: TensorMut<'a, T>,
    /// dV [B, Skv, Hkv, D].
    pub dv: TensorMut<'a, T>,
    /// f32 `[H]`: the gradient of the loss with respect to each head's sink
    /// logit (`AttnOptions::sinks`, which it needs), summed over the batch
    /// and the head's rows; overwritten, as the other gradients are.
    pub d_sinks: Option<CudaViewMut<'a, f32>>,
}

impl<'a, T> Grads<'a, T> {
    /// dQ, dK and dV.
    pub fn new(dq: TensorMut<'a, T>, dk: TensorMut<'a, T>, dv: TensorMut<'a, T>) -> Self {
        Self {
            dq,
            dk,
            dv,
            d_sinks: None,
        }
    }

    /// The sinks' gradient too.
    pub fn with_sinks(self, d_sinks: CudaViewMut<'a, f32>) -> Self {
        Self {
            d_sinks: Some(d_sinks),
            ..self
        }
    }
}

/// One attention state for [`FlashAttention::merge_states`]: O over some set
/// of keys, [B, S, H, D], and its f32 log-sum-exp [B, H, S].
pub struct State<'a, T> {
    /// The attention output over the state's keys.
    pub o: &'a TensorRef<'a, T>,
    /// Its log-sum-exp (natural log; -inf for a row that saw no key).
    pub lse: &'a CudaView<'a, f32>,
}

impl<T> Clone for State<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for State<'_, T> {}

/// The new tokens of a [`FlashAttention::decode_kvcache`] step.
pub struct DecodeStep<'a, T> {
    /// Queries [B, Snew, H, D].
    pub q: &'a TensorRef<'a, T>,
    /// (K_new, V_new) [B, Snew, Hkv, D], appended to the cache before
    /// attending; `None` when the cache already holds them.
    pub new_kv: Option<(&'a TensorRef<'a, T>, &'a TensorRef<'a, T>)>,
}

impl<T> Clone for DecodeStep<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DecodeStep<'_, T> {}

/// A KV cache for [`FlashAttention::decode_kvcache`].
pub struct KvCache<'a, T> {
    /// Contiguous [B, Lmax, Hkv, D], or with `block_table` a page pool
    /// [num_pages, page_size, Hkv, D].
    pub k: TensorMut<'a, T>,
    /// Like `k`.
    pub v: TensorMut<'a, T>,
    /// i32 `[B]` on the device: tokens already in the cache per sequence.
    pub seqlens: CudaView<'a, i32>,
    /// The page table when `k`/`v` are page pools.
    pub block_table: Option<BlockTable<'a>>,
}

/// Page table of a paged KV cache: i32 [B, max_pages] on the device, row-major;
/// entry (b, i) is the pool page holding tokens `i * page_size..` of sequence b.
pub struct BlockTable<'a> {
    /// i32 [B, max_pages], row-major.
    pub table: CudaView<'a, i32>,
    /// Pages per sequence: the row length of `table`.
    pub max_pages: usize,
}

/// The sequence boundaries of a varlen call (FlashAttention's
/// `cu_seqlens_q`, `cu_seqlens_k`, `max_seqlen_q`, `max_seqlen_k`).
pub struct Varlen<'a> {
    /// i32 [B + 1] on the device: sequence `b` owns packed rows
    /// `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of Q and O.
    pub cu_seqlens_q: &'a CudaView<'a, i32>,
    /// i32 [B + 1] on the device, likewise for K and V.
    pub cu_seqlens_k: &'a CudaView<'a, i32>,
    /// The longest query sequence: the grid covers this many rows per sequence.
    pub max_seqlen_q: usize,
    /// The longest key sequence (at most the packed K/V rows).
    pub max_seqlen_k: usize,
}

/// Packed queries against a paged KV cache (chunked prefill, as vLLM and
/// FlashAttention's varlen with `block_table` run it): query sequence `b`
/// owns rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of Q and O, and its keys
/// are the first `seqlens_k[b]` tokens of the cache pages listed in row `b`
/// of the block table, the new chunk's own K/V included (written into the
/// cache beforehand).
pub struct PagedVarlen<'a> {
    /// i32 [B + 1] on the device.
    pub cu_seqlens_q: &'a CudaView<'a, i32>,
    /// The longest query sequence: the grid covers this many rows per sequence.
    pub max_seqlen_q: usize,
    /// i32 `[B]` on the device: keys per sequence, each clamped by the kernel
    /// to `max_pages x page_size`.
    pub seqlens_k: &'a CudaView<'a, i32>,
    /// The page table of the K/V pools.
    pub block_table: &'a BlockTable<'a>,
}

/// Device addresses and row counts of packed (varlen) sequences; with
/// `paged` (block table, geometry), K/V are a page pool and `cu_seqlens_k`
/// points to i32 [B] key counts (see `AttnParams::cu_seqlens_q`).
#[derive(Clone, Copy, Default)]
struct Packed {
    cu_seqlens_q: u64,
    cu_seqlens_k: u64,
    total_q: usize,
    total_k: usize,
    /// The host's bound on a sequence's keys (the Hopper dispatch's length).
    max_seqlen_k: usize,
    paged: Option<(u64, Paging)>,
}

/// Validated device pointers and element strides of one decode call.
struct DecodeCall {
    q: (u64, BshStrides),
    k: (u64, BshStrides),
    v: (u64, BshStrides),
    o: (u64, BshStrides),
    /// 0 when no LSE is asked for.
    lse: u64,
    seqlens: u64,
    block_table: u64,
    cache: KvCacheShape,
}

impl DecodeCall {
    /// Whether K's and V's heads are adjacent ([`heads_adjacent`]).
    fn heads_adjacent<T: AttnElement>(&self) -> bool {
        heads_adjacent::<T>(&self.k.1, &self.v.1, self.cache.decode.head_dim)
    }
}

/// Whether each K/V row's heads follow one another (head stride = head dim,
/// in the kernels' 16-bit units), so adjacent heads read as one ([`kv_fold`]).
fn heads_adjacent<T: AttnElement>(k: &BshStrides, v: &BshStrides, head_dim: usize) -> bool {
    let row = (head_dim * size_of::<T>() / 2) as i64;
    k.head == row && v.head == row
}

/// The decode entry's policies for a launch of `need` that folds `fold` KV
/// heads into one: the `SeqKind::Folded` entries where it folds.
fn folded_policies(need: Policies, fold: usize) -> Policies {
    if fold == KV_FOLD {
        Policies {
            seq: SeqKind::Folded,
            ..need
        }
    } else {
        need
    }
}

/// `shape` as a launch that folds `fold` adjacent KV heads into one sees it.
fn folded(shape: &DecodeShape, fold: usize) -> DecodeShape {
    DecodeShape {
        kv_heads: shape.kv_heads / fold,
        head_dim: shape.head_dim * fold,
        ..*shape
    }
}

/// f32 scratch for split-KV decode partials. Allocate once with
/// [`FlashAttention::decode_workspace`] and reuse it, e.g. across CUDA-graph replays.
pub struct DecodeWorkspace {
    o_accum: CudaSlice<f32>,
    lse_accum: CudaSlice<f32>,
}

/// A tensor's strides as the kernels take them: in 16-bit units, so an f32
/// tensor's element strides are doubled (`params::BshStrides`).
fn strides<T: AttnElement>(l: &Layout) -> BshStrides {
    let units = (size_of::<T>() / 2) as i64;
    BshStrides {
        batch: l.strides[0] as i64 * units,
        row: l.strides[1] as i64 * units,
        head: l.strides[2] as i64 * units,
    }
}

/// The device address of an optional output (0, which the kernels read as
/// "not requested", when absent) and the guard that orders it on `stream`.
fn optional_ptr_mut<'a>(
    out: Option<&'a mut CudaViewMut<'_, f32>>,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    match out {
        Some(view) => view.device_ptr_mut(stream),
        None => (0, SyncOnDrop::Record(None)),
    }
}

fn info(layout: Layout, len: usize, addr: u64) -> TensorInfo {
    TensorInfo { layout, len, addr }
}

/// A validated tensor's address and strides as a decode launch takes them.
fn addressed<T: AttnElement>(t: &TensorInfo) -> (u64, BshStrides) {
    (t.addr, strides::<T>(&t.layout))
}

/// The tensors of a call as the checks and the launch see them, with the
/// guards that order their buffers on the stream.
struct Bound<'a> {
    ops: Operands,
    /// The LSE's device address; 0 (which the kernels read as "not
    /// requested") when none is asked for.
    lse: u64,
    _guards: [SyncOnDrop<'a>; 5],
}

fn bind<'a, T: AttnElement>(
    stream: &'a CudaStream,
    Qkv { q, k, v }: Qkv<'a, T>,
    out: &'a mut Out<'_, T>,
) -> Bound<'a> {
    let (q_ptr, q_sync) = q.data.device_ptr(stream);
    let (k_ptr, k_sync) = k.data.device_ptr(stream);
    let (v_ptr, v_sync) = v.data.device_ptr(stream);
    let (o_len, o_layout) = (out.o.data.len(), out.o.layout);
    let (o_ptr, o_sync) = out.o.data.device_ptr_mut(stream);
    let lse_len = out.lse.as_ref().map(|l| l.len());
    let (lse, lse_sync) = optional_ptr_mut(out.lse.as_mut(), stream);
    Bound {
        ops: Operands {
            q: info(q.layout, q.data.len(), q_ptr),
            k: info(k.layout, k.data.len(), k_ptr),
            v: info(v.layout, v.data.len(), v_ptr),
            o: info(o_layout, o_len, o_ptr),
            lse_len,
        },
        lse,
        _guards: [q_sync, k_sync, v_sync, o_sync, lse_sync],
    }
}

/// A window bound as the kernels take it: negative = unbounded; bounds past
/// any sequence length are equivalent to i32::MAX.
fn window_bound(bound: Option<usize>) -> i32 {
    bound.map_or(-1, |b| b.min(i32::MAX as usize) as i32)
}

/// The mask policy a window needs.
fn mask_kind(window: Window) -> MaskKind {
    match (window.left, window.right) {
        (None, None) => MaskKind::Full,
        (None, Some(0)) => MaskKind::Causal,
        _ => MaskKind::Local,
    }
}

/// The policies of a call and their launch parameters (in `AttnParams`'
/// fields; the rest default), with the guards that order the option
/// tensors on the stream.
struct PolicyArgs<'a> {
    need: Policies,
    params: AttnParams,
    _guards: [SyncOnDrop<'a>; 2],
}

fn policy_args<'a>(
    opts: &'a AttnOptions<'a>,
    mask: Window,
    scale: f32,
    heads: usize,
    seq: SeqKind,
    stream: &'a CudaStream,
) -> PolicyArgs<'a> {
    let (alibi, alibi_batch_stride, alibi_guard) = match opts.alibi_slopes {
        None => (0, 0, SyncOnDrop::Record(None)),
        Some(AlibiSlopes::PerHead(v)) => {
            let (ptr, guard) = v.device_ptr(stream);
            (ptr, 0, guard)
        }
        Some(AlibiSlopes::PerBatchHead(v)) => {
            let (ptr, guard) = v.device_ptr(stream);
            (ptr, heads as u32, guard)
        }
    };
    let (sinks, sinks_guard) = match opts.sinks {
        Some(v) => v.device_ptr(stream),
        None => (0, SyncOnDrop::Record(None)),
    };
    // With a softcap the kernel's S is tanh(scale · q·k / c), which c turns
    // into logits: c takes the softmax scale's place as the logit factor.
    let softcap_pre = opts.softcap.map_or(0.0, |c| scale / c);
    let logit_factor = opts.softcap.unwrap_or(scale);
    let modified = opts.softcap.is_some() || alibi != 0 || sinks != 0;
    PolicyArgs {
        need: Policies {
            mask: mask_kind(mask),
            score: if modified {
                ScoreKind::Modified
            } else {
                ScoreKind::Plain
            },
            seq,
        },
        params: AttnParams {
            window_left: window_bound(mask.left),
            window_right: window_bound(mask.right),
            softcap_pre,
            alibi,
            alibi_batch_stride,
            inv_scale: 1.0 / logit_factor,
            sinks,
            scale_log2: logit_factor * std::f32::consts::LOG2_E,
            ..Default::default()
        },
        _guards: [alibi_guard, sinks_guard],
    }
}

/// The largest span K = c · log2(e) of a softcap's logits (log2 units) for
/// which the forward softmax holds m at 0 instead of a running row max
/// (`AttnParams::fixed_max`; c up to 51.98, so Gemma 2's 50 and Grok's 30).
/// Every P = 2^logit then lies in (2^-75, 2^75):
/// - P is f32 and bf16 at full relative precision: both hold 2^-126 to
///   2^128 (f16, at most 2^16, cannot: f16 and f32 inputs keep the max);
/// - the P below 2^-126 that `ex2.approx.ftz` flushes to 0 lose at most
///   Skv · 2^-126 of a row sum that is above 2^-75, 2^-24 of it for Skv
///   below 2^27 keys;
/// - l and O's f32 accumulators stay below Skv · max|V| · 2^75, finite for
///   Skv · max|V| < 2^53 (a million keys with |V| below 8.6e9; the online
///   max's bound, P <= 2^8, is Skv · max|V| < 2^120).
const FIXED_MAX_LOG2_SPAN: f32 = 75.0;

/// Whether a forward call's softmax holds its max fixed: bf16 (P's
/// exponent range), a softcap whose span is within
/// [`FIXED_MAX_LOG2_SPAN`], and no ALiBi (whose bias has no lower bound).
/// Without the row max, a capped key block skips the max, the shuffles and
/// the lazy rescale (H200, D = 128, B = 4, S = 4k, over the plain row: the
/// `mma.sync` kernels +0.4 % causal and +7.0 % non-causal, against f16's
/// +8-12 %; the Hopper lines +22.0 % and +17.6 %, against f16's +23-33 %;
/// docs/perf-notes.md, v51).
fn softmax_max_fixed(dtype: Dtype, softcap: Option<f32>, alibi: bool) -> bool {
    dtype == Dtype::Bf16
        && !alibi
        && softcap.is_some_and(|c| c * std::f32::consts::LOG2_E <= FIXED_MAX_LOG2_SPAN)
}

/// Which code [`FlashAttention::new_with`] loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ModuleChoice {
    /// The embedded cubins for the device, in order ([`crate::cubins_for`];
    /// no JIT), then the PTX if the driver refuses them all or there are none.
    #[default]
    PreferCubin,
    /// Always the PTX, JIT-compiled by the driver (slow the first time in a
    /// process without a warm driver cache; compares the driver's compiler
    /// with the pinned ptxas).
    Ptx,
}

/// `arch`'s module for the context's device: the embedded cubins in order
/// (with `PreferCubin`), then the PTX. A driver too old for a cubin refuses
/// it; the next candidate, and last the PTX, follow.
pub(crate) fn load_module(
    ctx: &Arc<CudaContext>,
    arch: PtxArch,
    choice: ModuleChoice,
) -> Result<(Arc<CudaModule>, LoadedCode), FlashAttnError> {
    let (major, minor) = ctx.compute_capability()?;
    let cubins = match choice {
        ModuleChoice::PreferCubin => cubins_for(arch, major, minor),
        ModuleChoice::Ptx => Vec::new(),
    };
    let cubin = cubins.iter().find_map(|&(name, cubin)| {
        let module = ctx.load_module(Ptx::from_binary(cubin.unpack())).ok()?;
        Some((module, LoadedCode::Cubin(name)))
    });
    match cubin {
        Some(loaded) => Ok(loaded),
        None => Ok((
            ctx.load_module(Ptx::from_src(ptx_text(arch)))?,
            LoadedCode::Ptx(arch.target_cpu()),
        )),
    }
}

/// `arch`'s module for the context's device ([`load_module`]) and a kernel
/// for each of its entries, with its shared-memory limit raised where the
/// tile needs more than the default and its occupancy.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    arch: PtxArch,
    choice: ModuleChoice,
) -> Result<(HashMap<&'static str, Kernel>, LoadedCode), FlashAttnError> {
    let (module, loaded) = load_module(ctx, arch, choice)?;
    let mut kernels = HashMap::new();
    for entry in arch.entries() {
        let function = module
            .load_function(entry.name)
            .map_err(|_| FlashAttnError::MissingKernel(entry.name))?;
        let smem = entry.smem_bytes(arch);
        if smem > DEFAULT_SMEM_LIMIT {
            function.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let ctas_per_sm = function.occupancy_max_active_blocks_per_multiprocessor(
            entry.threads(arch) as u32,
            smem,
            None,
        )? as usize;
        kernels.insert(
            entry.name,
            Kernel {
                function,
                entry,
                arch,
                ctas_per_sm: ctas_per_sm.max(1),
            },
        );
    }
    Ok((kernels, loaded))
}

impl FlashAttention {
    /// Loads the kernels for the context's device (its cubin when this build
    /// has one, else the PTX) and caches every entry point. Fails with
    /// [`FlashAttnError::UnsupportedArch`] below sm_75. With
    /// [`MODULE_ENV`] it loads an older module (JIT-compiled from PTX on
    /// newer GPUs), or fails with [`FlashAttnError::Unsupported`] on a value
    /// that names none the GPU runs.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, FlashAttnError> {
        Self::new_with(ctx, ModuleChoice::PreferCubin)
    }

    /// [`Self::new`] with the choice of code spelled out.
    pub fn new_with(ctx: &Arc<CudaContext>, choice: ModuleChoice) -> Result<Self, FlashAttnError> {
        let (major, minor) = ctx.compute_capability()?;
        let smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let native = PtxArch::for_device(major, minor, smem_optin.max(0) as usize)
            .ok_or(FlashAttnError::UnsupportedArch { major, minor })?;
        let env = std::env::var(MODULE_ENV).ok();
        let arch = module_for(native, env.as_deref())?;
        let num_sms =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let want_hopper = !(hopper::forced_off() || arch != native);
        // The Hopper module unpacks and loads on a thread of its own while
        // this one does: unpacking the two cubins is most of `new` on Hopper
        // since the kernels are embedded as zstd frames (docs/perf-notes.md, v69).
        let (main, hopper) = std::thread::scope(|s| {
            let hopper = s.spawn(|| match want_hopper {
                true => ctx
                    .bind_to_thread()
                    .map_err(FlashAttnError::from)
                    .and_then(|()| HopperModule::load(ctx, choice)),
                false => Ok(None),
            });
            let main = load_kernels(ctx, arch, choice);
            let hopper = hopper
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (main, hopper)
        });
        let (kernels, loaded) = main?;
        let hopper = hopper?;
        Ok(FlashAttention {
            ctx: ctx.clone(),
            kernels,
            num_sms,
            compute_capability: (major, minor),
            arch,
            loaded,
            hopper_forward: AtomicBool::new(hopper.is_some()),
            hopper_backward: AtomicBool::new(hopper.is_some()),
            hopper,
            static_tiles: AtomicBool::new(false),
            programmatic_launch: AtomicBool::new(arch == PtxArch::Sm90),
            kv_fold: AtomicU8::new(KvFold::Auto as u8),
            bwd_head_splits: AtomicU32::new(0),
        })
    }

    /// Whether forward calls run on the Hopper kernels (`wgmma` + TMA,
    /// compute capability 9.0) where one covers the call; the others, and
    /// every call on other GPUs, run on the `mma.sync` kernels.
    pub fn hopper_forward(&self) -> bool {
        self.hopper_forward.load(Ordering::Relaxed)
    }

    /// Switches the Hopper forward of this instance off (to compare both
    /// paths in one process) or back on, for the calls issued after it;
    /// without the Hopper module (another GPU, or
    /// [`hopper::FORCE_SM80_ENV`]) it stays off.
    pub fn set_hopper_forward(&self, on: bool) {
        self.hopper_forward
            .store(on && self.hopper.is_some(), Ordering::Relaxed);
    }

    /// Whether backward calls run their key-block kernel on `wgmma`
    /// (compute capability 9.0, head dims in [`HOPPER_BWD_HEAD_DIMS`]); the
    /// others, and every call on other GPUs, run the `mma.sync` one.
    ///
    /// [`HOPPER_BWD_HEAD_DIMS`]: flash_attn_kernels::config::HOPPER_BWD_HEAD_DIMS
    pub fn hopper_backward(&self) -> bool {
        self.hopper_backward.load(Ordering::Relaxed)
    }

    /// As [`Self::set_hopper_forward`], for the backward's key-block kernel.
    pub fn set_hopper_backward(&self, on: bool) {
        self.hopper_backward
            .store(on && self.hopper.is_some(), Ordering::Relaxed);
    }

    /// Makes this instance's persistent Hopper launches walk the static
    /// tile order (`index::persistent_step`), which they otherwise take only
    /// once the counters for graph-captured launches run out, or claim
    /// tiles from a counter again: to test and compare both orders. Not
    /// part of the supported API.
    #[doc(hidden)]
    pub fn set_static_tile_order(&self, on: bool) {
        self.static_tiles.store(on, Ordering::Relaxed);
    }

    /// Whether a decode step's later kernels are launched as programmatic
    /// dependents of the kernel before them (the default on the `sm_90`
    /// module, Hopper and newer): the decode kernel after
    /// [`Self::decode_kvcache`]'s append, and the split-KV combine after the
    /// decode kernel. Each is scheduled while the grid before it still runs
    /// and waits in the kernel (`griddepcontrol.wait`) before it reads that
    /// grid's output, so the launch gap between the two overlaps the first
    /// one's tail. Calls whose KV heads' query rows take several row tiles
    /// launch the combine plainly either way.
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic_launch.load(Ordering::Relaxed)
    }

    /// Switches the programmatic launches off (plain launches, to compare
    /// both in one process) or back on, for the decode calls issued after
    /// it; below the `sm_90` module they stay off (no `griddepcontrol`).
    pub fn set_programmatic_launch(&self, on: bool) {
        self.programmatic_launch
            .store(on && self.arch == PtxArch::Sm90, Ordering::Relaxed);
    }

    /// Whether decode launches fold pairs of adjacent KV heads into one
    /// ([`KvFold`]; default [`KvFold::Auto`]).
    pub fn kv_fold(&self) -> KvFold {
        match self.kv_fold.load(Ordering::Relaxed) {
            x if x == KvFold::Off as u8 => KvFold::Off,
            x if x == KvFold::On as u8 => KvFold::On,
            _ => KvFold::Auto,
        }
    }

    /// Sets how the decode calls issued after it fold KV heads: to compare
    /// both in one process, or to test the folded kernels on any call that
    /// allows them. A fold changes the split count: a workspace from
    /// [`Self::decode_workspace`] before the change may be too small after
    /// it (refused with [`FlashAttnError::WorkspaceTooSmall`]).
    pub fn set_kv_fold(&self, mode: KvFold) {
        self.kv_fold.store(mode as u8, Ordering::Relaxed);
    }

    /// How the backward calls issued after it split each KV head's query
    /// heads across CTAs: `None` (the default) chooses per call (more CTAs
    /// when the key blocks alone fill fewer than four waves: GQA/MQA with a
    /// small batch), `Some(n)` takes the largest divisor of the group size
    /// up to `n` (1: never split). To compare both, or to test the split
    /// path on any call. The result is the same either way, up to f32
    /// rounding of dK and dV's sums.
    pub fn set_backward_head_splits(&self, splits: Option<usize>) {
        let n = splits.map_or(0, |n| n.clamp(1, u32::MAX as usize) as u32);
        self.bwd_head_splits.store(n, Ordering::Relaxed);
    }

    /// See [`Self::set_backward_head_splits`].
    pub fn backward_head_splits(&self) -> Option<usize> {
        match self.bwd_head_splits.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n as usize),
        }
    }

    /// The CUDA context the kernels were loaded into.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }
    /// The PTX module loaded for this device.
    pub fn ptx_arch(&self) -> PtxArch {
        self.arch
    }
    /// Whether machine code or PTX (JIT-compiled by the driver) was loaded.
    pub fn loaded_code(&self) -> LoadedCode {
        self.loaded
    }
    /// Likewise for the Hopper module; `None` when it is not loaded (not
    /// compute capability 9.0, or `FLASH_ATTN_FORCE_SM80=1`).
    pub fn hopper_loaded_code(&self) -> Option<LoadedCode> {
        self.hopper.as_ref().map(|h| h.loaded)
    }
    /// The device's streaming multiprocessors.
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }

    fn kernel_named(&self, name: &str) -> &Kernel {
        &self.kernels[name]
    }

    /// The most specialised kernel of `kind` whose policies cover `need`.
    /// Every public call checks its dtype against the module first
    /// ([`check_dtype`]), and the config tests check that the table covers
    /// every validated problem.
    fn kernel(&self, kind: KernelKind, dtype: Dtype, head_dim: usize, need: Policies) -> &Kernel {
        let entry = find_entry(kind, dtype, head_dim, need)
            .expect("every validated problem has an entry (config tests check the table)");
        &self.kernels[entry.name]
    }

    /// Attention over full sequences: `o = softmax(scale · q·kᵀ [+ mask]) · v`.
    ///
    /// Q and O are [B, Sq, H, D], K and V [B, Skv, Hkv, D] with any strides
    /// whose last dimension is contiguous. `out.lse`, if given, receives the f32
    /// log-sum-exp [B, H, Sq] (natural log). Nothing is launched, and `out.o` and
    /// `out.lse` stay untouched, when validation fails.
    pub fn forward<T: AttnElement>(
        &self,
        stream: &CudaStream,
        qkv: Qkv<'_, T>,
        mut out: Out<'_, T>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        check_dtype(self.arch, T::DTYPE, &[KernelKind::Forward], "forward")?;
        let t = bind(stream, qkv, &mut out);
        let shape = check_forward(&t.ops, opts)?;
        self.launch_forward::<T>(stream, &t, &shape, None, opts)
    }

    /// Attention over variable-length sequences packed without padding
    /// (FlashAttention's `flash_attn_varlen_func`): Q and O are [total_q, H,
    /// D], K and V [total_k, Hkv, D], given as [`Layout::packed`] layouts
    /// ([1, total, heads, head_dim], any row and head strides); sequence `b`
    /// owns rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of Q and likewise of
    /// K/V, each with its own bottom-right-aligned mask. `out.lse`, if given, is
    /// f32 [H, total_q]. The `cu_seqlens` live on the device: each range is
    /// clamped to the packed tensors, and rows of a sequence past
    /// `max_seqlen_q` are not written.
    ///
    /// Three prompts of 100, 7 and 2000 tokens in one causal call:
    ///
    /// ```no_run
    /// use flash_attn::{AttnOptions, FlashAttention, Layout, Out, Qkv, TensorMut, TensorRef, Varlen};
    /// use cudarc::driver::CudaContext;
    /// use half::bf16;
    ///
    /// let ctx = CudaContext::new(0)?;
    /// let stream = ctx.default_stream();
    /// let fa = FlashAttention::new(&ctx)?;
    /// let (h, hkv, d) = (16, 4, 64);
    /// let cu = stream.clone_htod(&[0i32, 100, 107, 2107])?;
    /// let total = 2107;
    /// let q = stream.alloc_zeros::<bf16>(total * h * d)?;
    /// let kv = stream.alloc_zeros::<bf16>(total * hkv * d)?;
    /// let mut o = stream.alloc_zeros::<bf16>(total * h * d)?;
    /// let (q_layout, kv_layout) = (Layout::packed([total, h, d]), Layout::packed([total, hkv, d]));
    /// let kv_ref = TensorRef::new(kv.as_view(), kv_layout);
    /// fa.forward_varlen(
    ///     &stream,
    ///     Qkv { q: &TensorRef::new(q.as_view(), q_layout), k: &kv_ref, v: &kv_ref },
    ///     Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
    ///     &Varlen { cu_seqlens_q: &cu.as_view(), cu_seqlens_k: &cu.as_view(), max_seqlen_q: 2000, max_seqlen_k: 2000 },
    ///     &AttnOptions { causal: true, ..Default::default() },
    /// )?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_varlen<T: AttnElement>(
        &self,
        stream: &CudaStream,
        qkv: Qkv<'_, T>,
        mut out: Out<'_, T>,
        seqlens: &Varlen<'_>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        check_dtype(
            self.arch,
            T::DTYPE,
            &[KernelKind::Forward],
            "forward_varlen",
        )?;
        let (cu_q, _cq_sync) = seqlens.cu_seqlens_q.device_ptr(stream);
        let (cu_k, _ck_sync) = seqlens.cu_seqlens_k.device_ptr(stream);
        let t = bind(stream, qkv, &mut out);
        let shape: VarlenShape = check_varlen(
            &t.ops,
            seqlens.cu_seqlens_q.len(),
            seqlens.cu_seqlens_k.len(),
            seqlens.max_seqlen_q,
            seqlens.max_seqlen_k,
            opts,
        )?;
        let packed = Packed {
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
            total_q: shape.total_q,
            total_k: shape.total_k,
            max_seqlen_k: shape.max_seqlen_k,
            paged: None,
        };
        self.launch_forward::<T>(stream, &t, &shape.grid(), Some(packed), opts)
    }

    /// Packed queries against a paged KV cache ([`PagedVarlen`]; chunked
    /// prefill): Q and O are [total_q, H, D] as [`Layout::packed`] layouts,
    /// K and V page pools [num_pages, page_size, Hkv, D] (page_size a
    /// multiple of 16). Query `i` of sequence `b` (of `n_q` rows) sits at key
    /// position `i + seqlens_k[b] - n_q`: the chunk is the end of the
    /// sequence, as in [`Self::forward_varlen`]'s bottom-right alignment.
    /// `out.lse`, if given, is f32 [H, total_q]. Page indices and `seqlens_k` live
    /// on the device and are clamped by the kernel (indices to the pool,
    /// lengths to `max_pages x page_size`).
    pub fn forward_varlen_paged<T: AttnElement>(
        &self,
        stream: &CudaStream,
        qkv: Qkv<'_, T>,
        mut out: Out<'_, T>,
        seqs: &PagedVarlen<'_>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        check_dtype(
            self.arch,
            T::DTYPE,
            &[KernelKind::Forward],
            "forward_varlen_paged",
        )?;
        let (cu_q, _cq_sync) = seqs.cu_seqlens_q.device_ptr(stream);
        let (seqlens_k, _sk_sync) = seqs.seqlens_k.device_ptr(stream);
        let (table, _t_sync) = seqs.block_table.table.device_ptr(stream);
        let t = bind(stream, qkv, &mut out);
        let (shape, paging) = check_varlen_paged(
            &t.ops,
            seqs.cu_seqlens_q.len(),
            seqs.seqlens_k.len(),
            (seqs.block_table.table.len(), seqs.block_table.max_pages),
            seqs.max_seqlen_q,
            opts,
        )?;
        // The kernel reads a paged call's key counts where a packed call's
        // cu_seqlens_k go, and clamps them to total_k = the capacity.
        let packed = Packed {
            cu_seqlens_q: cu_q,
            cu_seqlens_k: seqlens_k,
            total_q: shape.total_q,
            total_k: shape.total_k,
            max_seqlen_k: shape.max_seqlen_k,
            paged: Some((table, paging)),
        };
        self.launch_forward::<T>(stream, &t, &shape.grid(), Some(packed), opts)
    }

    /// Launches the forward kernel for a validated problem: dense, or packed
    /// sequences when `packed` is given.
    fn launch_forward<T: AttnElement>(
        &self,
        stream: &CudaStream,
        t: &Bound,
        shape: &ForwardShape,
        packed: Option<Packed>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        let seq = match packed {
            None => SeqKind::Dense,
            Some(Packed { paged: None, .. }) => SeqKind::Packed,
            Some(_) => SeqKind::Ragged,
        };
        let policy = policy_args(
            opts,
            shape.mask(),
            shape.softmax_scale,
            shape.heads,
            seq,
            stream,
        );
        let kernel = self.kernel(KernelKind::Forward, T::DTYPE, shape.head_dim, policy.need);
        let tile = kernel.tile();
        let hopper_seqs = packed;
        let packed = packed.unwrap_or_default();
        let (table, paging) = packed.paged.unwrap_or_default();
        let params = AttnParams {
            q: t.ops.q.addr,
            k: t.ops.k.addr,
            v: t.ops.v.addr,
            o: t.ops.o.addr,
            lse: t.lse,
            q_strides: strides::<T>(&t.ops.q.layout),
            k_strides: strides::<T>(&t.ops.k.layout),
            v_strides: strides::<T>(&t.ops.v.layout),
            o_strides: strides::<T>(&t.ops.o.layout),
            batch: shape.batch as u32,
            heads: shape.heads as u32,
            kv_heads: shape.kv_heads as u32,
            seqlen_q: shape.seqlen_q as u32,
            seqlen_k: shape.seqlen_k as u32,
            pack: 1,
            num_splits: 1,
            cu_seqlens_q: packed.cu_seqlens_q,
            cu_seqlens_k: packed.cu_seqlens_k,
            total_q: packed.total_q as u32,
            total_k: packed.total_k as u32,
            block_table: table,
            max_pages: paging.max_pages as u32,
            page_size: FastDiv::new(paging.page_size as u32),
            num_pages: paging.num_pages as u32,
            head_dim: shape.v_dim() as u32,
            fixed_max: u32::from(softmax_max_fixed(
                T::DTYPE,
                opts.softcap,
                opts.alibi_slopes.is_some(),
            )),
            ..policy.params
        };
        let on_hopper = self.launch_hopper_forward::<T>(
            stream,
            t,
            shape,
            hopper_seqs,
            policy.need,
            opts,
            params,
        )?;
        if on_hopper {
            return Ok(());
        }
        let grid = (
            shape.seqlen_q.div_ceil(tile.block_m) as u32,
            shape.heads as u32,
            shape.batch as u32,
        );
        self.launch(stream, kernel, grid, ByValue(params))
    }

    /// Runs a forward call on the Hopper kernels if this instance uses them,
    /// an entry covers the call and TMA can address the tensors (the driver
    /// refuses a map, e.g. for a zero stride, and the call then stays on the
    /// `mma.sync` path). Packed sequences' maps span all packed rows as one
    /// sequence; a paged cache's span its pool, a page per "sequence", in
    /// boxes of `index::paged_box_rows` rows. Returns whether it launched.
    #[allow(clippy::too_many_arguments)]
    fn launch_hopper_forward<T: AttnElement>(
        &self,
        stream: &CudaStream,
        t: &Bound,
        shape: &ForwardShape,
        packed: Option<Packed>,
        need: Policies,
        opts: &AttnOptions,
        params: AttnParams,
    ) -> Result<bool, FlashAttnError> {
        let Some(module) = self.hopper.as_ref().filter(|_| self.hopper_forward()) else {
            return Ok(false);
        };
        let call = HopperCall {
            dtype: T::DTYPE,
            head_dim: shape.head_dim,
            need,
            batch: shape.batch,
            heads: shape.heads,
            seqlen_q: shape.seqlen_q,
            seqlen_k: packed.map_or(shape.seqlen_k, |p| p.max_seqlen_k),
            window_keys: match (params.window_left, params.window_right) {
                (l @ 0.., r @ 0..) => Some(l as usize + r as usize + 1),
                _ => None,
            },
            num_sms: self.num_sms,
        };
        // Each map has its tensor's own head dim: TMA zero-fills the line's
        // columns past it (a smaller head dim, or V's own).
        let map =
            |x: &TensorInfo, (batch, seqlen): (usize, usize), heads: usize, box_rows: usize| {
                let s = &x.layout.strides;
                let bytes = |elems: usize| (elems * std::mem::size_of::<T>()) as u64;
                encode_tensor_map(&TiledTensor {
                    base: x.addr,
                    dtype: T::DTYPE,
                    dims: [
                        x.layout.shape[3] as u64,
                        seqlen as u64,
                        heads as u64,
                        batch as u64,
                    ],
                    strides: [bytes(s[1]), bytes(s[2]), bytes(s[0])],
                    box_rows: box_rows as u32,
                })
                .ok()
            };
        let pick = HopperPick {
            rows: opts.hopper_rows,
            persistent: opts.hopper_persistent,
            keys: opts.hopper_keys,
        };
        let Some(entry) = find_hopper_entry(&call, pick) else {
            return Ok(false);
        };
        // The dense lines store O with TMA; an O whose layout no tensor map
        // describes takes the `mma.sync` path.
        let o_map = match packed {
            None => match map(
                &t.ops.o,
                (shape.batch, shape.seqlen_q),
                shape.heads,
                WGMMA_M,
            ) {
                Some(o) => o,
                None => return Ok(false),
            },
            Some(_) => TensorMap::default(),
        };
        let tile = entry.hopper_tile();
        // The maps' (batch, rows) of Q and of K/V, and the K/V box rows.
        let (q_dims, kv_dims, kv_box) = match packed {
            None => (
                (shape.batch, shape.seqlen_q),
                (shape.batch, shape.seqlen_k),
                tile.block_n,
            ),
            Some(Packed {
                total_q,
                total_k,
                paged: None,
                ..
            }) => ((1, total_q), (1, total_k), tile.block_n),
            Some(Packed {
                total_q,
                paged: Some((_, paging)),
                ..
            }) => (
                (1, total_q),
                (paging.num_pages, paging.page_size),
                paged_box_rows(paging.page_size as u32, tile.block_n as u32) as usize,
            ),
        };
        let maps = (
            map(&t.ops.q, q_dims, shape.heads, tile.block_m),
            map(&t.ops.k, kv_dims, shape.kv_heads, kv_box),
            map(&t.ops.v, kv_dims, shape.kv_heads, kv_box),
        );
        let (Some(q), Some(k), Some(v)) = maps else {
            return Ok(false);
        };
        let m_blocks = shape.seqlen_q.div_ceil(tile.block_m);
        let mut params = params;
        let grid = if tile.persistent {
            // One CTA per SM at most, each looping over the tiles
            // (`index::persistent_step`), whose divisions are exact below
            // the tile limit (2^30 tiles: far past any real launch).
            let tiles = m_blocks * shape.heads * shape.batch;
            if tiles >= TileGrid::TILE_LIMIT {
                return Ok(false);
            }
            let causal = matches!(need.mask, MaskKind::Causal);
            let paired = causal && tiles > self.num_sms;
            let ctas = tiles.min(self.num_sms).max(1);
            params.tiles = TileGrid::new(
                m_blocks as u32,
                shape.heads as u32,
                shape.kv_heads as u32,
                paired,
            );
            let dynamic = tile.claims_tiles(entry.policies.mask)
                && !self.static_tiles.load(Ordering::Relaxed);
            if dynamic {
                if let Some(counter) = module.counters.for_launch(stream)? {
                    let tail = if causal {
                        (HOPPER_TAIL_WAVES * ctas).div_ceil(m_blocks)
                    } else {
                        0
                    };
                    params.tiles = params.tiles.dynamic(
                        (shape.heads * shape.batch) as u32,
                        tail as u32,
                        counter,
                    );
                }
            }
            (ctas as u32, 1, 1)
        } else {
            (m_blocks as u32, shape.heads as u32, shape.batch as u32)
        };
        let maps = HopperFwdMaps { q, k, v, o: o_map };
        module.launch_forward(stream, entry, maps, params, grid)?;
        Ok(true)
    }

    /// The backward pass of [`Self::forward`] (FlashAttention-2's Algorithm
    /// 2): given dO, the gradient of a loss with respect to O, writes dQ, dK
    /// and dV. With GQA/MQA, dK and dV sum over the query heads that share a
    /// KV head. Takes every option of the forward call (masks, softcap,
    /// ALiBi, sinks, `softmax_scale`), which must be the same as there; ALiBi
    /// slopes and sinks are constants (no gradient), except that
    /// `grads.d_sinks` receives the sinks' gradient when given. A V head dim
    /// of its own, f32 and head dims outside [`BWD_HEAD_DIMS`] are refused
    /// with a typed error. Three launches on `stream` (`delta = rowsum(dO ∘
    /// O)`, the key-block kernel, dQ from an f32 buffer that the key blocks
    /// add to with atomics, so dQ's rounding may differ from run to run),
    /// and a fourth after the first for `d_sinks` (one CTA per head, the
    /// same result on every run); the call allocates that buffer, 4 · B · H
    /// · Sq · D bytes, and the `delta` rows, 4 · B · H · Sq bytes, zeroed on
    /// `stream`. With GQA/MQA on a grid of fewer than four waves of key-block
    /// CTAs, each KV head's query heads are split across CTAs
    /// ([`Self::set_backward_head_splits`]): their dK and dV parts go to an
    /// f32 buffer of 8 · splits · B · Skv · Hkv · D bytes, and a fifth
    /// launch sums them in order (the same result on every run).
    /// Nothing is launched and the gradients stay untouched when validation
    /// fails.
    ///
    /// [`BWD_HEAD_DIMS`]: flash_attn_kernels::config::BWD_HEAD_DIMS
    pub fn backward<T: AttnElement>(
        &self,
        stream: &Arc<CudaStream>,
        qkv: Qkv<'_, T>,
        saved: BackwardInputs<'_, T>,
        grads: Grads<'_, T>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        self.run_backward(stream, qkv, saved, grads, None, opts)
    }

    /// The backward pass of [`Self::forward_varlen`], as [`Self::backward`]
    /// is of [`Self::forward`]: Q, O, dO and dQ are [total_q, H, D], K, V,
    /// dK and dV [total_k, Hkv, D] (packed layouts, any one-to-one strides
    /// for the gradients), the LSE is the forward's f32 [H, total_q], and
    /// `seqlens` must be the forward call's. Every option of the fixed-batch
    /// backward applies per sequence (ALiBi slopes [B, H] by sequence); the
    /// sinks' gradient sums over every sequence's rows. `cu_seqlens` live on
    /// the device and are clamped as in the forward; packed rows that no
    /// sequence owns get dQ = 0 and keep their dK and dV, as do keys of a
    /// sequence past `max_seqlen_k`; the call allocates 4 · H · total_q ·
    /// (D + 1) bytes of f32 workspace, and with split query heads (see
    /// [`Self::backward`]) 8 · splits · total_k · Hkv · D bytes more.
    pub fn backward_varlen<T: AttnElement>(
        &self,
        stream: &Arc<CudaStream>,
        qkv: Qkv<'_, T>,
        saved: BackwardInputs<'_, T>,
        grads: Grads<'_, T>,
        seqlens: &Varlen<'_>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        self.run_backward(stream, qkv, saved, grads, Some(seqlens), opts)
    }

    /// [`Self::backward`], or with `varlen` [`Self::backward_varlen`].
    fn run_backward<T: AttnElement>(
        &self,
        stream: &Arc<CudaStream>,
        Qkv { q, k, v }: Qkv<'_, T>,
        saved: BackwardInputs<'_, T>,
        mut grads: Grads<'_, T>,
        varlen: Option<&Varlen<'_>>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        let kinds = [
            KernelKind::Backward,
            KernelKind::BackwardPrep,
            KernelKind::BackwardDq,
            KernelKind::BackwardDkv,
            KernelKind::BackwardSinks,
        ];
        let entry = if varlen.is_some() {
            "backward_varlen"
        } else {
            "backward"
        };
        check_dtype(self.arch, T::DTYPE, &kinds, entry)?;
        let (q_ptr, _q_sync) = q.data.device_ptr(stream);
        let (k_ptr, _k_sync) = k.data.device_ptr(stream);
        let (v_ptr, _v_sync) = v.data.device_ptr(stream);
        let (o_ptr, _o_sync) = saved.o.data.device_ptr(stream);
        let (lse_ptr, _lse_sync) = saved.lse.device_ptr(stream);
        let (do_ptr, _do_sync) = saved.d_o.data.device_ptr(stream);
        let (dq_len, dk_len, dv_len) = (
            grads.dq.data.len(),
            grads.dk.data.len(),
            grads.dv.data.len(),
        );
        let d_sinks_len = grads.d_sinks.as_ref().map(|d| d.len());
        let (dq_ptr, _dq_sync) = grads.dq.data.device_ptr_mut(stream);
        let (dk_ptr, _dk_sync) = grads.dk.data.device_ptr_mut(stream);
        let (dv_ptr, _dv_sync) = grads.dv.data.device_ptr_mut(stream);
        let (d_sinks_ptr, _d_sinks_sync) = match grads.d_sinks.as_mut() {
            Some(d) => d.device_ptr_mut(stream),
            None => (0, SyncOnDrop::Record(None)),
        };
        let ops = BackwardOperands {
            fwd: Operands {
                q: info(q.layout, q.data.len(), q_ptr),
                k: info(k.layout, k.data.len(), k_ptr),
                v: info(v.layout, v.data.len(), v_ptr),
                o: info(saved.o.layout, saved.o.data.len(), o_ptr),
                lse_len: Some(saved.lse.len()),
            },
            d_o: info(saved.d_o.layout, saved.d_o.data.len(), do_ptr),
            dq: info(grads.dq.layout, dq_len, dq_ptr),
            dk: info(grads.dk.layout, dk_len, dk_ptr),
            dv: info(grads.dv.layout, dv_len, dv_ptr),
            d_sinks_len,
        };
        let (cu_q, _cq_sync) = match varlen {
            Some(s) => s.cu_seqlens_q.device_ptr(stream),
            None => (0, SyncOnDrop::Record(None)),
        };
        let (cu_k, _ck_sync) = match varlen {
            Some(s) => s.cu_seqlens_k.device_ptr(stream),
            None => (0, SyncOnDrop::Record(None)),
        };
        let shape = match varlen {
            None => check_backward(&ops, opts)?,
            Some(s) => check_backward_varlen(
                &ops,
                (s.cu_seqlens_q.len(), s.cu_seqlens_k.len()),
                (s.max_seqlen_q, s.max_seqlen_k),
                opts,
            )?,
        };
        let rows = shape.query_rows();
        let dq_accum = stream.alloc_zeros::<f32>(rows * shape.head_dim)?;
        let delta = stream.alloc_zeros::<f32>(rows)?;
        let (dq_accum_ptr, _accum_sync) = dq_accum.device_ptr(stream);
        let (delta_ptr, _delta_sync) = delta.device_ptr(stream);
        let mask = shape.mask;
        let policy = policy_args(
            opts,
            mask,
            shape.softmax_scale,
            shape.heads,
            SeqKind::Dense,
            stream,
        );
        let scores = &policy.params;
        // The key-block kernel, its key blocks and how its CTAs split each
        // KV head's query heads.
        let policies = Policies {
            score: if opts.softcap.is_some() || opts.alibi_slopes.is_some() {
                ScoreKind::Modified
            } else {
                ScoreKind::Plain
            },
            ..policy.need
        };
        let on_hopper = self
            .hopper
            .as_ref()
            .filter(|_| self.hopper_backward())
            .zip(find_hopper_backward(T::DTYPE, shape.head_dim, policies));
        let (block_n, ctas_per_sm) = match on_hopper {
            Some(_) => {
                let t = HopperBwdTile::of(shape.head_dim);
                (t.block_n(), t.ctas_per_sm())
            }
            None => {
                let t = BwdTile::of(shape.head_dim, self.arch);
                (t.block_n, t.ctas_per_sm)
            }
        };
        let key_blocks = shape.seqlen_k.div_ceil(block_n);
        let splits = backward_head_splits(
            (shape.heads / shape.kv_heads) as u32,
            (key_blocks * shape.kv_heads * shape.batch).min(u32::MAX as usize) as u32,
            (self.num_sms * ctas_per_sm) as u32,
            self.backward_head_splits().map(|n| n as u32),
        ) as usize;
        let key_rows = shape
            .packed
            .map_or(shape.batch * shape.seqlen_k, |(_, k)| k);
        let dkv_parts = match splits {
            1 => None,
            // SAFETY: f32 workspace; the key-block kernel writes every row of
            // every part that `BackwardDkv` reads (the keys of each sequence).
            _ => Some(unsafe {
                stream.alloc::<f32>(2 * splits * key_rows * shape.kv_heads * shape.head_dim)
            }?),
        };
        let (dkv_parts_ptr, _parts_sync) = match &dkv_parts {
            Some(b) => b.device_ptr(stream),
            None => (0, SyncOnDrop::Record(None)),
        };
        let params = BwdParams {
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            o: o_ptr,
            d_o: do_ptr,
            lse: lse_ptr,
            dq: dq_ptr,
            dk: dk_ptr,
            dv: dv_ptr,
            dq_accum: dq_accum_ptr,
            delta: delta_ptr,
            q_strides: strides::<T>(&q.layout),
            k_strides: strides::<T>(&k.layout),
            v_strides: strides::<T>(&v.layout),
            o_strides: strides::<T>(&saved.o.layout),
            do_strides: strides::<T>(&saved.d_o.layout),
            dq_strides: strides::<T>(&grads.dq.layout),
            dk_strides: strides::<T>(&grads.dk.layout),
            dv_strides: strides::<T>(&grads.dv.layout),
            batch: shape.batch as u32,
            heads: shape.heads as u32,
            kv_heads: shape.kv_heads as u32,
            seqlen_q: shape.seqlen_q as u32,
            seqlen_k: shape.seqlen_k as u32,
            head_dim: shape.head_dim as u32,
            scale: shape.softmax_scale,
            scale_log2: scores.scale_log2,
            window_left: scores.window_left,
            window_right: scores.window_right,
            softcap_pre: scores.softcap_pre,
            inv_scale: scores.inv_scale,
            alibi: scores.alibi,
            alibi_batch_stride: scores.alibi_batch_stride,
            sinks: scores.sinks,
            d_sinks: d_sinks_ptr,
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
            total_q: shape.packed.map_or(0, |(total_q, _)| total_q as u32),
            total_k: shape.packed.map_or(0, |(_, total_k)| total_k as u32),
            head_splits: splits as u32,
            dkv_parts: dkv_parts_ptr,
        };
        let chunks = rows * shape.head_dim / CHUNK_ELEMS;
        let prep = self.kernel(KernelKind::BackwardPrep, T::DTYPE, 0, Policies::PLAIN);
        let dq = self.kernel(KernelKind::BackwardDq, T::DTYPE, 0, Policies::PLAIN);
        self.launch(
            stream,
            prep,
            (rows.div_ceil(BWD_THREADS) as u32, 1, 1),
            ByValue(params),
        )?;
        if d_sinks_ptr != 0 {
            let sinks = self.kernel(KernelKind::BackwardSinks, T::DTYPE, 0, Policies::PLAIN);
            self.launch(stream, sinks, (shape.heads as u32, 1, 1), ByValue(params))?;
        }
        let grid = (
            key_blocks as u32,
            (shape.kv_heads * splits) as u32,
            shape.batch as u32,
        );
        if let Some((module, entry)) = on_hopper {
            module.launch_backward(stream, entry, params, grid)?;
        } else {
            let main = self.kernel(KernelKind::Backward, T::DTYPE, shape.head_dim, policies);
            self.launch(stream, main, grid, ByValue(params))?;
        }
        if splits > 1 {
            let dkv = self.kernel(KernelKind::BackwardDkv, T::DTYPE, 0, Policies::PLAIN);
            let chunks = shape.seqlen_k * shape.kv_heads * shape.head_dim / CHUNK_ELEMS;
            let grid = (chunks.div_ceil(BWD_THREADS) as u32, shape.batch as u32, 1);
            self.launch(stream, dkv, grid, ByValue(params))?;
        }
        self.launch(
            stream,
            dq,
            (chunks.div_ceil(BWD_THREADS) as u32, 1, 1),
            ByValue(params),
        )
    }

    /// Merges two attention states over disjoint key sets into the state over
    /// their union (FlashInfer's `merge_state`; ring attention, context
    /// parallelism, shared-prefix attention): `lse = log(e^lse_a + e^lse_b)`,
    /// `O = e^(lse_a - lse)·O_a + e^(lse_b - lse)·O_b`. O tensors are
    /// [B, S, H, D] (any strides, last dim contiguous, D a multiple of 8 up to
    /// 256), LSEs f32 [B, H, S] as [`Self::forward`] writes them (natural
    /// log; -inf for a state that saw no key). `out.o` may alias `a.o` or `b.o`
    /// exactly. Computed in f32 from the stored states, so the merged O
    /// carries one extra rounding to `T`.
    pub fn merge_states<T: AttnElement>(
        &self,
        stream: &CudaStream,
        a: State<'_, T>,
        b: State<'_, T>,
        mut out: Out<'_, T>,
    ) -> Result<(), FlashAttnError> {
        check_dtype(self.arch, T::DTYPE, &[KernelKind::Merge], "merge_states")?;
        let (State { o: o_a, lse: lse_a }, State { o: o_b, lse: lse_b }) = (a, b);
        let (o, lse) = (&mut out.o, out.lse.as_mut());
        let (a_ptr, _a_sync) = o_a.data.device_ptr(stream);
        let (b_ptr, _b_sync) = o_b.data.device_ptr(stream);
        let (la_ptr, _la_sync) = lse_a.device_ptr(stream);
        let (lb_ptr, _lb_sync) = lse_b.device_ptr(stream);
        let o_len = o.data.len();
        let (o_ptr, _o_sync) = o.data.device_ptr_mut(stream);
        let [batch, seqlen, heads, head_dim] = check_merge(
            &info(o_a.layout, o_a.data.len(), a_ptr),
            &info(o_b.layout, o_b.data.len(), b_ptr),
            &info(o.layout, o_len, o_ptr),
            [
                Some(lse_a.len()),
                Some(lse_b.len()),
                lse.as_ref().map(|l| l.len()),
            ],
        )?;
        let (lse_ptr, _lse_sync) = optional_ptr_mut(lse, stream);
        let params = MergeParams {
            o_a: a_ptr,
            lse_a: la_ptr,
            o_b: b_ptr,
            lse_b: lb_ptr,
            o: o_ptr,
            lse: lse_ptr,
            o_a_strides: strides::<T>(&o_a.layout),
            o_b_strides: strides::<T>(&o_b.layout),
            o_strides: strides::<T>(&o.layout),
            batch: batch as u32,
            seqlen: seqlen as u32,
            heads: heads as u32,
            row_chunks: (head_dim / CHUNK_ELEMS) as u32,
        };
        let chunks = batch * seqlen * heads * head_dim / CHUNK_ELEMS;
        let kernel = self.kernel(KernelKind::Merge, T::DTYPE, 0, Policies::PLAIN);
        self.launch(
            stream,
            kernel,
            (chunks.div_ceil(MERGE_THREADS) as u32, 1, 1),
            ByValue(params),
        )
    }

    /// The decode tile of `shape`'s head dim in the loaded module.
    fn decode_tile(&self, shape: &DecodeShape) -> AttnTile {
        AttnTile::of(KernelKind::Decode, shape.head_dim, self.arch)
    }

    /// KV heads a decode launch of `shape` reads as one ([`KvFold`]), for a
    /// cache whose heads are adjacent (head stride = head dim).
    pub fn decode_kv_fold<T: AttnElement>(&self, shape: &DecodeShape) -> usize {
        self.decode_plan::<T>(shape, true).fold
    }

    /// K/V ring stages a decode launch of `shape` uses: the tile's deepest
    /// ring where every CTA is resident at that ring's footprint and either
    /// the grid's distinct K/V streams (the CTAs of one KV head's row tiles
    /// share one) are at most one per SM or each CTA streams at most 8 key
    /// blocks; else its `busy_stages` (more resident CTAs at HBM bandwidth).
    /// For a cache whose heads are adjacent, as [`Self::decode_kv_fold`].
    pub fn decode_ring_stages<T: AttnElement>(&self, shape: &DecodeShape) -> usize {
        self.decode_plan::<T>(shape, true).stages
    }

    /// Split count the decode kernel uses for `shape` with element type `T`:
    /// `shape.num_splits` if set (lowered to two key blocks per split), else
    /// the heuristic's. For a cache whose heads are adjacent, as
    /// [`Self::decode_kv_fold`].
    pub fn decode_splits<T: AttnElement>(&self, shape: &DecodeShape) -> usize {
        self.decode_plan::<T>(shape, true).splits
    }

    /// Fold, split count and ring depth of a decode launch (see
    /// [`Self::decode_kv_fold`], [`Self::decode_splits`],
    /// [`Self::decode_ring_stages`]); `heads_adjacent`: K's and V's head
    /// strides equal the head dim.
    fn decode_plan<T: AttnElement>(
        &self,
        caller: &DecodeShape,
        heads_adjacent: bool,
    ) -> DecodePlan {
        let fold = kv_fold(&FoldProblem {
            mode: self.kv_fold(),
            measured_arch: self.arch == PtxArch::Sm90,
            elem_bytes: size_of::<T>(),
            heads_adjacent,
            head_dim: caller.head_dim,
            kv_heads: caller.kv_heads,
            rows: caller.seqlen_q * (caller.heads / caller.kv_heads),
            block_m: AttnTile::for_kernel(KernelKind::Decode, caller.head_dim * KV_FOLD, self.arch)
                .map_or(0, |t| t.block_m),
            batch: caller.batch,
            num_sms: self.num_sms,
        });
        let shape = &folded(caller, fold);
        let tile = self.decode_tile(shape);
        let rows = shape.seqlen_q * (shape.heads / shape.kv_heads);
        // One KV head's rows in row tiles, which all read that head's K/V.
        let row_tiles = rows.div_ceil(tile.block_m);
        let ctas = shape.batch * shape.kv_heads * row_tiles;
        // A left window bounds the keys any row sees, whatever the cache holds.
        let keys = match shape.mask().left {
            Some(left) => shape.cache_len.min(left.saturating_add(shape.seqlen_q)),
            None => shape.cache_len,
        };
        let key_blocks = keys.div_ceil(tile.block_n);
        // Every decode variant of a head dim has the same tile and occupancy;
        // the folded entries are read for folded launches all the same.
        // (A dtype the module lacks, whose calls are refused, reads f16's.)
        let dtype = if self.arch.has_dtype(T::DTYPE) {
            T::DTYPE
        } else {
            Dtype::F16
        };
        let ctas_per_sm = self
            .kernel(
                KernelKind::Decode,
                dtype,
                shape.head_dim,
                folded_policies(Policies::PLAIN, fold),
            )
            .ctas_per_sm;
        let max_splits = (key_blocks / MIN_BLOCKS_PER_SPLIT)
            .clamp(1, MAX_SPLITS)
            .min(MAX_GRID_YZ / shape.batch);
        let splits = match shape.num_splits {
            Some(n) => n.clamp(1, max_splits),
            None => choose_splits(&SplitProblem {
                ctas,
                bytes_per_cta: keys * 2 * shape.head_dim * size_of::<T>(),
                key_blocks,
                num_sms: self.num_sms,
                ctas_per_sm,
                max_splits,
                // The combine merges the caller's rows, unfolded.
                combine_groups: combine_groups(caller.head_dim),
                // Fitted (H200, v57): where one KV head's rows take several
                // row tiles, the gain chose fewer splits to reach one CTA per
                // SM, which ran 0.82-0.91x (Qwen 28/4 with 4 new tokens).
                // Those grids take the deep ring at up to a stream per SM
                // anyway (`ring_stages`, v65), so more splits lose nothing.
                solo_ring_gain: if rows <= tile.block_m {
                    (tile.kv_stages - 1) as f64 / (tile.busy_stages - 1) as f64
                } else {
                    1.0
                },
            }),
        };
        let stages = ring_stages(
            &tile,
            &RingProblem {
                grid_ctas: ctas * splits,
                row_tiles,
                blocks_per_cta: key_blocks.div_ceil(splits),
                num_sms: self.num_sms,
                ctas_per_sm,
            },
        );
        DecodePlan {
            fold,
            splits,
            stages,
            programmatic_combine: self.programmatic_launch() && rows <= tile.block_m,
            grid_ctas: ctas * splits,
            ctas_per_sm,
        }
    }

    /// Scratch for decoding `shape` with element type `T`; reusable for any
    /// problem that needs no more.
    pub fn decode_workspace<T: AttnElement>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &DecodeShape,
    ) -> Result<DecodeWorkspace, FlashAttnError> {
        // Either fold: the call's cache layout is not known here.
        let splits = [true, false]
            .map(|adjacent| self.decode_plan::<T>(shape, adjacent).splits)
            .into_iter()
            .max()
            .unwrap_or(1);
        let rows = splits * shape.batch * shape.heads * shape.seqlen_q;
        Ok(DecodeWorkspace {
            o_accum: stream.alloc_zeros::<f32>((rows * shape.head_dim).max(1))?,
            lse_accum: stream.alloc_zeros::<f32>(rows.max(1))?,
        })
    }

    /// Decode against a KV cache (flash-decoding): Q and O [B, Sq, H, D] hold
    /// the newest `Sq` tokens; K/V caches are [B, Lmax, Hkv, D], of which
    /// sequence `b` uses the first `cache_seqlens[b]` entries (i32 on the
    /// device, so a captured CUDA graph can be replayed as they change; each
    /// is clamped to `[0, Lmax]` by the kernel). With `causal`, new token `t`
    /// sees keys `j <= cache_seqlens[b] - Sq + t`. The keys are split across
    /// CTAs when the batch alone cannot fill the GPU; `workspace` (from
    /// [`Self::decode_workspace`]) holds the partials, or one is allocated.
    /// For a paged cache or appending new K/V first, see [`Self::decode_kvcache`].
    pub fn decode<T: AttnElement>(
        &self,
        stream: &Arc<CudaStream>,
        qkv: Qkv<'_, T>,
        cache_seqlens: &CudaView<'_, i32>,
        mut out: Out<'_, T>,
        opts: &AttnOptions,
        workspace: Option<&mut DecodeWorkspace>,
    ) -> Result<(), FlashAttnError> {
        check_dtype(
            self.arch,
            T::DTYPE,
            &[KernelKind::Decode, KernelKind::Combine],
            "decode",
        )?;
        let t = bind(stream, qkv, &mut out);
        let (seqlens_ptr, _s_sync) = cache_seqlens.device_ptr(stream);
        let shape = check_decode(&t.ops, cache_seqlens.len(), opts)?;
        let call = DecodeCall {
            q: addressed::<T>(&t.ops.q),
            k: addressed::<T>(&t.ops.k),
            v: addressed::<T>(&t.ops.v),
            o: addressed::<T>(&t.ops.o),
            lse: t.lse,
            seqlens: seqlens_ptr,
            block_table: 0,
            cache: KvCacheShape {
                decode: shape,
                paging: None,
                seqlen_new: 0,
            },
        };
        let plan = self.decode_plan::<T>(&shape, call.heads_adjacent::<T>());
        self.run_decode::<T>(stream, &call, &plan, opts, workspace)
    }

    /// [`Self::decode`] with a KV cache that may be paged, optionally after
    /// appending `step.new_kv` = (K_new, V_new) [B, Snew, Hkv, D] at positions
    /// `cache.seqlens[b]..+Snew` (which then attend to `seqlens[b] + Snew`
    /// keys). Like FlashAttention's `flash_attn_with_kvcache`, `seqlens` is not
    /// advanced: the caller adds Snew for the next step. Host-side checks cover
    /// shapes, page size and block-table length; device data (page indices,
    /// lengths past the capacity) cannot be checked before the launch, so the
    /// kernels clamp them: page indices to the pool, lengths to the capacity,
    /// and appended tokens past the capacity are dropped.
    ///
    /// One decode step of a GQA model (32 query heads, 8 KV heads) over a
    /// paged cache of 16-token pages, appending the step's K/V first:
    ///
    /// ```no_run
    /// use flash_attn::{
    ///     AttnOptions, BlockTable, DecodeStep, FlashAttention, KvCache, Layout, Out, TensorMut, TensorRef,
    /// };
    /// use cudarc::driver::CudaContext;
    /// use half::f16;
    ///
    /// let ctx = CudaContext::new(0)?;
    /// let stream = ctx.default_stream();
    /// let fa = FlashAttention::new(&ctx)?;
    /// let (b, h, hkv, d, page, max_pages) = (4, 32, 8, 128, 16, 256);
    /// let pages = b * max_pages;
    /// let pool = Layout::contiguous([pages, page, hkv, d]);
    /// let mut k_pool = stream.alloc_zeros::<f16>(pages * page * hkv * d)?;
    /// let mut v_pool = stream.alloc_zeros::<f16>(pages * page * hkv * d)?;
    /// // Sequence i owns pages i * max_pages.. (any permutation works).
    /// let table: Vec<i32> = (0..pages as i32).collect();
    /// let table = stream.clone_htod(&table)?;
    /// let seqlens = stream.clone_htod(&vec![1000i32; b])?;
    /// let (q, k_new, v_new) = (
    ///     stream.alloc_zeros::<f16>(b * h * d)?,
    ///     stream.alloc_zeros::<f16>(b * hkv * d)?,
    ///     stream.alloc_zeros::<f16>(b * hkv * d)?,
    /// );
    /// let mut o = stream.alloc_zeros::<f16>(b * h * d)?;
    /// let (q_layout, kv_layout) = (Layout::contiguous([b, 1, h, d]), Layout::contiguous([b, 1, hkv, d]));
    /// let mut cache = KvCache {
    ///     k: TensorMut::new(k_pool.as_view_mut(), pool),
    ///     v: TensorMut::new(v_pool.as_view_mut(), pool),
    ///     seqlens: seqlens.as_view(),
    ///     block_table: Some(BlockTable { table: table.as_view(), max_pages }),
    /// };
    /// fa.decode_kvcache(
    ///     &stream,
    ///     DecodeStep {
    ///         q: &TensorRef::new(q.as_view(), q_layout),
    ///         new_kv: Some((&TensorRef::new(k_new.as_view(), kv_layout), &TensorRef::new(v_new.as_view(), kv_layout))),
    ///     },
    ///     &mut cache,
    ///     Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
    ///     &AttnOptions { causal: true, ..Default::default() },
    ///     None,
    /// )?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn decode_kvcache<T: AttnElement>(
        &self,
        stream: &Arc<CudaStream>,
        step: DecodeStep<'_, T>,
        cache: &mut KvCache<'_, T>,
        mut out: Out<'_, T>,
        opts: &AttnOptions,
        workspace: Option<&mut DecodeWorkspace>,
    ) -> Result<(), FlashAttnError> {
        check_dtype(
            self.arch,
            T::DTYPE,
            &[KernelKind::Decode, KernelKind::Combine],
            "decode_kvcache",
        )?;
        let DecodeStep { q, new_kv } = step;
        let (o, lse) = (&mut out.o, out.lse.as_mut());
        let (q_ptr, _q_sync) = q.data.device_ptr(stream);
        let (seqlens_ptr, _s_sync) = cache.seqlens.device_ptr(stream);
        let (k_len, v_len) = (cache.k.data.len(), cache.v.data.len());
        let (k_ptr, _k_sync) = cache.k.data.device_ptr_mut(stream);
        let (v_ptr, _v_sync) = cache.v.data.device_ptr_mut(stream);
        let (table_ptr, _t_sync) = match &cache.block_table {
            Some(t) => t.table.device_ptr(stream),
            None => (0, SyncOnDrop::Record(None)),
        };
        let new_ptrs = new_kv.map(|(k, v)| (k.data.device_ptr(stream), v.data.device_ptr(stream)));
        let o_len = o.data.len();
        let (o_ptr, _o_sync) = o.data.device_ptr_mut(stream);
        let new_infos = match (new_kv, &new_ptrs) {
            (Some((k, v)), Some(((kp, _), (vp, _)))) => Some((
                info(k.layout, k.data.len(), *kp),
                info(v.layout, v.data.len(), *vp),
            )),
            _ => None,
        };
        let operands = Operands {
            q: info(q.layout, q.data.len(), q_ptr),
            k: info(cache.k.layout, k_len, k_ptr),
            v: info(cache.v.layout, v_len, v_ptr),
            o: info(o.layout, o_len, o_ptr),
            lse_len: lse.as_ref().map(|l| l.len()),
        };
        let shape = check_kvcache(
            &operands,
            cache.seqlens.len(),
            cache
                .block_table
                .as_ref()
                .map(|t| (t.table.len(), t.max_pages)),
            new_infos.as_ref().map(|(k, v)| (k, v)),
            opts,
        )?;
        let adjacent = heads_adjacent::<T>(
            &strides::<T>(&operands.k.layout),
            &strides::<T>(&operands.v.layout),
            shape.decode.head_dim,
        );
        let plan = self.decode_plan::<T>(&shape.decode, adjacent);
        if let (Some((k_new, v_new)), Some(((kp, _), (vp, _)))) = (new_kv, &new_ptrs) {
            let paging = shape.paging.unwrap_or_default();
            // 16-byte chunks: an f32 row has twice a 16-bit row's.
            let chunks = shape.decode.batch
                * shape.seqlen_new
                * shape.decode.kv_heads
                * shape.decode.head_dim
                / CHUNK_ELEMS
                * size_of::<T>()
                / 2;
            let append_ctas = chunks.div_ceil(APPEND_THREADS);
            let early =
                grids_fit_together(append_ctas, plan.grid_ctas, self.num_sms, plan.ctas_per_sm);
            let params = AppendParams {
                k_new: *kp,
                v_new: *vp,
                k_cache: k_ptr,
                v_cache: v_ptr,
                cache_seqlens: seqlens_ptr,
                block_table: table_ptr,
                k_new_strides: strides::<T>(&k_new.layout),
                v_new_strides: strides::<T>(&v_new.layout),
                k_cache_strides: strides::<T>(&cache.k.layout),
                v_cache_strides: strides::<T>(&cache.v.layout),
                batch: shape.decode.batch as u32,
                seqlen_new: shape.seqlen_new as u32,
                kv_heads: shape.decode.kv_heads as u32,
                row_chunks: (shape.decode.head_dim / CHUNK_ELEMS * size_of::<T>() / 2) as u32,
                capacity: shape.decode.cache_len as u32,
                max_pages: paging.max_pages as u32,
                page_size: FastDiv::new(paging.page_size as u32),
                num_pages: paging.num_pages as u32,
                early_dependents: (self.programmatic_launch() && early) as u32,
            };
            let kernel = self.kernel_named(APPEND_ENTRY);
            self.launch(stream, kernel, (append_ctas as u32, 1, 1), ByValue(params))?;
        }
        let (lse_ptr, _lse_sync) = optional_ptr_mut(lse, stream);
        let call = DecodeCall {
            q: addressed::<T>(&operands.q),
            k: addressed::<T>(&operands.k),
            v: addressed::<T>(&operands.v),
            o: addressed::<T>(&operands.o),
            lse: lse_ptr,
            seqlens: seqlens_ptr,
            block_table: table_ptr,
            cache: shape,
        };
        self.run_decode::<T>(stream, &call, &plan, opts, workspace)
    }

    /// Launches the split-KV decode kernel, and the combine kernel when the
    /// keys are split, for validated arguments and `plan`, the call's
    /// [`Self::decode_plan`].
    fn run_decode<T: AttnElement>(
        &self,
        stream: &Arc<CudaStream>,
        call: &DecodeCall,
        plan: &DecodePlan,
        opts: &AttnOptions,
        workspace: Option<&mut DecodeWorkspace>,
    ) -> Result<(), FlashAttnError> {
        let shape = &call.cache.decode;
        let splits = plan.splits;
        let partial_rows = splits * shape.batch * shape.heads * shape.seqlen_q;
        let rows = shape.batch * shape.heads * shape.seqlen_q;
        if rows > u32::MAX as usize {
            return Err(FlashAttnError::TooLarge {
                what: "batch x heads x seqlen_q",
                value: rows,
                limit: u32::MAX as usize,
            });
        }
        let mut owned;
        let workspace = match workspace {
            Some(w) => {
                if splits > 1
                    && (w.lse_accum.len() < partial_rows
                        || w.o_accum.len() < partial_rows * shape.head_dim)
                {
                    return Err(FlashAttnError::WorkspaceTooSmall {
                        needed: partial_rows * shape.head_dim,
                        len: w.o_accum.len(),
                    });
                }
                w
            }
            None => {
                owned = self.decode_workspace::<T>(stream, shape)?;
                &mut owned
            }
        };
        let (oacc_ptr, _oa_sync) = workspace.o_accum.device_ptr_mut(stream);
        let (lacc_ptr, _la_sync) = workspace.lse_accum.device_ptr_mut(stream);

        // The kernel's view: `plan.fold` adjacent KV heads as one.
        let fold = plan.fold;
        let kernel_shape = folded(shape, fold);
        let tile = self.decode_tile(&kernel_shape).with_stages(plan.stages);
        let pack = kernel_shape.heads / kernel_shape.kv_heads;
        let fold_heads = |(ptr, s): (u64, BshStrides)| {
            (
                ptr,
                BshStrides {
                    head: s.head * fold as i64,
                    ..s
                },
            )
        };
        let (k, v) = (fold_heads(call.k), fold_heads(call.v));
        let paging = call.cache.paging.unwrap_or_default();
        let policy = policy_args(
            opts,
            shape.mask(),
            shape.softmax_scale,
            shape.heads,
            SeqKind::Dense,
            stream,
        );
        let params = AttnParams {
            q: call.q.0,
            k: k.0,
            v: v.0,
            o: call.o.0,
            lse: call.lse,
            o_accum: oacc_ptr,
            lse_accum: lacc_ptr,
            cache_seqlens: call.seqlens,
            q_strides: call.q.1,
            k_strides: k.1,
            v_strides: v.1,
            o_strides: call.o.1,
            batch: shape.batch as u32,
            heads: shape.heads as u32,
            kv_heads: kernel_shape.kv_heads as u32,
            seqlen_q: shape.seqlen_q as u32,
            seqlen_k: shape.cache_len as u32,
            pack: pack as u32,
            num_splits: splits as u32,
            kv_stages: tile.kv_stages as u32,
            seqlen_new: call.cache.seqlen_new as u32,
            block_table: call.block_table,
            max_pages: paging.max_pages as u32,
            page_size: FastDiv::new(paging.page_size as u32),
            num_pages: paging.num_pages as u32,
            head_dim: kernel_shape.head_dim as u32,
            ..policy.params
        };
        let grid = (
            (shape.seqlen_q * pack).div_ceil(tile.block_m) as u32,
            kernel_shape.kv_heads as u32,
            (shape.batch * splits) as u32,
        );
        let need = folded_policies(policy.need, fold);
        let kernel = self.kernel(KernelKind::Decode, T::DTYPE, kernel_shape.head_dim, need);
        // New tokens (validated nonzero) mean the append kernel ran just
        // before; the decode kernel waits for it exactly then.
        if call.cache.seqlen_new > 0 && self.programmatic_launch() {
            launch_programmatic(stream, kernel, grid, tile.smem_bytes(), ByValue(params))?;
        } else {
            self.launch_sized(stream, kernel, grid, tile.smem_bytes(), ByValue(params))?;
        }
        if splits > 1 {
            let shape_c = combine_shape(shape.head_dim, splits);
            let combine = CombineParams {
                o_accum: oacc_ptr,
                lse_accum: lacc_ptr,
                o: call.o.0,
                lse: call.lse,
                o_strides: call.o.1,
                batch: shape.batch as u32,
                heads: shape.heads as u32,
                seqlen_q: shape.seqlen_q as u32,
                num_splits: splits as u32,
                sinks: policy.params.sinks,
                split_groups: shape_c.split_groups as u32,
            };
            let rows = shape.batch * shape.heads * shape.seqlen_q;
            let grid = (rows.div_ceil(shape_c.rows_per_cta) as u32, 1, 1);
            let kernel = self.kernel(
                KernelKind::Combine,
                T::DTYPE,
                shape.head_dim,
                Policies::PLAIN,
            );
            if plan.programmatic_combine {
                launch_programmatic(stream, kernel, grid, kernel.smem_bytes(), ByValue(combine))?;
            } else {
                self.launch(stream, kernel, grid, ByValue(combine))?;
            }
        }
        Ok(())
    }

    fn launch<P>(
        &self,
        stream: &CudaStream,
        kernel: &Kernel,
        grid: (u32, u32, u32),
        params: ByValue<P>,
    ) -> Result<(), FlashAttnError>
    where
        ByValue<P>: DeviceRepr,
    {
        self.launch_sized(stream, kernel, grid, kernel.smem_bytes(), params)
    }

    /// [`Self::launch`] with `smem` bytes of dynamic shared memory, at most
    /// the entry's (a decode launch with a shallower ring).
    fn launch_sized<P>(
        &self,
        stream: &CudaStream,
        kernel: &Kernel,
        grid: (u32, u32, u32),
        smem: usize,
        params: ByValue<P>,
    ) -> Result<(), FlashAttnError>
    where
        ByValue<P>: DeviceRepr,
    {
        debug_assert!(smem <= kernel.smem_bytes());
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (kernel.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut builder = stream.launch_builder(&kernel.function);
        builder.arg(&params);
        // SAFETY: the entry takes exactly one by-value parameter of this type;
        // validation bounded every address the kernel derives from it.
        unsafe { builder.launch(cfg) }?;
        Ok(())
    }
}

/// Launches `kernel` (one by-value parameter of type `P`, `smem` bytes of
/// dynamic shared memory, at most the entry's) as a programmatic
/// dependent of the stream's previous grid (`cuLaunchKernelEx` with
/// `PROGRAMMATIC_STREAM_SERIALIZATION`): its CTAs may be scheduled once every
/// CTA of that grid has run `griddepcontrol.launch_dependents`, and the
/// kernel must run `griddepcontrol.wait` before it reads that grid's output.
/// Stream capture keeps the dependency as a programmatic graph edge.
fn launch_programmatic<P: Copy>(
    stream: &CudaStream,
    kernel: &Kernel,
    grid: (u32, u32, u32),
    smem: usize,
    params: ByValue<P>,
) -> Result<(), FlashAttnError> {
    debug_assert!(smem <= kernel.smem_bytes());
    stream.context().bind_to_thread()?;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue { pad: [0; 64] },
    };
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: kernel.threads() as u32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem as u32,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut args = [&params.0 as *const P as *mut std::ffi::c_void];
    // SAFETY: the entry takes exactly one by-value parameter of type `P`,
    // which `args` points at and the driver copies before returning;
    // validation bounded every address the kernel derives from it.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            kernel.function.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()?;
    Ok(())
}

/// Whether a decode grid of `decode` CTAs (`per_sm` of them fit an SM) can
/// be scheduled while an append grid of `append` CTAs runs with every decode
/// CTA placed as on an idle GPU: a grid of at most one CTA per SM spreads one
/// to an SM, so the append's CTAs need SMs of their own; a fuller grid needs
/// room for both. Where this holds the append lets its programmatic
/// dependent in at its start, else once its chunks are stored. Fitted on the
/// H200 (v59): where it fails, an early start made 128-CTA grids beside 8-16
/// append CTAs 4-7 % slower (GQA 32/8 at B = 8, MHA at B = 4) and a 256-CTA
/// grid beside 64 up to 13 % (Qwen 28/4, 4 tokens, B = 32).
pub(crate) fn grids_fit_together(
    append: usize,
    decode: usize,
    num_sms: usize,
    per_sm: usize,
) -> bool {
    if decode <= num_sms {
        append + decode <= num_sms
    } else {
        append + decode <= num_sms * per_sm
    }
}

/// What decides whether a decode launch folds KV heads ([`kv_fold`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FoldProblem {
    pub mode: KvFold,
    /// The loaded module is the one the rule was measured on (`sm_90`).
    pub measured_arch: bool,
    /// Bytes of an element: the fold reads 16-bit rows only.
    pub elem_bytes: usize,
    /// K's and V's head strides equal the head dim ([`heads_adjacent`]).
    pub heads_adjacent: bool,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Query rows of one KV head: new tokens x query heads per KV head.
    pub rows: usize,
    /// Rows of the decode tile at `KV_FOLD` x `head_dim`; 0 when that head
    /// dim has no decode kernel.
    pub block_m: usize,
    pub batch: usize,
    pub num_sms: usize,
}

/// KV heads a decode CTA reads as one: [`KV_FOLD`] adjacent heads become one
/// head of `KV_FOLD x head_dim` (the decode entries of `SeqKind::Folded`),
/// or 1. The K/V bytes are the same; each CTA reads rows twice as long,
/// and its MMAs do twice the work on zero halves of Q, which decode
/// (HBM-bound) has time for. Allowed for 16-bit caches whose heads are
/// adjacent, head dims of [`FOLD_HEAD_DIMS`], an even KV head count, and
/// folded rows that fit one row tile (a second would re-read the K/V).
/// [`KvFold::Auto`] folds on the `sm_90` module where the call has at
/// least one K/V stream (batch x KV head) per two SMs. H200 (v68), folded
/// against unfolded: Phi-3 (D = 96, 32/32 heads) at B = 8 and 32
/// 1.04-1.14x, D = 32 (16/16) 1.12-1.38x, D = 64 32/32 0.99-1.055x and
/// 32/8 0.99-1.00x; at B = 1 (16-32 streams) the proxy of call 1 lost
/// with short caches (D = 96 and 1k keys 0.94x, D = 32 0.95x). Other
/// modules are not measured and do not fold by default.
pub(crate) fn kv_fold(p: &FoldProblem) -> usize {
    let allowed = p.elem_bytes == 2
        && p.heads_adjacent
        && FOLD_HEAD_DIMS.contains(&p.head_dim)
        && p.kv_heads.is_multiple_of(KV_FOLD)
        && p.rows * KV_FOLD <= p.block_m;
    let wanted = match p.mode {
        KvFold::Off => false,
        KvFold::On => true,
        KvFold::Auto => p.measured_arch && 2 * p.batch * p.kv_heads >= p.num_sms,
    };
    if allowed && wanted {
        KV_FOLD
    } else {
        1
    }
}

/// A decode grid as the ring depth sees it ([`ring_stages`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingProblem {
    /// CTAs of the decode grid.
    pub grid_ctas: usize,
    /// CTAs that read the same K/V: one KV head's row tiles (the query
    /// heads it serves times the new tokens, over the tile's rows).
    pub row_tiles: usize,
    /// Key blocks each CTA streams.
    pub blocks_per_cta: usize,
    pub num_sms: usize,
    /// Decode CTAs one SM holds at the tile's deepest ring.
    pub ctas_per_sm: usize,
}

/// K/V ring stages of a decode launch: the tile's deepest ring where all
/// its CTAs are resident at that ring's footprint and either its distinct
/// K/V streams (CTAs over `row_tiles`) are at most one per SM, or its CTAs
/// are short ([`SHORT_CTA_BLOCKS`]); else the tile's `busy_stages`. A
/// stream's CTAs wait on its loads together, so with few streams per SM
/// more blocks in flight hide that latency; with more, the busy ring's
/// smaller footprint was 1-2 % faster at HBM bandwidth (H200, v64c). The
/// row tiles of one stream at the busy ring have one distinct block in
/// flight between them: Qwen 28/4 with 4 new tokens (two row tiles per KV
/// head, 256 CTAs) ran 1.17-1.23x faster at the deep ring (v65).
pub(crate) fn ring_stages(tile: &AttnTile, p: &RingProblem) -> usize {
    let resident = p.grid_ctas <= p.num_sms * p.ctas_per_sm;
    let streams = p.grid_ctas.div_ceil(p.row_tiles.max(1));
    if resident && (streams <= p.num_sms || p.blocks_per_cta <= SHORT_CTA_BLOCKS) {
        tile.kv_stages
    } else {
        tile.busy_stages
    }
}

/// What the split-KV choice needs to know of a decode problem.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SplitProblem {
    /// Decode CTAs without splitting: (batch, KV head, row tile).
    pub ctas: usize,
    /// K and V bytes each of them streams.
    pub bytes_per_cta: usize,
    pub key_blocks: usize,
    pub num_sms: usize,
    /// Decode CTAs one SM holds at once.
    pub ctas_per_sm: usize,
    pub max_splits: usize,
    /// Row-wide thread groups of a combine CTA (`config::combine_groups`).
    pub combine_groups: usize,
    /// How much faster a CTA streams with the ring of a grid of at most one
    /// CTA per SM than with the ring of a fuller one: its blocks in flight,
    /// `(kv_stages - 1) / (busy_stages - 1)`. Without it the model split
    /// GQA 32/8 at B = 1 in 32 where 16 (one CTA per SM) was 1.06-1.09x
    /// faster, and MHA at B = 1 in 8 where 4 was 1.02-1.11x faster (H200, v57).
    pub solo_ring_gain: f64,
}

impl SplitProblem {
    /// Predicted µs of the decode step with `s` splits: the keys streamed by
    /// `ctas x s` CTAs, no faster than HBM allows, plus the combine.
    fn predicted_us(&self, s: usize) -> f64 {
        let saturating = (SATURATING_CTAS_PER_SM * self.num_sms as f64)
            .min((self.num_sms * self.ctas_per_sm) as f64);
        let ctas = self.ctas * s;
        let gain = if ctas <= self.num_sms {
            self.solo_ring_gain
        } else {
            1.0
        };
        let streams = (ctas as f64 * gain).min(saturating);
        let stream_us = (self.bytes_per_cta * self.ctas) as f64 / (streams * CTA_BYTES_PER_US);
        let combine_us = if s > 1 {
            let rounds = s
                .div_ceil(COMBINE_SPLIT_GROUP)
                .div_ceil(self.combine_groups.max(1));
            COMBINE_LAUNCH_US + COMBINE_GROUP_US * rounds as f64
        } else {
            0.0
        };
        stream_us + combine_us
    }
}

/// The fewest power-of-two splits whose predicted time
/// ([`SplitProblem::predicted_us`]) is within [`SPLIT_MIN_GAIN`] of the
/// least; 1 below [`MIN_BLOCKS_TO_SPLIT`] key blocks. On H100 the least-time
/// count came within 0.5% (geometric mean) of the best of 1-64 splits over
/// 104 cells at B = 1 and 4 (worst 1.07x), where FlashAttention-2's
/// wave-efficiency rule was 7% off on average and 1.68x at worst
/// (docs/perf-notes.md, v11); on the H200 sweeps of 1-128 splits (v57, v58)
/// this choice is within 0.06-0.12% (worst 1.03x).
pub(crate) fn choose_splits(p: &SplitProblem) -> usize {
    if p.key_blocks < MIN_BLOCKS_TO_SPLIT {
        return 1;
    }
    // Powers of two, as the model was fitted on.
    let times: Vec<(usize, f64)> = std::iter::successors(Some(1usize), |s| Some(s * 2))
        .take_while(|&s| s <= p.max_splits.max(1))
        .map(|s| (s, p.predicted_us(s)))
        .collect();
    let least = times.iter().map(|&(_, t)| t).fold(f64::INFINITY, f64::min);
    times
        .iter()
        .find(|&&(_, t)| t <= least * (1.0 + SPLIT_MIN_GAIN))
        .map_or(1, |&(s, _)| s)
}

#[cfg(test)]
mod tests {
    use super::{
        choose_splits, grids_fit_together, kv_fold, ring_stages, softmax_max_fixed, FoldProblem,
        KvFold, RingProblem, SplitProblem, FIXED_MAX_LOG2_SPAN, SHORT_CTA_BLOCKS,
    };
    use flash_attn_kernels::config::{combine_groups, AttnTile, Dtype, KernelKind, PtxArch};
    use half::bf16;
    use std::f64::consts::LOG2_E;

    /// Phi-3 (32/32 heads, D = 96), D = 32 (16/16) and D = 64 (32/32), one
    /// new token, on the H200's 132 SMs: the shapes of v68's table.
    fn fold_problem(batch: usize, heads: usize, kv_heads: usize, head_dim: usize) -> FoldProblem {
        FoldProblem {
            mode: KvFold::Auto,
            measured_arch: true,
            elem_bytes: 2,
            heads_adjacent: true,
            head_dim,
            kv_heads,
            rows: heads / kv_heads,
            block_m: 16,
            batch,
            num_sms: 132,
        }
    }

    #[test]
    fn kv_heads_fold_in_full_grids() {
        // Measured faster folded (H200, v68): B = 8 and 32.
        for batch in [8, 32] {
            assert_eq!(kv_fold(&fold_problem(batch, 32, 32, 96)), 2);
            assert_eq!(kv_fold(&fold_problem(batch, 16, 16, 32)), 2);
            assert_eq!(kv_fold(&fold_problem(batch, 32, 32, 64)), 2);
        }
        // Slower folded at B = 1 with short caches (16-32 streams).
        assert_eq!(kv_fold(&fold_problem(1, 32, 32, 96)), 1);
        assert_eq!(kv_fold(&fold_problem(1, 16, 16, 32)), 1);
        // Not measured on other modules.
        let other = FoldProblem {
            measured_arch: false,
            ..fold_problem(32, 32, 32, 96)
        };
        assert_eq!(kv_fold(&other), 1);
        assert_eq!(
            kv_fold(&FoldProblem {
                mode: KvFold::On,
                ..other
            }),
            2
        );
    }

    #[test]
    fn kv_heads_fold_only_where_the_call_allows() {
        let base = FoldProblem {
            mode: KvFold::On,
            ..fold_problem(1, 32, 32, 96)
        };
        assert_eq!(kv_fold(&base), 2);
        let refused = [
            FoldProblem {
                elem_bytes: 4,
                ..base
            },
            FoldProblem {
                heads_adjacent: false,
                ..base
            },
            FoldProblem {
                head_dim: 128,
                ..base
            },
            // SmolLM 9/3: an odd KV head count.
            FoldProblem {
                kv_heads: 3,
                rows: 3,
                ..base
            },
            // Llama-3.2-1B (32/8) with 4 new tokens: 32 folded rows.
            FoldProblem {
                kv_heads: 8,
                rows: 16,
                ..base
            },
            // No decode kernel at twice the head dim.
            FoldProblem { block_m: 0, ..base },
            FoldProblem {
                mode: KvFold::Off,
                ..base
            },
        ];
        for p in refused {
            assert_eq!(kv_fold(&p), 1, "{p:?}");
        }
        // 8 rows per KV head still fit one 16-row tile folded.
        assert_eq!(
            kv_fold(&FoldProblem {
                kv_heads: 8,
                rows: 8,
                ..base
            }),
            2
        );
    }

    #[test]
    fn fixed_max_only_where_p_stays_in_range() {
        assert!(softmax_max_fixed(Dtype::Bf16, Some(50.0), false));
        assert!(softmax_max_fixed(Dtype::Bf16, Some(0.5), false));
        assert!(!softmax_max_fixed(Dtype::Bf16, Some(52.0), false));
        assert!(!softmax_max_fixed(Dtype::Bf16, Some(50.0), true));
        assert!(!softmax_max_fixed(Dtype::Bf16, None, false));
        assert!(!softmax_max_fixed(Dtype::F16, Some(50.0), false));
        assert!(!softmax_max_fixed(Dtype::F32, Some(50.0), false));
    }

    /// One row as the kernels compute it with m held at 0: P = 2^logit in
    /// f32 (flushed to 0 below 2^-126, as `ex2.approx.ftz`), summed in f32,
    /// rounded to bf16 for P·V with f32 accumulation. Returns (O, LSE).
    fn fixed_max_row(logits_log2: &[f64], v: &[f64]) -> (f64, f64) {
        let (mut l, mut o) = (0f32, 0f32);
        for (&x, &vj) in logits_log2.iter().zip(v) {
            let p = (x as f32).exp2();
            let p = if p < f32::MIN_POSITIVE { 0.0 } else { p };
            l += p;
            o += bf16::from_f32(p).to_f32() * bf16::from_f64(vj).to_f32();
        }
        (f64::from(o / l), f64::from(l).log2() / LOG2_E)
    }

    /// The same row in f64 with its own max.
    fn exact_row(logits_log2: &[f64], v: &[f64]) -> (f64, f64) {
        let m = logits_log2
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = logits_log2.iter().map(|x| (x - m).exp2()).collect();
        let l: f64 = p.iter().sum();
        let o = p.iter().zip(v).map(|(p, v)| p * v).sum::<f64>() / l;
        (o, (m + l.log2()) / LOG2_E)
    }

    /// At the largest allowed span, rows whose logits all sit at the
    /// bottom of the range, at the top, or spread over all of it keep bf16's
    /// accuracy over 2^14 keys; at twice the span every one breaks (the
    /// bottom row's P all flush to 0, the others' top P overflow), so the
    /// bound is what keeps them.
    #[test]
    fn fixed_max_rows_keep_bf16_accuracy_within_the_span() {
        let keys = 1 << 14;
        let v: Vec<f64> = (0..keys)
            .map(|j| ((j * 37 % 101) as f64 / 50.0) - 1.0)
            .collect();
        let rows = |k: f64| -> Vec<Vec<f64>> {
            let at = |lo: f64, hi: f64| -> Vec<f64> {
                (0..keys)
                    .map(|j| lo + (hi - lo) * ((j * 61 % 97) as f64 / 96.0))
                    .collect()
            };
            vec![at(-k, -k + 3.0), at(k - 3.0, k), at(-k, k)]
        };
        let k = f64::from(FIXED_MAX_LOG2_SPAN);
        for row in rows(k) {
            let (got, want) = (fixed_max_row(&row, &v), exact_row(&row, &v));
            // bf16's rounding of P and V: 2^-8 relative per term.
            assert!((got.0 - want.0).abs() <= 2f64.powi(-7), "{got:?} {want:?}");
            assert!(
                (got.1 - want.1).abs() <= 1e-4 * want.1.abs().max(1.0),
                "{got:?} {want:?}"
            );
        }
        let broken = rows(2.0 * k)
            .iter()
            .filter(|row| {
                let (got, want) = (fixed_max_row(row, &v), exact_row(row, &v));
                // NaN (a row of flushed P: 0 / 0) counts as broken.
                (got.0 - want.0).abs().is_nan() || (got.0 - want.0).abs() > 2f64.powi(-7)
            })
            .count();
        assert_eq!(broken, 3);
    }

    /// A decode problem on an H100 or H200 (132 SMs; the sm_90 decode tiles'
    /// CTAs per SM) of `ctas` CTAs, one row tile per KV head, each streaming
    /// `keys` keys of D = `d` (f16 K and V).
    fn sm90(ctas: usize, keys: usize, d: usize) -> SplitProblem {
        let tile = AttnTile::of(KernelKind::Decode, d, PtxArch::Sm90);
        let key_blocks = keys.div_ceil(tile.block_n);
        SplitProblem {
            ctas,
            bytes_per_cta: keys * 2 * d * 2,
            key_blocks,
            num_sms: 132,
            // At three stages shared memory bounds D = 96 (rows padded to
            // 256 bytes: 96 KB), 128, 192 and 256; registers bound D = 32
            // (118 per thread) and 64 (159), ptxas 13.0.88.
            ctas_per_sm: match d {
                32 => 4,
                96 | 128 | 256 => 2,
                _ => 3,
            },
            max_splits: (key_blocks / 2).clamp(1, 128),
            combine_groups: combine_groups(d),
            solo_ring_gain: (tile.kv_stages - 1) as f64 / (tile.busy_stages - 1) as f64,
        }
    }

    #[test]
    fn deep_ring_where_streams_are_few_or_short() {
        let tile = AttnTile::of(KernelKind::Decode, 256, PtxArch::Sm90);
        let (deep, busy) = (tile.kv_stages, tile.busy_stages);
        assert!(deep > busy);
        let grid = |grid_ctas, row_tiles, blocks_per_cta| RingProblem {
            grid_ctas,
            row_tiles,
            blocks_per_cta,
            num_sms: 132,
            ctas_per_sm: 2,
        };
        // One CTA per SM, however long.
        assert_eq!(ring_stages(&tile, &grid(132, 1, 2048)), deep);
        // B = 32 GQA 32/8: 256 CTAs at 2 per SM, 256 keys in 8 blocks.
        assert_eq!(ring_stages(&tile, &grid(256, 1, SHORT_CTA_BLOCKS)), deep);
        assert_eq!(
            ring_stages(&tile, &grid(256, 1, SHORT_CTA_BLOCKS + 1)),
            busy
        );
        // Qwen 28/4 with 4 new tokens: two row tiles share each stream.
        assert_eq!(ring_stages(&tile, &grid(256, 2, 2048)), deep);
        assert_eq!(ring_stages(&tile, &grid(266, 2, 2048)), busy);
        // Few streams or short, but not all resident at the deep footprint.
        assert_eq!(ring_stages(&tile, &grid(265, 1, 1)), busy);
        assert_eq!(ring_stages(&tile, &grid(512, 8, 2048)), busy);
        let one_ring = AttnTile::of(KernelKind::Decode, 64, PtxArch::Sm90);
        assert_eq!(one_ring.kv_stages, one_ring.busy_stages);
        assert_eq!(
            ring_stages(&one_ring, &grid(64, 1, 64)),
            one_ring.busy_stages
        );
    }

    #[test]
    fn short_caches_are_not_split() {
        assert_eq!(choose_splits(&sm90(8, 256, 128)), 1);
        assert_eq!(choose_splits(&sm90(3, 256, 64)), 1);
    }

    #[test]
    fn full_grids_are_not_split() {
        assert_eq!(choose_splits(&sm90(256, 65536, 128)), 1);
        assert_eq!(choose_splits(&sm90(1024, 4096, 128)), 1);
    }

    #[test]
    fn small_batches_split_towards_the_measured_best() {
        // H200, graph-timed sweeps of 1-128 splits (v57, v58): GQA 32/8 B=1
        // was fastest at 16 splits for L=4k-64k, MHA 32/32 B=1 at 4, SmolLM
        // 9/3 B=1 L=16k at 64 (128: 1.06-1.08x slower), SmolLM B=4 L=4k at
        // 16 (32: 1.05x slower).
        assert_eq!(choose_splits(&sm90(8, 4096, 128)), 16);
        assert_eq!(choose_splits(&sm90(8, 16384, 128)), 16);
        assert_eq!(choose_splits(&sm90(32, 4096, 128)), 4);
        assert_eq!(choose_splits(&sm90(3, 16384, 64)), 64);
        assert_eq!(choose_splits(&sm90(12, 4096, 64)), 16);
        // The other head dims' batch-1 steps (v67's sweeps of 2-128 splits,
        // two passes): Phi-3-mini (32/32, D = 96) fastest at 4 splits for
        // L = 4k and 16k (8: 1.03-1.04x slower at 4k); DeepSeek-V2-Lite
        // unabsorbed (16/16, D = 192) at 8 for L = 1k; 16/16 at D = 32 at
        // 16 for L = 4k (8: 1.05-1.09x slower).
        assert_eq!(choose_splits(&sm90(32, 4096, 96)), 4);
        assert_eq!(choose_splits(&sm90(32, 16384, 96)), 4);
        assert_eq!(choose_splits(&sm90(16, 1024, 192)), 8);
        assert_eq!(choose_splits(&sm90(16, 4096, 32)), 16);
    }

    #[test]
    fn early_decode_start_where_both_grids_fit() {
        // H200 (132 SMs), v59's rows with an append: the early start was
        // faster at GQA 32/8 B = 4 (4 append CTAs beside 128 decode CTAs)
        // and SmolLM B = 1 at 16k (1 beside 192, three to an SM), slower at
        // GQA 32/8 B = 8 (8 beside 128) and Qwen 28/4 B = 32 with 4 tokens
        // (64 beside 256, two to an SM).
        assert!(grids_fit_together(4, 128, 132, 2));
        assert!(grids_fit_together(1, 192, 132, 3));
        assert!(!grids_fit_together(8, 128, 132, 2));
        assert!(!grids_fit_together(64, 256, 132, 2));
    }

    #[test]
    fn splits_respect_the_cap() {
        let mut p = sm90(1, 1 << 20, 128);
        p.max_splits = 5;
        assert!(choose_splits(&p) <= 5);
        p.max_splits = 0;
        assert_eq!(choose_splits(&p), 1);
    }
}
