//! Typed errors. Every user-input error is reported before any launch, and
//! leaves the output buffers untouched.

use flash_attn_kernels::config::Dtype;

/// Why a call was refused (before any launch) or failed in the driver.
#[derive(Debug, thiserror::Error)]
pub enum FlashAttnError {
    /// No kernel is compiled for this head dim.
    #[error("head dim {got} is not supported; supported head dims: {supported:?}")]
    UnsupportedHeadDim {
        /// The head dim asked for.
        got: usize,
        /// The compiled head dims.
        supported: &'static [usize],
    },

    /// V (and O) may have a head dim of their own, within Q/K's.
    #[error("V head dim {v} is not supported with Q/K head dim {qk}: it must be a positive multiple of 8, at most the Q/K head dim")]
    UnsupportedVHeadDim {
        /// The head dim of V (and O).
        v: usize,
        /// The head dim of Q and K.
        qk: usize,
    },

    /// GQA/MQA needs the query heads to be a multiple of the KV heads.
    #[error("{heads} query heads are not a multiple of {kv_heads} KV heads (MQA/GQA needs heads % kv_heads == 0)")]
    HeadsNotDivisible {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },

    /// A tensor's dimension disagrees with the others'.
    #[error("{tensor}: dimension {dim} is {got}, expected {expected}")]
    ShapeMismatch {
        /// The argument's name.
        tensor: &'static str,
        /// The dimension's name or index.
        dim: &'static str,
        /// What the other arguments imply.
        expected: usize,
        /// What the argument has.
        got: usize,
    },

    /// A dimension is zero.
    #[error("{tensor}: dimension {dim} is 0; every dimension must be at least 1")]
    ZeroSized {
        /// The argument's name.
        tensor: &'static str,
        /// The dimension's name or index.
        dim: &'static str,
    },

    /// The head dimension must have stride 1 (16-byte row loads).
    #[error(
        "{tensor}: the last (head) dimension must be contiguous (stride 1), got stride {stride}"
    )]
    NonContiguousLastDim {
        /// The argument's name.
        tensor: &'static str,
        /// Its last dimension's stride.
        stride: usize,
    },

    /// A base address or stride breaks the 16-byte alignment of row loads.
    #[error("{tensor}: {what} is {value} (bytes for an address, elements for a stride); it must be 16-byte aligned for 16-byte loads")]
    Misaligned {
        /// The argument's name.
        tensor: &'static str,
        /// `address` or the stride's name.
        what: &'static str,
        /// The offending value.
        value: u64,
    },

    /// An output's strides map two elements to one address.
    #[error(
        "{tensor}: the strides make distinct elements overlap; an output needs a one-to-one layout"
    )]
    OverlappingOutput {
        /// The argument's name.
        tensor: &'static str,
    },

    /// The layout reaches past the end of the buffer.
    #[error("{tensor}: the buffer holds {len} elements but the layout reaches element {needed}")]
    BufferTooSmall {
        /// The argument's name.
        tensor: &'static str,
        /// Elements the layout spans.
        needed: usize,
        /// Elements in the buffer.
        len: usize,
    },

    /// `softmax_scale` is not finite and positive.
    #[error("softmax_scale must be finite and > 0, got {0}")]
    InvalidScale(f32),

    /// `softcap` is not finite and positive.
    #[error("softcap must be finite and > 0, got {0}")]
    InvalidSoftcap(f32),

    /// ALiBi slopes, sinks or the sinks' gradient of the wrong length.
    #[error("{what}: expected {expected} f32 elements, got {got}")]
    ParamLength {
        /// The option's name.
        what: &'static str,
        /// Elements it needs.
        expected: usize,
        /// Elements given.
        got: usize,
    },

    /// An option that this entry point does not take.
    #[error("{what} is not supported by {entry}")]
    Unsupported {
        /// The option's name.
        what: &'static str,
        /// The entry point.
        entry: &'static str,
    },

    /// `cache_seqlens` does not hold one length per sequence.
    #[error("cache_seqlens has {got} entries, expected one per batch ({expected})")]
    SeqlensLength {
        /// The batch.
        expected: usize,
        /// Entries given.
        got: usize,
    },

    /// The LSE buffer is too short.
    #[error("lse: expected {expected} f32 elements ([batch, heads, seqlen_q]), got {got}")]
    LseLength {
        /// Elements needed.
        expected: usize,
        /// Elements given.
        got: usize,
    },

    /// A size beyond what the kernels' index types or grid allow.
    #[error("{what} = {value} exceeds the kernel's limit of {limit}")]
    TooLarge {
        /// The quantity.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The largest accepted.
        limit: usize,
    },

    /// Pages must hold a positive multiple of 16 tokens.
    #[error("page size {page_size} is not a positive multiple of {multiple} tokens")]
    PageSize {
        /// The page pool's page size.
        page_size: usize,
        /// The multiple required.
        multiple: usize,
    },

    /// The block table is shorter than batch x max_pages.
    #[error("block table has {got} entries, expected batch x max_pages = {expected}")]
    BlockTableLength {
        /// Entries needed.
        expected: usize,
        /// Entries given.
        got: usize,
    },

    /// `num_splits` outside 1..=max.
    #[error("num_splits must be in 1..={max}, got {got}")]
    NumSplits {
        /// The value given.
        got: usize,
        /// The largest accepted.
        max: usize,
    },

    /// `hopper_rows` other than 64, 128 or 192.
    #[error("hopper_rows must be 64, 128 or 192, got {got}")]
    HopperRows {
        /// The value given.
        got: usize,
    },

    /// `hopper_keys` other than the keys per block of some Hopper line.
    #[error("hopper_keys must be 64, 80, 112 or 128, got {got}")]
    HopperKeys {
        /// The value given.
        got: usize,
    },

    /// The decode workspace is smaller than the problem's partials.
    #[error("decode workspace holds {len} f32 partials, the problem needs {needed}")]
    WorkspaceTooSmall {
        /// f32 elements needed.
        needed: usize,
        /// f32 elements in the workspace.
        len: usize,
    },

    /// No kernel of the loaded module serves this element type for this
    /// call: Turing's tensor cores (the `sm_75` module) have no bf16, and
    /// `merge_states` has no f32 kernel.
    #[error("{} is not supported for {call} by the {arch} kernels (bf16 needs sm_80 or newer; merge_states takes f16/bf16)", dtype.name())]
    UnsupportedDtype {
        /// The element type asked for.
        dtype: Dtype,
        /// The loaded module's target, e.g. `sm_75`.
        arch: &'static str,
        /// The entry point, e.g. `forward`.
        call: &'static str,
    },

    /// The GPU is older than Turing.
    #[error("GPU compute capability {major}.{minor} is below the required 7.5 (Turing or newer)")]
    UnsupportedArch {
        /// Compute capability, major.
        major: i32,
        /// Compute capability, minor.
        minor: i32,
    },

    /// The loaded module lacks an entry point (a build/module mismatch).
    #[error("{0} is not in the loaded PTX module")]
    MissingKernel(&'static str),

    /// The CUDA driver failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}
