//! Naive host attention, the oracle for the kernels' tests and for users who
//! want to check results. It materialises every score and probability and
//! accumulates in f64, trading speed for being obviously correct: keep it
//! free of any of the kernels' tricks (tiling, online softmax, splits).
//!
//! Semantics (FlashAttention 2.6+, natural-log units). A sequence has `sq`
//! queries and `n` keys in use; query `i` sits on the diagonal position
//! `i + off` with `off = n - sq`, so the last query lines up with the last key
//! (bottom-right alignment).
//!
//! - Mask: the shape's window with `causal` folded in (`shape.mask()`): query
//!   `i` sees key `j` when `j >= i + off - left` and `j <= i + off + right`, a
//!   side that is `None` being unbounded. Visible keys are therefore one range.
//! - Score of a visible pair: `s = scale * q·k`; with a softcap `c`,
//!   `s = c * tanh(s / c)`; with ALiBi slopes, `s -= slope[b, h] * |i + off - j|`.
//! - Softmax over the visible keys; an attention sink adds `exp(sink[h])` to the
//!   denominator with no value attached. LSE is the log of that denominator.
//! - A row with nothing to attend to (no visible key, and no sink or a sink of
//!   -inf) has O = 0 and LSE = -inf; with a finite sink and no visible key,
//!   O = 0 and LSE = sink.
//! - MQA/GQA: query head `h` reads KV head `h / (heads / kv_heads)`.
//!
//! Entry points: [`attention`]/[`attention_ext`] (fixed layout),
//! [`decode`]/[`decode_ext`] (a cache with per-sequence lengths), [`varlen`]
//! (packed sequences), [`probabilities`] (P itself), [`merge_states`] (the
//! exact combination of two partial results over disjoint keys),
//! [`attention_backward_ext`] and [`varlen_backward`] (the gradients of
//! [`attention_ext`] and [`varlen`]); each row is
//! [`softmax_row`]/[`output_row`], public for inputs read on demand.
use crate::validate::{DecodeShape, ForwardShape, VarlenShape, Window};
use std::ops::Range;

/// Output of the reference. For [`attention`] and [`decode`], `o` is
/// [batch, seqlen_q, heads, head_dim] row-major and `lse` is
/// [batch, heads, seqlen_q]; for [`varlen`], `o` is [total_q, heads, head_dim]
/// and `lse` is [heads, total_q]; for [`merge_states`], `o` is [rows, head_dim]
/// and `lse` is `[rows]`. LSE is in natural-log units.
#[derive(Clone, Debug, PartialEq)]
pub struct RefOutput {
    /// The attention output.
    pub o: Vec<f64>,
    /// Log-sum-exp of each row's scores (natural log).
    pub lse: Vec<f64>,
}

/// Device-side extras of a problem, as f64.
#[derive(Clone, Copy, Debug, Default)]
pub struct Extras<'a> {
    /// ALiBi slopes: `[heads]` (the same for every batch entry) or
    /// `[batch * heads]` row-major; the length decides.
    pub alibi_slopes: Option<&'a [f64]>,
    /// `[heads]` sink logits.
    pub sinks: Option<&'a [f64]>,
}

/// What every query row of a problem shares. Q and O are addressed by row
/// (one row holds all `heads` heads of one token), K and V likewise with
/// `kv_heads` heads, so the fixed, decode and packed layouts all reduce to
/// lists of [`Seq`]s over the same storage and the loop nest exists once.
struct Problem<'a> {
    /// Sequences in the problem (what a `[batch * heads]` slope array counts).
    batch: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Head dim of V and O.
    v_head_dim: usize,
    /// The mask, `causal` folded in.
    window: Window,
    scale: f64,
    softcap: Option<f64>,
    extras: Extras<'a>,
    q: &'a [f64],
    k: &'a [f64],
}

/// One sequence: its queries are rows `q_start..q_start + sq` of Q (and of O),
/// its keys rows `k_start..k_start + n` of K and V.
#[derive(Clone, Copy, Debug)]
struct Seq {
    /// Position in the batch (selects per-batch ALiBi slopes).
    index: usize,
    q_start: usize,
    sq: usize,
    k_start: usize,
    n: usize,
}

/// What the softmax of one query row depends on besides its query and the
/// keys: the mask, the score policies, and where the row sits.
#[derive(Clone, Copy, Debug)]
pub struct RowSpec {
    /// The mask, `causal` folded in ([`Window::effective`]).
    pub window: Window,
    /// Multiplies q·k.
    pub scale: f64,
    /// Softcap `c` of `c * tanh(s / c)`.
    pub softcap: Option<f64>,
    /// The row's ALiBi slope (its batch entry's and head's).
    pub alibi_slope: Option<f64>,
    /// The row's head's sink logit.
    pub sink: Option<f64>,
    /// The query's index within its sequence.
    pub query: usize,
    /// Queries in the sequence.
    pub seqlen_q: usize,
    /// Keys in use in the sequence.
    pub seqlen_k: usize,
}

impl RowSpec {
    /// Where the query sits among the keys: `query + seqlen_k - seqlen_q`,
    /// signed because it is negative when there are more queries than keys.
    fn diagonal(&self) -> i128 {
        self.query as i128 + self.seqlen_k as i128 - self.seqlen_q as i128
    }

    /// The keys the query sees: `diagonal - left <= j <= diagonal + right`
    /// within `0..seqlen_k`, an unbounded side reaching the end of the keys.
    pub fn visible(&self) -> Range<usize> {
        let d = self.diagonal();
        let n = self.seqlen_k as i128;
        let lo = self.window.left.map_or(0, |l| d - l as i128).clamp(0, n);
        let hi = self
            .window
            .right
            .map_or(n, |r| d + r as i128 + 1)
            .clamp(lo, n);
        lo as usize..hi as usize
    }
}

