//! Argument validation as pure functions over tensor metadata, so every rule is
//! testable without a GPU. The launch paths call these before anything touches
//! the device.
use crate::error::FlashAttnError;
use crate::tensor::Layout;
use cudarc::driver::CudaView;
use flash_attn_kernels::config::{
    AttnTile, Dtype, Entry, KernelKind, PtxArch, BWD_HEAD_DIMS, BWD_THREADS, CHUNK_ELEMS,
    ELEM_BYTES, HOPPER_ENTRIES, MAX_HEAD_DIM, MAX_SPLITS, PAGE_SIZE_MULTIPLE, REQUIRED_ALIGN_BYTES,
    SUPPORTED_HEAD_DIMS,
};

/// A sliding window around each query's diagonal (FlashAttention 2.6
/// semantics, aligned to the bottom-right like the causal mask): query `i`
/// sees key `j` when `i + Skv - Sq - left <= j <= i + Skv - Sq + right`.
/// `None` leaves that side unbounded; the default is no window at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// Keys left of the diagonal a query sees.
    pub left: Option<usize>,
    /// Keys right of the diagonal a query sees.
    pub right: Option<usize>,
}

impl Window {
    /// No bound on either side.
    pub const UNBOUNDED: Window = Window {
        left: None,
        right: None,
    };

    /// Mistral-style: `left` keys before the diagonal, none after (combine
    /// with `causal` or give `right: Some(0)`).
    pub const fn left(left: usize) -> Window {
        Window {
            left: Some(left),
            right: None,
        }
    }

    /// The window a mask applies: `causal` bounds the right side at 0.
    pub fn effective(self, causal: bool) -> Window {
        Window {
            left: self.left,
            right: if causal { Some(0) } else { self.right },
        }
    }

    /// Whether neither side is bounded (no window).
    pub fn is_unbounded(self) -> bool {
        self.left.is_none() && self.right.is_none()
    }
}

/// ALiBi slopes on the device: bias `-slope * |i + Skv - Sq - j|` is added to
/// the scaled score of query `i` and key `j`.
#[derive(Clone, Copy, Debug)]
pub enum AlibiSlopes<'a> {
    /// f32 `[heads]`, the same for every batch entry.
    PerHead(&'a CudaView<'a, f32>),
    /// f32 [batch, heads], row-major.
    PerBatchHead(&'a CudaView<'a, f32>),
}

/// Options shared by forward, varlen and decode.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnOptions<'a> {
    /// Causal mask aligned to the bottom-right: query `i` sees keys
    /// `j <= i + seqlen_k - seqlen_q` (a window whose right side is 0). A
    /// query row that sees no key gets O = 0 and LSE = -inf.
    pub causal: bool,
    /// Defaults to `1 / sqrt(head_dim)`. Must be finite and positive.
    pub softmax_scale: Option<f32>,
    /// Sliding window; combined with `causal`, whose right bound of 0 wins.
    pub window: Window,
    /// Logit soft-capping (Gemma 2): score = `c * tanh(scale * q·k / c)`.
    /// Must be finite and positive. A bf16 forward with c <= 51.98 and no
    /// ALiBi runs its softmax without a row max (the capped logits are
    /// bounded): O and LSE as with it, for any inputs with Skv · max|V| <
    /// 2^53.
    pub softcap: Option<f32>,
    /// ALiBi slopes (Bloom, MPT), added after the scale (and softcap).
    pub alibi_slopes: Option<AlibiSlopes<'a>>,
    /// f32 `[heads]` attention-sink logits (gpt-oss): each row's softmax
    /// denominator also holds `exp(sink[h])`, with no value attached. The LSE
    /// output includes that term.
    pub sinks: Option<&'a CudaView<'a, f32>>,
    /// Decode only (as FlashAttention's `flash_attn_with_kvcache`): split
    /// each sequence's keys across this many CTAs instead of the heuristic's
    /// choice, in 1..=128, lowered to what the cache length allows (two key
    /// blocks per split). The forward entry points refuse it.
    pub num_splits: Option<usize>,
    /// Forward on the Hopper kernels only: query rows per CTA, 64, 128
    /// or 192, instead of the heuristic's choice (`config::hopper_rows`); a
    /// call without a line of those rows (192 exists for D = 64, 64 for D = 64
    /// and for plain full and causal calls at D = 128) takes its 128-row line.
    /// Setting it also runs a call on its Hopper line where the heuristic
    /// would keep it on `mma.sync` (`config::hopper_padded_short`: D = 32
    /// over few keys). For tuning and tests; other GPUs and the `mma.sync`
    /// path ignore it, other values are refused, and decode calls refuse it.
    /// Varlen calls (packed or paged) have 128-row lines only.
    pub hopper_rows: Option<usize>,
    /// Forward on the Hopper kernels only: `Some(true)` takes the call's
    /// persistent line (at most one CTA per SM, each looping over tiles:
    /// D = 64 and 128, 128 rows, plain full and causal, dense) where one
    /// covers it, `Some(false)` a line with one CTA per tile, instead of the
    /// heuristic's choice (`config::hopper_persistent`). For tuning and tests,
    /// as `hopper_rows`; decode calls refuse it.
    pub hopper_persistent: Option<bool>,
    /// Forward on the Hopper kernels only: keys per K/V block, 64, 80, 112
    /// or 128, instead of the heuristic's choice (`config::hopper_keys`),
    /// where the call's head dim has lines of that many (D = 256: 80, and 64
    /// for plain causal calls, which the heuristic takes up to 2k keys; each
    /// other head dim has one size per rows); a call without such a line
    /// takes its head dim's own. For tuning and tests, as `hopper_rows`;
    /// other values are refused, and decode calls refuse it.
    pub hopper_keys: Option<usize>,
}

