//! Tensor views over `cudarc` buffers: a device view plus a [B, S, H, D] layout
//! in elements.
use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use flash_attn_kernels::config::Dtype;

/// Shape and element strides of a [batch, seq, heads, head_dim] tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// [batch, seq, heads, head_dim].
    pub shape: [usize; 4],
    /// Element strides of the same dimensions.
    pub strides: [usize; 4],
}

impl Layout {
    /// Row-major (BSHD-contiguous) layout of `shape`.
    pub fn contiguous(shape: [usize; 4]) -> Layout {
        let [_, s, h, d] = shape;
        Layout {
            shape,
            strides: [s * h * d, h * d, d, 1],
        }
    }

    /// A packed (varlen) [total, heads, head_dim] tensor, row-major, as the
    /// [1, total, heads, head_dim] layout the varlen entry points take.
    pub fn packed([total, heads, head_dim]: [usize; 3]) -> Layout {
        Layout::contiguous([1, total, heads, head_dim])
    }

    /// Number of elements the layout spans, from element 0 to its last element
    /// plus one; `None` on overflow. 0 when any dimension is 0.
    pub fn span(&self) -> Option<usize> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        let mut last = 0usize;
        for (n, s) in self.shape.iter().zip(self.strides) {
            last = last.checked_add((n - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }
}

/// Element types the kernels accept.
pub trait AttnElement:
    DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + std::fmt::Debug + PartialEq + 'static
{
    /// The kernels' name for the type.
    const DTYPE: Dtype;
    /// Exact widening (for the reference and tests).
    fn to_f64(self) -> f64;
    /// Round to nearest.
    fn from_f64(x: f64) -> Self;
}

impl AttnElement for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(x: f64) -> Self {
        half::f16::from_f64(x)
    }
}

/// f32 tensors: rounded to f16 where the kernels stage them into shared
/// memory (the tensor cores' operands), O written in f32 (README, dtypes).
impl AttnElement for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl AttnElement for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(x: f64) -> Self {
        half::bf16::from_f64(x)
    }
}

/// A read-only tensor on the device.
pub struct TensorRef<'a, T> {
    /// The device buffer (element 0 is the layout's origin).
    pub data: CudaView<'a, T>,
    /// Shape and strides in elements.
    pub layout: Layout,
}

impl<'a, T> TensorRef<'a, T> {
    /// A view of `data` with `layout` (checked at the call that uses it).
    pub fn new(data: CudaView<'a, T>, layout: Layout) -> Self {
        TensorRef { data, layout }
    }
}

/// A writable tensor on the device.
pub struct TensorMut<'a, T> {
    /// The device buffer (element 0 is the layout's origin).
    pub data: CudaViewMut<'a, T>,
    /// Shape and strides in elements.
    pub layout: Layout,
}

impl<'a, T> TensorMut<'a, T> {
    /// A view of `data` with `layout` (checked at the call that uses it).
    pub fn new(data: CudaViewMut<'a, T>, layout: Layout) -> Self {
        TensorMut { data, layout }
    }
}
