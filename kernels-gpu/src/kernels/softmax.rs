//! Online softmax in the exp2 domain (FlashAttention-2, Algorithm 1).
//!
//! Per lane: two rows (g and g + 8 of the warp's 16), their running max `m` of
//! scores already multiplied by `scale * log2(e)` and a lane-partial running
//! sum `l`; the full row sum is reduced across the 4 lanes of the row only
//! once, in [`OnlineSoftmax::finalize`].
use super::element::Element;
use crate::arch::{math, shfl, vote};
use crate::unroll::unroll;

/// ln(2): converts log2-domain values back to natural log for the LSE output.
const LN_2: f32 = core::f32::consts::LN_2;

/// m of a row that has seen no visible key yet. Finite, unlike the -inf of a
/// masked score, so that `S * scale - m` and `m_old - m_new` are never
/// `-inf - -inf` = NaN: masked scores give P = exp2(-inf) = 0 and the first
/// visible key replaces it. Because it needs no -inf test, m is also the very
/// offset the exponentials subtract, with no second copy per row.
const NO_KEY_MAX: f32 = f32::MIN;

/// How far (log2 units) a row's max may exceed its stale m before m is
/// updated: P = exp2(S * scale - m) then stays below 2^8 = 256, exact in
/// f16/bf16 to the same relative precision and far from any overflow of the
/// f32 row sums.
const RESCALE_SLACK: f32 = 8.0;

/// m of every row when the logits are bounded (`AttnParams::fixed_max`):
/// a capped logit lies in (-c, c), i.e. (-K, K) in log2 units with K = c ·
/// log2(e), so with m = 0 every P = 2^logit lies in (2^-K, 2^K), as far
/// from f32's (and bf16's) underflow at 2^-126 as from its overflow at
/// 2^128. The host allows K <= 75 (`flash_attn`'s `softmax_max_fixed`
/// gives the margins). No row max is then needed to keep P in range, and
/// O and l are never rescaled.
pub const FIXED_MAX: f32 = 0.0;

pub struct OnlineSoftmax {
    pub m: [f32; 2],
    pub l: [f32; 2],
}