/// Softmax of one query row over the keys it sees.
#[derive(Clone, Debug, PartialEq)]
pub struct RowSoftmax {
    /// The visible keys (indices within the sequence), a possibly empty range.
    pub keys: Range<usize>,
    /// Probabilities of `keys`, in order.
    pub p: Vec<f64>,
    /// Natural-log softmax denominator (sink included); -inf when the row has
    /// nothing to attend to.
    pub lse: f64,
}

/// The softmax of one query row: `q` is its query vector and `key(j, buf)`
/// writes key `j` of its sequence (of the query's KV head) into `buf`. Every
/// entry point of this module computes its rows here; callers whose inputs are
/// too large to hold in f64 (the bench checks sampled rows of long caches)
/// call it directly with inputs read on demand.
pub fn softmax_row(
    spec: &RowSpec,
    q: &[f64],
    mut key: impl FnMut(usize, &mut [f64]),
) -> RowSoftmax {
    let keys = spec.visible();
    let mut k = vec![0.0; q.len()];
    let scores: Vec<f64> = keys
        .clone()
        .map(|j| {
            key(j, &mut k);
            let mut s = spec.scale * q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>();
            if let Some(c) = spec.softcap {
                s = c * (s / c).tanh();
            }
            if let Some(slope) = spec.alibi_slope {
                let distance = (spec.diagonal() - j as i128).abs();
                s += -slope * distance as f64;
            }
            s
        })
        .collect();
    // Subtracting the maximum (the sink included) keeps exp() from overflowing;
    // a sink is one more logit in the denominator, with no value attached.
    let max = scores
        .iter()
        .copied()
        .chain(spec.sink)
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        // Nothing to attend to (exp(-inf - -inf) would be NaN).
        return RowSoftmax {
            p: vec![0.0; keys.len()],
            keys,
            lse: f64::NEG_INFINITY,
        };
    }
    let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum::<f64>()
        + spec.sink.map_or(0.0, |s| (s - max).exp());
    let p = scores.iter().map(|s| (s - max).exp() / sum).collect();
    RowSoftmax {
        keys,
        p,
        lse: max + sum.ln(),
    }
}

/// O and LSE of one query row, as [`softmax_row`], with `value(j, buf)`
/// reading V (rows of `v_dim` elements, V's own head dim) like `key` reads
/// K. Only visible keys contribute, so whatever lies behind the mask (even
/// a non-finite value) cannot reach the output.
pub fn output_row(
    spec: &RowSpec,
    q: &[f64],
    key: impl FnMut(usize, &mut [f64]),
    mut value: impl FnMut(usize, &mut [f64]),
    v_dim: usize,
) -> (Vec<f64>, f64) {
    let row = softmax_row(spec, q, key);
    let mut o = vec![0.0; v_dim];
    let mut v = vec![0.0; v_dim];
    for (j, &pj) in row.keys.zip(&row.p) {
        value(j, &mut v);
        for (oc, vc) in o.iter_mut().zip(&v) {
            *oc += pj * vc;
        }
    }
    (o, row.lse)
}

