//! Typed errors. Every user-input error is reported before any launch, and
//! leaves the output buffers untouched.
#[derive(Debug, thiserror::Error)]
pub enum FlashAttnError {
    #[error("head dim {got} is not supported; supported head dims: {supported:?}")]
    UnsupportedHeadDim {
        got: usize,
        supported: &'static [usize],
    },

    #[error("{heads} query heads are not a multiple of {kv_heads} KV heads (MQA/GQA needs heads % kv_heads == 0)")]
    HeadsNotDivisible { heads: usize, kv_heads: usize },

    #[error("{tensor}: dimension {dim} is {got}, expected {expected}")]
    ShapeMismatch {
        tensor: &'static str,
        dim: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("{tensor}: dimension {dim} is 0; every dimension must be at least 1")]
    ZeroSized {
        tensor: &'static str,
        dim: &'static str,
    },

    #[error(
        "{tensor}: the last (head) dimension must be contiguous (stride 1), got stride {stride}"
    )]
    NonContiguousLastDim { tensor: &'static str, stride: usize },

    #[error("{tensor}: {what} is {value} (bytes for an address, elements for a stride); it must be 16-byte aligned for 16-byte loads")]
    Misaligned {
        tensor: &'static str,
        what: &'static str,
        value: u64,
    },

    #[error(
        "{tensor}: the strides make distinct elements overlap; an output needs a one-to-one layout"
    )]
    OverlappingOutput { tensor: &'static str },

    #[error("{tensor}: the buffer holds {len} elements but the layout reaches element {needed}")]
    BufferTooSmall {
        tensor: &'static str,
        needed: usize,
        len: usize,
    },

    #[error("softmax_scale must be finite and > 0, got {0}")]
    InvalidScale(f32),

    #[error("softcap must be finite and > 0, got {0}")]
    InvalidSoftcap(f32),

    #[error("{what}: expected {expected} f32 elements, got {got}")]
    ParamLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("{what} is not supported by {entry}")]
    Unsupported {
        what: &'static str,
        entry: &'static str,
    },

    #[error("cache_seqlens has {got} entries, expected one per batch ({expected})")]
    SeqlensLength { expected: usize, got: usize },

    #[error("lse: expected {expected} f32 elements ([batch, heads, seqlen_q]), got {got}")]
    LseLength { expected: usize, got: usize },

    #[error("{what} = {value} exceeds the kernel's limit of {limit}")]
    TooLarge {
        what: &'static str,
        value: usize,
        limit: usize,
    },

    #[error("page size {page_size} is not a positive multiple of {multiple} tokens")]
    PageSize { page_size: usize, multiple: usize },

    #[error("block table has {got} entries, expected batch x max_pages = {expected}")]
    BlockTableLength { expected: usize, got: usize },

    #[error("num_splits must be in 1..={max}, got {got}")]
    NumSplits { got: usize, max: usize },

    #[error("decode workspace holds {len} f32 partials, the problem needs {needed}")]
    WorkspaceTooSmall { needed: usize, len: usize },

    #[error("GPU compute capability {major}.{minor} is below the required 8.0 (Ampere or newer)")]
    UnsupportedArch { major: i32, minor: i32 },

    #[error("{0} is not in the loaded PTX module")]
    MissingKernel(&'static str),

    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}
