//! The element types, as seen by the tensor cores and by global memory. f16
//! and bf16 are stored and computed as themselves; f32 inputs are rounded to
//! f16 where they are staged into shared memory (the tensor cores' 16-bit
//! operands; Turing has no tf32), and f32 outputs are written from the f32
//! accumulators.
use super::copy;
use crate::arch::{global, math, mma, smem};
use crate::config::CHUNK_ELEMS;
use crate::unroll::unroll;

pub trait Element {
    /// bf16 rather than f16: picks the element type of a `wgmma`.
    const BF16: bool;
    /// Bytes of one element in global memory. An f32 tensor's strides reach
    /// the kernels in 16-bit units (doubled, `params::BshStrides`), so row
    /// pointers are computed alike; offsets within a row scale by this.
    const BYTES: u32;
    /// D += A·B on one m16n8k16 tile with f32 accumulation.
    fn mma(c: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32);
    /// Two f32 rounded to nearest into one packed pair, `lo` first in memory.
    fn pack(lo: f32, hi: f32) -> u32;
    /// The two values of a packed pair, `lo` (first in memory) first.
    fn unpack(pair: u32) -> (f32, f32);
    /// Copies the [`CHUNK_ELEMS`] elements at `src` into the 16-byte
    /// shared-memory chunk `dst` as packed 16-bit operands, or zeros when
    /// `!valid` (`src` is then not read, but a 16-bit `cp.async` still
    /// names it; compute-sanitizer's memcheck does not flag a 0-byte read
    /// past an allocation, docs/perf-notes.md v63). The default is the
    /// 16-bit copy.
    #[inline(always)]
    fn stage(dst: u32, src: u64, valid: bool) {
        stage_16bit(dst, src, valid)
    }
    /// Writes [`CHUNK_ELEMS`] outputs to `dst`; the default as four packed
    /// pairs.
    #[inline(always)]
    fn store_chunk(dst: u64, v: [f32; CHUNK_ELEMS])
    where
        Self: Sized,
    {
        store_pairs::<Self>(dst, v)
    }
}

pub struct F16;
pub struct Bf16;
/// f32 in global memory, f16 on the tensor cores.
pub struct F32;

/// A chunk of 16-bit outputs: four packed pairs, one 16-byte store.
#[inline(always)]
fn store_pairs<T: Element>(dst: u64, v: [f32; CHUNK_ELEMS]) {
    let mut packed = [0u32; 4];
    unroll::<4>(|e| packed[e] = T::pack(v[2 * e], v[2 * e + 1]));
    global::st_v4_b32(dst, packed);
}

/// The 16-bit chunk copy: `cp.async` or through registers (`copy`).
#[inline(always)]
fn stage_16bit(dst: u32, src: u64, valid: bool) {
    copy::chunk(dst, src, if valid { 16 } else { 0 });
}

impl Element for F16 {
    const BF16: bool = false;
    const BYTES: u32 = 2;
    #[inline(always)]
    fn mma(c: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
        if cfg!(target_feature = "sm_80") {
            mma::m16n8k16_f16(c, a, b0, b1)
        } else {
            // sm_75: the two k-halves (arch::mma's fragment layouts).
            mma::m16n8k8_f16(c, a[0], a[1], b0);
            mma::m16n8k8_f16(c, a[2], a[3], b1);
        }
    }
    #[inline(always)]
    fn pack(lo: f32, hi: f32) -> u32 {
        math::pack_f16x2(lo, hi)
    }
    #[inline(always)]
    fn unpack(pair: u32) -> (f32, f32) {
        math::unpack_f16x2(pair)
    }
}

impl Element for Bf16 {
    const BF16: bool = true;
    const BYTES: u32 = 2;
    #[inline(always)]
    fn mma(c: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
        mma::m16n8k16_bf16(c, a, b0, b1)
    }
    #[inline(always)]
    fn pack(lo: f32, hi: f32) -> u32 {
        math::pack_bf16x2(lo, hi)
    }
    #[inline(always)]
    fn unpack(pair: u32) -> (f32, f32) {
        // A bf16 is the upper half of an f32.
        (
            f32::from_bits(pair << 16),
            f32::from_bits(pair & 0xffff_0000),
        )
    }
}

impl Element for F32 {
    const BF16: bool = false;
    const BYTES: u32 = 4;
    #[inline(always)]
    fn mma(c: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
        F16::mma(c, a, b0, b1)
    }
    #[inline(always)]
    fn pack(lo: f32, hi: f32) -> u32 {
        F16::pack(lo, hi)
    }
    #[inline(always)]
    fn unpack(pair: u32) -> (f32, f32) {
        F16::unpack(pair)
    }
    /// Through registers on every GPU: 32 bytes in, rounded to f16, 16 out.
    #[inline(always)]
    fn stage(dst: u32, src: u64, valid: bool) {
        let packed = if valid {
            let (lo, hi) = (global::ld_nc_v4_f32(src), global::ld_nc_v4_f32(src + 16));
            [
                F16::pack(lo[0], lo[1]),
                F16::pack(lo[2], lo[3]),
                F16::pack(hi[0], hi[1]),
                F16::pack(hi[2], hi[3]),
            ]
        } else {
            [0; 4]
        };
        smem::st_v4_b32(dst, packed);
    }
    #[inline(always)]
    fn store_chunk(dst: u64, v: [f32; CHUNK_ELEMS]) {
        global::st_v4_b32(dst, [0, 1, 2, 3].map(|e| v[e].to_bits()));
        global::st_v4_b32(dst + 16, [4, 5, 6, 7].map(|e| v[e].to_bits()));
    }
}
