//! Attention policies as types, as CUTLASS and FlashAttention-3 write them:
//! which keys a query row sees ([`Mask`]), what is done to the scores besides
//! the scale ([`Scores`]), and where a CTA's sequence lives ([`Seq`]). A
//! kernel is instantiated per policy triple listed in
//! `config::attention_variants`; a policy that is fixed at compile time costs
//! nothing where it is off, and the `Local`/`Modified`/`Ragged` policies read
//! their settings from the launch parameters (uniform branches).
use super::element::Element;
use crate::arch::{global, math};
use crate::config::{MaskKind, Policies, ScoreKind, SeqKind};
use crate::params::{AttnParams, BwdParams};
use crate::unroll::unroll;

pub trait Mask {
    const KIND: MaskKind;
    /// Whether a row's visible keys may start after key 0 (a left bound).
    const LEFT: bool = matches!(Self::KIND, MaskKind::Local);
    /// (left, right) window bounds in keys around the bottom-right-aligned
    /// diagonal; negative = unbounded on that side.
    fn window(p: &AttnParams) -> (i32, i32);
}

/// Every key of the sequence.
pub struct Full;
/// Keys up to the diagonal.
pub struct Causal;
/// A sliding window from the launch parameters (covers `Full` and `Causal`).
pub struct Local;

impl Mask for Full {
    const KIND: MaskKind = MaskKind::Full;
    #[inline(always)]
    fn window(_: &AttnParams) -> (i32, i32) {
        (-1, -1)
    }
}

impl Mask for Causal {
    const KIND: MaskKind = MaskKind::Causal;
    #[inline(always)]
    fn window(_: &AttnParams) -> (i32, i32) {
        (-1, 0)
    }
}

impl Mask for Local {
    const KIND: MaskKind = MaskKind::Local;
    #[inline(always)]
    fn window(p: &AttnParams) -> (i32, i32) {
        (p.window_left, p.window_right)
    }
}

pub trait Scores {
    const KIND: ScoreKind;
    /// Whether softcap, ALiBi and sinks are read from the launch parameters.
    const MODIFIED: bool = matches!(Self::KIND, ScoreKind::Modified);
}

/// scale · q·k and nothing else.
pub struct Plain;
/// Softcap, ALiBi and sinks, each when its parameter is set.
pub struct Modified;

impl Scores for Plain {
    const KIND: ScoreKind = ScoreKind::Plain;
}
impl Scores for Modified {
    const KIND: ScoreKind = ScoreKind::Modified;
}

pub trait Seq {
    const KIND: SeqKind;
    /// Whether `cu_seqlens` are read from the launch parameters.
    const RAGGED: bool = matches!(Self::KIND, SeqKind::Packed | SeqKind::Ragged);
    /// Whether a paged K/V cache is read from the launch parameters.
    const PAGED: bool = matches!(Self::KIND, SeqKind::Ragged);
    /// Decode: KV heads read in adjacent pairs (`SeqKind::Folded`).
    const FOLDED: bool = matches!(Self::KIND, SeqKind::Folded);
}

/// [B, S, H, D] with batch strides.
pub struct Dense;
/// Packed sequences, K/V never paged.
pub struct Packed;
/// Packed sequences and/or a paged K/V cache.
pub struct Ragged;
/// Decode with KV heads read in adjacent pairs.
pub struct Folded;

impl Seq for Dense {
    const KIND: SeqKind = SeqKind::Dense;
}
impl Seq for Packed {
    const KIND: SeqKind = SeqKind::Packed;
}
impl Seq for Ragged {
    const KIND: SeqKind = SeqKind::Ragged;
}
impl Seq for Folded {
    const KIND: SeqKind = SeqKind::Folded;
}

/// The config table's description of a policy triple (it selects the tile).
pub const fn policies<M: Mask, S: Scores, L: Seq>() -> Policies {
    Policies {
        mask: M::KIND,
        score: S::KIND,
        seq: L::KIND,
    }
}

/// Where a kernel's launch parameters hold the score modifiers' settings
/// (the forward's [`AttnParams`] and the backward's [`BwdParams`] name them
/// alike).
pub trait ScoreArgs {
    /// `AttnParams::softcap_pre` (0 = off).
    fn softcap_pre(&self) -> f32;
    /// `AttnParams::alibi` (0 = off) and `alibi_batch_stride`.
    fn alibi(&self) -> (u64, u32);
    /// `AttnParams::inv_scale`.
    fn inv_scale(&self) -> f32;
    /// `AttnParams::fixed_max`; the backward reads P from the LSE instead.
    fn fixed_max(&self) -> bool;
}

impl ScoreArgs for AttnParams {
    #[inline(always)]
    fn softcap_pre(&self) -> f32 {
        self.softcap_pre
    }
    #[inline(always)]
    fn alibi(&self) -> (u64, u32) {
        (self.alibi, self.alibi_batch_stride)
    }
    #[inline(always)]
    fn inv_scale(&self) -> f32 {
        self.inv_scale
    }
    #[inline(always)]
    fn fixed_max(&self) -> bool {
        self.fixed_max != 0
    }
}