/// What validation needs to know of one tensor argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Shape and strides in elements.
    pub layout: Layout,
    /// Elements in the buffer behind the view.
    pub len: usize,
    /// Device address of element 0.
    pub addr: u64,
}

/// The tensors of one call as validation sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operands {
    /// Queries.
    pub q: TensorInfo,
    /// Keys: for a decode the K cache, for a paged call the K page pool.
    pub k: TensorInfo,
    /// Values, like `k`.
    pub v: TensorInfo,
    /// The output.
    pub o: TensorInfo,
    /// The f32 LSE buffer's length, when one is asked for.
    pub lse_len: Option<usize>,
}

/// A validated forward problem.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ForwardShape {
    /// Sequences.
    pub batch: usize,
    /// Query tokens per sequence.
    pub seqlen_q: usize,
    /// Key tokens per sequence.
    pub seqlen_k: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Head dimension of Q and K.
    pub head_dim: usize,
    /// Head dimension of V and O, at most `head_dim` (DeepSeek's MLA
    /// prefill: 192 for Q·K, 128 for V); 0 means `head_dim`
    /// ([`ForwardShape::v_dim`]).
    pub v_head_dim: usize,
    /// Bottom-right-aligned causal mask.
    pub causal: bool,
    /// The scale applied to q·k (default 1/sqrt(head_dim) resolved).
    pub softmax_scale: f32,
    /// As given; [`Window::effective`] folds `causal` in.
    pub window: Window,
    /// Logit softcap c, if any.
    pub softcap: Option<f32>,
}

impl ForwardShape {
    /// The window the mask applies (`causal` folded in).
    pub fn mask(&self) -> Window {
        self.window.effective(self.causal)
    }

    /// The head dim of V and O (`v_head_dim`, or `head_dim` for 0).
    pub fn v_dim(&self) -> usize {
        v_dim(self.head_dim, self.v_head_dim)
    }
}

fn v_dim(head_dim: usize, v_head_dim: usize) -> usize {
    if v_head_dim == 0 {
        head_dim
    } else {
        v_head_dim
    }
}

/// A validated decode problem; `cache_len` is the capacity Lmax of the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeShape {
    /// Sequences.
    pub batch: usize,
    /// Query tokens per sequence.
    pub seqlen_q: usize,
    /// Capacity of the cache per sequence (Lmax).
    pub cache_len: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Bottom-right-aligned causal mask.
    pub causal: bool,
    /// The scale applied to q·k (default 1/sqrt(head_dim) resolved).
    pub softmax_scale: f32,
    /// As given; [`Window::effective`] folds `causal` in.
    pub window: Window,
    /// Logit softcap c, if any.
    pub softcap: Option<f32>,
    /// See [`AttnOptions::num_splits`].
    pub num_splits: Option<usize>,
}

impl DecodeShape {
    /// The window the mask applies (`causal` folded in).
    pub fn mask(&self) -> Window {
        self.window.effective(self.causal)
    }
}

/// A validated variable-length (packed) forward problem: Q and O are
/// [total_q, H, D], K and V [total_k, Hkv, D]; sequence `b` owns rows
/// `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of Q (likewise K/V). LSE is
/// [H, total_q].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct VarlenShape {
    /// Sequences.
    pub batch: usize,
    /// Rows of the packed Q.
    pub total_q: usize,
    /// Rows of the packed K/V.
    pub total_k: usize,
    /// Longest query sequence (host-given bound).
    pub max_seqlen_q: usize,
    /// Longest key sequence (host-given bound).
    pub max_seqlen_k: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Head dimension of Q and K.
    pub head_dim: usize,
    /// Head dimension of V and O, as [`ForwardShape::v_head_dim`] (0 means
    /// `head_dim`).
    pub v_head_dim: usize,
    /// Bottom-right-aligned causal mask.
    pub causal: bool,
    /// The scale applied to q·k (default 1/sqrt(head_dim) resolved).
    pub softmax_scale: f32,
    /// As given; [`Window::effective`] folds `causal` in.
    pub window: Window,
    /// Logit softcap c, if any.
    pub softcap: Option<f32>,
}

impl VarlenShape {
    /// The window the mask applies (`causal` folded in).
    pub fn mask(&self) -> Window {
        self.window.effective(self.causal)
    }

    /// The head dim of V and O (`v_head_dim`, or `head_dim` for 0).
    pub fn v_dim(&self) -> usize {
        v_dim(self.head_dim, self.v_head_dim)
    }

    /// The launch geometry: `max_seqlen_q` rows per sequence (the kernel
    /// reads each sequence's own lengths on the device) and `total_k` as the
    /// bound of every key count.
    pub fn grid(&self) -> ForwardShape {
        ForwardShape {
            batch: self.batch,
            seqlen_q: self.max_seqlen_q,
            seqlen_k: self.total_k,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            v_head_dim: self.v_head_dim,
            causal: self.causal,
            softmax_scale: self.softmax_scale,
            window: self.window,
            softcap: self.softcap,
        }
    }
}