/// The lane's max of row half `r` of an S tile (columns 2r, 2r + 1 of each
/// n-tile) in `CHAINS` independent chains: one chain is 2·ST dependent max
/// ops on the softmax's critical path; more chains shorten it for
/// `CHAINS - 1` registers more per row (docs/perf-notes.md, v30).
#[inline(always)]
fn lane_row_max<const ST: usize, const CHAINS: usize>(s: &[[f32; 4]; ST], r: usize) -> f32 {
    let mut acc = [f32::NEG_INFINITY; CHAINS];
    unroll::<ST>(|j| {
        let c = j % CHAINS;
        acc[c] = acc[c].max(s[j][2 * r]).max(s[j][2 * r + 1]);
    });
    let mut mx = acc[0];
    unroll::<CHAINS>(|c| {
        if c > 0 {
            mx = mx.max(acc[c]);
        }
    });
    mx
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
            m: [NO_KEY_MAX; 2],
            l: [0.0; 2],
        }
    }

    /// Folds the row maxima of the S tile into m and rescales l and O by
    /// exp2(m_old - m_new) — only when some row of the warp would grow by more
    /// than [`RESCALE_SLACK`] (FlashAttention-4's lazy rescaling). Otherwise m
    /// stays as it is: exact, since O, l and the LSE all use the same m, and
    /// the O rescale (D/4 multiplies per row) is skipped for the block.
    #[inline(always)]
    pub fn rescale<const ST: usize, const OT: usize>(
        &mut self,
        s: &[[f32; 4]; ST],
        o: &mut [[f32; 4]; OT],
        scale_log2: f32,
    ) {
        // scale_log2 > 0, so the max of the scaled scores is the scaled max.
        self.rescale_by(s, o, |mx| mx * scale_log2);
    }

    /// [`Self::rescale`] for softcapped scores, S still raw (the logit of
    /// a score x is tanh(x · pre) · scale): tanh is increasing and pre > 0
    /// (`Modifiers`), so the max of the capped scores is the cap of the raw
    /// max, and the max chain needs S alone, not the tanh ops. Only for a
    /// block with no mask (a masked score is -inf after the cap, not -1).
    /// P then comes from [`Self::p_fragment_capped`].
    #[inline(always)]
    pub fn rescale_capped<const ST: usize, const OT: usize>(
        &mut self,
        s: &[[f32; 4]; ST],
        o: &mut [[f32; 4]; OT],
        scale_log2: f32,
        pre: f32,
    ) {
        self.rescale_by(s, o, |mx| math::tanh(mx * pre) * scale_log2);
    }

    /// [`Self::rescale`] where `logit` maps a raw score to its logit (log2
    /// units) and is increasing, so that it maps the raw row max to the
    /// row's max logit.
    #[inline(always)]
    fn rescale_by<const ST: usize, const OT: usize>(
        &mut self,
        s: &[[f32; 4]; ST],
        o: &mut [[f32; 4]; OT],
        logit: impl Fn(f32) -> f32,
    ) {
        let mut m_new = [0.0; 2];
        let mut grows = false;
        unroll::<2>(|r| {
            let mut mx = f32::NEG_INFINITY;
            unroll::<ST>(|j| mx = mx.max(s[j][2 * r]).max(s[j][2 * r + 1]));
            m_new[r] = self.m[r].max(logit(quad_max(mx)));
            grows |= m_new[r] - self.m[r] > RESCALE_SLACK;
        });
        if vote::any(grows) {
            unroll::<2>(|r| {
                let correction = math::ex2(self.m[r] - m_new[r]);
                self.m[r] = m_new[r];
                self.l[r] *= correction;
                unroll::<OT>(|d| {
                    o[d][2 * r] *= correction;
                    o[d][2 * r + 1] *= correction;
                });
            });
        }
    }

    /// Holds m at [`FIXED_MAX`] where [`Self::rescale`] would fold S's row
    /// maxima into it (`AttnParams::fixed_max`).
    #[inline(always)]
    pub fn hold_fixed_max(&mut self) {
        self.m = [FIXED_MAX; 2];
    }

    /// P = exp2(S * scale - m) of one 8-column n-tile of S (after
    /// [`Self::rescale`]), added to l. Called per n-tile right before P is
    /// packed for its MMA, so each n-tile's S registers die there instead of
    /// all of S staying live until the row sums.
    #[inline(always)]
    pub fn exp(&mut self, s: &[f32; 4], scale_log2: f32) -> [f32; 4] {
        let mut p = [0.0; 4];
        unroll::<4>(|e| p[e] = math::ex2(math::fma(s[e], scale_log2, -self.m[e / 2])));
        self.l[0] += p[0] + p[1];
        self.l[1] += p[2] + p[3];
        p
    }

    /// P of two consecutive 8-key n-tiles of S (one 16-key k-step of P·V),
    /// packed to 16 bits: the mma accumulator layout of S is exactly the A
    /// fragment layout of that k-step, so P never leaves registers.
    #[inline(always)]
    pub fn p_fragment<T: Element>(
        &mut self,
        lo: &[f32; 4],
        hi: &[f32; 4],
        scale_log2: f32,
    ) -> [u32; 4] {
        let (lo, hi) = (self.exp(lo, scale_log2), self.exp(hi, scale_log2));
        pack_fragment::<T>(&lo, &hi)
    }

    /// [`Self::p_fragment`] of raw scores whose row max went through
    /// [`Self::rescale_capped`]: each score is capped right before its
    /// exponential, so the tanh and ex2 ops of an n-tile pair alternate
    /// on the MUFU instead of all tanh ops waiting for the max chain.
    #[inline(always)]
    pub fn p_fragment_capped<T: Element>(
        &mut self,
        lo: &[f32; 4],
        hi: &[f32; 4],
        scale_log2: f32,
        pre: f32,
    ) -> [u32; 4] {
        let cap = |s: &[f32; 4]| s.map(|x| math::tanh(x * pre));
        self.p_fragment::<T>(&cap(lo), &cap(hi), scale_log2)
    }

    /// The online-softmax step of a key block whose O += P·V cannot be
    /// rescaled yet, because the previous block's `wgmma`s still accumulate
    /// into O (FlashAttention-3's intra-warpgroup overlap): folds S's row
    /// maxima into m as [`Self::rescale`] does (lazily), rescales l, and
    /// overwrites S with P = exp2(S * scale - m), added to l. Returns the
    /// factor exp2(m_old - m_new) per row that O still needs, `None` when no
    /// row of the warp moved m.
    #[inline(always)]
    pub fn advance<const ST: usize, const MAX_CHAINS: usize>(
        &mut self,
        s: &mut [[f32; 4]; ST],
        scale_log2: f32,
    ) -> Option<[f32; 2]> {
        let mut m_new = [0.0; 2];
        let mut grows = false;
        unroll::<2>(|r| {
            let mx = lane_row_max::<ST, MAX_CHAINS>(s, r);
            m_new[r] = self.m[r].max(quad_max(mx) * scale_log2);
            grows |= m_new[r] - self.m[r] > RESCALE_SLACK;
        });
        let moved = vote::any(grows);
        let mut correction = [1.0; 2];
        if moved {
            unroll::<2>(|r| {
                correction[r] = math::ex2(self.m[r] - m_new[r]);
                self.m[r] = m_new[r];
                self.l[r] *= correction[r];
            });
        }
        unroll::<ST>(|j| s[j] = self.exp(&s[j], scale_log2));
        if moved {
            Some(correction)
        } else {
            None
        }
    }

    /// [`Self::advance`] with m held at [`FIXED_MAX`]
    /// (`AttnParams::fixed_max`): no row max, no vote, and never a factor
    /// for O.
    #[inline(always)]
    pub fn advance_fixed<const ST: usize>(
        &mut self,
        s: &mut [[f32; 4]; ST],
        scale_log2: f32,
    ) -> Option<[f32; 2]> {
        self.hold_fixed_max();
        unroll::<ST>(|j| s[j] = self.exp(&s[j], scale_log2));
        None
    }

    /// [`Self::advance`] for softcapped scores, S still raw: P =
    /// exp2(tanh(S · pre) · scale - m). tanh is increasing, so the row max
    /// of the capped scores is the cap of the raw row max: the max chain
    /// needs S alone and runs beside the tanh ops, not after them. Only for
    /// a block with no mask (a masked score is -inf after the cap, not -1).
    /// Its tail (the vote, the rescale of l) is `advance`'s, copied as in
    /// `advance_biased`: one helper for the three changed the PTX of 100
    /// other entries (LLVM laid the loops out anew; not measured).
    #[inline(always)]
    pub fn advance_capped<const ST: usize>(
        &mut self,
        s: &mut [[f32; 4]; ST],
        scale_log2: f32,
        pre: f32,
    ) -> Option<[f32; 2]> {
        let mut mx = [f32::NEG_INFINITY; 2];
        unroll::<ST>(|j| {
            unroll::<4>(|e| {
                mx[e / 2] = mx[e / 2].max(s[j][e]);
                s[j][e] = math::tanh(s[j][e] * pre);
            });
        });
        let mut m_new = [0.0; 2];
        let mut grows = false;
        unroll::<2>(|r| {
            // pre > 0 (`Modifiers`), so this is the max of the capped scores.
            m_new[r] = self.m[r].max(math::tanh(quad_max(mx[r]) * pre) * scale_log2);
            grows |= m_new[r] - self.m[r] > RESCALE_SLACK;
        });
        let moved = vote::any(grows);
        let mut correction = [1.0; 2];
        if moved {
            unroll::<2>(|r| {
                correction[r] = math::ex2(self.m[r] - m_new[r]);
                self.m[r] = m_new[r];
                self.l[r] *= correction[r];
            });
        }
        unroll::<ST>(|j| s[j] = self.exp(&s[j], scale_log2));
        if moved {
            Some(correction)
        } else {
            None
        }
    }

    /// [`Self::advance`] for S whose true value is S + `bias` per row half,
    /// the bias being the lane's own (`policy::alibi_one_sided`: its keys
    /// differ from the other lanes' of the row): P = exp2((S + bias) * scale
    /// - m). A copy rather than a generalisation of `advance`: sharing the
    /// code made LLVM fold the plain kernels' first key block into their loop
    /// (H100: 5 % slower, docs/perf-notes.md).
    #[inline(always)]
    pub fn advance_biased<const ST: usize, const MAX_CHAINS: usize>(
        &mut self,
        s: &mut [[f32; 4]; ST],
        scale_log2: f32,
        bias: [f32; 2],
    ) -> Option<[f32; 2]> {
        let mut m_new = [0.0; 2];
        let mut grows = false;
        unroll::<2>(|r| {
            let mx = lane_row_max::<ST, MAX_CHAINS>(s, r);
            // Added before the row's lanes agree on m.
            m_new[r] = self.m[r].max(quad_max(mx + bias[r]) * scale_log2);
            grows |= m_new[r] - self.m[r] > RESCALE_SLACK;
        });
        let moved = vote::any(grows);
        let mut correction = [1.0; 2];
        if moved {
            unroll::<2>(|r| {
                correction[r] = math::ex2(self.m[r] - m_new[r]);
                self.m[r] = m_new[r];
                self.l[r] *= correction[r];
            });
        }
        let offset = [0, 1].map(|r| math::fma(bias[r], scale_log2, -self.m[r]));
        unroll::<ST>(|j| {
            let mut p = [0.0; 4];
            unroll::<4>(|e| p[e] = math::ex2(math::fma(s[j][e], scale_log2, offset[e / 2])));
            self.l[0] += p[0] + p[1];
            self.l[1] += p[2] + p[3];
            s[j] = p;
        });
        if moved {
            Some(correction)
        } else {
            None
        }
    }

    /// Per row: the running max m (log2 domain; the finite "no key yet" value
    /// for a row that saw no key, whose l is 0) and the full row sum l
    /// (reduced over the row's lanes).
    #[inline(always)]
    pub fn row_stats(&self) -> ([f32; 2], [f32; 2]) {
        let mut l = [0.0; 2];
        unroll::<2>(|r| l[r] = quad_sum(self.l[r]));
        (self.m, l)
    }

    /// The rows' l: the quad's lane sums added up.
    #[inline(always)]
    pub fn row_sums(&self) -> [f32; 2] {
        [quad_sum(self.l[0]), quad_sum(self.l[1])]
    }

    /// Returns, per row, 1/l (0 for a row that saw no key, whose O is then 0)
    /// and the natural-log LSE (-inf for such a row). With `sinks` (per row,
    /// log2 units), the denominator also holds 2^sink: l' = l·2^(m - m') +
    /// 2^(sink - m') with m' = max(m, sink), O = acc·2^(m - m') / l', and the
    /// LSE includes the sink (a row that saw no key gets O = 0, LSE = sink).
    #[inline(always)]
    pub fn finalize(&self, sinks: Option<[f32; 2]>) -> ([f32; 2], [f32; 2]) {
        finish(self.m, |r| quad_sum(self.l[r]), sinks)
    }

    /// [`Self::finalize`] of rows whose max is `m` and whose l (summed over
    /// the quad) is `l`.
    #[inline(always)]
    pub fn finalize_rows(
        m: [f32; 2],
        l: [f32; 2],
        sinks: Option<[f32; 2]>,
    ) -> ([f32; 2], [f32; 2]) {
        finish(m, |r| l[r], sinks)
    }
}

