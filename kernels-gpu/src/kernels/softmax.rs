//! Online softmax in the exp2 domain (FlashAttention-2, Algorithm 1).
//!
//! Per lane: two rows (g and g + 8 of the warp's 16), their running max `m` of
//! raw scores and a lane-partial running sum `l`; the full row sum is reduced
//! across the 4 lanes of the row only once, in [`OnlineSoftmax::finalize`].
use super::unroll::unroll;
use crate::arch::{math, shfl};

/// ln(2): converts log2-domain values back to natural log for the LSE output.
const LN_2: f32 = core::f32::consts::LN_2;

pub struct OnlineSoftmax {
    pub m: [f32; 2],
    pub l: [f32; 2],
}

/// Max over the 4 lanes that share a row (lanes differ in bits 0 and 1).
#[inline(always)]
fn quad_max(x: f32) -> f32 {
    let x = x.max(shfl::bfly_f32(x, 1));
    x.max(shfl::bfly_f32(x, 2))
}

#[inline(always)]
fn quad_sum(x: f32) -> f32 {
    let x = x + shfl::bfly_f32(x, 1);
    x + shfl::bfly_f32(x, 2)
}

impl OnlineSoftmax {
    #[inline(always)]
    pub const fn new() -> Self {
        OnlineSoftmax {
            m: [f32::NEG_INFINITY; 2],
            l: [0.0; 2],
        }
    }

    /// Folds the S tile into the running statistics: updates m, rescales l and
    /// O by exp2((m_old - m_new) * scale), and overwrites S with
    /// P = exp2(S * scale - m_new * scale).
    #[inline(always)]
    pub fn update<const ST: usize, const OT: usize>(
        &mut self,
        s: &mut [[f32; 4]; ST],
        o: &mut [[f32; 4]; OT],
        scale_log2: f32,
    ) {
        unroll::<2>(|r| {
            let mut mx = self.m[r];
            unroll::<ST>(|j| mx = mx.max(s[j][2 * r]).max(s[j][2 * r + 1]));
            let mx = quad_max(mx);
            // A row that has seen only masked keys keeps m = -inf; subtracting 0
            // instead makes its P exactly 0 rather than NaN.
            let m_scaled = if mx == f32::NEG_INFINITY {
                0.0
            } else {
                mx * scale_log2
            };
            let correction = math::ex2(math::fma(self.m[r], scale_log2, -m_scaled));
            self.m[r] = mx;
            self.l[r] *= correction;
            unroll::<OT>(|d| {
                o[d][2 * r] *= correction;
                o[d][2 * r + 1] *= correction;
            });
            let mut sum = 0.0;
            unroll::<ST>(|j| {
                unroll::<2>(|e| {
                    let p = math::ex2(math::fma(s[j][2 * r + e], scale_log2, -m_scaled));
                    s[j][2 * r + e] = p;
                    sum += p;
                });
            });
            self.l[r] += sum;
        });
    }

    /// Per row: the running max in the scaled log2 domain (-inf for a row
    /// that saw no key) and the full row sum l (reduced over the row's lanes).
    #[inline(always)]
    pub fn row_stats(&self, scale_log2: f32) -> ([f32; 2], [f32; 2]) {
        let (mut m, mut l) = ([0.0; 2], [0.0; 2]);
        unroll::<2>(|r| {
            m[r] = self.m[r] * scale_log2;
            l[r] = quad_sum(self.l[r]);
        });
        (m, l)
    }

    /// Returns, per row, 1/l (0 for a row that saw no key, whose O is then 0)
    /// and the natural-log LSE (-inf for such a row).
    #[inline(always)]
    pub fn finalize(&self, scale_log2: f32) -> ([f32; 2], [f32; 2]) {
        let mut inv = [0.0; 2];
        let mut lse = [f32::NEG_INFINITY; 2];
        unroll::<2>(|r| {
            let l = quad_sum(self.l[r]);
            if l > 0.0 {
                inv[r] = math::rcp(l);
                lse[r] = (self.m[r] * scale_log2 + math::lg2(l)) * LN_2;
            }
        });
        (inv, lse)
    }
}