/// Grid dimensions y and z are limited to 65535 CTAs.
const MAX_GRID_YZ: usize = 65_535;
/// Sequence lengths and counts travel as u32/i32 in the launch parameters.
const MAX_LEN: usize = i32::MAX as usize;

const DIM_NAMES: [&str; 4] = ["batch", "seqlen", "heads", "head_dim"];

fn check_tensor(name: &'static str, t: &TensorInfo) -> Result<(), FlashAttnError> {
    for (dim, &n) in DIM_NAMES.iter().zip(&t.layout.shape) {
        if n == 0 {
            return Err(FlashAttnError::ZeroSized { tensor: name, dim });
        }
        if n > MAX_LEN {
            return Err(FlashAttnError::TooLarge {
                what: dim,
                value: n,
                limit: MAX_LEN,
            });
        }
    }
    if t.layout.strides[3] != 1 {
        return Err(FlashAttnError::NonContiguousLastDim {
            tensor: name,
            stride: t.layout.strides[3],
        });
    }
    if !t.addr.is_multiple_of(REQUIRED_ALIGN_BYTES as u64) {
        return Err(FlashAttnError::Misaligned {
            tensor: name,
            what: "the base address",
            value: t.addr,
        });
    }
    let align_elems = REQUIRED_ALIGN_BYTES / ELEM_BYTES;
    let stride_names = ["the batch stride", "the sequence stride", "the head stride"];
    for ((what, &stride), &extent) in stride_names
        .iter()
        .zip(&t.layout.strides)
        .zip(&t.layout.shape)
    {
        // A dimension of extent 1 never applies its stride (frameworks often
        // leave an arbitrary one there).
        if extent > 1 && stride % align_elems != 0 {
            return Err(FlashAttnError::Misaligned {
                tensor: name,
                what,
                value: stride as u64,
            });
        }
        // Strides travel as i64 byte-addressable element offsets.
        if stride > i64::MAX as usize / ELEM_BYTES {
            return Err(FlashAttnError::TooLarge {
                what,
                value: stride,
                limit: i64::MAX as usize / ELEM_BYTES,
            });
        }
    }
    let needed = t.layout.span().ok_or(FlashAttnError::TooLarge {
        what: "the layout's extent",
        value: usize::MAX,
        limit: isize::MAX as usize,
    })?;
    if needed > t.len {
        return Err(FlashAttnError::BufferTooSmall {
            tensor: name,
            needed,
            len: t.len,
        });
    }
    Ok(())
}

/// An output written by many threads needs every element at its own address:
/// ordered by stride, each dimension must step past the whole extent of the
/// smaller ones.
fn check_one_to_one(name: &'static str, layout: &Layout) -> Result<(), FlashAttnError> {
    let mut dims: Vec<(usize, usize)> = layout
        .strides
        .iter()
        .zip(&layout.shape)
        .filter(|(_, &n)| n > 1)
        .map(|(&s, &n)| (s, n))
        .collect();
    dims.sort_unstable();
    let mut extent = 1usize;
    for (stride, n) in dims {
        if stride < extent {
            return Err(FlashAttnError::OverlappingOutput { tensor: name });
        }
        extent = stride.saturating_mul(n);
    }
    Ok(())
}

fn expect_dim(
    tensor: &'static str,
    dim: usize,
    expected: usize,
    got: usize,
) -> Result<(), FlashAttnError> {
    if expected != got {
        return Err(FlashAttnError::ShapeMismatch {
            tensor,
            dim: DIM_NAMES[dim],
            expected,
            got,
        });
    }
    Ok(())
}

fn expect_shape(
    tensor: &'static str,
    expected: [usize; 4],
    got: [usize; 4],
) -> Result<(), FlashAttnError> {
    for dim in 0..4 {
        expect_dim(tensor, dim, expected[dim], got[dim])?;
    }
    Ok(())
}

fn check_heads_and_scale(
    head_dim: usize,
    heads: usize,
    kv_heads: usize,
    opts: &AttnOptions,
) -> Result<f32, FlashAttnError> {
    if !AttnTile::supports(head_dim) {
        return Err(FlashAttnError::UnsupportedHeadDim {
            got: head_dim,
            supported: &SUPPORTED_HEAD_DIMS,
        });
    }
    if !heads.is_multiple_of(kv_heads) {
        return Err(FlashAttnError::HeadsNotDivisible { heads, kv_heads });
    }
    if heads > MAX_GRID_YZ {
        return Err(FlashAttnError::TooLarge {
            what: "heads",
            value: heads,
            limit: MAX_GRID_YZ,
        });
    }
    let scale = opts.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
    if !(scale.is_finite() && scale > 0.0) {
        return Err(FlashAttnError::InvalidScale(scale));
    }
    if let Some(c) = opts.softcap {
        if !(c.is_finite() && c > 0.0) {
            return Err(FlashAttnError::InvalidSoftcap(c));
        }
    }
    Ok(scale)
}

/// Checks the lengths of the device-side option tensors (their values live
/// on the device and are used as given): ALiBi slopes `[heads]` or
/// [batch, heads], sinks `[heads]`.
pub fn check_option_lengths(
    opts: &AttnOptions,
    batch: usize,
    heads: usize,
) -> Result<(), FlashAttnError> {
    if let Some(slopes) = opts.alibi_slopes {
        let (expected, got) = match slopes {
            AlibiSlopes::PerHead(v) => (heads, v.len()),
            AlibiSlopes::PerBatchHead(v) => (batch * heads, v.len()),
        };
        if got < expected {
            return Err(FlashAttnError::ParamLength {
                what: "alibi_slopes",
                expected,
                got,
            });
        }
    }
    if let Some(sinks) = opts.sinks {
        if sinks.len() < heads {
            return Err(FlashAttnError::ParamLength {
                what: "sinks",
                expected: heads,
                got: sinks.len(),
            });
        }
    }
    Ok(())
}