impl<'a> Problem<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        batch: usize,
        heads: usize,
        kv_heads: usize,
        (head_dim, v_head_dim): (usize, usize),
        window: Window,
        scale: f32,
        softcap: Option<f32>,
        extras: &Extras<'a>,
        q: &'a [f64],
        k: &'a [f64],
    ) -> Self {
        assert!(
            kv_heads > 0 && heads.is_multiple_of(kv_heads),
            "reference: {heads} heads cannot share {kv_heads} KV heads"
        );
        if let Some(slopes) = extras.alibi_slopes {
            assert!(
                slopes.len() == heads || slopes.len() == batch * heads,
                "reference: alibi_slopes has {} elements, expected {heads} (per head) or {} \
                 (per batch entry and head)",
                slopes.len(),
                batch * heads
            );
        }
        if let Some(sinks) = extras.sinks {
            assert!(
                sinks.len() == heads,
                "reference: sinks has {} elements, expected {heads}",
                sinks.len()
            );
        }
        Problem {
            batch,
            heads,
            kv_heads,
            head_dim,
            v_head_dim,
            window,
            scale: f64::from(scale),
            softcap: softcap.map(f64::from),
            extras: *extras,
            q,
            k,
        }
    }

    /// Panics unless `t` holds `rows` rows of `heads` heads of Q/K's head dim.
    fn check_len(&self, name: &str, got: usize, rows: usize, heads: usize) {
        self.check_len_dim(name, got, rows, heads, self.head_dim);
    }

    /// Panics unless `t` holds `rows` rows of `heads` heads of `dim` elements.
    fn check_len_dim(&self, name: &str, got: usize, rows: usize, heads: usize, dim: usize) {
        let needed = rows * heads * dim;
        assert!(
            got >= needed,
            "reference: {name} has {got} elements, the shape needs {needed}"
        );
    }

    fn q_row(&self, row: usize, h: usize) -> &[f64] {
        let start = (row * self.heads + h) * self.head_dim;
        &self.q[start..start + self.head_dim]
    }

    /// Row `row` of K or V (rows of `dim` elements) for query head `h`:
    /// MQA/GQA maps consecutive groups of `heads / kv_heads` query heads onto
    /// one KV head.
    fn kv_row<'t>(&self, t: &'t [f64], row: usize, h: usize, dim: usize) -> &'t [f64] {
        let kv_head = h / (self.heads / self.kv_heads);
        let start = (row * self.kv_heads + kv_head) * dim;
        &t[start..start + dim]
    }

    fn alibi_slope(&self, seq: &Seq, h: usize) -> Option<f64> {
        let slopes = self.extras.alibi_slopes?;
        Some(if slopes.len() == self.heads {
            slopes[h]
        } else {
            slopes[seq.index * self.heads + h]
        })
    }

    fn spec(&self, seq: &Seq, i: usize, h: usize) -> RowSpec {
        RowSpec {
            window: self.window,
            scale: self.scale,
            softcap: self.softcap,
            alibi_slope: self.alibi_slope(seq, h),
            sink: self.extras.sinks.map(|s| s[h]),
            query: i,
            seqlen_q: seq.sq,
            seqlen_k: seq.n,
        }
    }

    /// Reads row `j` of `seq`'s keys (or values, `dim` = V's head dim) of
    /// query head `h` from `t`.
    fn reader<'t>(
        &'t self,
        t: &'t [f64],
        seq: &'t Seq,
        h: usize,
        dim: usize,
    ) -> impl FnMut(usize, &mut [f64]) + 't {
        move |j, buf| buf.copy_from_slice(self.kv_row(t, seq.k_start + j, h, dim))
    }

    fn row(&self, seq: &Seq, i: usize, h: usize) -> RowSoftmax {
        let q = self.q_row(seq.q_start + i, h);
        let key = self.reader(self.k, seq, h, self.head_dim);
        softmax_row(&self.spec(seq, i, h), q, key)
    }

    /// O (`q_rows` rows, rows no sequence owns left 0) and LSE (`lse_len`
    /// entries, those no sequence owns left -inf); `lse_index(seq, h, i)` places
    /// the LSE of query `i` of `seq` for head `h`.
    fn attend(
        &self,
        v: &[f64],
        seqs: &[Seq],
        q_rows: usize,
        lse_len: usize,
        lse_index: impl Fn(&Seq, usize, usize) -> usize,
    ) -> RefOutput {
        let (h_n, d) = (self.heads, self.v_head_dim);
        let mut o = vec![0.0; q_rows * h_n * d];
        let mut lse = vec![f64::NEG_INFINITY; lse_len];
        for seq in seqs {
            for h in 0..h_n {
                for i in 0..seq.sq {
                    let q = self.q_row(seq.q_start + i, h);
                    let spec = self.spec(seq, i, h);
                    let (row_o, row_lse) = output_row(
                        &spec,
                        q,
                        self.reader(self.k, seq, h, self.head_dim),
                        self.reader(v, seq, h, d),
                        d,
                    );
                    lse[lse_index(seq, h, i)] = row_lse;
                    let out_start = ((seq.q_start + i) * h_n + h) * d;
                    o[out_start..out_start + d].copy_from_slice(&row_o);
                }
            }
        }
        RefOutput { o, lse }
    }
}

fn forward_problem<'a>(
    shape: &ForwardShape,
    q: &'a [f64],
    k: &'a [f64],
    extras: &Extras<'a>,
) -> (Problem<'a>, Vec<Seq>) {
    let p = Problem::new(
        shape.batch,
        shape.heads,
        shape.kv_heads,
        (shape.head_dim, shape.v_dim()),
        shape.mask(),
        shape.softmax_scale,
        shape.softcap,
        extras,
        q,
        k,
    );
    p.check_len("q", q.len(), shape.batch * shape.seqlen_q, p.heads);
    p.check_len("k", k.len(), shape.batch * shape.seqlen_k, p.kv_heads);
    let seqs = (0..shape.batch)
        .map(|b| Seq {
            index: b,
            q_start: b * shape.seqlen_q,
            sq: shape.seqlen_q,
            k_start: b * shape.seqlen_k,
            n: shape.seqlen_k,
        })
        .collect();
    (p, seqs)
}

/// LSE index in the fixed [batch, heads, seqlen_q] layout.
fn batched_lse_index(heads: usize) -> impl Fn(&Seq, usize, usize) -> usize {
    move |seq, h, i| (seq.index * heads + h) * seq.sq + i
}

/// Attention of `q` over `k`/`v` with the shape's mask and softcap and no
/// extras; the same as [`attention_ext`] with `Extras::default()`.
///
/// Panics if a slice is shorter than `shape` requires.
pub fn attention(shape: &ForwardShape, q: &[f64], k: &[f64], v: &[f64]) -> RefOutput {
    attention_ext(shape, q, k, v, &Extras::default())
}

/// Attention of `q` over `k`/`v`. q: [B, Sq, H, D], k: [B, Skv, Hkv, D], v:
/// [B, Skv, Hkv, Dv] (`shape.v_dim()`; O is [B, Sq, H, Dv]), all contiguous
/// row-major f64; every policy of the module docs applies.
///
/// Panics if a slice is shorter than `shape` requires, or if an extra has the
/// wrong length.
pub fn attention_ext(
    shape: &ForwardShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    extras: &Extras,
) -> RefOutput {
    let (p, seqs) = forward_problem(shape, q, k, extras);
    let rows_k = shape.batch * shape.seqlen_k;
    p.check_len_dim("v", v.len(), rows_k, p.kv_heads, p.v_head_dim);
    let rows = shape.batch * shape.seqlen_q;
    p.attend(v, &seqs, rows, rows * p.heads, batched_lse_index(p.heads))
}

/// Softmax probabilities P as [B, H, Sq, Skv] row-major, with the shape's mask
/// and softcap (masked entries 0; a row with no visible key is all 0).
///
/// Panics if a slice is shorter than `shape` requires.
pub fn probabilities(shape: &ForwardShape, q: &[f64], k: &[f64]) -> Vec<f64> {
    probabilities_ext(shape, q, k, &Extras::default())
}