impl ScoreArgs for BwdParams {
    #[inline(always)]
    fn softcap_pre(&self) -> f32 {
        self.softcap_pre
    }
    #[inline(always)]
    fn alibi(&self) -> (u64, u32) {
        (self.alibi, self.alibi_batch_stride)
    }
    #[inline(always)]
    fn inv_scale(&self) -> f32 {
        self.inv_scale
    }
    #[inline(always)]
    fn fixed_max(&self) -> bool {
        false
    }
}

/// The score modifiers of a CTA, read once from the launch parameters.
/// Scores stay in S units, which the softmax turns into logits by the factor
/// in `scale_log2` (softmax_scale, or the softcap c): the softcap is `tanh(pre
/// · S)` with pre = scale / c, and the ALiBi bias is divided by that factor.
#[derive(Clone, Copy)]
pub struct Modifiers {
    pub softcap: bool,
    pub alibi: bool,
    /// The softmax holds m at `softmax::FIXED_MAX` (`AttnParams::fixed_max`;
    /// only where P is bf16, whose exponent range holds every P of a capped
    /// row, and only in the forward kernels).
    pub fixed_max: bool,
}

impl Modifiers {
    #[inline(always)]
    pub fn new<T: Element, S: Scores>(p: &impl ScoreArgs) -> Modifiers {
        Modifiers {
            softcap: S::MODIFIED && p.softcap_pre() != 0.0,
            alibi: S::MODIFIED && p.alibi().0 != 0,
            fixed_max: T::BF16 && S::MODIFIED && p.fixed_max(),
        }
    }

    /// ALiBi slope of (batch, head) over the logit factor (S units).
    #[inline(always)]
    pub fn slope(p: &impl ScoreArgs, batch: u32, head: u32) -> f32 {
        let (slopes, batch_stride) = p.alibi();
        let index = batch as u64 * batch_stride as u64 + head as u64;
        global::ld_nc_f32(slopes + index * 4) * p.inv_scale()
    }

    /// Applies the modifiers to one S tile in accumulator layout. `key0` is
    /// the key of the lane's first column; per row half r, `pos[r]` is the
    /// row's position on the key axis (token + Skv - Sq) and `slope[r]` its
    /// scaled ALiBi slope.
    #[inline(always)]
    pub fn apply<const ST: usize>(
        &self,
        p: &AttnParams,
        s: &mut [[f32; 4]; ST],
        key0: i32,
        pos: [i32; 2],
        slope: [f32; 2],
    ) {
        self.softcap(p, s);
        if self.alibi {
            alibi(s, key0, pos, slope);
        }
    }

    /// The softcap alone (when set): S <- tanh(S · pre).
    #[inline(always)]
    pub fn softcap<const ST: usize>(&self, p: &AttnParams, s: &mut [[f32; 4]; ST]) {
        if self.softcap {
            unroll::<ST>(|j| {
                unroll::<4>(|e| s[j][e] = math::tanh(s[j][e] * p.softcap_pre));
            });
        }
    }
}

/// Adds the ALiBi bias `-slope · |pos - key|` to every score (arguments as
/// in [`Modifiers::apply`]).
#[inline(always)]
pub fn alibi<const ST: usize>(s: &mut [[f32; 4]; ST], key0: i32, pos: [i32; 2], slope: [f32; 2]) {
    let dist0 = [(pos[0] - key0) as f32, (pos[1] - key0) as f32];
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            let dist = math::abs(dist0[e / 2] - column(j, e));
            s[j][e] = math::fma(-slope[e / 2], dist, s[j][e]);
        });
    });
}

/// [`alibi`] for a key block that lies on one side of every row's origin
/// (`index::OriginSide::Left` when `left`, else `Right`): there the bias is
/// `±slope · (key - key0)`, one FMA with a constant per score, plus a
/// part `±slope · (key0 - pos)` per row half (and lane: `key0` is the
/// lane's), returned for the softmax to add to the row
/// (`OnlineSoftmax::advance_biased`) instead of to every score.
#[inline(always)]
pub fn alibi_one_sided<const ST: usize>(
    s: &mut [[f32; 4]; ST],
    key0: i32,
    pos: [i32; 2],
    slope: [f32; 2],
    left: bool,
) -> [f32; 2] {
    let slope = slope.map(|m| if left { m } else { -m });
    unroll::<ST>(|j| {
        unroll::<4>(|e| s[j][e] = math::fma(slope[e / 2], column(j, e), s[j][e]));
    });
    [0, 1].map(|r| slope[r] * (key0 - pos[r]) as f32)
}

/// Key offset of accumulator element `e` of n-tile `j` from the lane's first
/// column.
#[inline(always)]
pub(crate) fn column(j: usize, e: usize) -> f32 {
    (j * 8 + (e & 1)) as f32
}