fn check_lse(
    lse_len: Option<usize>,
    batch: usize,
    heads: usize,
    seqlen_q: usize,
) -> Result<(), FlashAttnError> {
    if let Some(got) = lse_len {
        let expected = batch * heads * seqlen_q;
        if got < expected {
            return Err(FlashAttnError::LseLength { expected, got });
        }
    }
    Ok(())
}

/// Whether the loaded module `arch` has the kernels of `kinds` for `dtype`
/// (bf16 needs sm_80: Turing's tensor cores have none; merging has no f32
/// kernel); `call` names the entry point in the error.
pub fn check_dtype(
    arch: PtxArch,
    dtype: Dtype,
    kinds: &[KernelKind],
    call: &'static str,
) -> Result<(), FlashAttnError> {
    let compiled = |kind: &KernelKind| {
        arch.entries().iter().any(|e| {
            e.kind == *kind
                && (e.dtype == dtype
                    || matches!(kind, KernelKind::Append | KernelKind::BackwardSinks))
        })
    };
    if arch.has_dtype(dtype) && kinds.iter().all(compiled) {
        Ok(())
    } else {
        Err(FlashAttnError::UnsupportedDtype {
            dtype,
            arch: arch.target_cpu(),
            call,
        })
    }
}

/// Validates a forward call: Q/O [B, Sq, H, D], K/V [B, Skv, Hkv, D].
pub fn check_forward(t: &Operands, opts: &AttnOptions) -> Result<ForwardShape, FlashAttnError> {
    refuse("num_splits", opts.num_splits, "forward")?;
    check_hopper_pick(opts)?;
    check_dense(t, opts)
}

/// `hopper_rows` and `hopper_keys`, where given, are the rows (64, 128 or
/// 192) and the keys per block (64, 80, 112 or 128) of some Hopper line.
fn check_hopper_pick(opts: &AttnOptions) -> Result<(), FlashAttnError> {
    let some_line = |of: &dyn Fn(&Entry) -> bool| {
        HOPPER_ENTRIES
            .iter()
            .any(|e| e.kind == KernelKind::WgmmaForward && of(e))
    };
    if let Some(got) = opts.hopper_rows {
        if !some_line(&|e| e.rows == got) {
            return Err(FlashAttnError::HopperRows { got });
        }
    }
    if let Some(got) = opts.hopper_keys {
        if !some_line(&|e| e.hopper_tile().block_n == got) {
            return Err(FlashAttnError::HopperKeys { got });
        }
    }
    Ok(())
}

/// An option `entry` does not take: the forward kernels never split the
/// keys (`num_splits`), and decode picks no Hopper line (`hopper_*`).
fn refuse(
    what: &'static str,
    given: Option<usize>,
    entry: &'static str,
) -> Result<(), FlashAttnError> {
    match given {
        None => Ok(()),
        Some(_) => Err(FlashAttnError::Unsupported { what, entry }),
    }
}

/// The checks of [`check_forward`] that decode shares.
fn check_dense(t: &Operands, opts: &AttnOptions) -> Result<ForwardShape, FlashAttnError> {
    let Operands {
        q,
        k,
        v,
        o,
        lse_len,
    } = t;
    let [batch, seqlen_q, heads, head_dim] = q.layout.shape;
    check_tensor("q", q)?;
    check_tensor("k", k)?;
    check_tensor("v", v)?;
    check_tensor("o", o)?;
    check_one_to_one("o", &o.layout)?;
    let [kb, seqlen_k, kv_heads, kd] = k.layout.shape;
    expect_dim("k", 0, batch, kb)?;
    expect_dim("k", 3, head_dim, kd)?;
    // V, and so O, may have a head dim of their own.
    let v_head_dim = expect_v_shape("v", k.layout.shape, v.layout.shape)?;
    expect_shape(
        "o",
        with_head_dim(q.layout.shape, v_head_dim),
        o.layout.shape,
    )?;
    let softmax_scale = check_heads_and_scale(head_dim, heads, kv_heads, opts)?;
    check_v_head_dim(head_dim, v_head_dim)?;
    if batch > MAX_GRID_YZ {
        return Err(FlashAttnError::TooLarge {
            what: "batch",
            value: batch,
            limit: MAX_GRID_YZ,
        });
    }
    check_lse(*lse_len, batch, heads, seqlen_q)?;
    check_option_lengths(opts, batch, heads)?;
    Ok(ForwardShape {
        batch,
        seqlen_q,
        seqlen_k,
        heads,
        kv_heads,
        head_dim,
        v_head_dim,
        causal: opts.causal,
        softmax_scale,
        window: opts.window,
        softcap: opts.softcap,
    })
}

fn with_head_dim([b, s, h, _]: [usize; 4], head_dim: usize) -> [usize; 4] {
    [b, s, h, head_dim]
}