/// [`probabilities`] with ALiBi and sinks (a sink takes its share of each
/// row's denominator, so a row's P sums to less than 1).
///
/// Panics if a slice is shorter than `shape` requires, or if an extra has the
/// wrong length.
pub fn probabilities_ext(shape: &ForwardShape, q: &[f64], k: &[f64], extras: &Extras) -> Vec<f64> {
    let (p, seqs) = forward_problem(shape, q, k, extras);
    let n = shape.seqlen_k;
    let mut out = Vec::with_capacity(p.batch * p.heads * shape.seqlen_q * n);
    for seq in &seqs {
        for h in 0..p.heads {
            for i in 0..seq.sq {
                let row = p.row(seq, i, h);
                let mut full = vec![0.0; n];
                full[row.keys].copy_from_slice(&row.p);
                out.extend(full);
            }
        }
    }
    out
}

/// Gradients of [`attention_ext`] for a loss whose gradient with respect to
/// O is `d_o`, in the layouts of q, k and v.
#[derive(Clone, Debug, PartialEq)]
pub struct RefGrads {
    /// dQ [B, Sq, H, D].
    pub dq: Vec<f64>,
    /// dK [B, Skv, Hkv, D].
    pub dk: Vec<f64>,
    /// dV [B, Skv, Hkv, Dv] (V's head dim).
    pub dv: Vec<f64>,
    /// The sinks' gradients `[H]` (empty without sinks).
    pub d_sinks: Vec<f64>,
}

/// The backward pass of [`attention`]; the same as
/// [`attention_backward_ext`] with `Extras::default()`.
///
/// Panics as [`attention_backward_ext`] does.
pub fn attention_backward(
    shape: &ForwardShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
) -> RefGrads {
    attention_backward_ext(shape, q, k, v, d_o, &Extras::default())
}

/// The backward pass of [`attention_ext`] (mask, window, softcap, ALiBi,
/// sinks and GQA as there). With logits `s_ij` and P their softmax (the
/// sink in the denominator), `dV_j = Σ_i P_ij dO_i`, `dP_ij = dO_i·V_j`,
/// `dS_ij = P_ij (dP_ij - delta_i)` with `delta_i = Σ_l P_il dP_il`, and
/// `ds_ij/d(q·k) = scale`, or `scale (1 - (s_ij / c)²)` where a softcap c
/// makes `s = c tanh(scale q·k / c)` (ALiBi's bias does not depend on q or
/// k): `dQ_i = Σ_j dS_ij ds_ij/d(q·k) K_j`, `dK_j` likewise over `Q_i`, a KV
/// head summing over the query heads that share it. The sink of head h has
/// `d sink_h = -Σ_i P_sink,i delta_i` (`P_sink,i = exp(sink_h - LSE_i)`,
/// its logit's dS with dP = 0: no value). q: [B, Sq, H, D]; k: [B, Skv,
/// Hkv, D]; v: [B, Skv, Hkv, Dv] and d_o: [B, Sq, H, Dv] (`shape.v_dim()`),
/// contiguous row-major; dV has V's head dim.
///
/// Panics if a slice is shorter than `shape` requires or if an extra has
/// the wrong length.
pub fn attention_backward_ext(
    shape: &ForwardShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
    extras: &Extras,
) -> RefGrads {
    let (b, sq, skv, h, hkv, d, dv) = (
        shape.batch,
        shape.seqlen_q,
        shape.seqlen_k,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.v_dim(),
    );
    assert!(
        d_o.len() >= b * sq * h * dv,
        "d_o is shorter than the shape"
    );
    assert!(v.len() >= b * skv * hkv * dv, "v is shorter than the shape");
    let (problem, seqs) = forward_problem(shape, q, k, extras);
    let scale = shape.softmax_scale as f64;
    let softcap = shape.softcap.map(f64::from);
    let group = h / hkv;
    let q_at = |bi: usize, i: usize, hi: usize| ((bi * sq + i) * h + hi) * d;
    let k_at = |bi: usize, j: usize, hk: usize| ((bi * skv + j) * hkv + hk) * d;
    // Rows of V, dO and dV (V's head dim).
    let o_at = |bi: usize, i: usize, hi: usize| ((bi * sq + i) * h + hi) * dv;
    let v_at = |bi: usize, j: usize, hk: usize| ((bi * skv + j) * hkv + hk) * dv;
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut g = RefGrads {
        dq: vec![0.0; b * sq * h * d],
        dk: vec![0.0; b * skv * hkv * d],
        dv: vec![0.0; b * skv * hkv * dv],
        d_sinks: vec![0.0; if extras.sinks.is_some() { h } else { 0 }],
    };
    for seq in &seqs {
        let bi = seq.index;
        for hi in 0..h {
            let hk = hi / group;
            for i in 0..sq {
                let row = problem.row(seq, i, hi);
                let (qa, doi) = (q_at(bi, i, hi), &d_o[o_at(bi, i, hi)..][..dv]);
                let dp: Vec<f64> = row
                    .keys
                    .clone()
                    .map(|j| dot(doi, &v[v_at(bi, j, hk)..][..dv]))
                    .collect();
                let delta: f64 = row.p.iter().zip(&dp).map(|(p, x)| p * x).sum();
                if let Some(sinks) = extras.sinks {
                    if row.lse.is_finite() {
                        g.d_sinks[hi] -= (sinks[hi] - row.lse).exp() * delta;
                    }
                }
                for (t, j) in row.keys.clone().enumerate() {
                    let ka = k_at(bi, j, hk);
                    let ds = row.p[t] * (dp[t] - delta);
                    let slope = match softcap {
                        Some(c) => {
                            let capped = (scale * dot(&q[qa..][..d], &k[ka..][..d]) / c).tanh();
                            scale * (1.0 - capped * capped)
                        }
                        None => scale,
                    };
                    let va = v_at(bi, j, hk);
                    for (e, x) in doi.iter().enumerate() {
                        g.dv[va + e] += row.p[t] * x;
                    }
                    for e in 0..d {
                        g.dq[qa + e] += slope * ds * k[ka + e];
                        g.dk[ka + e] += slope * ds * q[qa + e];
                    }
                }
            }
        }
    }
    g
}