/// [`OnlineSoftmax::finalize`] with row r's l from `row_l(r)`, computed
/// where it is used.
#[inline(always)]
fn finish(
    m: [f32; 2],
    row_l: impl Fn(usize) -> f32,
    sinks: Option<[f32; 2]>,
) -> ([f32; 2], [f32; 2]) {
    let mut inv = [0.0; 2];
    let mut lse = [f32::NEG_INFINITY; 2];
    unroll::<2>(|r| {
        let l = row_l(r);
        let (m, l, o_weight) = match sinks {
            Some(sink) => {
                // A row that saw no key weighs only the sink, also where m
                // was held at `FIXED_MAX` rather than left at `NO_KEY_MAX`:
                // 2^(sink - FIXED_MAX) could underflow.
                let m_row = if l > 0.0 { m[r] } else { NO_KEY_MAX };
                let m_sink = m_row.max(sink[r]);
                let o_weight = math::ex2(m_row - m_sink);
                (
                    m_sink,
                    math::fma(l, o_weight, math::ex2(sink[r] - m_sink)),
                    o_weight,
                )
            }
            None => (m[r], l, 1.0),
        };
        if l > 0.0 {
            inv[r] = o_weight * math::rcp(l);
            lse[r] = (m + math::lg2(l)) * LN_2;
        }
    });
    (inv, lse)
}