/// V's shape is K's but for a head dim of its own, which it returns
/// ([`check_v_head_dim`] checks that one).
fn expect_v_shape(
    tensor: &'static str,
    k: [usize; 4],
    v: [usize; 4],
) -> Result<usize, FlashAttnError> {
    expect_shape(tensor, with_head_dim(k, v[3]), v)?;
    Ok(v[3])
}

/// V's head dim: a positive multiple of 8 within Q/K's (the kernel of Q/K's
/// head dim loads V's missing columns as zeros).
pub fn check_v_head_dim(head_dim: usize, v_head_dim: usize) -> Result<(), FlashAttnError> {
    if v_head_dim == 0 || !v_head_dim.is_multiple_of(CHUNK_ELEMS) || v_head_dim > head_dim {
        return Err(FlashAttnError::UnsupportedVHeadDim {
            v: v_head_dim,
            qk: head_dim,
        });
    }
    Ok(())
}

/// Validates a decode call: Q/O [B, Sq, H, D], K/V caches [B, Lmax, Hkv, D],
/// `cache_seqlens` one i32 per batch entry. The values of `cache_seqlens` live
/// on the device and cannot be checked here; the kernel clamps each to
/// `[0, Lmax]`.
pub fn check_decode(
    t: &Operands,
    cache_seqlens_len: usize,
    opts: &AttnOptions,
) -> Result<DecodeShape, FlashAttnError> {
    refuse("hopper_rows", opts.hopper_rows, "decode")?;
    refuse(
        "hopper_persistent",
        opts.hopper_persistent.map(usize::from),
        "decode",
    )?;
    refuse("hopper_keys", opts.hopper_keys, "decode")?;
    let shape = check_dense(t, opts)?;
    if shape.v_head_dim != shape.head_dim {
        return Err(FlashAttnError::Unsupported {
            what: "a V head dim other than Q/K's",
            entry: "decode",
        });
    }
    if let Some(n) = opts.num_splits {
        if n == 0 || n > MAX_SPLITS {
            return Err(FlashAttnError::NumSplits {
                got: n,
                max: MAX_SPLITS,
            });
        }
    }
    if cache_seqlens_len != shape.batch {
        return Err(FlashAttnError::SeqlensLength {
            expected: shape.batch,
            got: cache_seqlens_len,
        });
    }
    Ok(DecodeShape {
        batch: shape.batch,
        seqlen_q: shape.seqlen_q,
        cache_len: shape.seqlen_k,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        causal: shape.causal,
        softmax_scale: shape.softmax_scale,
        window: shape.window,
        softcap: shape.softcap,
        num_splits: opts.num_splits,
    })
}

/// Geometry of a paged KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Paging {
    /// Tokens per page.
    pub page_size: usize,
    /// Pages per sequence in the block table.
    pub max_pages: usize,
    /// Pages in the pool.
    pub num_pages: usize,
}

/// A validated [`check_kvcache`] problem. `decode.cache_len` is the capacity
/// per sequence (Lmax, or max_pages x page_size).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvCacheShape {
    /// The decode problem over the logical cache.
    pub decode: DecodeShape,
    /// The page pool's geometry, when paged.
    pub paging: Option<Paging>,
    /// Tokens appended before attending (0 without new K/V).
    pub seqlen_new: usize,
}

/// The geometry of a page pool `k_cache` [num_pages, page_size, Hkv, D]
/// addressed by a block table of `entries` i32 = [batch, max_pages].
fn check_paging(
    k_cache: &TensorInfo,
    batch: usize,
    (entries, max_pages): (usize, usize),
) -> Result<Paging, FlashAttnError> {
    let [num_pages, page_size, _, _] = k_cache.layout.shape;
    if page_size == 0 || page_size % PAGE_SIZE_MULTIPLE != 0 {
        return Err(FlashAttnError::PageSize {
            page_size,
            multiple: PAGE_SIZE_MULTIPLE,
        });
    }
    if max_pages == 0 {
        return Err(FlashAttnError::ZeroSized {
            tensor: "block_table",
            dim: "max_pages",
        });
    }
    let expected = batch
        .checked_mul(max_pages)
        .ok_or(FlashAttnError::TooLarge {
            what: "batch x max_pages",
            value: usize::MAX,
            limit: MAX_LEN,
        })?;
    if entries < expected {
        return Err(FlashAttnError::BlockTableLength {
            expected,
            got: entries,
        });
    }
    Ok(Paging {
        page_size,
        max_pages,
        num_pages,
    })
}

/// A page pool checked as if it were a [`lead`, capacity, Hkv, D] tensor:
/// the per-tensor rules (strides, alignment, extent) apply to the pool, and
/// the shape rules see the logical cache of `max_pages x page_size` keys.
fn logical_cache(
    name: &'static str,
    t: &TensorInfo,
    lead: usize,
    p: Paging,
) -> Result<TensorInfo, FlashAttnError> {
    check_tensor(name, t)?;
    let capacity = p
        .max_pages
        .checked_mul(p.page_size)
        .filter(|&c| c <= MAX_LEN)
        .ok_or(FlashAttnError::TooLarge {
            what: "max_pages x page_size",
            value: usize::MAX,
            limit: MAX_LEN,
        })?;
    let [_, _, h, d] = t.layout.shape;
    let layout = Layout {
        shape: [lead, capacity, h, d],
        strides: [0, 0, t.layout.strides[2], 1],
    };
    Ok(TensorInfo {
        layout,
        len: layout.span().unwrap_or(usize::MAX),
        addr: t.addr,
    })
}

