//! The two 16-bit element types, as seen by the tensor cores.
use crate::arch::{math, mma};

pub trait Element {
    /// bf16 rather than f16: picks the element type of a `wgmma`.
    const BF16: bool;
    /// D += A·B on one m16n8k16 tile with f32 accumulation.
    fn mma(c: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32);
    /// Two f32 rounded to nearest into one packed pair, `lo` first in memory.
    fn pack(lo: f32, hi: f32) -> u32;
    /// The two values of a packed pair, `lo` (first in memory) first.
    fn unpack(pair: u32) -> (f32, f32);
}

pub struct F16;
pub struct Bf16;

impl Element for F16 {
    const BF16: bool = false;
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