/// Two states of the same rows over disjoint key sets, each its rows' max
/// `m` and row sum `l` ([`OnlineSoftmax::row_sums`]), as one: the max of
/// both, and the weight 2^(m_x - m) with which each state's l and O count
/// (a state that saw no key has m = `NO_KEY_MAX` and weight 0; where
/// neither saw one, both weights are 1 over l = 0). Returns the merged (m,
/// l) and the weights of `a` and `b`.
#[inline(always)]
pub fn merge_rows(
    a: ([f32; 2], [f32; 2]),
    b: ([f32; 2], [f32; 2]),
) -> (([f32; 2], [f32; 2]), [f32; 2], [f32; 2]) {
    let mut merged = ([0.0; 2], [0.0; 2]);
    let (mut wa, mut wb) = ([0.0; 2], [0.0; 2]);
    unroll::<2>(|r| {
        let m = a.0[r].max(b.0[r]);
        wa[r] = math::ex2(a.0[r] - m);
        wb[r] = math::ex2(b.0[r] - m);
        merged.0[r] = m;
        merged.1[r] = math::fma(a.1[r], wa[r], b.1[r] * wb[r]);
    });
    (merged, wa, wb)
}

/// Two consecutive 8-column n-tiles of P in accumulator layout, packed to
/// 16 bits as the A fragment of one 16-key k-step (see
/// [`OnlineSoftmax::p_fragment`]).
#[inline(always)]
pub fn pack_fragment<T: Element>(lo: &[f32; 4], hi: &[f32; 4]) -> [u32; 4] {
    [
        T::pack(lo[0], lo[1]),
        T::pack(lo[2], lo[3]),
        T::pack(hi[0], hi[1]),
        T::pack(hi[2], hi[3]),
    ]
}