/// Validates a decode call against a KV cache that may be paged and may get
/// `new_kv` = (K_new, V_new) [B, Snew, Hkv, D] appended first. Contiguous
/// caches are [B, Lmax, Hkv, D]; paged ones are page pools [num_pages,
/// page_size, Hkv, D] with `block_table` = (entries, max_pages) describing an
/// i32 [B, max_pages] table. Page indices and `cache_seqlens` values live on
/// the device and are clamped there, not checked here.
pub fn check_kvcache(
    t: &Operands,
    cache_seqlens_len: usize,
    block_table: Option<(usize, usize)>,
    new_kv: Option<(&TensorInfo, &TensorInfo)>,
    opts: &AttnOptions,
) -> Result<KvCacheShape, FlashAttnError> {
    let (k_cache, v_cache) = (&t.k, &t.v);
    let batch = t.q.layout.shape[0];
    let paging = match block_table {
        None => None,
        Some(table) => Some(check_paging(k_cache, batch, table)?),
    };
    let logical = |name: &'static str, t: &TensorInfo| match paging {
        None => Ok(*t),
        Some(p) => logical_cache(name, t, batch, p),
    };
    if paging.is_some() {
        expect_shape("v_cache", k_cache.layout.shape, v_cache.layout.shape)?;
    }
    let cache_view = Operands {
        k: logical("k_cache", k_cache)?,
        v: logical("v_cache", v_cache)?,
        ..*t
    };
    let decode = check_decode(&cache_view, cache_seqlens_len, opts)?;
    let seqlen_new = match new_kv {
        None => 0,
        Some((k_new, v_new)) => {
            check_tensor("k_new", k_new)?;
            check_tensor("v_new", v_new)?;
            let [_, s_new, _, _] = k_new.layout.shape;
            expect_shape(
                "k_new",
                [batch, s_new, decode.kv_heads, decode.head_dim],
                k_new.layout.shape,
            )?;
            expect_shape("v_new", k_new.layout.shape, v_new.layout.shape)?;
            if s_new > decode.cache_len {
                return Err(FlashAttnError::TooLarge {
                    what: "new tokens",
                    value: s_new,
                    limit: decode.cache_len,
                });
            }
            s_new
        }
    };
    Ok(KvCacheShape {
        decode,
        paging,
        seqlen_new,
    })
}

/// Validates a varlen call: Q/O [total_q, H, D] and K/V [total_k, Hkv, D]
/// given as layouts of shape [1, total, heads, head_dim] (see
/// [`Layout::packed`]), `cu_seqlens_q`/`cu_seqlens_k` of `batch + 1` i32
/// each, and the host's `max_seqlen_q`/`max_seqlen_k`. The `cu_seqlens`
/// values live on the device: the kernel clamps each sequence to the packed
/// tensors and to `max_seqlen_q` rows (rows past it are not written).
pub fn check_varlen(
    t: &Operands,
    cu_seqlens_q_len: usize,
    cu_seqlens_k_len: usize,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    opts: &AttnOptions,
) -> Result<VarlenShape, FlashAttnError> {
    let batch = varlen_batch(cu_seqlens_q_len)?;
    check_hopper_pick(opts)?;
    if cu_seqlens_k_len != cu_seqlens_q_len {
        return Err(FlashAttnError::SeqlensLength {
            expected: cu_seqlens_q_len,
            got: cu_seqlens_k_len,
        });
    }
    check_packed(t, batch, (max_seqlen_q, max_seqlen_k), opts)
}

/// Validates packed queries against a paged KV cache (chunked prefill): Q/O
/// [total_q, H, D] as [`Layout::packed`] layouts with `cu_seqlens_q` of
/// `batch + 1` i32; K/V page pools [num_pages, page_size, Hkv, D];
/// `seqlens_k` of `batch` i32 (keys per sequence, on the device); a block
/// table of `entries` i32 = [batch, max_pages]. The shape's `total_k` and
/// `max_seqlen_k` are the capacity per sequence, `max_pages x page_size`,
/// which the kernel clamps each `seqlens_k` entry to.
pub fn check_varlen_paged(
    t: &Operands,
    cu_seqlens_q_len: usize,
    seqlens_k_len: usize,
    block_table: (usize, usize),
    max_seqlen_q: usize,
    opts: &AttnOptions,
) -> Result<(VarlenShape, Paging), FlashAttnError> {
    let (k_cache, v_cache) = (&t.k, &t.v);
    let batch = varlen_batch(cu_seqlens_q_len)?;
    check_hopper_pick(opts)?;
    if seqlens_k_len != batch {
        return Err(FlashAttnError::SeqlensLength {
            expected: batch,
            got: seqlens_k_len,
        });
    }
    let paging = check_paging(k_cache, batch, block_table)?;
    expect_v_shape("v_cache", k_cache.layout.shape, v_cache.layout.shape)?;
    let cache_view = Operands {
        k: logical_cache("k_cache", k_cache, 1, paging)?,
        v: logical_cache("v_cache", v_cache, 1, paging)?,
        ..*t
    };
    let capacity = cache_view.k.layout.shape[1];
    let shape = check_packed(&cache_view, batch, (max_seqlen_q, capacity), opts)?;
    Ok((shape, paging))
}