/// The backward pass of [`varlen`] for a loss whose gradient with respect
/// to O is `d_o` ([total_q, H, D]): each sequence's gradients are
/// [`attention_backward_ext`]'s for a batch of that one sequence (per-batch
/// ALiBi slopes by sequence), written into the packed layouts of q, k and
/// v (rows no sequence owns stay 0), and the sinks' gradient sums over the
/// sequences. V, dO and dV have V's head dim (`shape.v_dim()`).
///
/// Panics as [`varlen`] does.
#[allow(clippy::too_many_arguments)]
pub fn varlen_backward(
    shape: &VarlenShape,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
    extras: &Extras,
) -> RefGrads {
    let (d, dv) = (shape.head_dim, shape.v_dim());
    let seqs = PackedSeqs::new(shape, cu_seqlens_q, cu_seqlens_k);
    seqs.each(
        &[(q, d), (d_o, dv)],
        &[(k, d), (v, dv)],
        extras,
        (d, dv),
        |one, [q, d_o], [k, v], e| attention_backward_ext(one, q, k, v, d_o, e),
    )
}

/// The sequences of a packed problem, for functions that run the fixed
/// layout's version once per sequence.
struct PackedSeqs<'a> {
    shape: &'a VarlenShape,
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
}

impl<'a> PackedSeqs<'a> {
    fn new(shape: &'a VarlenShape, cu_seqlens_q: &[i32], cu_seqlens_k: &[i32]) -> Self {
        PackedSeqs {
            shape,
            cu_q: offsets("cu_seqlens_q", cu_seqlens_q, shape.batch, shape.total_q),
            cu_k: offsets("cu_seqlens_k", cu_seqlens_k, shape.batch, shape.total_k),
        }
    }

