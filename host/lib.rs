#![warn(missing_docs)]
//! flash-attn: FlashAttention forward, decode and backward kernels written in Rust,
//! compiled to PTX at build time (or taken from the committed, hash-checked
//! PTX), and launched through `cudarc`'s driver API.
//!
//! ```no_run
//! use flash_attn::{AttnOptions, FlashAttention, Layout, Out, Qkv, TensorMut, TensorRef};
//! use cudarc::driver::CudaContext;
//! use half::f16;
//!
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.default_stream();
//! let fa = FlashAttention::new(&ctx)?;
//! let (b, s, h, d) = (2, 1000, 8, 128);
//! let layout = Layout::contiguous([b, s, h, d]);
//! let q = stream.clone_htod(&vec![f16::from_f32(0.1); b * s * h * d])?;
//! let k = q.clone();
//! let v = q.clone();
//! let mut o = stream.alloc_zeros::<f16>(b * s * h * d)?;
//! fa.forward(
//!     &stream,
//!     Qkv {
//!         q: &TensorRef::new(q.as_view(), layout),
//!         k: &TensorRef::new(k.as_view(), layout),
//!         v: &TensorRef::new(v.as_view(), layout),
//!     },
//!     Out::new(TensorMut::new(o.as_view_mut(), layout)),
//!     &AttnOptions { causal: true, ..Default::default() },
//! )?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod attention;
#[cfg(feature = "candle")]
pub mod candle;
mod driver;
mod error;
pub mod hopper;
mod kernels;
pub mod reference;
mod tensor;
pub mod validate;

pub use attention::{
    module_for, BackwardInputs, BlockTable, DecodeStep, DecodeWorkspace, FlashAttention, Grads,
    KvCache, KvFold, LoadedCode, ModuleChoice, Out, PagedVarlen, Qkv, State, Varlen, MODULE_ENV,
};
pub use driver::cuda_device_count;
pub use error::FlashAttnError;
pub use flash_attn_kernels::config::{
    Dtype, PtxArch, BWD_HEAD_DIMS, HOPPER_BWD_HEAD_DIMS, SUPPORTED_HEAD_DIMS,
};
pub use tensor::{AttnElement, Layout, TensorMut, TensorRef};
pub use validate::{
    AlibiSlopes, AttnOptions, BackwardOperands, DecodeShape, ForwardShape, KvCacheShape, Paging,
    VarlenShape, Window,
};

/// The PTX modules embedded in this build, one per target architecture.
pub use kernels::{cubins_for, ptx_text, KernelImage, PTX_SOURCE};