/// The batch of a varlen call from the length of `cu_seqlens_q` (B + 1).
fn varlen_batch(cu_seqlens_q_len: usize) -> Result<usize, FlashAttnError> {
    if cu_seqlens_q_len < 2 {
        return Err(FlashAttnError::SeqlensLength {
            expected: 2,
            got: cu_seqlens_q_len,
        });
    }
    let batch = cu_seqlens_q_len - 1;
    if batch > MAX_GRID_YZ {
        return Err(FlashAttnError::TooLarge {
            what: "batch",
            value: batch,
            limit: MAX_GRID_YZ,
        });
    }
    Ok(batch)
}

/// The rules every packed-query call shares: the tensors as one sequence
/// each ([1, total, heads, head_dim]), the host's maximum lengths within the
/// packed rows, the LSE [H, total_q] and the option lengths.
fn check_packed(
    t: &Operands,
    batch: usize,
    (max_seqlen_q, max_seqlen_k): (usize, usize),
    opts: &AttnOptions,
) -> Result<VarlenShape, FlashAttnError> {
    for (name, x) in [("q", &t.q), ("k", &t.k), ("v", &t.v), ("o", &t.o)] {
        expect_dim(name, 0, 1, x.layout.shape[0])?;
    }
    refuse("num_splits", opts.num_splits, "varlen forward")?;
    // The LSE of packed rows is [H, total_q], checked below.
    let shape = check_dense(
        &Operands {
            lse_len: None,
            ..*t
        },
        opts,
    )?;
    let (total_q, total_k) = (shape.seqlen_q, shape.seqlen_k);
    for (what, value, total) in [
        ("max_seqlen_q", max_seqlen_q, total_q),
        ("max_seqlen_k", max_seqlen_k, total_k),
    ] {
        if value == 0 {
            return Err(FlashAttnError::ZeroSized {
                tensor: "varlen",
                dim: what,
            });
        }
        if value > total {
            return Err(FlashAttnError::TooLarge {
                what,
                value,
                limit: total,
            });
        }
    }
    check_lse(t.lse_len, 1, shape.heads, total_q)?;
    check_option_lengths(opts, batch, shape.heads)?;
    Ok(VarlenShape {
        batch,
        total_q,
        total_k,
        max_seqlen_q,
        max_seqlen_k,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        v_head_dim: shape.v_head_dim,
        causal: opts.causal,
        softmax_scale: shape.softmax_scale,
        window: opts.window,
        softcap: opts.softcap,
    })
}

/// The tensors of a backward call as validation sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardOperands {
    /// Q, K, V, the forward's O and its LSE's length.
    pub fwd: Operands,
    /// dO, shaped like O.
    pub d_o: TensorInfo,
    /// dQ, shaped like Q.
    pub dq: TensorInfo,
    /// dK, shaped like K.
    pub dk: TensorInfo,
    /// dV, shaped like V.
    pub dv: TensorInfo,
    /// The length of the sinks' gradient buffer, if one is given.
    pub d_sinks_len: Option<usize>,
}

/// The shape of a backward call, fixed-batch or packed (varlen).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackwardShape {
    /// Sequences.
    pub batch: usize,
    /// Query tokens per sequence; varlen: the longest sequence's
    /// (`max_seqlen_q`).
    pub seqlen_q: usize,
    /// Keys per sequence; varlen: `max_seqlen_k`.
    pub seqlen_k: usize,
    /// Query heads.
    pub heads: usize,
    /// K/V heads (divides `heads`).
    pub kv_heads: usize,
    /// Head dim of Q, K and V.
    pub head_dim: usize,
    /// Varlen: the packed rows of Q (`total_q`) and of K/V (`total_k`).
    pub packed: Option<(usize, usize)>,
    /// The window the mask applies (`causal` folded in).
    pub mask: Window,
    /// The scale applied to q·k (default 1/sqrt(head_dim) resolved).
    pub softmax_scale: f32,
}

impl BackwardShape {
    /// Query rows of all heads: the f32 rows of the LSE, `delta` and the
    /// dQ buffer (B · H · Sq, or H · total_q packed).
    pub fn query_rows(&self) -> usize {
        match self.packed {
            Some((total_q, _)) => self.heads * total_q,
            None => self.batch * self.heads * self.seqlen_q,
        }
    }
}

/// Validates a backward call: the forward's tensors and options as
/// [`check_forward`] takes them (the LSE required), dO shaped like O,
/// one-to-one dQ, dK and dV shaped like Q, K and V, and a sinks' gradient
/// of `[heads]` (only with sinks). The backward kernels take every mask and
/// score option and GQA; a V head dim of its own and head dims outside
/// [`BWD_HEAD_DIMS`] are refused.
pub fn check_backward(
    t: &BackwardOperands,
    opts: &AttnOptions,
) -> Result<BackwardShape, FlashAttnError> {
    const ENTRY: &str = "backward";
    refuse_backward_options(t, opts, ENTRY)?;
    let s = check_dense(&t.fwd, opts)?;
    let shape = BackwardShape {
        batch: s.batch,
        seqlen_q: s.seqlen_q,
        seqlen_k: s.seqlen_k,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        packed: None,
        mask: s.mask(),
        softmax_scale: s.softmax_scale,
    };
    check_gradients(t, opts, &shape, s.v_dim(), ENTRY)?;
    Ok(shape)
}