    /// `f` over each sequence as a batch of one (per-batch ALiBi slopes by
    /// sequence), given that sequence's rows of the query-row tensors `qs`
    /// ([total_q, H, width]) and key-row tensors `ks` ([total_k, Hkv,
    /// width]), each given with its width; its results, `widths` values
    /// per head of a row (dQ and dK, then dV), are written into the packed
    /// layouts (rows no sequence owns stay 0) and the sinks' entries summed
    /// over the sequences.
    fn each<const NQ: usize, const NK: usize>(
        &self,
        qs: &[(&[f64], usize); NQ],
        ks: &[(&[f64], usize); NK],
        extras: &Extras,
        (width, v_width): (usize, usize),
        mut f: impl FnMut(&ForwardShape, [&[f64]; NQ], [&[f64]; NK], &Extras) -> RefGrads,
    ) -> RefGrads {
        let shape = self.shape;
        let (h, hkv, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        let (q_out, k_out, v_out) = (h * width, hkv * width, hkv * v_width);
        let mut g = RefGrads {
            dq: vec![0.0; shape.total_q * q_out],
            dk: vec![0.0; shape.total_k * k_out],
            dv: vec![0.0; shape.total_k * v_out],
            d_sinks: vec![0.0; if extras.sinks.is_some() { h } else { 0 }],
        };
        for b in 0..shape.batch {
            let (qs_at, ks_at) = (
                self.cu_q[b]..self.cu_q[b + 1],
                self.cu_k[b]..self.cu_k[b + 1],
            );
            let one = ForwardShape {
                batch: 1,
                seqlen_q: qs_at.len(),
                seqlen_k: ks_at.len(),
                heads: h,
                kv_heads: hkv,
                head_dim: d,
                v_head_dim: shape.v_head_dim,
                causal: shape.causal,
                softmax_scale: shape.softmax_scale,
                window: shape.window,
                softcap: shape.softcap,
            };
            let slopes = extras.alibi_slopes.map(|s| {
                if s.len() == h {
                    s
                } else {
                    &s[b * h..(b + 1) * h]
                }
            });
            let seq_extras = Extras {
                alibi_slopes: slopes,
                sinks: extras.sinks,
            };
            let gb = f(
                &one,
                qs.map(|(t, w)| &t[qs_at.start * h * w..qs_at.end * h * w]),
                ks.map(|(t, w)| &t[ks_at.start * hkv * w..ks_at.end * hkv * w]),
                &seq_extras,
            );
            g.dq[qs_at.start * q_out..qs_at.end * q_out].copy_from_slice(&gb.dq);
            g.dk[ks_at.start * k_out..ks_at.end * k_out].copy_from_slice(&gb.dk);
            g.dv[ks_at.start * v_out..ks_at.end * v_out].copy_from_slice(&gb.dv);
            for (sum, x) in g.d_sinks.iter_mut().zip(&gb.d_sinks) {
                *sum += x;
            }
        }
        g
    }
}

/// How a backward pass may err, for [`backward_bounds`].
#[derive(Clone, Copy, Debug)]
pub struct BwdErrorModel {
    /// Unit roundoff of the inputs' type: 2^-11 for f16, 2^-8 for bf16.
    pub unit: f64,
    /// The largest relative error of the kernel's `tanh` (softcap only).
    pub tanh_rel_err: f64,
    /// The largest absolute error of the forward's LSE.
    pub lse_tol: f64,
}

/// Error bounds, row by row, of a backward pass that computes
/// [`attention_backward_ext`] in the arithmetic `model` describes, given the
/// O its forward produced (`o`, contiguous [B, Sq, H, D]). The result's
/// `dq` holds one bound per row of dQ ([B, Sq, H]), `dk` and `dv` per row
/// of theirs ([B, Skv, Hkv]), `d_sinks` per head; [`check_backward`] adds
/// each row's rounding of its largest value.
///
/// The model: P and dS are rounded to the inputs' type before their
/// products, `delta` is taken from the rounded O, and each gradient is
/// rounded once (f32 accumulation is exact by comparison). With M_ij = P_ij
/// times the sum of |dP_ij|, |delta_i| and Σ|dO_i ∘ O_i|, the bounds are 2u
/// · Σ_i P_ij max|dO_i| for dV_j, 2u · scale · Σ_i M_ij max|Q_i| for dK_j
/// and 2u · scale · Σ_j M_ij max|K_j| for dQ_i. A softcap c adds the
/// `tanh`'s error ε: a logit c·t moves by up to c·|t|·ε, so P_ij by that
/// and by the LSE's share, at most the row's largest, e_i, and dS's factor
/// 1 - t² by 2t²ε; each row's terms take a relative error of 2e_i + 2ε
/// more, on M_ij plus P_ij Σ_l P_il |dP_il| (`delta`'s error). The sinks'
/// gradient -Σ_i P_sink,i · delta_i (P_sink,i the share of row i's
/// denominator that is the sink's) takes the LSE's error (and e_i)
/// relative to each term and 4u · Σ|dO_i ∘ O_i| for `delta`'s rounding.
///
/// Panics as [`attention_backward_ext`] does, or if `o` is shorter than
/// the shape requires.
#[allow(clippy::too_many_arguments)]
pub fn backward_bounds(
    shape: &ForwardShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
    o: &[f64],
    extras: &Extras,
    model: &BwdErrorModel,
) -> RefGrads {
    let (b, sq, sk, h, hkv, d, dv) = (
        shape.batch,
        shape.seqlen_q,
        shape.seqlen_k,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.v_dim(),
    );
    assert!(o.len() >= b * sq * h * dv, "o is shorter than the shape");
    let p = probabilities_ext(shape, q, k, extras);
    let u = model.unit;
    let scale = shape.softmax_scale as f64;
    let group = h / hkv;
    let row_max = |t: &[f64], at: usize, width: usize| {
        t[at..at + width].iter().fold(0f64, |m, x| m.max(x.abs()))
    };
    let q_at = |bi: usize, i: usize, hi: usize| ((bi * sq + i) * h + hi) * d;
    let k_at = |bi: usize, j: usize, hk: usize| ((bi * sk + j) * hkv + hk) * d;
    // Rows of V, dO and O (V's head dim).
    let o_at = |bi: usize, i: usize, hi: usize| ((bi * sq + i) * h + hi) * dv;
    let v_at = |bi: usize, j: usize, hk: usize| ((bi * sk + j) * hkv + hk) * dv;
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut tol = RefGrads {
        dq: vec![0.0; b * sq * h],
        dk: vec![0.0; b * sk * hkv],
        dv: vec![0.0; b * sk * hkv],
        d_sinks: vec![0.0; if extras.sinks.is_some() { h } else { 0 }],
    };
    for bi in 0..b {
        for hi in 0..h {
            let hk = hi / group;
            for i in 0..sq {
                let prow = &p[((bi * h + hi) * sq + i) * sk..][..sk];
                let (qa, oa) = (q_at(bi, i, hi), o_at(bi, i, hi));
                let (dmax, qmax) = (row_max(d_o, oa, dv), row_max(q, qa, d));
                let dp: Vec<f64> = (0..sk)
                    .map(|j| dot(&d_o[oa..][..dv], &v[v_at(bi, j, hk)..][..dv]))
                    .collect();
                let delta: f64 = (0..sk).map(|j| prow[j] * dp[j]).sum();
                let spread: f64 = (0..sk).map(|j| prow[j] * dp[j].abs()).sum();
                let od: f64 = (0..dv).map(|t| (d_o[oa + t] * o[oa + t]).abs()).sum();
                // The largest logit error of the row's softcapped scores.
                let capped = shape.softcap.map_or(0.0, |cap| {
                    let cap = cap as f64;
                    (0..sk)
                        .filter(|&j| prow[j] != 0.0)
                        .map(|j| {
                            let t = scale * dot(&q[qa..][..d], &k[k_at(bi, j, hk)..][..d]);
                            cap * (t / cap).tanh().abs() * model.tanh_rel_err
                        })
                        .fold(0.0, f64::max)
                });
                let extra = if shape.softcap.is_some() {
                    2.0 * capped + 2.0 * model.tanh_rel_err
                } else {
                    0.0
                };
                for j in (0..sk).filter(|&j| prow[j] != 0.0) {
                    let m = prow[j] * (dp[j].abs() + delta.abs() + od);
                    let m = 2.0 * u * m + extra * (m + prow[j] * spread);
                    let kr = (bi * sk + j) * hkv + hk;
                    tol.dv[kr] += (2.0 * u + extra) * prow[j] * dmax;
                    tol.dk[kr] += scale * m * qmax;
                    tol.dq[(bi * sq + i) * h + hi] += scale * m * row_max(k, k_at(bi, j, hk), d);
                }
                if extras.sinks.is_some() {
                    let share = (1.0 - prow.iter().sum::<f64>()).max(0.0);
                    tol.d_sinks[hi] +=
                        share * (delta.abs() * (model.lse_tol + capped) + 4.0 * u * od);
                }
            }
        }
    }
    tol
}

/// [`backward_bounds`] of a packed problem: each sequence's as a batch of
/// one (see [`varlen_backward`]); `o` is the forward's [total_q, H, D].
///
/// Panics as [`varlen_backward`] does, or if `o` is shorter than the shape
/// requires.
#[allow(clippy::too_many_arguments)]
pub fn varlen_backward_bounds(
    shape: &VarlenShape,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
    o: &[f64],
    extras: &Extras,
    model: &BwdErrorModel,
) -> RefGrads {
    let (d, dv) = (shape.head_dim, shape.v_dim());
    let seqs = PackedSeqs::new(shape, cu_seqlens_q, cu_seqlens_k);
    seqs.each(
        &[(q, d), (d_o, dv), (o, dv)],
        &[(k, d), (v, dv)],
        extras,
        (1, 1),
        |one, [q, d_o, o], [k, v], e| backward_bounds(one, q, k, v, d_o, o, e, model),
    )
}

/// Gradients `got` against `want` within `bounds` ([`backward_bounds`]),
/// all contiguous in [`RefGrads`]' layouts with rows of `head_dim` values
/// (dV's of `v_head_dim`):
/// each row's bound plus `unit` times the row's largest reference value
/// (the gradient's own rounding), and 1e-6 for sums that cancel to 0. The
/// first value outside, or any NaN, is the error.
pub fn check_backward(
    got: &RefGrads,
    want: &RefGrads,
    bounds: &RefGrads,
    unit: f64,
    (head_dim, v_head_dim): (usize, usize),
) -> Result<(), String> {
    let rows = |name: &str, got: &[f64], want: &[f64], tol: &[f64], head_dim: usize| {
        if got.len() != want.len() || want.len() != tol.len() * head_dim {
            return Err(format!(
                "{name}: {} values, want {} ({} rows of {head_dim})",
                got.len(),
                want.len(),
                tol.len()
            ));
        }
        for (row, ((g, w), t)) in got
            .chunks(head_dim)
            .zip(want.chunks(head_dim))
            .zip(tol)
            .enumerate()
        {
            let bound = t + unit * w.iter().fold(0f64, |m, x| m.max(x.abs())) + 1e-6;
            for (col, (&g, &w)) in g.iter().zip(w).enumerate() {
                let err = (g - w).abs();
                if err.is_nan() || err > bound {
                    return Err(format!(
                        "{name} row {row} col {col}: got {g}, want {w}, row bound {bound:.3e}"
                    ));
                }
            }
        }
        Ok::<(), String>(())
    };
    rows("dv", &got.dv, &want.dv, &bounds.dv, v_head_dim)?;
    rows("dk", &got.dk, &want.dk, &bounds.dk, head_dim)?;
    rows("dq", &got.dq, &want.dq, &bounds.dq, head_dim)?;
    if got.d_sinks.len() != want.d_sinks.len() {
        return Err(format!(
            "d_sinks: {} values, want {}",
            got.d_sinks.len(),
            want.d_sinks.len()
        ));
    }
    for (hi, ((&g, &w), &t)) in got
        .d_sinks
        .iter()
        .zip(&want.d_sinks)
        .zip(&bounds.d_sinks)
        .enumerate()
    {
        let bound = t + 1e-6;
        let err = (g - w).abs();
        if err.is_nan() || err > bound {
            return Err(format!(
                "d_sinks head {hi}: got {g}, want {w}, bound {bound:.3e}"
            ));
        }
    }
    Ok(())
}

/// Decode with the shape's mask and softcap and no extras; the same as
/// [`decode_ext`] with `Extras::default()`.
///
/// Panics if a slice is shorter than `shape` requires.
pub fn decode(
    shape: &DecodeShape,
    q: &[f64],
    k_cache: &[f64],
    v_cache: &[f64],
    cache_seqlens: &[i32],
) -> RefOutput {
    decode_ext(
        shape,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        &Extras::default(),
    )
}

/// Decode: q [B, Sq, H, D]; k_cache/v_cache [B, cache_len, Hkv, D]; sequence `b`
/// uses the first `clamp(cache_seqlens[b], 0, cache_len)` keys, the same clamp
/// the kernel applies, and the mask is aligned bottom-right within those keys.
/// Output layouts are those of [`attention`].
///
/// Panics if a slice is shorter than `shape` requires, or if an extra has the
/// wrong length.
pub fn decode_ext(
    shape: &DecodeShape,
    q: &[f64],
    k_cache: &[f64],
    v_cache: &[f64],
    cache_seqlens: &[i32],
    extras: &Extras,
) -> RefOutput {
    let p = Problem::new(
        shape.batch,
        shape.heads,
        shape.kv_heads,
        (shape.head_dim, shape.head_dim),
        shape.mask(),
        shape.softmax_scale,
        shape.softcap,
        extras,
        q,
        k_cache,
    );
    let kv_rows = shape.batch * shape.cache_len;
    p.check_len("q", q.len(), shape.batch * shape.seqlen_q, p.heads);
    p.check_len("k_cache", k_cache.len(), kv_rows, p.kv_heads);
    p.check_len("v_cache", v_cache.len(), kv_rows, p.kv_heads);
    assert!(
        cache_seqlens.len() >= shape.batch,
        "reference: cache_seqlens has {} entries, the batch is {}",
        cache_seqlens.len(),
        shape.batch
    );
    let seqs: Vec<Seq> = (0..shape.batch)
        .map(|b| Seq {
            index: b,
            q_start: b * shape.seqlen_q,
            sq: shape.seqlen_q,
            k_start: b * shape.cache_len,
            n: usize::try_from(cache_seqlens[b]).map_or(0, |n| n.min(shape.cache_len)),
        })
        .collect();
    let rows = shape.batch * shape.seqlen_q;
    p.attend(
        v_cache,
        &seqs,
        rows,
        rows * p.heads,
        batched_lse_index(p.heads),
    )
}

/// `cu_seqlens` as row offsets: at least `batch + 1` entries, non-negative,
/// non-decreasing, the last used one at most `total`.
fn offsets(name: &str, cu: &[i32], batch: usize, total: usize) -> Vec<usize> {
    assert!(
        cu.len() > batch,
        "reference: {name} has {} entries, the batch of {batch} needs {}",
        cu.len(),
        batch + 1
    );
    let cu: Vec<usize> = cu[..=batch]
        .iter()
        .map(|&c| usize::try_from(c).unwrap_or_else(|_| panic!("reference: {name} holds {c} < 0")))
        .collect();
    assert!(
        cu.windows(2).all(|w| w[0] <= w[1]),
        "reference: {name} decreases: {cu:?}"
    );
    assert!(
        cu[batch] <= total,
        "reference: {name} ends at {}, past the {total} rows",
        cu[batch]
    );
    cu
}

/// Packed variable-length attention: q [total_q, H, D], k/v [total_k, Hkv, D]
/// row-major; sequence `b` owns rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of
/// Q (likewise `cu_seqlens_k` for K/V), and its mask is aligned bottom-right
/// within its own lengths. `o` is [total_q, H, D] and `lse` [H, total_q]. Rows
/// of Q that no sequence owns get O = 0 and LSE = -inf. `max_seqlen_*` of the
/// shape are not used. Per-batch ALiBi slopes are indexed by sequence.
///
/// Panics if a slice is shorter than `shape` requires, if the offsets are not
/// a non-decreasing list of `batch + 1` non-negative rows within the totals,
/// or if an extra has the wrong length.
pub fn varlen(
    shape: &VarlenShape,
    cu_seqlens_q: &[i32],
    cu_seqlens_k: &[i32],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    extras: &Extras,
) -> RefOutput {
    let p = Problem::new(
        shape.batch,
        shape.heads,
        shape.kv_heads,
        (shape.head_dim, shape.v_dim()),
        shape.mask(),
        shape.softmax_scale,
        shape.softcap,
        extras,
        q,
        k,
    );
    p.check_len("q", q.len(), shape.total_q, p.heads);
    p.check_len("k", k.len(), shape.total_k, p.kv_heads);
    p.check_len_dim("v", v.len(), shape.total_k, p.kv_heads, p.v_head_dim);
    let cu_q = offsets("cu_seqlens_q", cu_seqlens_q, shape.batch, shape.total_q);
    let cu_k = offsets("cu_seqlens_k", cu_seqlens_k, shape.batch, shape.total_k);
    let seqs: Vec<Seq> = (0..shape.batch)
        .map(|b| Seq {
            index: b,
            q_start: cu_q[b],
            sq: cu_q[b + 1] - cu_q[b],
            k_start: cu_k[b],
            n: cu_k[b + 1] - cu_k[b],
        })
        .collect();
    let total_q = shape.total_q;
    p.attend(v, &seqs, total_q, p.heads * total_q, |seq, h, i| {
        h * total_q + seq.q_start + i
    })
}

/// Exact merge of two attention states of the same queries over disjoint key
/// sets: `o_a`/`o_b` are [rows, head_dim] (any row order, the same for both and
/// for `lse_a`/`lse_b`, which are `[rows]`, natural log). The result is
/// `lse = ln(exp(lse_a) + exp(lse_b))` and
/// `o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b`, what attention over the
/// union of the key sets gives. A state with LSE -inf (no key) carries no
/// weight, its O unread; when both are -inf, O = 0 and LSE = -inf. LSE values
/// must not be +inf or NaN.
///
/// Panics if the lengths disagree.
pub fn merge_states(
    o_a: &[f64],
    lse_a: &[f64],
    o_b: &[f64],
    lse_b: &[f64],
    head_dim: usize,
) -> RefOutput {
    let rows = lse_a.len();
    assert_eq!(
        lse_b.len(),
        rows,
        "reference: lse_b and lse_a differ in length"
    );
    assert_eq!(
        o_a.len(),
        rows * head_dim,
        "reference: o_a is not [rows, head_dim]"
    );
    assert_eq!(
        o_b.len(),
        rows * head_dim,
        "reference: o_b is not [rows, head_dim]"
    );
    let mut o = vec![0.0; rows * head_dim];
    let mut lse = vec![f64::NEG_INFINITY; rows];
    for r in 0..rows {
        let max = lse_a[r].max(lse_b[r]);
        if max == f64::NEG_INFINITY {
            continue;
        }
        let merged = max + ((lse_a[r] - max).exp() + (lse_b[r] - max).exp()).ln();
        lse[r] = merged;
        let out = &mut o[r * head_dim..(r + 1) * head_dim];
        for (state_o, state_lse) in [(o_a, lse_a[r]), (o_b, lse_b[r])] {
            if state_lse == f64::NEG_INFINITY {
                continue;
            }
            let w = (state_lse - merged).exp();
            for (oc, sc) in out.iter_mut().zip(&state_o[r * head_dim..]) {
                *oc += w * sc;
            }
        }
    }
    RefOutput { o, lse }
}