/// Validates a varlen backward call: the forward's tensors, `cu_seqlens`
/// lengths, bounds and options as [`check_varlen`] takes them (the LSE
/// [H, total_q] required), and the gradients as [`check_backward`] does,
/// shaped like the packed tensors.
pub fn check_backward_varlen(
    t: &BackwardOperands,
    (cu_seqlens_q_len, cu_seqlens_k_len): (usize, usize),
    (max_seqlen_q, max_seqlen_k): (usize, usize),
    opts: &AttnOptions,
) -> Result<BackwardShape, FlashAttnError> {
    const ENTRY: &str = "backward_varlen";
    refuse_backward_options(t, opts, ENTRY)?;
    let s = check_varlen(
        &t.fwd,
        cu_seqlens_q_len,
        cu_seqlens_k_len,
        max_seqlen_q,
        max_seqlen_k,
        opts,
    )?;
    let shape = BackwardShape {
        batch: s.batch,
        seqlen_q: s.max_seqlen_q,
        seqlen_k: s.max_seqlen_k,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        packed: Some((s.total_q, s.total_k)),
        mask: s.mask(),
        softmax_scale: s.softmax_scale,
    };
    check_gradients(t, opts, &shape, s.v_dim(), ENTRY)?;
    Ok(shape)
}

/// The forward options a backward call has no use for, and the LSE it needs.
fn refuse_backward_options(
    t: &BackwardOperands,
    opts: &AttnOptions,
    entry: &'static str,
) -> Result<(), FlashAttnError> {
    refuse("num_splits", opts.num_splits, entry)?;
    refuse("hopper_rows", opts.hopper_rows, entry)?;
    refuse("hopper_keys", opts.hopper_keys, entry)?;
    if t.fwd.lse_len.is_none() {
        return Err(FlashAttnError::Unsupported {
            what: "a call without the forward's LSE",
            entry,
        });
    }
    Ok(())
}

/// The backward's own checks, after the forward's: its head dims, dO, the
/// gradients and the sinks' gradient, and the dQ kernel's grid.
fn check_gradients(
    t: &BackwardOperands,
    opts: &AttnOptions,
    shape: &BackwardShape,
    v_dim: usize,
    entry: &'static str,
) -> Result<(), FlashAttnError> {
    if !BWD_HEAD_DIMS.contains(&shape.head_dim) {
        return Err(FlashAttnError::UnsupportedHeadDim {
            got: shape.head_dim,
            supported: &BWD_HEAD_DIMS,
        });
    }
    if v_dim != shape.head_dim {
        return Err(FlashAttnError::Unsupported {
            what: "a V head dim of its own",
            entry,
        });
    }
    if let Some(got) = t.d_sinks_len {
        if opts.sinks.is_none() {
            return Err(FlashAttnError::Unsupported {
                what: "d_sinks without sinks",
                entry,
            });
        }
        if got < shape.heads {
            return Err(FlashAttnError::ParamLength {
                what: "d_sinks",
                expected: shape.heads,
                got,
            });
        }
    }
    check_tensor("d_o", &t.d_o)?;
    expect_shape("d_o", t.fwd.o.layout.shape, t.d_o.layout.shape)?;
    for (name, grad, like) in [
        ("dq", &t.dq, &t.fwd.q),
        ("dk", &t.dk, &t.fwd.k),
        ("dv", &t.dv, &t.fwd.v),
    ] {
        check_tensor(name, grad)?;
        check_one_to_one(name, &grad.layout)?;
        expect_shape(name, like.layout.shape, grad.layout.shape)?;
    }
    // The dQ kernel's grid has a thread per 8-element chunk of dQ, in at
    // most 2^31 - 1 CTAs (grid.x). K/V heads divide the heads, whose bound
    // (grid.y) the forward's checks have checked.
    let chunks = shape.query_rows() * shape.head_dim / CHUNK_ELEMS;
    let limit = i32::MAX as usize * BWD_THREADS;
    if chunks > limit {
        return Err(FlashAttnError::TooLarge {
            what: "query elements / 8",
            value: chunks,
            limit,
        });
    }
    Ok(())
}

/// Validates a `merge_states` call: three O tensors of one [B, S, H, D]
/// shape (D a multiple of 8, at most `MAX_HEAD_DIM`) and three f32 LSEs
/// [B, H, S] (the output LSE optional).
pub fn check_merge(
    o_a: &TensorInfo,
    o_b: &TensorInfo,
    o: &TensorInfo,
    lse_lens: [Option<usize>; 3],
) -> Result<[usize; 4], FlashAttnError> {
    check_tensor("o_a", o_a)?;
    check_tensor("o_b", o_b)?;
    check_tensor("o", o)?;
    check_one_to_one("o", &o.layout)?;
    let shape = o_a.layout.shape;
    expect_shape("o_b", shape, o_b.layout.shape)?;
    expect_shape("o", shape, o.layout.shape)?;
    let [batch, seqlen, heads, head_dim] = shape;
    if head_dim % CHUNK_ELEMS != 0 || head_dim > MAX_HEAD_DIM {
        return Err(FlashAttnError::UnsupportedHeadDim {
            got: head_dim,
            supported: &SUPPORTED_HEAD_DIMS,
        });
    }
    for len in lse_lens {
        check_lse(len, batch, heads, seqlen)?;
    }
    if batch * seqlen * heads * head_dim / CHUNK_ELEMS > u32::MAX as usize {
        return Err(FlashAttnError::TooLarge {
            what: "elements",
            value: batch * seqlen * heads * head_dim,
            limit: u32::MAX as usize,
        });
    }
    Ok(shape)
}
