//! Tests that need no GPU: properties of the reference (the oracle the GPU tests
//! trust, so it is checked against independent formulations of attention),
//! every argument-validation rule, the kernel configuration's invariants, and
//! `Layout::span`.
use approx::assert_relative_eq;
use flash_attn::reference::{self, Extras, RefOutput};
use flash_attn::validate::{check_decode, check_forward, Operands, TensorInfo};
use flash_attn::{
    AttnOptions, DecodeShape, FlashAttnError, ForwardShape, Layout, VarlenShape, Window,
};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------
// Reference properties
// ---------------------------------------------------------------------------

/// Values are drawn from a seed rather than by proptest itself: shrinking
/// thousands of floats is slow and the shapes are what matter when a case fails.
fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-2.0..=2.0)).collect()
}

/// Head dims include odd and tiny ones: the reference has no tile constraints.
fn head_dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1usize),
        Just(3),
        Just(8),
        Just(16),
        Just(64),
        Just(128)
    ]
}

/// (kv_heads, heads) with kv_heads dividing heads.
fn heads() -> impl Strategy<Value = (usize, usize)> {
    (1usize..=3, 1usize..=3).prop_map(|(kv, group)| (kv, kv * group))
}

/// Both the default scale and arbitrary ones, so a wrong scale cannot hide.
fn scale(d: usize, custom: Option<f32>) -> f32 {
    custom.unwrap_or(1.0 / (d as f32).sqrt())
}

prop_compose! {
    fn forward_shape(causal: Option<bool>)(
        batch in 1usize..3,
        seqlen_q in 1usize..40,
        seqlen_k in 1usize..40,
        (kv_heads, heads) in heads(),
        head_dim in head_dim(),
        c in any::<bool>(),
        custom in proptest::option::of(0.05f32..1.5),
    ) -> ForwardShape {
        ForwardShape {
            batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim,
            causal: causal.unwrap_or(c),
            softmax_scale: scale(head_dim, custom),
            ..Default::default()
        }
    }
}

struct Qkv {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
}

fn qkv(s: &ForwardShape, seed: u64) -> Qkv {
    let mut rng = StdRng::seed_from_u64(seed);
    Qkv {
        q: random_vec(&mut rng, s.batch * s.seqlen_q * s.heads * s.head_dim),
        k: random_vec(&mut rng, s.batch * s.seqlen_k * s.kv_heads * s.head_dim),
        v: random_vec(&mut rng, s.batch * s.seqlen_k * s.kv_heads * s.v_dim()),
    }
}

/// Windows as the tests draw them: each side unbounded or small (the sequences
/// are short, so small bounds are what masks anything).
fn window() -> impl Strategy<Value = Window> {
    let side = || proptest::option::of(prop_oneof![0usize..4, 0usize..45]);
    (side(), side()).prop_map(|(left, right)| Window { left, right })
}

prop_compose! {
    /// A forward shape with a window and maybe a softcap on top.
    fn policy_shape()(
        s in forward_shape(None),
        window in window(),
        softcap in proptest::option::of(0.05f32..5.0),
    ) -> ForwardShape {
        ForwardShape { window, softcap, ..s }
    }
}

/// The mask as specified, in the form `j + Sq + left >= i + Skv` and
/// `j + Sq <= i + Skv + right` so it needs no signed arithmetic and shares
/// nothing with the reference's formulation (u128 keeps huge bounds from
/// overflowing). `causal` bounds the right side at 0.
fn sees(s: &ForwardShape, i: usize, j: usize) -> bool {
    let (key, query) = ((j + s.seqlen_q) as u128, (i + s.seqlen_k) as u128);
    let right = if s.causal { Some(0) } else { s.window.right };
    s.window.left.is_none_or(|l| key + l as u128 >= query)
        && right.is_none_or(|r| key <= query + r as u128)
}

fn q_at(s: &ForwardShape, q: &[f64], b: usize, i: usize, h: usize) -> Vec<f64> {
    let start = ((b * s.seqlen_q + i) * s.heads + h) * s.head_dim;
    q[start..start + s.head_dim].to_vec()
}

/// Row `j` of K or V seen by query head `h`.
fn kv_at(s: &ForwardShape, t: &[f64], b: usize, j: usize, h: usize) -> Vec<f64> {
    let kvh = h / (s.heads / s.kv_heads);
    let start = ((b * s.seqlen_k + j) * s.kv_heads + kvh) * s.head_dim;
    t[start..start + s.head_dim].to_vec()
}

fn score(s: &ForwardShape, x: &Qkv, b: usize, i: usize, h: usize, j: usize) -> f64 {
    let q = q_at(s, &x.q, b, i, h);
    let k = kv_at(s, &x.k, b, j, h);
    let raw = f64::from(s.softmax_scale) * q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>();
    match s.softcap.map(f64::from) {
        Some(c) => c * (raw / c).tanh(),
        None => raw,
    }
}

fn o_row(s: &ForwardShape, o: &[f64], b: usize, i: usize, h: usize) -> Vec<f64> {
    q_at(s, o, b, i, h)
}

fn lse_at(s: &ForwardShape, lse: &[f64], b: usize, i: usize, h: usize) -> f64 {
    lse[(b * s.heads + h) * s.seqlen_q + i]
}

fn assert_close(got: &[f64], want: &[f64]) {
    assert_close_tol(got, want, 1e-10);
}

fn assert_close_tol(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (idx, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol + tol * w.abs(),
            "element {idx}: got {g}, want {w}"
        );
    }
}

/// LSE vectors may hold -inf, which must match exactly.
fn assert_lse_close(got: &[f64], want: &[f64]) {
    assert_lse_close_tol(got, want, 1e-10);
}

fn assert_lse_close_tol(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (idx, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, w, "lse {idx}");
        } else {
            assert!(
                (g - w).abs() <= tol + tol * w.abs(),
                "lse {idx}: got {g}, want {w}"
            );
        }
    }
}

fn assert_outputs_close(got: &RefOutput, want: &RefOutput) {
    assert_close(&got.o, &want.o);
    assert_lse_close(&got.lse, &want.lse);
}

#[test]
fn reference_hand_computed() {
    // S = [0, ln 3] so P = [1/4, 3/4]: O = 4/4 + 3*8/4 = 7, LSE = ln 4.
    let s = ForwardShape {
        batch: 1,
        seqlen_q: 1,
        seqlen_k: 2,
        heads: 1,
        kv_heads: 1,
        head_dim: 1,
        causal: false,
        softmax_scale: 0.5,
        ..Default::default()
    };
    let q = [2.0];
    let k = [0.0, 3f64.ln()];
    let v = [4.0, 8.0];
    let out = reference::attention(&s, &q, &k, &v);
    assert_relative_eq!(out.o[0], 7.0, max_relative = 1e-12);
    assert_relative_eq!(out.lse[0], 4f64.ln(), max_relative = 1e-12);
    let p = reference::probabilities(&s, &q, &k);
    assert_relative_eq!(p[0], 0.25, max_relative = 1e-12);
    assert_relative_eq!(p[1], 0.75, max_relative = 1e-12);

    // Causal with Sq = Skv = 2: row 0 sees key 0 only, so it is exactly V[0].
    let s = ForwardShape {
        seqlen_q: 2,
        causal: true,
        ..s
    };
    let out = reference::attention(&s, &[1.0, 1.0], &k, &v);
    assert_relative_eq!(out.o[0], 4.0, max_relative = 1e-12);
    assert_relative_eq!(out.lse[0], 0.0, epsilon = 1e-12);
}

#[test]
fn reference_huge_scores_are_stable() {
    // exp(1000) overflows f64; the max-subtracted form must not.
    let s = ForwardShape {
        batch: 1,
        seqlen_q: 1,
        seqlen_k: 2,
        heads: 1,
        kv_heads: 1,
        head_dim: 1,
        causal: false,
        softmax_scale: 1.0,
        ..Default::default()
    };
    let out = reference::attention(&s, &[1000.0], &[1.0, 1.0], &[1.0, 3.0]);
    assert_relative_eq!(out.o[0], 2.0, max_relative = 1e-12);
    assert_relative_eq!(out.lse[0], 1000.0 + 2f64.ln(), max_relative = 1e-12);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn probabilities_are_a_masked_softmax(s in policy_shape(), seed in any::<u64>()) {
        let x = qkv(&s, seed);
        let p = reference::probabilities(&s, &x.q, &x.k);
        prop_assert_eq!(p.len(), s.batch * s.heads * s.seqlen_q * s.seqlen_k);
        for (r, row) in p.chunks(s.seqlen_k).enumerate() {
            let i = r % s.seqlen_q;
            let visible = (0..s.seqlen_k).filter(|&j| sees(&s, i, j)).count();
            for (j, &pj) in row.iter().enumerate() {
                prop_assert!(pj >= 0.0 && pj.is_finite(), "row {} key {}: {}", r, j, pj);
                if !sees(&s, i, j) {
                    prop_assert_eq!(pj, 0.0, "masked row {} key {}", r, j);
                }
            }
            let sum: f64 = row.iter().sum();
            let want = if visible > 0 { 1.0 } else { 0.0 };
            prop_assert!((sum - want).abs() < 1e-12, "row {} sums to {}", r, sum);
        }
    }

    #[test]
    fn attention_is_p_times_v_and_lse_is_logsumexp(s in policy_shape(), seed in any::<u64>()) {
        let x = qkv(&s, seed);
        let p = reference::probabilities(&s, &x.q, &x.k);
        let out = reference::attention(&s, &x.q, &x.k, &x.v);
        prop_assert_eq!(out.o.len(), x.q.len());
        prop_assert_eq!(out.lse.len(), s.batch * s.heads * s.seqlen_q);
        for b in 0..s.batch {
            for h in 0..s.heads {
                for i in 0..s.seqlen_q {
                    let prow = &p[((b * s.heads + h) * s.seqlen_q + i) * s.seqlen_k..][..s.seqlen_k];
                    let mut want = vec![0.0; s.head_dim];
                    for (j, &pj) in prow.iter().enumerate() {
                        for (w, vc) in want.iter_mut().zip(kv_at(&s, &x.v, b, j, h)) {
                            *w += pj * vc;
                        }
                    }
                    assert_close(&o_row(&s, &out.o, b, i, h), &want);

                    let scores: Vec<f64> =
                        (0..s.seqlen_k).filter(|&j| sees(&s, i, j)).map(|j| score(&s, &x, b, i, h, j)).collect();
                    let lse = lse_at(&s, &out.lse, b, i, h);
                    if scores.is_empty() {
                        prop_assert_eq!(lse, f64::NEG_INFINITY);
                        continue;
                    }
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let want_lse = m + scores.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                    prop_assert!((lse - want_lse).abs() < 1e-10 * (1.0 + want_lse.abs()), "lse {} vs {}", lse, want_lse);
                    // P and LSE must describe the same softmax: P_ij = exp(S_ij - LSE_i).
                    for (j, &sj) in (0..s.seqlen_k).filter(|&j| sees(&s, i, j)).zip(&scores) {
                        let pj = (sj - lse).exp();
                        prop_assert!((prow[j] - pj).abs() < 1e-10 * (1.0 + pj), "p {} vs exp(s - lse) {}", prow[j], pj);
                    }
                }
            }
        }
    }

    #[test]
    fn causal_rows_ignore_keys_they_cannot_see(
        s in forward_shape(Some(true)),
        seed in any::<u64>(),
        cut_frac in 0.0f64..1.0,
    ) {
        let x = qkv(&s, seed);
        let base = reference::attention(&s, &x.q, &x.k, &x.v);
        // Rewrite every key and value at positions >= cut with large values.
        let cut = (cut_frac * s.seqlen_k as f64) as usize;
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        let (mut k, mut v) = (x.k.clone(), x.v.clone());
        let row = s.kv_heads * s.head_dim;
        for b in 0..s.batch {
            let tail = (b * s.seqlen_k + cut) * row..(b + 1) * s.seqlen_k * row;
            for e in tail {
                k[e] = rng.random_range(-50.0..50.0);
                v[e] = rng.random_range(-50.0..50.0);
            }
        }
        let changed = reference::attention(&s, &x.q, &k, &v);
        for b in 0..s.batch {
            for h in 0..s.heads {
                for i in 0..s.seqlen_q {
                    // Row i sees keys j <= i + Skv - Sq, all of them below cut.
                    if i + s.seqlen_k < s.seqlen_q + cut {
                        prop_assert_eq!(o_row(&s, &changed.o, b, i, h), o_row(&s, &base.o, b, i, h));
                        prop_assert_eq!(lse_at(&s, &changed.lse, b, i, h), lse_at(&s, &base.lse, b, i, h));
                    }
                }
            }
        }
    }

    #[test]
    fn decode_is_bottom_right_causal_attention_over_the_cache_prefix(
        batch in 1usize..3,
        seqlen_q in 1usize..8,
        cache_len in 1usize..40,
        (kv_heads, heads) in heads(),
        head_dim in head_dim(),
        causal in any::<bool>(),
        seqlens in proptest::collection::vec(-3i32..45, 2),
        seed in any::<u64>(),
    ) {
        let shape = DecodeShape {
            batch, seqlen_q, cache_len, heads, kv_heads, head_dim, causal,
            softmax_scale: scale(head_dim, None),
            ..Default::default()
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let q = random_vec(&mut rng, batch * seqlen_q * heads * head_dim);
        let k = random_vec(&mut rng, batch * cache_len * kv_heads * head_dim);
        let v = random_vec(&mut rng, batch * cache_len * kv_heads * head_dim);
        let seqlens = &seqlens[..batch];
        let out = reference::decode(&shape, &q, &k, &v, seqlens);
        prop_assert_eq!(out.o.len(), q.len());
        prop_assert_eq!(out.lse.len(), batch * heads * seqlen_q);

        let (q_per_b, kv_per_b) = (seqlen_q * heads * head_dim, cache_len * kv_heads * head_dim);
        let lse_per_b = heads * seqlen_q;
        for b in 0..batch {
            let n = seqlens[b].clamp(0, cache_len as i32) as usize;
            let got = RefOutput {
                o: out.o[b * q_per_b..][..q_per_b].to_vec(),
                lse: out.lse[b * lse_per_b..][..lse_per_b].to_vec(),
            };
            let qb = &q[b * q_per_b..][..q_per_b];
            if n == 0 {
                prop_assert!(got.o.iter().all(|&x| x == 0.0));
                prop_assert!(got.lse.iter().all(|&x| x == f64::NEG_INFINITY));
                continue;
            }
            // The cache prefix, contiguous [1, n, Hkv, D].
            let kb = &k[b * kv_per_b..][..n * kv_heads * head_dim];
            let vb = &v[b * kv_per_b..][..n * kv_heads * head_dim];
            let fwd = ForwardShape {
                batch: 1, seqlen_q, seqlen_k: n, heads, kv_heads, head_dim, causal,
                softmax_scale: shape.softmax_scale,
                ..Default::default()
            };
            assert_outputs_close(&got, &reference::attention(&fwd, qb, kb, vb));

            // Bottom-right alignment: the decode queries are the last Sq rows of
            // a square causal problem over the same n keys, whose other rows are
            // arbitrary.
            if causal && seqlen_q <= n {
                let row = heads * head_dim;
                let mut q_full = random_vec(&mut rng, (n - seqlen_q) * row);
                q_full.extend_from_slice(qb);
                let square = ForwardShape { seqlen_q: n, ..fwd };
                let full = reference::attention(&square, &q_full, kb, vb);
                let want_o = full.o[(n - seqlen_q) * row..].to_vec();
                let want_lse: Vec<f64> = (0..heads)
                    .flat_map(|h| full.lse[h * n + n - seqlen_q..(h + 1) * n].to_vec())
                    .collect();
                assert_outputs_close(&got, &RefOutput { o: want_o, lse: want_lse });
            }
        }
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv_heads(s in policy_shape(), seed in any::<u64>()) {
        let x = qkv(&s, seed);
        let group = s.heads / s.kv_heads;
        let repeat = |t: &[f64]| -> Vec<f64> {
            let mut out = Vec::with_capacity(t.len() * group);
            for kv_row in t.chunks(s.head_dim) {
                for _ in 0..group {
                    out.extend_from_slice(kv_row);
                }
            }
            out
        };
        let mha = ForwardShape { kv_heads: s.heads, ..s };
        let want = reference::attention(&mha, &x.q, &repeat(&x.k), &repeat(&x.v));
        assert_outputs_close(&reference::attention(&s, &x.q, &x.k, &x.v), &want);
    }

    #[test]
    fn unmasked_attention_ignores_key_order(s in forward_shape(Some(false)), seed in any::<u64>()) {
        let x = qkv(&s, seed);
        let mut perm: Vec<usize> = (0..s.seqlen_k).collect();
        perm.shuffle(&mut StdRng::seed_from_u64(seed.wrapping_add(1)));
        let row = s.kv_heads * s.head_dim;
        let permute = |t: &[f64]| -> Vec<f64> {
            let mut out = Vec::with_capacity(t.len());
            for b in 0..s.batch {
                for &j in &perm {
                    out.extend_from_slice(&t[(b * s.seqlen_k + j) * row..][..row]);
                }
            }
            out
        };
        let want = reference::attention(&s, &x.q, &x.k, &x.v);
        assert_outputs_close(&reference::attention(&s, &x.q, &permute(&x.k), &permute(&x.v)), &want);
    }

    #[test]
    fn causal_rows_without_keys_are_zero_with_lse_minus_inf(
        s in forward_shape(Some(true)).prop_filter("Sq > Skv", |s| s.seqlen_q > s.seqlen_k),
        seed in any::<u64>(),
    ) {
        let x = qkv(&s, seed);
        let out = reference::attention(&s, &x.q, &x.k, &x.v);
        for b in 0..s.batch {
            for h in 0..s.heads {
                for i in 0..s.seqlen_q {
                    let lse = lse_at(&s, &out.lse, b, i, h);
                    if i < s.seqlen_q - s.seqlen_k {
                        prop_assert_eq!(lse, f64::NEG_INFINITY, "row {}", i);
                        prop_assert!(o_row(&s, &out.o, b, i, h).iter().all(|&x| x == 0.0));
                    } else {
                        prop_assert!(lse.is_finite(), "row {} sees a key", i);
                    }
                }
            }
        }
    }
}

/// Values of the extras, drawn from a seed. `alibi`: 0 none, 1 per head [H],
/// 2 per batch entry and head [B * H].
struct ExtraVals {
    slopes: Option<Vec<f64>>,
    sinks: Option<Vec<f64>>,
    heads: usize,
}

impl ExtraVals {
    fn new(batch: usize, heads: usize, alibi: u8, sinks: bool, seed: u64) -> ExtraVals {
        let mut rng = StdRng::seed_from_u64(seed ^ 0xa11b1);
        let mut draw = |n: usize, lo: f64, hi: f64| -> Vec<f64> {
            (0..n).map(|_| rng.random_range(lo..=hi)).collect()
        };
        let slopes = match alibi {
            0 => None,
            1 => Some(draw(heads, 0.0, 1.0)),
            _ => Some(draw(batch * heads, 0.0, 1.0)),
        };
        let sinks = sinks.then(|| draw(heads, -4.0, 4.0));
        ExtraVals {
            slopes,
            sinks,
            heads,
        }
    }

    fn extras(&self) -> Extras<'_> {
        Extras {
            alibi_slopes: self.slopes.as_deref(),
            sinks: self.sinks.as_deref(),
        }
    }

    /// The extras of batch entry `b` as a problem of its own (batch 1).
    fn of_entry(&self, b: usize) -> Extras<'_> {
        let h = self.heads;
        Extras {
            alibi_slopes: self.slopes.as_deref().map(|s| {
                if s.len() == h {
                    s
                } else {
                    &s[b * h..][..h]
                }
            }),
            sinks: self.sinks.as_deref(),
        }
    }

    /// The slope of batch entry `b`, head `h`, whatever the layout.
    fn slope(&self, b: usize, h: usize) -> Option<f64> {
        let s = self.slopes.as_deref()?;
        Some(if s.len() == self.heads {
            s[h]
        } else {
            s[b * self.heads + h]
        })
    }
}

/// Attention with every policy straight from its definition: a score for
/// every key `sees` admits (softcap in `score`, the ALiBi distance
/// `|i + Skv - Sq - j|` as an unsigned difference), the sink as one more term
/// of the denominator.
fn brute_force(s: &ForwardShape, x: &Qkv, e: &ExtraVals) -> RefOutput {
    let mut o = vec![0.0; x.q.len()];
    let mut lse = vec![0.0; s.batch * s.heads * s.seqlen_q];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..s.seqlen_q {
                let terms: Vec<(usize, f64)> = (0..s.seqlen_k)
                    .filter(|&j| sees(s, i, j))
                    .map(|j| {
                        let bias = e.slope(b, h).map_or(0.0, |m| {
                            -m * (i + s.seqlen_k).abs_diff(j + s.seqlen_q) as f64
                        });
                        (j, score(s, x, b, i, h, j) + bias)
                    })
                    .collect();
                let sink = e.sinks.as_ref().map(|v| v[h]);
                let m = terms
                    .iter()
                    .map(|t| t.1)
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let l = &mut lse[(b * s.heads + h) * s.seqlen_q + i];
                if m == f64::NEG_INFINITY {
                    *l = m;
                    continue;
                }
                let den: f64 = terms.iter().map(|t| (t.1 - m).exp()).sum::<f64>()
                    + sink.map_or(0.0, |x| (x - m).exp());
                *l = m + den.ln();
                let start = ((b * s.seqlen_q + i) * s.heads + h) * s.head_dim;
                for &(j, sj) in &terms {
                    let w = (sj - m).exp() / den;
                    for (oc, vc) in o[start..][..s.head_dim]
                        .iter_mut()
                        .zip(kv_at(s, &x.v, b, j, h))
                    {
                        *oc += w * vc;
                    }
                }
            }
        }
    }
    RefOutput { o, lse }
}

/// Added to the narrowest covering window's sides: none, one, some, or all
/// the way to `usize::MAX` (saturating).
fn slack() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(1), 0usize..100, Just(usize::MAX)]
}

/// ln(exp(a) + exp(b)), written out.
fn log_add_exp(a: f64, b: f64) -> f64 {
    let m = a.max(b);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// LSE [B, H, Sq] reordered like O's rows, [B, Sq, H], and back.
fn lse_to_rows(s: &ForwardShape, lse: &[f64]) -> Vec<f64> {
    let mut out = Vec::with_capacity(lse.len());
    for b in 0..s.batch {
        for i in 0..s.seqlen_q {
            for h in 0..s.heads {
                out.push(lse_at(s, lse, b, i, h));
            }
        }
    }
    out
}

fn lse_from_rows(s: &ForwardShape, rows: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; rows.len()];
    for b in 0..s.batch {
        for i in 0..s.seqlen_q {
            for h in 0..s.heads {
                out[(b * s.heads + h) * s.seqlen_q + i] = rows[(b * s.seqlen_q + i) * s.heads + h];
            }
        }
    }
    out
}

/// Keys `range` of every batch entry of a [B, Skv, Hkv, D] tensor.
fn key_slice(s: &ForwardShape, t: &[f64], range: std::ops::Range<usize>) -> Vec<f64> {
    let row = s.kv_heads * s.head_dim;
    (0..s.batch)
        .flat_map(|b| {
            t[(b * s.seqlen_k + range.start) * row..(b * s.seqlen_k + range.end) * row].to_vec()
        })
        .collect()
}

#[test]
fn reference_policies_hand_computed() {
    let one = ForwardShape {
        batch: 1,
        seqlen_q: 1,
        seqlen_k: 1,
        heads: 1,
        kv_heads: 1,
        head_dim: 1,
        causal: false,
        softmax_scale: 1.0,
        ..Default::default()
    };
    // A sink equal to the only score takes half the mass; both are 1000, so
    // this also needs the sink inside the max subtraction.
    let sinks = [1000.0];
    let with_sink = Extras {
        sinks: Some(&sinks),
        ..Default::default()
    };
    let out = reference::attention_ext(&one, &[1000.0], &[1.0], &[6.0], &with_sink);
    assert_relative_eq!(out.o[0], 3.0, max_relative = 1e-12);
    assert_relative_eq!(out.lse[0], 1000.0 + 2f64.ln(), max_relative = 1e-12);

    // A row that sees no key: O = 0, LSE = the sink.
    let s = ForwardShape {
        seqlen_q: 2,
        causal: true,
        ..one
    };
    let out = reference::attention_ext(&s, &[1.0, 1.0], &[1.0], &[6.0], &with_sink);
    assert_eq!(out.o[0], 0.0);
    assert_eq!(out.lse[0], 1000.0);

    // ALiBi with zero scores: one query over 3 keys, slope ln 2, distances
    // 2, 1, 0, so the weights are 1/4, 1/2, 1: P = [1, 2, 4] / 7.
    let s = ForwardShape { seqlen_k: 3, ..one };
    let slopes = [2f64.ln()];
    let alibi = Extras {
        alibi_slopes: Some(&slopes),
        ..Default::default()
    };
    let out = reference::attention_ext(&s, &[0.0], &[1.0, 2.0, 3.0], &[7.0, 0.0, 0.0], &alibi);
    assert_relative_eq!(out.o[0], 1.0, max_relative = 1e-12);
    assert_relative_eq!(out.lse[0], (7.0f64 / 4.0).ln(), max_relative = 1e-12);

    // Softcap 1 turns scores ±100 into ±tanh(100).
    let s = ForwardShape {
        seqlen_k: 2,
        softcap: Some(1.0),
        ..one
    };
    let p = reference::probabilities(&s, &[100.0], &[1.0, -1.0]);
    let t = 100f64.tanh();
    assert_relative_eq!(p[0], t.exp() / (t.exp() + (-t).exp()), max_relative = 1e-12);

    // Window (1, 0) without causal, 4 x 4: row 2 sees keys 1 and 2; window
    // (0, 1): keys 2 and 3.
    for (window, keys) in [
        (
            Window {
                left: Some(1),
                right: Some(0),
            },
            [1, 2],
        ),
        (
            Window {
                left: Some(0),
                right: Some(1),
            },
            [2, 3],
        ),
    ] {
        let s = ForwardShape {
            seqlen_q: 4,
            seqlen_k: 4,
            window,
            ..one
        };
        let p = reference::probabilities(&s, &[0.0; 4], &[0.0; 4]);
        let mut want = [0.0; 4];
        for j in keys {
            want[j] = 0.5;
        }
        assert_eq!(p[8..12], want, "{window:?}");
    }
}

#[test]
fn merge_states_hand_computed() {
    // Row 0: LSEs ln 1 and ln 3 weigh 1/4 and 3/4: O = 2/4 + 18/4 = 5.
    // Row 1: state a has no key (its O is not even read); the merge is b.
    // Row 2: neither has a key.
    let o_a = [2.0, f64::NAN, 0.0];
    let lse_a = [0.0, f64::NEG_INFINITY, f64::NEG_INFINITY];
    let o_b = [6.0, 9.0, 0.0];
    let lse_b = [3f64.ln(), 1.5, f64::NEG_INFINITY];
    let out = reference::merge_states(&o_a, &lse_a, &o_b, &lse_b, 1);
    assert_relative_eq!(out.o[0], 5.0, max_relative = 1e-12);
    assert_relative_eq!(out.lse[0], 4f64.ln(), max_relative = 1e-12);
    assert_eq!((out.o[1], out.lse[1]), (9.0, 1.5));
    assert_eq!((out.o[2], out.lse[2]), (0.0, f64::NEG_INFINITY));
    // Huge LSEs must not overflow.
    let out = reference::merge_states(&[1.0], &[1000.0], &[3.0], &[1000.0], 1);
    assert_relative_eq!(out.o[0], 2.0, max_relative = 1e-12);
    assert_relative_eq!(out.lse[0], 1000.0 + 2f64.ln(), max_relative = 1e-12);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn attention_ext_is_a_brute_force_softmax(
        s in policy_shape(),
        alibi in 0u8..3,
        sinks in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let x = qkv(&s, seed);
        let e = ExtraVals::new(s.batch, s.heads, alibi, sinks, seed);
        let got = reference::attention_ext(&s, &x.q, &x.k, &x.v, &e.extras());
        assert_outputs_close(&got, &brute_force(&s, &x, &e));
    }

    #[test]
    fn window_visibility_is_brute_force(s in policy_shape(), seed in any::<u64>()) {
        // With Q = 0 every score is 0 (softcap or not), so each visible key
        // gets exactly 1 / (number visible) and every other key 0.
        let x = qkv(&s, seed);
        let p = reference::probabilities(&s, &vec![0.0; x.q.len()], &x.k);
        for (r, row) in p.chunks(s.seqlen_k).enumerate() {
            let i = r % s.seqlen_q;
            let visible = (0..s.seqlen_k).filter(|&j| sees(&s, i, j)).count();
            for (j, &pj) in row.iter().enumerate() {
                let want = if sees(&s, i, j) { 1.0 / visible as f64 } else { 0.0 };
                prop_assert_eq!(pj, want, "row {} key {}", r, j);
            }
        }
    }

    #[test]
    fn causal_is_the_window_none_zero(
        s in forward_shape(Some(false)),
        left in proptest::option::of(0usize..45),
        right in proptest::option::of(0usize..45),
        seed in any::<u64>(),
    ) {
        let x = qkv(&s, seed);
        let windowed = ForwardShape { window: Window { left, right: Some(0) }, ..s };
        // causal folds into the right side whatever it was.
        let causal = ForwardShape { causal: true, window: Window { left, right }, ..s };
        assert_outputs_close(
            &reference::attention(&windowed, &x.q, &x.k, &x.v),
            &reference::attention(&causal, &x.q, &x.k, &x.v),
        );
    }

    /// Includes (None, None), which is `Window::default()` itself; the
    /// property with teeth is that the narrowest window still covering every
    /// key (left Skv - 1, right Sq - 1), or any wider one up to `usize::MAX`,
    /// masks nothing.
    #[test]
    fn a_window_covering_every_key_is_no_window(
        s in forward_shape(Some(false)),
        softcap in proptest::option::of(0.05f32..5.0),
        extra in proptest::option::of(slack()),
        extra_right in proptest::option::of(slack()),
        seed in any::<u64>(),
    ) {
        let x = qkv(&s, seed);
        let plain = ForwardShape { softcap, ..s };
        let window = Window {
            left: extra.map(|e| (s.seqlen_k - 1).saturating_add(e)),
            right: extra_right.map(|e| (s.seqlen_q - 1).saturating_add(e)),
        };
        let windowed = ForwardShape { window, ..plain };
        assert_outputs_close(
            &reference::attention(&windowed, &x.q, &x.k, &x.v),
            &reference::attention(&plain, &x.q, &x.k, &x.v),
        );
    }

    #[test]
    fn window_rows_ignore_keys_outside_their_window(
        s in policy_shape(),
        alibi in 0u8..3,
        sinks in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let x = qkv(&s, seed);
        let e = ExtraVals::new(s.batch, s.heads, alibi, sinks, seed);
        let base = reference::attention_ext(&s, &x.q, &x.k, &x.v, &e.extras());
        // Poison every key and value row that query i0 cannot see: NaN would
        // spread to anything it reached.
        let i0 = (seed % s.seqlen_q as u64) as usize;
        let (mut k, mut v) = (x.k.clone(), x.v.clone());
        let row = s.kv_heads * s.head_dim;
        for b in 0..s.batch {
            for j in (0..s.seqlen_k).filter(|&j| !sees(&s, i0, j)) {
                let r = (b * s.seqlen_k + j) * row..(b * s.seqlen_k + j + 1) * row;
                k[r.clone()].fill(f64::NAN);
                v[r].fill(f64::NAN);
            }
        }
        let changed = reference::attention_ext(&s, &x.q, &k, &v, &e.extras());
        for b in 0..s.batch {
            for h in 0..s.heads {
                prop_assert_eq!(o_row(&s, &changed.o, b, i0, h), o_row(&s, &base.o, b, i0, h));
                prop_assert_eq!(lse_at(&s, &changed.lse, b, i0, h), lse_at(&s, &base.lse, b, i0, h));
            }
        }
    }

    #[test]
    fn huge_softcap_is_no_softcap(s in policy_shape(), seed in any::<u64>()) {
        let x = qkv(&s, seed);
        let plain = ForwardShape { softcap: None, ..s };
        let capped = ForwardShape { softcap: Some(1e9), ..s };
        let got = reference::attention(&capped, &x.q, &x.k, &x.v);
        let want = reference::attention(&plain, &x.q, &x.k, &x.v);
        assert_close_tol(&got.o, &want.o, 1e-9);
        assert_lse_close_tol(&got.lse, &want.lse, 1e-9);
    }

    #[test]
    fn softcap_bounds_the_scores(
        s in policy_shape(),
        c in 0.05f32..3.0,
        seed in any::<u64>(),
    ) {
        // Q times 5 pushes raw scores well past the cap.
        let s = ForwardShape { softcap: Some(c), ..s };
        let x = qkv(&s, seed);
        let q: Vec<f64> = x.q.iter().map(|v| 5.0 * v).collect();
        let p = reference::probabilities(&s, &q, &x.k);
        let out = reference::attention(&s, &q, &x.k, &x.v);
        let c = f64::from(c);
        for b in 0..s.batch {
            for h in 0..s.heads {
                for i in 0..s.seqlen_q {
                    let lse = lse_at(&s, &out.lse, b, i, h);
                    let prow = &p[((b * s.heads + h) * s.seqlen_q + i) * s.seqlen_k..][..s.seqlen_k];
                    for j in (0..s.seqlen_k).filter(|&j| sees(&s, i, j)) {
                        // P = exp(S - LSE), so S = LSE + ln P.
                        let score = lse + prow[j].ln();
                        prop_assert!(score.abs() <= c + 1e-9, "row {} key {}: |{}| > {}", i, j, score, c);
                    }
                }
            }
        }
    }

    #[test]
    fn minus_inf_sinks_are_no_sinks(
        s in policy_shape(),
        sink in prop_oneof![Just(f64::NEG_INFINITY), Just(-1e300)],
        seed in any::<u64>(),
    ) {
        let x = qkv(&s, seed);
        let sinks = vec![sink; s.heads];
        let extras = Extras { sinks: Some(&sinks), ..Default::default() };
        let got = reference::attention_ext(&s, &x.q, &x.k, &x.v, &extras);
        let mut want = reference::attention(&s, &x.q, &x.k, &x.v);
        // A row without keys reports the sink itself as its LSE.
        for l in &mut want.lse {
            if *l == f64::NEG_INFINITY {
                *l = sink;
            }
        }
        assert_outputs_close(&got, &want);
    }

    #[test]
    fn sinks_take_probability_mass(
        s in policy_shape(),
        sinks in proptest::collection::vec(
            prop_oneof![4 => -4.0f64..4.0, 1 => Just(800.0), 1 => Just(-800.0)],
            9,
        ),
        seed in any::<u64>(),
    ) {
        let x = qkv(&s, seed);
        let sinks = &sinks[..s.heads];
        let extras = Extras { sinks: Some(sinks), ..Default::default() };
        let plain = reference::attention(&s, &x.q, &x.k, &x.v);
        let got = reference::attention_ext(&s, &x.q, &x.k, &x.v, &extras);
        // With V = 1 every element of O is the row sum of P.
        let ones = vec![1.0; x.v.len()];
        let sums = reference::attention_ext(&s, &x.q, &x.k, &ones, &extras);
        for b in 0..s.batch {
            for (h, &sink) in sinks.iter().enumerate() {
                for i in 0..s.seqlen_q {
                    let lse_plain = lse_at(&s, &plain.lse, b, i, h);
                    let lse = lse_at(&s, &got.lse, b, i, h);
                    let want_lse = log_add_exp(lse_plain, sink);
                    prop_assert!(
                        (lse - want_lse).abs() <= 1e-10 * (1.0 + want_lse.abs()),
                        "lse {} vs {}", lse, want_lse
                    );
                    // The sink scales P (hence O) by exp(lse_plain - lse).
                    let shrink = (lse_plain - lse).exp();
                    let want_o: Vec<f64> = o_row(&s, &plain.o, b, i, h).iter().map(|o| o * shrink).collect();
                    assert_close(&o_row(&s, &got.o, b, i, h), &want_o);
                    let sum = o_row(&s, &sums.o, b, i, h)[0];
                    let sink_mass = (sink - lse).exp();
                    prop_assert!(
                        (sum - (1.0 - sink_mass)).abs() < 1e-12,
                        "row sum {} vs 1 - {}", sum, sink_mass
                    );
                    // Strictly below 1 wherever the sink's share survives rounding.
                    prop_assert!(sum <= 1.0 + 1e-12, "row sum {}", sum);
                    prop_assert!(
                        sum < 1.0 || sink_mass < 1e-12,
                        "row sum {} with sink mass {}", sum, sink_mass
                    );
                }
            }
        }
    }

    #[test]
    fn zero_alibi_slopes_are_no_alibi(s in policy_shape(), per_batch in any::<bool>(), seed in any::<u64>()) {
        let x = qkv(&s, seed);
        let slopes = vec![0.0; if per_batch { s.batch * s.heads } else { s.heads }];
        let extras = Extras { alibi_slopes: Some(&slopes), ..Default::default() };
        assert_outputs_close(
            &reference::attention_ext(&s, &x.q, &x.k, &x.v, &extras),
            &reference::attention(&s, &x.q, &x.k, &x.v),
        );
    }

    #[test]
    fn per_head_slopes_equal_them_repeated_per_batch_entry(s in policy_shape(), seed in any::<u64>()) {
        let x = qkv(&s, seed);
        let e = ExtraVals::new(s.batch, s.heads, 1, false, seed);
        let per_head = e.slopes.clone().unwrap();
        let repeated: Vec<f64> = per_head.iter().copied().cycle().take(s.batch * s.heads).collect();
        let extras = |slopes| Extras { alibi_slopes: Some(slopes), ..Default::default() };
        assert_outputs_close(
            &reference::attention_ext(&s, &x.q, &x.k, &x.v, &extras(&per_head)),
            &reference::attention_ext(&s, &x.q, &x.k, &x.v, &extras(&repeated)),
        );
    }

    #[test]
    fn varlen_of_one_sequence_is_the_forward(
        s in policy_shape(),
        alibi in 0u8..3,
        sinks in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let s = ForwardShape { batch: 1, ..s };
        let x = qkv(&s, seed);
        let e = ExtraVals::new(1, s.heads, alibi, sinks, seed);
        let v = VarlenShape {
            batch: 1,
            total_q: s.seqlen_q,
            total_k: s.seqlen_k,
            max_seqlen_q: s.seqlen_q,
            max_seqlen_k: s.seqlen_k,
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            v_head_dim: 0,
            causal: s.causal,
            softmax_scale: s.softmax_scale,
            window: s.window,
            softcap: s.softcap,
        };
        let cu_q = [0, s.seqlen_q as i32];
        let cu_k = [0, s.seqlen_k as i32];
        assert_outputs_close(
            &reference::varlen(&v, &cu_q, &cu_k, &x.q, &x.k, &x.v, &e.extras()),
            &reference::attention_ext(&s, &x.q, &x.k, &x.v, &e.extras()),
        );
    }

    #[test]
    fn varlen_is_a_loop_over_sequences(
        lens in proptest::collection::vec(
            (prop_oneof![Just(0usize), Just(1), 0usize..14], prop_oneof![Just(0usize), Just(1), 0usize..14]),
            1..5,
        ),
        pads in [0usize..3, 0usize..3, 0usize..3, 0usize..3],
        (kv_heads, heads) in heads(),
        head_dim in prop_oneof![Just(1usize), Just(3), Just(16)],
        causal in any::<bool>(),
        window in window(),
        softcap in proptest::option::of(0.05f32..5.0),
        alibi in 0u8..3,
        sinks in any::<bool>(),
        seed in any::<u64>(),
    ) {
        // Rows before the first and after the last sequence belong to none.
        let batch = lens.len();
        let cu = |pad: usize, len: fn(&(usize, usize)) -> usize| -> Vec<usize> {
            let ends = lens.iter().scan(pad, |acc, l| {
                *acc += len(l);
                Some(*acc)
            });
            std::iter::once(pad).chain(ends).collect()
        };
        let (cu_q, cu_k) = (cu(pads[0], |l| l.0), cu(pads[1], |l| l.1));
        let (total_q, total_k) = (cu_q[batch] + pads[2], cu_k[batch] + pads[3]);
        let mut rng = StdRng::seed_from_u64(seed);
        let q = random_vec(&mut rng, total_q * heads * head_dim);
        let k = random_vec(&mut rng, total_k * kv_heads * head_dim);
        let v = random_vec(&mut rng, total_k * kv_heads * head_dim);
        let e = ExtraVals::new(batch, heads, alibi, sinks, seed);
        let shape = VarlenShape {
            batch, total_q, total_k,
            max_seqlen_q: lens.iter().map(|l| l.0).max().unwrap(),
            max_seqlen_k: lens.iter().map(|l| l.1).max().unwrap(),
            heads, kv_heads, head_dim, v_head_dim: 0, causal,
            softmax_scale: scale(head_dim, None),
            window, softcap,
        };
        let to_i32 = |cu: &[usize]| cu.iter().map(|&c| c as i32).collect::<Vec<_>>();
        let got = reference::varlen(&shape, &to_i32(&cu_q), &to_i32(&cu_k), &q, &k, &v, &e.extras());

        let (q_row, kv_row) = (heads * head_dim, kv_heads * head_dim);
        let mut want = RefOutput { o: vec![0.0; q.len()], lse: vec![f64::NEG_INFINITY; heads * total_q] };
        for b in 0..batch {
            let (sq, sk) = lens[b];
            let fwd = ForwardShape {
                batch: 1, seqlen_q: sq, seqlen_k: sk, heads, kv_heads, head_dim, v_head_dim: 0, causal,
                softmax_scale: shape.softmax_scale, window, softcap,
            };
            let kb = &k[cu_k[b] * kv_row..cu_k[b + 1] * kv_row];
            let vb = &v[cu_k[b] * kv_row..cu_k[b + 1] * kv_row];
            let qb = &q[cu_q[b] * q_row..cu_q[b + 1] * q_row];
            let out = reference::attention_ext(&fwd, qb, kb, vb, &e.of_entry(b));
            want.o[cu_q[b] * q_row..cu_q[b + 1] * q_row].copy_from_slice(&out.o);
            for h in 0..heads {
                want.lse[h * total_q + cu_q[b]..][..sq].copy_from_slice(&out.lse[h * sq..][..sq]);
            }
        }
        assert_outputs_close(&got, &want);
    }

    /// Splitting the keys at `cut` into a prefix A and a suffix B: the suffix
    /// keeps the mask (the alignment is to the end of the keys), while the
    /// prefix, whose end lies `Skv - cut` keys earlier, needs the right bound
    /// widened by `Skv - cut`. Causal rows that see nothing of B, or nothing
    /// at all (Sq > Skv), exercise the -inf states.
    #[test]
    fn merge_states_over_a_key_split_is_attention_over_all(
        s in forward_shape(None),
        right in proptest::option::of(0usize..45),
        softcap in proptest::option::of(0.05f32..5.0),
        cut_frac in 0.0f64..=1.0,
        seed in any::<u64>(),
    ) {
        let s = ForwardShape { window: Window { left: None, right }, softcap, ..s };
        let x = qkv(&s, seed);
        let cut = ((cut_frac * s.seqlen_k as f64) as usize).min(s.seqlen_k);
        let full = reference::attention(&s, &x.q, &x.k, &x.v);

        let tail = s.seqlen_k - cut;
        let right_a = s.mask().right.map(|r| r + tail);
        let shape_a = ForwardShape {
            seqlen_k: cut,
            causal: false,
            window: Window { left: None, right: right_a },
            ..s
        };
        let shape_b = ForwardShape { seqlen_k: tail, ..s };
        let half = |shape: &ForwardShape, keys: std::ops::Range<usize>| {
            let (k, v) = (key_slice(&s, &x.k, keys.clone()), key_slice(&s, &x.v, keys));
            reference::attention(shape, &x.q, &k, &v)
        };
        let (a, b) = (half(&shape_a, 0..cut), half(&shape_b, cut..s.seqlen_k));
        let (lse_a, lse_b) = (lse_to_rows(&s, &a.lse), lse_to_rows(&s, &b.lse));
        let merged = reference::merge_states(&a.o, &lse_a, &b.o, &lse_b, s.head_dim);
        let merged = RefOutput { o: merged.o, lse: lse_from_rows(&s, &merged.lse) };
        assert_outputs_close(&merged, &full);
    }

    #[test]
    fn decode_ext_is_attention_ext_over_the_cache_prefix(
        batch in 1usize..3,
        seqlen_q in 1usize..8,
        cache_len in 1usize..40,
        (kv_heads, heads) in heads(),
        head_dim in head_dim(),
        causal in any::<bool>(),
        window in window(),
        softcap in proptest::option::of(0.05f32..5.0),
        alibi in 0u8..3,
        sinks in any::<bool>(),
        seqlens in proptest::collection::vec(-3i32..45, 2),
        seed in any::<u64>(),
    ) {
        let shape = DecodeShape {
            batch, seqlen_q, cache_len, heads, kv_heads, head_dim, causal,
            softmax_scale: scale(head_dim, None),
            window, softcap, num_splits: None,
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let q = random_vec(&mut rng, batch * seqlen_q * heads * head_dim);
        let k = random_vec(&mut rng, batch * cache_len * kv_heads * head_dim);
        let v = random_vec(&mut rng, batch * cache_len * kv_heads * head_dim);
        let e = ExtraVals::new(batch, heads, alibi, sinks, seed);
        let seqlens = &seqlens[..batch];
        let out = reference::decode_ext(&shape, &q, &k, &v, seqlens, &e.extras());

        let (q_per_b, kv_per_b) = (seqlen_q * heads * head_dim, cache_len * kv_heads * head_dim);
        let lse_per_b = heads * seqlen_q;
        for b in 0..batch {
            let n = seqlens[b].clamp(0, cache_len as i32) as usize;
            let got = RefOutput {
                o: out.o[b * q_per_b..][..q_per_b].to_vec(),
                lse: out.lse[b * lse_per_b..][..lse_per_b].to_vec(),
            };
            let fwd = ForwardShape {
                batch: 1, seqlen_q, seqlen_k: n, heads, kv_heads, head_dim, v_head_dim: 0, causal,
                softmax_scale: shape.softmax_scale, window, softcap,
            };
            let prefix = n * kv_heads * head_dim;
            let want = reference::attention_ext(
                &fwd,
                &q[b * q_per_b..][..q_per_b],
                &k[b * kv_per_b..][..prefix],
                &v[b * kv_per_b..][..prefix],
                &e.of_entry(b),
            );
            assert_outputs_close(&got, &want);
        }
    }
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

const B: usize = 2;
const SQ: usize = 16;
const SK: usize = 24;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 64;
const BASE: u64 = 0x7f00_0000_0000;

fn info(layout: Layout, addr: u64) -> TensorInfo {
    TensorInfo {
        layout,
        len: layout.span().expect("test layouts do not overflow"),
        addr,
    }
}

/// A valid GQA problem; each test breaks exactly one rule of it.
struct Args {
    q: TensorInfo,
    k: TensorInfo,
    v: TensorInfo,
    o: TensorInfo,
    lse_len: Option<usize>,
    opts: AttnOptions<'static>,
}

impl Args {
    fn new() -> Args {
        Args::with_shapes([B, SQ, H, D], [B, SK, HKV, D])
    }

    fn with_shapes(q: [usize; 4], kv: [usize; 4]) -> Args {
        Args {
            q: info(Layout::contiguous(q), BASE),
            k: info(Layout::contiguous(kv), BASE + 0x1000_0000),
            v: info(Layout::contiguous(kv), BASE + 0x2000_0000),
            o: info(Layout::contiguous(q), BASE + 0x3000_0000),
            lse_len: Some(q[0] * q[2] * q[1]),
            opts: AttnOptions {
                causal: true,
                softmax_scale: None,
                ..Default::default()
            },
        }
    }

    fn operands(&self) -> Operands {
        Operands {
            q: self.q,
            k: self.k,
            v: self.v,
            o: self.o,
            lse_len: self.lse_len,
        }
    }

    fn forward(&self) -> Result<ForwardShape, FlashAttnError> {
        check_forward(&self.operands(), &self.opts)
    }

    fn decode(&self, seqlens_len: usize) -> Result<DecodeShape, FlashAttnError> {
        check_decode(&self.operands(), seqlens_len, &self.opts)
    }

    /// The four tensors by name, for rules that apply to each.
    fn tensor(&mut self, name: &str) -> &mut TensorInfo {
        match name {
            "q" => &mut self.q,
            "k" => &mut self.k,
            "v" => &mut self.v,
            "o" => &mut self.o,
            _ => unreachable!(),
        }
    }
}

const TENSORS: [&str; 4] = ["q", "k", "v", "o"];
const DIMS: [&str; 4] = ["batch", "seqlen", "heads", "head_dim"];

#[test]
fn valid_forward_and_decode_pass() {
    let a = Args::new();
    let shape = a.forward().unwrap();
    assert_eq!(
        shape,
        ForwardShape {
            batch: B,
            seqlen_q: SQ,
            seqlen_k: SK,
            heads: H,
            kv_heads: HKV,
            head_dim: D,
            v_head_dim: D,
            causal: true,
            softmax_scale: 0.125,
            ..Default::default()
        }
    );
    let d = a.decode(B).unwrap();
    assert_eq!(
        d,
        DecodeShape {
            batch: B,
            seqlen_q: SQ,
            cache_len: SK,
            heads: H,
            kv_heads: HKV,
            head_dim: D,
            causal: true,
            softmax_scale: 0.125,
            ..Default::default()
        }
    );
    // LSE is optional, and a longer buffer is fine; MQA and head dim 128 too.
    let mut a = Args::with_shapes([1, 3, 8, 128], [1, 5, 1, 128]);
    a.lse_len = None;
    assert_eq!(a.forward().unwrap().head_dim, 128);
    a.lse_len = Some(1000);
    a.opts.softmax_scale = Some(0.3);
    assert_eq!(a.forward().unwrap().softmax_scale, 0.3);
}

#[test]
fn packed_qkv_views_validate() {
    // Q, K and V sliced out of one [B, S, 3H, D] buffer, as after a fused QKV
    // projection; each view's buffer runs from its offset to the end.
    let (b, s, h, d) = (2, 10, 4, 64);
    let strides = [s * 3 * h * d, 3 * h * d, d, 1];
    let total = b * s * 3 * h * d;
    let view = |i: usize| TensorInfo {
        layout: Layout {
            shape: [b, s, h, d],
            strides,
        },
        len: total - i * h * d,
        addr: BASE + (i * h * d * 2) as u64,
    };
    // The V view ends exactly at the end of the buffer.
    assert_eq!(view(2).layout.span(), Some(view(2).len));
    let o = info(Layout::contiguous([b, s, h, d]), BASE + 0x1000_0000);
    let opts = AttnOptions {
        causal: false,
        softmax_scale: None,
        ..Default::default()
    };
    let shape = check_forward(
        &Operands {
            q: view(0),
            k: view(1),
            v: view(2),
            o,
            lse_len: Some(b * h * s),
        },
        &opts,
    )
    .unwrap();
    assert_eq!(
        shape,
        ForwardShape {
            batch: b,
            seqlen_q: s,
            seqlen_k: s,
            heads: h,
            kv_heads: h,
            head_dim: d,
            v_head_dim: d,
            causal: false,
            softmax_scale: 1.0 / 8.0,
            ..Default::default()
        }
    );
    // One element less and V overruns its buffer.
    let mut v = view(2);
    v.len -= 1;
    assert!(matches!(
        check_forward(
            &Operands {
                q: view(0),
                k: view(1),
                v,
                o,
                lse_len: None
            },
            &opts
        ),
        Err(FlashAttnError::BufferTooSmall { tensor: "v", .. })
    ));
}

#[test]
fn v_head_dim_of_its_own() {
    // DeepSeek's MLA prefill: Q·K over 192, V and O 128.
    let mut a = Args::with_shapes([B, SQ, H, 192], [B, SK, HKV, 192]);
    let narrow = |s: [usize; 4], addr| info(Layout::contiguous(s), addr);
    a.v = narrow([B, SK, HKV, 128], a.v.addr);
    a.o = narrow([B, SQ, H, 128], a.o.addr);
    let shape = a.forward().unwrap();
    assert_eq!(
        (shape.head_dim, shape.v_head_dim, shape.v_dim()),
        (192, 128, 128)
    );
    // The default scale is Q/K's.
    assert_eq!(shape.softmax_scale, 1.0 / 192f32.sqrt());
    assert!(matches!(
        a.decode(B),
        Err(FlashAttnError::Unsupported {
            entry: "decode",
            ..
        })
    ));
    // O has V's head dim.
    let o = a.o;
    a.o = narrow([B, SQ, H, 192], o.addr);
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::ShapeMismatch {
            tensor: "o",
            dim: "head_dim",
            expected: 128,
            got: 192
        })
    ));
    // V's head dim lies within Q/K's.
    for dv in [200, 256] {
        a.v = narrow([B, SK, HKV, dv], a.v.addr);
        a.o = narrow([B, SQ, H, dv], o.addr);
        assert!(
            matches!(a.forward(), Err(FlashAttnError::UnsupportedVHeadDim { v, qk: 192 }) if v == dv),
            "V head dim {dv}"
        );
    }
    // V's other dims are K's.
    a.v = narrow([B, SK + 1, HKV, 128], a.v.addr);
    a.o = narrow([B, SQ, H, 128], o.addr);
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::ShapeMismatch {
            tensor: "v",
            dim: "seqlen",
            ..
        })
    ));
    let unit = ForwardShape {
        v_head_dim: 0,
        ..shape
    };
    assert_eq!(unit.v_dim(), 192);
}

proptest! {
    /// O with V's own head dim Dv is the first Dv columns of O over the
    /// whole V (each column of O is P times that column of V), with the same LSE.
    #[test]
    fn v_head_dim_is_a_slice_of_v(
        s in forward_shape(None),
        frac in 0.0f64..1.0,
        seed in any::<u64>(),
    ) {
        let d = s.head_dim;
        let dv = 1 + ((d - 1) as f64 * frac) as usize;
        let x = qkv(&s, seed);
        let whole = reference::attention(&s, &x.q, &x.k, &x.v);
        let v: Vec<f64> = x.v.chunks(d).flat_map(|r| r[..dv].to_vec()).collect();
        let narrow = reference::attention(&ForwardShape { v_head_dim: dv, ..s }, &x.q, &x.k, &v);
        prop_assert_eq!(&whole.lse, &narrow.lse);
        for (w, n) in whole.o.chunks(d).zip(narrow.o.chunks(dv)) {
            prop_assert_eq!(&w[..dv], n);
        }
    }
}

#[test]
fn unsupported_head_dims() {
    for d in [8, 16, 40, 80, 112, 264] {
        let a = Args::with_shapes([B, SQ, H, d], [B, SK, HKV, d]);
        assert!(
            matches!(a.forward(), Err(FlashAttnError::UnsupportedHeadDim { got, .. }) if got == d),
            "head dim {d}"
        );
    }
}

#[test]
fn heads_not_divisible_by_kv_heads() {
    for (h, hkv) in [(6, 4), (3, 2), (1, 2)] {
        let a = Args::with_shapes([B, SQ, h, D], [B, SK, hkv, D]);
        assert!(
            matches!(a.forward(), Err(FlashAttnError::HeadsNotDivisible { heads, kv_heads }) if heads == h && kv_heads == hkv),
            "{h} / {hkv}"
        );
    }
}

#[test]
fn k_batch_mismatch() {
    let a = Args::with_shapes([B, SQ, H, D], [B + 1, SK, HKV, D]);
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::ShapeMismatch { tensor: "k", dim: "batch", expected: B, got }) if got == B + 1
    ));
}

#[test]
fn k_head_dim_mismatch() {
    // Both head dims are supported; they just disagree.
    let mut a = Args::new();
    a.k = info(Layout::contiguous([B, SK, HKV, 128]), a.k.addr);
    a.v = a.k;
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::ShapeMismatch {
            tensor: "k",
            dim: "head_dim",
            expected: D,
            got: 128
        })
    ));
}

/// V's head dim may differ from K's (`v_head_dim_of_its_own`), no other dim.
#[test]
fn v_must_match_k() {
    for dim in 0..3 {
        let mut a = Args::new();
        let mut shape = a.k.layout.shape;
        shape[dim] += 1;
        a.v = info(Layout::contiguous(shape), a.v.addr);
        assert!(
            matches!(a.forward(), Err(FlashAttnError::ShapeMismatch { tensor: "v", dim: got, .. }) if got == DIMS[dim]),
            "dim {dim}: {:?}",
            a.forward()
        );
    }
}

#[test]
fn o_must_match_q() {
    for dim in 0..4 {
        let mut a = Args::new();
        let mut shape = a.o.layout.shape;
        shape[dim] += if dim == 3 { 64 } else { 1 };
        a.o = info(Layout::contiguous(shape), a.o.addr);
        assert!(
            matches!(a.forward(), Err(FlashAttnError::ShapeMismatch { tensor: "o", dim: got, .. }) if got == DIMS[dim]),
            "dim {dim}: {:?}",
            a.forward()
        );
    }
}

#[test]
fn zero_sized_dims() {
    for name in TENSORS {
        for (dim, dim_name) in DIMS.iter().enumerate() {
            let mut a = Args::new();
            let t = a.tensor(name);
            t.layout.shape[dim] = 0;
            assert!(
                matches!(a.forward(), Err(FlashAttnError::ZeroSized { tensor, dim: d }) if tensor == name && d == *dim_name),
                "{name}.{dim_name}: {:?}",
                a.forward()
            );
        }
    }
}

#[test]
fn zero_kv_heads_is_an_error_not_a_division_by_zero() {
    let a = Args::with_shapes([B, SQ, H, D], [B, SK, 0, D]);
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::ZeroSized {
            tensor: "k",
            dim: "heads"
        })
    ));
}

#[test]
fn dims_beyond_i32_are_too_large() {
    let mut a = Args::new();
    let n = i32::MAX as usize + 1;
    // Zero strides keep the span small, so only the length rule can fire.
    a.k.layout = Layout {
        shape: [B, n, HKV, D],
        strides: [0, 0, D, 1],
    };
    a.v.layout = a.k.layout;
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::TooLarge { what: "seqlen", value, .. }) if value == n
    ));
}

#[test]
fn non_contiguous_last_dim() {
    for name in TENSORS {
        let mut a = Args::new();
        let t = a.tensor(name);
        t.layout.strides[3] = 2;
        t.len *= 2;
        assert!(
            matches!(a.forward(), Err(FlashAttnError::NonContiguousLastDim { tensor, stride: 2 }) if tensor == name),
            "{name}"
        );
    }
}

#[test]
fn misaligned_base_address() {
    for name in TENSORS {
        for offset in [2, 8, 14] {
            let mut a = Args::new();
            a.tensor(name).addr += offset;
            assert!(
                matches!(a.forward(), Err(FlashAttnError::Misaligned { tensor, what: "the base address", .. }) if tensor == name),
                "{name} + {offset}"
            );
        }
        // 16-byte aligned but not 256: fine.
        let mut a = Args::new();
        a.tensor(name).addr += 16;
        assert!(a.forward().is_ok());
    }
}

#[test]
fn misaligned_strides() {
    let whats = ["the batch stride", "the sequence stride", "the head stride"];
    for name in TENSORS {
        for (dim, want) in whats.iter().enumerate() {
            let mut a = Args::new();
            let t = a.tensor(name);
            // 4 more elements (8 bytes) break the 16-byte alignment of every
            // row after the first.
            t.layout.strides[dim] += 4;
            t.len = t.layout.span().unwrap();
            assert!(
                matches!(a.forward(), Err(FlashAttnError::Misaligned { tensor, what, value }) if tensor == name && what == *want && value % 8 == 4),
                "{name} dim {dim}: {:?}",
                a.forward()
            );
        }
    }
    // Padding by 8 elements (16 bytes) is fine.
    let mut a = Args::new();
    a.q.layout.strides = [SQ * (H * D + 8), H * D + 8, D, 1];
    a.q.len = a.q.layout.span().unwrap();
    assert!(a.forward().is_ok());
}

#[test]
fn strides_beyond_i64_are_too_large() {
    let mut a = Args::new();
    let stride = 1usize << 62; // > i64::MAX / 2 bytes per element, still aligned
    a.q.layout.strides[0] = stride;
    a.q.len = a.q.layout.span().unwrap();
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::TooLarge { what: "the batch stride", value, .. }) if value == stride
    ));
}

#[test]
fn overflowing_span_is_too_large() {
    let mut a = Args::new();
    a.k.layout = Layout {
        shape: [8, SK, HKV, D],
        strides: [(1 << 62) - 8, HKV * D, D, 1],
    };
    a.k.len = usize::MAX;
    a.q.layout.shape[0] = 8;
    a.q.len = a.q.layout.span().unwrap();
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::TooLarge {
            what: "the layout's extent",
            ..
        })
    ));
}

#[test]
fn buffer_too_small() {
    for name in TENSORS {
        let mut a = Args::new();
        let t = a.tensor(name);
        let span = t.len;
        t.len -= 1;
        assert!(
            matches!(a.forward(), Err(FlashAttnError::BufferTooSmall { tensor, needed, len }) if tensor == name && needed == span && len == span - 1),
            "{name}"
        );
    }
}

#[test]
fn invalid_softmax_scale() {
    for scale in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut a = Args::new();
        a.opts.softmax_scale = Some(scale);
        assert!(
            matches!(a.forward(), Err(FlashAttnError::InvalidScale(s)) if s.to_bits() == scale.to_bits()),
            "{scale}"
        );
    }
    let mut a = Args::new();
    a.opts.softmax_scale = Some(f32::MIN_POSITIVE);
    assert!(a.forward().is_ok());
}

#[test]
fn lse_too_short() {
    let mut a = Args::new();
    let expected = B * H * SQ;
    a.lse_len = Some(expected - 1);
    assert!(matches!(
        a.forward(),
        Err(FlashAttnError::LseLength { expected: e, got }) if e == expected && got == expected - 1
    ));
    a.lse_len = Some(expected);
    assert!(a.forward().is_ok());
    a.lse_len = Some(expected - 1);
    assert!(matches!(a.decode(B), Err(FlashAttnError::LseLength { .. })));
}

#[test]
fn cache_seqlens_length_must_equal_batch() {
    let a = Args::new();
    for n in [0, B - 1, B + 1] {
        assert!(
            matches!(a.decode(n), Err(FlashAttnError::SeqlensLength { expected: B, got }) if got == n),
            "{n}"
        );
    }
}

#[test]
fn decode_applies_the_forward_rules() {
    let a = Args::with_shapes([B, 1, H, 80], [B, SK, HKV, 80]);
    assert!(matches!(
        a.decode(B),
        Err(FlashAttnError::UnsupportedHeadDim { got: 80, .. })
    ));
    let mut a = Args::new();
    a.k.addr += 8;
    assert!(matches!(
        a.decode(B),
        Err(FlashAttnError::Misaligned { tensor: "k", .. })
    ));
}

/// A tensor of `shape` whose only non-zero stride is the last, so huge extents
/// need no real buffer.
fn broadcast(shape: [usize; 4], addr: u64) -> TensorInfo {
    info(
        Layout {
            shape,
            strides: [0, 0, 0, 1],
        },
        addr,
    )
}

#[test]
fn heads_beyond_grid_limit() {
    let mut a = Args::new();
    for (h, ok) in [(65_535, true), (65_536, false)] {
        a.q = broadcast([1, 1, h, D], a.q.addr);
        a.o = info(Layout::contiguous([1, 1, h, D]), a.o.addr);
        a.k = broadcast([1, 1, 1, D], a.k.addr);
        a.v = broadcast([1, 1, 1, D], a.v.addr);
        a.lse_len = None;
        let r = a.forward();
        if ok {
            assert!(r.is_ok(), "{r:?}");
        } else {
            assert!(
                matches!(
                    r,
                    Err(FlashAttnError::TooLarge {
                        what: "heads",
                        value: 65_536,
                        limit: 65_535
                    })
                ),
                "{r:?}"
            );
        }
    }
}

#[test]
fn batch_beyond_grid_limit() {
    let mut a = Args::new();
    for (b, ok) in [(65_535, true), (65_536, false)] {
        a.q = broadcast([b, 1, 1, D], a.q.addr);
        a.o = info(Layout::contiguous([b, 1, 1, D]), a.o.addr);
        a.k = broadcast([b, 1, 1, D], a.k.addr);
        a.v = broadcast([b, 1, 1, D], a.v.addr);
        a.lse_len = None;
        let r = a.forward();
        if ok {
            assert!(r.is_ok(), "{r:?}");
        } else {
            assert!(
                matches!(
                    r,
                    Err(FlashAttnError::TooLarge {
                        what: "batch",
                        value: 65_536,
                        limit: 65_535
                    })
                ),
                "{r:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Kernel configuration
// ---------------------------------------------------------------------------

mod config {
    use flash_attn_kernels::config::*;
    use std::collections::HashSet;

    const KINDS: [KernelKind; 3] = [KernelKind::Forward, KernelKind::Decode, KernelKind::Combine];
    const DTYPES: [Dtype; 3] = [Dtype::F16, Dtype::Bf16, Dtype::F32];
    const MASKS: [MaskKind; 3] = [MaskKind::Full, MaskKind::Causal, MaskKind::Local];
    const SCORES: [ScoreKind; 2] = [ScoreKind::Plain, ScoreKind::Modified];
    const SEQS: [SeqKind; 4] = [
        SeqKind::Dense,
        SeqKind::Packed,
        SeqKind::Ragged,
        SeqKind::Folded,
    ];

    fn word<T: std::fmt::Debug>(x: T) -> String {
        format!("{x:?}").to_lowercase()
    }

    fn expected_name(e: &Entry) -> String {
        let kind = match e.kind {
            KernelKind::Forward => "fwd",
            KernelKind::Decode => "decode",
            KernelKind::Combine => "combine",
            KernelKind::Backward => "bwd",
            KernelKind::Append => return "flash_append_kv".into(),
            KernelKind::Merge => return format!("flash_merge_{}", e.dtype.name()),
            KernelKind::BackwardPrep => return format!("flash_bwd_prep_{}", e.dtype.name()),
            KernelKind::BackwardDq => return format!("flash_bwd_dq_{}", e.dtype.name()),
            KernelKind::BackwardDkv => return format!("flash_bwd_dkv_{}", e.dtype.name()),
            KernelKind::BackwardSinks => return "flash_bwd_sinks".into(),
            KernelKind::Probe | KernelKind::WgmmaForward | KernelKind::WgmmaBackward => {
                panic!("{e:?} belongs to HOPPER_ENTRIES, not ENTRIES")
            }
        };
        let p = e.policies;
        format!(
            "flash_{kind}_{}_hd{}_{}_{}_{}",
            e.dtype.name(),
            e.head_dim,
            word(p.mask),
            word(p.score),
            word(p.seq)
        )
    }

    /// The sm_90a module's entries: the Hopper forward, named as the table's
    /// forward lines with `wgmma_` and sized by its `HopperTile`, and the
    /// probes, named after their shape, one warpgroup each; the module is
    /// for compute capability 9.0 alone.
    #[test]
    fn hopper_entries_are_named_by_the_table() {
        use flash_attn_kernels::config::{
            find_entry, HopperBwdTile, PtxArch, HOPPER_BWD_BLOCK_M, HOPPER_BWD_HEAD_DIMS,
            HOPPER_ENTRIES, PROBE_THREADS,
        };
        let mut names = HashSet::new();
        for e in HOPPER_ENTRIES {
            assert!(names.insert(e.name), "duplicate {}", e.name);
            if e.kind == KernelKind::WgmmaForward {
                let p = e.policies;
                let last_word = match (e.persistent, e.keys) {
                    (true, None) => "_persistent".to_string(),
                    (false, Some(n)) => format!("_n{n}"),
                    (false, None) => String::new(),
                    (true, Some(_)) => panic!("{}: one last word", e.name),
                };
                let want = format!(
                    "flash_wgmma_fwd_{}_hd{}_{}_{}_{}_m{}{last_word}",
                    e.dtype.name(),
                    e.head_dim,
                    word(p.mask),
                    word(p.score),
                    word(p.seq),
                    e.rows,
                );
                assert_eq!(e.name, want);
                let t = e.hopper_tile();
                assert_eq!(e.threads(PtxArch::Sm90a), t.threads());
                assert_eq!(e.smem_bytes(PtxArch::Sm90a), t.smem_bytes());
                assert_eq!(e.min_ctas_per_sm(PtxArch::Sm90a), Some(t.ctas_per_sm));
                continue;
            }
            if e.kind == KernelKind::WgmmaBackward {
                let p = e.policies;
                let want = format!(
                    "flash_wgmma_bwd_{}_hd{}_{}_{}_{}",
                    e.dtype.name(),
                    e.head_dim,
                    word(p.mask),
                    word(p.score),
                    word(p.seq),
                );
                assert_eq!(e.name, want);
                assert!(HOPPER_BWD_HEAD_DIMS.contains(&e.head_dim), "{e:?}");
                let t = HopperBwdTile::of(e.head_dim);
                assert_eq!(e.threads(PtxArch::Sm90a), t.threads());
                assert_eq!(e.smem_bytes(PtxArch::Sm90a), t.smem_bytes());
                assert!(t.smem_bytes() <= PtxArch::Sm90a.max_smem_bytes(), "{e:?}");
                assert_eq!(e.min_ctas_per_sm(PtxArch::Sm90a), Some(t.ctas_per_sm()));
                assert!(t.ctas_per_sm() * t.smem_bytes() <= PtxArch::Sm90a.max_smem_bytes());
                // wgmma descriptors and the SW128 swizzle address tiles
                // from 1024-byte atoms, and a tile holds whole 64-column
                // groups.
                let atom = flash_attn_kernels::config::SWIZZLE_ATOM_BYTES;
                for offset in [t.v_offset(), t.q_offset(1), t.do_offset(1), t.ds_offset()] {
                    assert_eq!(offset % atom, 0, "{e:?}");
                }
                let groups = e.head_dim.div_ceil(64);
                assert_eq!(t.v_offset(), t.block_n() * 128 * groups);
                assert_eq!(
                    t.do_offset(0) - t.q_offset(0),
                    HOPPER_BWD_BLOCK_M * 128 * groups
                );
                // The `mma.sync` line it stands in for, as the fallback.
                let need = p;
                assert!(find_entry(KernelKind::Backward, e.dtype, e.head_dim, need).is_some());
                continue;
            }
            assert_eq!(e.kind, KernelKind::Probe, "{e:?}");
            let want = if e.name.starts_with("flash_probe_tma_") {
                format!("flash_probe_tma_hd{}", e.head_dim)
            } else {
                let k = e.name.rsplit_once("_k").unwrap().1;
                format!("flash_probe_wgmma_{}_n{}_k{k}", e.dtype.name(), e.head_dim)
            };
            assert_eq!(e.name, want);
            assert_eq!(e.threads(PtxArch::Sm90a), PROBE_THREADS);
        }
        assert_eq!(PtxArch::Sm90a.entries(), HOPPER_ENTRIES);
        assert_eq!(PtxArch::Sm90.entries(), ENTRIES);
        assert_eq!(PtxArch::Sm80.entries(), ENTRIES);
        // sm_75: ENTRIES less bf16 (no bf16 tensor cores), in table order.
        let turing: Vec<_> = ENTRIES.iter().filter(|e| e.dtype != Dtype::Bf16).collect();
        assert_eq!(PtxArch::Sm75.entries().iter().collect::<Vec<_>>(), turing);
        assert!(!PtxArch::Sm75.has_dtype(Dtype::Bf16) && PtxArch::Sm75.has_dtype(Dtype::F16));
        assert!(PtxArch::Sm75.has_dtype(Dtype::F32));
        for arch in [PtxArch::Sm80, PtxArch::Sm90, PtxArch::Sm90a] {
            assert!(arch.has_dtype(Dtype::Bf16) && arch.has_dtype(Dtype::F16));
        }
        assert!(PtxArch::hopper_device(9, 0));
        assert!(!PtxArch::hopper_device(9, 1) && !PtxArch::hopper_device(10, 0));
        assert!(!PtxArch::hopper_device(8, 0));
    }

    /// Every Hopper tile fits the module's shared memory with its alignment
    /// slack; each K/V stage and Q start on a swizzle atom (TMA's SW128 and
    /// the `wgmma` descriptors address the tiles from such a boundary); the
    /// barriers are 8-byte aligned past the last tile; registers add up.
    #[test]
    fn hopper_tiles_fit_and_align() {
        use flash_attn_kernels::config::{PtxArch, SWIZZLE_ATOM_BYTES, WGMMA_M};
        let atom = SWIZZLE_ATOM_BYTES;
        let mut seen = 0;
        for e in HOPPER_ENTRIES
            .iter()
            .filter(|e| e.kind == KernelKind::WgmmaForward)
        {
            let t = e.hopper_tile();
            seen += 1;
            assert!(t.smem_bytes() <= PtxArch::Sm90a.max_smem_bytes(), "{t:?}");
            // A split-key tile's two consumers share its rows.
            let row_sets = if t.split_keys { 1 } else { t.consumers };
            assert_eq!(t.block_m, row_sets * WGMMA_M);
            assert_eq!(t.split_keys, t.head_dim == 256 && t.block_m == 64, "{t:?}");
            if t.split_keys {
                // Even stage counts: a stage holds one consumer's blocks.
                assert!(!t.persistent && t.consumers == 2 && !t.pingpong, "{t:?}");
                assert_eq!((t.block_n, t.stages, t.v_stages), (64, 2, 4), "{t:?}");
            } else if t.serial {
                // Half blocks: 3 K and 2 V stages of 32 KiB.
                assert!(!t.persistent && t.consumers == 2 && t.pingpong, "{t:?}");
                assert_eq!(
                    (t.head_dim, t.block_n, t.stages, t.v_stages),
                    (256, 128, 3, 2),
                    "{t:?}"
                );
                assert_eq!(2 * t.stage_bytes(), t.kv_bytes(), "{t:?}");
            } else {
                assert_eq!(t.v_stages, t.stages, "{t:?}");
                assert_eq!(t.stage_bytes(), t.kv_bytes(), "{t:?}");
            }
            assert!(t.block_m <= 256, "a TMA box has at most 256 rows: {t:?}");
            let (p, c) = (t.producer_regs() as usize, t.consumer_regs() as usize);
            // Registers and shared memory (with the 1 KiB the hardware
            // reserves per CTA, of 228 KiB per SM) for `ctas_per_sm` CTAs.
            assert_eq!(t.ctas_per_sm, if t.consumers == 1 { 2 } else { 1 });
            assert_eq!(e.min_ctas_per_sm(PtxArch::Sm90a), Some(t.ctas_per_sm));
            // `setmaxnreg` moves registers within the CTA's launch
            // allocation (ptxas: 64K over the threads of `ctas_per_sm`
            // CTAs, down to a multiple of 8); an `inc` past it waits forever.
            let launch = (65536 / (t.threads() * t.ctas_per_sm)) & !7;
            assert!(
                128 * p + t.consumers * 128 * c <= launch * t.threads(),
                "{t:?}"
            );
            assert!(
                (t.smem_bytes() + 1024) * t.ctas_per_sm <= 228 * 1024,
                "{t:?}"
            );
            assert!(p % 8 == 0 && c % 8 == 0 && c <= 256, "{t:?}");
            assert!(!t.pingpong || t.consumers == 2, "{t:?}");
            // Whole 64-column groups in shared memory; D = 96's second
            // one half used by its `wgmma`s.
            assert!(
                t.block_n % 16 == 0 && t.block_n <= 256 && t.head_dim % 32 == 0,
                "{t:?}"
            );
            assert_eq!(t.smem_cols() % 64, 0, "{t:?}");
            assert!(t.smem_cols() - t.head_dim < 64, "{t:?}");
            // Q buffers (three or four in a persistent CTA), then the K/V
            // stages.
            let qb = match (t.persistent, t.pingpong) {
                (true, false) => 4,
                (true, true) => 3,
                (false, _) => 1,
            };
            assert_eq!(t.q_buffers(), qb, "{t:?}");
            for b in 0..qb {
                assert_eq!(t.q_offset(b) % atom, 0, "{t:?}");
            }
            assert_eq!(t.k_offset(0), qb * t.q_bytes(), "{t:?}");
            for s in 0..t.stages {
                assert_eq!(t.k_offset(s) % atom, 0, "{t:?}");
                assert_eq!(t.v_offset(s) % atom, 0, "{t:?}");
            }
            for s in 0..t.v_stages {
                assert_eq!(t.v_offset(s) % atom, 0, "{t:?}");
            }
            assert_eq!(t.v_offset(0), t.k_offset(t.stages));
            assert_eq!(t.barrier(0), t.v_offset(t.v_stages));
            // Q full per buffer, Q empty per buffer of a persistent CTA,
            // then the rings'.
            let q_barriers = qb * (1 + t.persistent as usize);
            assert_eq!(t.k_ring(), q_barriers, "{t:?}");
            // A full and an empty barrier per stage of each ring.
            assert_eq!(t.v_ring(), t.k_ring() + 2 * t.stages, "{t:?}");
            assert_eq!(t.barriers(), q_barriers + 2 * (t.stages + t.v_stages));
            if t.persistent {
                assert_eq!((t.q_empty(0), t.q_empty(2)), (qb, qb + 2), "{t:?}");
                assert!(t.block_m == 128 && t.head_dim <= 128, "{t:?}");
            }
            // A persistent CTA's tile slots, 8 bytes per Q buffer, then a
            // split-key tile's row states, (m, l) per row and consumer,
            // close it.
            let slots = if t.persistent { qb } else { 0 };
            let rows = if t.split_keys { 2 * t.block_m * 8 } else { 0 };
            assert_eq!(t.tile_slot(0), t.barrier(t.barriers()), "{t:?}");
            assert_eq!(t.merge_rows_offset(), t.tile_slot(slots), "{t:?}");
            assert_eq!(
                t.smem_bytes(),
                atom + t.barrier(t.barriers()) + 8 * slots + rows
            );
        }
        assert!(seen > 0);
    }

    /// Dispatch to the Hopper path: the first table line that covers a call
    /// (the plain lines for plain calls, `causal modified` for causal
    /// modifiers, `local modified` for every other dense call) with the
    /// rows asked for where the head dim has them; D = 32 on the D = 64
    /// lines (the smallest line head dim at least as large), D = 96 on its
    /// own; packed sequences, against contiguous or paged K/V,
    /// on their own 128-row lines; none for f32 or a head dim past the
    /// widest line, so those stay on sm_90.
    #[test]
    fn hopper_dispatch_covers_only_its_lines() {
        let with_rows = |c: &HopperCall, rows| {
            let pick = HopperPick {
                rows,
                ..Default::default()
            };
            find_hopper_entry(c, pick).expect("a line")
        };
        let need = |mask, score, seq| Policies { mask, score, seq };
        let dense = |mask, score| need(mask, score, SeqKind::Dense);
        let (plain, modified) = (ScoreKind::Plain, ScoreKind::Modified);
        let call = |dtype, head_dim, need| HopperCall {
            dtype,
            head_dim,
            need,
            batch: 4,
            heads: 32,
            // Past the persistent lines' keys (`hopper_persistent`), so the
            // rows asked for decide.
            seqlen_q: 8192,
            seqlen_k: 8192,
            window_keys: None,
            num_sms: 132,
        };
        // f32 stays on the mma.sync kernels.
        for d in SUPPORTED_HEAD_DIMS {
            let any = need(MaskKind::Local, modified, SeqKind::Dense);
            assert!(find_hopper_entry(&call(Dtype::F32, d, any), HopperPick::default()).is_none());
        }
        for (d, line_d) in [
            (32, 64),
            (64, 64),
            (96, 96),
            (128, 128),
            (192, 192),
            (256, 256),
        ] {
            assert_eq!(hopper_line_head_dim(d), Some(line_d));
            // Any head dim up to the widest line.
            assert_eq!(hopper_line_head_dim(d - 8), Some(line_d), "{d}");
        }
        assert_eq!(hopper_line_head_dim(0), Some(64));
        assert_eq!(hopper_line_head_dim(264), None);
        for dtype in [Dtype::F16, Dtype::Bf16] {
            for d in SUPPORTED_HEAD_DIMS {
                let line_d = hopper_line_head_dim(d).unwrap();
                for (need, line, wide) in [
                    (
                        dense(MaskKind::Full, plain),
                        dense(MaskKind::Full, plain),
                        true,
                    ),
                    (
                        dense(MaskKind::Causal, plain),
                        dense(MaskKind::Causal, plain),
                        true,
                    ),
                    (
                        dense(MaskKind::Causal, modified),
                        dense(MaskKind::Causal, modified),
                        true,
                    ),
                    (
                        dense(MaskKind::Local, plain),
                        dense(MaskKind::Local, modified),
                        false,
                    ),
                    (
                        dense(MaskKind::Local, modified),
                        dense(MaskKind::Local, modified),
                        false,
                    ),
                    (
                        dense(MaskKind::Full, modified),
                        dense(MaskKind::Local, modified),
                        false,
                    ),
                ] {
                    let c = call(dtype, d, need);
                    // The 64-row lines: every D = 64 line, plain full and
                    // causal at D = 96, 128 and 256.
                    let narrow = line_d == 64
                        || matches!(line_d, 96 | 128 | 256)
                            && line.score == plain
                            && matches!(line.mask, MaskKind::Full | MaskKind::Causal);
                    for rows in [None, Some(64), Some(128), Some(192)] {
                        let e = with_rows(&c, rows);
                        assert_eq!(e.policies, line, "{need:?}");
                        assert_eq!((e.head_dim, e.dtype), (line_d, dtype));
                        // Rows where asked for (or chosen) and the line has
                        // them, else 128.
                        let asked = rows.unwrap_or(hopper_rows(&c));
                        let want = match asked {
                            192 if line_d == 64 && wide => 192,
                            64 if narrow => 64,
                            _ => 128,
                        };
                        assert_eq!(e.rows, want, "{need:?} {rows:?}");
                        assert_eq!(e.hopper_tile().block_m, want);
                    }
                }
                // Packed sequences: their own 128-row lines (plain full and
                // causal, `local modified` for the rest) whatever rows are
                // asked for; against paged K/V causal plain and `local
                // modified` for the rest.
                for (mask, score, line_mask) in [
                    (MaskKind::Full, plain, MaskKind::Full),
                    (MaskKind::Causal, plain, MaskKind::Causal),
                    (MaskKind::Local, plain, MaskKind::Local),
                    (MaskKind::Full, modified, MaskKind::Local),
                    (MaskKind::Causal, modified, MaskKind::Local),
                ] {
                    let c = call(dtype, d, need(mask, score, SeqKind::Packed));
                    for rows in [None, Some(64), Some(128), Some(192)] {
                        let e = with_rows(&c, rows);
                        let want_score = if line_mask == MaskKind::Local {
                            modified
                        } else {
                            plain
                        };
                        let want = need(line_mask, want_score, SeqKind::Packed);
                        assert_eq!(e.policies, want, "{mask:?} {score:?} {rows:?}");
                        assert_eq!((e.head_dim, e.dtype, e.rows), (line_d, dtype, 128));
                    }
                    let paged = call(dtype, d, need(mask, score, SeqKind::Ragged));
                    let (paged_mask, paged_score) = match (mask, score) {
                        (MaskKind::Causal, ScoreKind::Plain) => (MaskKind::Causal, plain),
                        _ => (MaskKind::Local, modified),
                    };
                    for rows in [None, Some(64), Some(192)] {
                        let e = with_rows(&paged, rows);
                        let want = need(paged_mask, paged_score, SeqKind::Ragged);
                        assert_eq!(e.policies, want, "{mask:?} {score:?} {rows:?}");
                        assert_eq!((e.head_dim, e.dtype, e.rows), (line_d, dtype, 128));
                    }
                }
            }
            let c = call(dtype, 264, dense(MaskKind::Full, plain));
            assert!(find_hopper_entry(&c, HopperPick::default()).is_none());
        }
    }

    /// A head dim the Hopper lines serve at twice its width or more (D = 32
    /// and below on the D = 64 lines) stays on the `mma.sync` kernels under
    /// `HOPPER_PADDED_MIN_KEYS` keys unless the caller asks for the line's
    /// rows; wider head dims (96 on 128) and exact ones take their lines at
    /// any length.
    #[test]
    fn hopper_padded_short_calls_stay_on_mma_sync() {
        let call = |head_dim, seqlen_k| HopperCall {
            dtype: Dtype::F16,
            head_dim,
            need: Policies {
                mask: MaskKind::Causal,
                score: ScoreKind::Plain,
                seq: SeqKind::Dense,
            },
            batch: 1,
            heads: 8,
            seqlen_q: 64,
            seqlen_k,
            window_keys: None,
            num_sms: 132,
        };
        let short = HOPPER_PADDED_MIN_KEYS - 1;
        for d in [8, 16, 24, 32] {
            assert!(hopper_padded_short(d, short), "{d}");
            assert!(!hopper_padded_short(d, HOPPER_PADDED_MIN_KEYS), "{d}");
            assert!(
                find_hopper_entry(&call(d, short), HopperPick::default()).is_none(),
                "{d}"
            );
            let asked = find_hopper_entry(
                &call(d, short),
                HopperPick {
                    rows: Some(128),
                    ..Default::default()
                },
            )
            .unwrap();
            assert_eq!(asked.head_dim, 64);
            let long =
                find_hopper_entry(&call(d, HOPPER_PADDED_MIN_KEYS), HopperPick::default()).unwrap();
            assert_eq!(long.head_dim, 64);
        }
        for d in [40, 64, 72, 96, 128, 192, 256] {
            assert!(!hopper_padded_short(d, 1), "{d}");
            assert!(
                find_hopper_entry(&call(d, 1), HopperPick::default()).is_some(),
                "{d}"
            );
        }
        assert!(!hopper_padded_short(264, 1));
    }

    /// The 64-key line: plain causal calls at D = 256 (and head dims padded
    /// to it) over at most `HOPPER_SHORT_CAUSAL_MAX_KEYS_D256` keys take it;
    /// the serial 128-key line: plain full calls there over at most
    /// `HOPPER_SERIAL_MAX_KEYS_D256` keys, unless their grid is small enough
    /// for 64-row tiles; longer ones, modified and packed calls and every
    /// other head dim the head dim's own keys; `keys` asked for takes a line
    /// with them where one covers the call, else the head dim's own.
    #[test]
    fn hopper_keys_choice() {
        let need = |mask, score, seq| Policies { mask, score, seq };
        let dense = |mask| need(mask, ScoreKind::Plain, SeqKind::Dense);
        let call = |dtype, head_dim, need, seqlen_k| HopperCall {
            dtype,
            head_dim,
            need,
            batch: 4,
            heads: 16,
            seqlen_q: seqlen_k,
            seqlen_k,
            window_keys: None,
            num_sms: 132,
        };
        let keys = |c: &HopperCall, asked| {
            let e = find_hopper_entry(
                c,
                HopperPick {
                    keys: asked,
                    ..Default::default()
                },
            );
            let e = e.expect("a line");
            assert!(e.policies.covers(c.need));
            let keyed = e.name.ends_with("_n64") || e.name.ends_with("_n128");
            assert_eq!(e.keys.is_some(), keyed, "{}", e.name);
            assert_eq!(
                e.hopper_tile().serial,
                e.name.ends_with("_n128"),
                "{}",
                e.name
            );
            e.hopper_tile().block_n
        };
        let short = HOPPER_SHORT_CAUSAL_MAX_KEYS_D256;
        for dtype in [Dtype::F16, Dtype::Bf16] {
            for d in [256, 200] {
                let causal = dense(MaskKind::Causal);
                for seqlen_k in [1, 512, 1000, short] {
                    assert_eq!(
                        keys(&call(dtype, d, causal, seqlen_k), None),
                        64,
                        "{d} {seqlen_k}"
                    );
                    assert_eq!(keys(&call(dtype, d, causal, seqlen_k), Some(80)), 80);
                    // No causal line has 128-key blocks (a small grid's
                    // 64-row tiles have 64).
                    assert_ne!(keys(&call(dtype, d, causal, seqlen_k), Some(128)), 128);
                }
                for seqlen_k in [short + 1, 4096, 16384] {
                    assert_eq!(
                        keys(&call(dtype, d, causal, seqlen_k), None),
                        80,
                        "{d} {seqlen_k}"
                    );
                    assert_eq!(keys(&call(dtype, d, causal, seqlen_k), Some(64)), 64);
                }
                let modified = need(MaskKind::Causal, ScoreKind::Modified, SeqKind::Dense);
                let packed = need(MaskKind::Causal, ScoreKind::Plain, SeqKind::Packed);
                let full = dense(MaskKind::Full);
                let serial = HOPPER_SERIAL_MAX_KEYS_D256;
                for seqlen_k in [129, 300, serial] {
                    assert_eq!(
                        keys(&call(dtype, d, full, seqlen_k), None),
                        128,
                        "{d} {seqlen_k}"
                    );
                    assert_eq!(keys(&call(dtype, d, full, seqlen_k), Some(80)), 80);
                }
                for seqlen_k in [serial + 1, 1024, 16384] {
                    assert_eq!(
                        keys(&call(dtype, d, full, seqlen_k), None),
                        80,
                        "{d} {seqlen_k}"
                    );
                    assert_eq!(keys(&call(dtype, d, full, seqlen_k), Some(128)), 128);
                }
                // A grid of at most one wave of 64-row tiles keeps its
                // split-key tiles (`hopper_rows`).
                let small = HopperCall {
                    batch: 1,
                    heads: 8,
                    ..call(dtype, d, full, serial)
                };
                assert_eq!(hopper_rows(&small), 64);
                let e = find_hopper_entry(&small, HopperPick::default()).expect("a line");
                assert!(e.hopper_tile().split_keys, "{}", e.name);
                for other in [full, dense(MaskKind::Local), modified, packed] {
                    for asked in [None, Some(64), Some(80), Some(128)] {
                        // Plain full calls asked for 64 keys take the
                        // split-key line, the one 64-key line that covers
                        // them, and for 128 (or none, at 512 keys) the
                        // serial line.
                        let want = match asked {
                            Some(64) if other == full => 64,
                            None | Some(128) if other == full => 128,
                            _ => 80,
                        };
                        assert_eq!(keys(&call(dtype, d, other, 512), asked), want, "{other:?}");
                    }
                }
            }
            for (d, own) in [(64, 128), (128, 128), (192, 112)] {
                for asked in [None, Some(64), Some(80)] {
                    let c = call(dtype, d, dense(MaskKind::Causal), 8192);
                    let want = if asked == Some(64) && d == 128 {
                        64
                    } else {
                        own
                    };
                    assert_eq!(keys(&c, asked), want, "{d} {asked:?}");
                }
            }
        }
    }

    /// The Hopper rows heuristic: 64 over few keys on the D = 64 and 128
    /// lines, or where 64-row CTAs do not outnumber the SMs; 192 for a call
    /// of at least one wave of 192-row CTAs that is not causal over fewer
    /// than `HOPPER_WIDE_CAUSAL_MIN_KEYS` keys; else 128. And every Hopper
    /// forward line is reachable with `hopper_rows` (the GPU suite's random
    /// trials ask for each), so each line's kernel is tested.
    /// The persistent lines: chosen up to `HOPPER_PERSISTENT_MAX_KEYS` keys
    /// where one covers the call, past them only for causal grids of few
    /// waves of 128-row tiles up to more keys (`HOPPER_PERSISTENT_CAUSAL_FEW_WAVES`),
    /// windows bounded on both sides up to `HOPPER_PERSISTENT_MAX_WINDOW_KEYS`
    /// wide;
    /// never for a call without a line (D = 256, modifiers past D = 64,
    /// packed sequences), for full and causal modified calls unless asked,
    /// or when other rows or `Some(false)` are asked for; `Some(true)`
    /// takes one at any length.
    #[test]
    fn hopper_persistent_choice() {
        let need = |mask, score, seq| Policies { mask, score, seq };
        let plain = |mask| need(mask, ScoreKind::Plain, SeqKind::Dense);
        let call = |head_dim, mask, seqlen_k| HopperCall {
            dtype: Dtype::Bf16,
            head_dim,
            need: plain(mask),
            batch: 8,
            heads: 16,
            seqlen_q: seqlen_k,
            seqlen_k,
            window_keys: None,
            num_sms: 132,
        };
        let persistent = |c: &HopperCall, rows, asked| {
            find_hopper_entry(
                c,
                HopperPick {
                    rows,
                    persistent: asked,
                    keys: None,
                },
            )
            .is_some_and(|e| e.persistent)
        };
        for (mask, i) in [(MaskKind::Full, 0), (MaskKind::Causal, 1)] {
            for d in [64, 128, 96, 32] {
                let max = HOPPER_PERSISTENT_MAX_KEYS[i];
                let (short, long) = (call(d, mask, max), call(d, mask, max + 1));
                // Past the keys, a causal grid of few waves still takes it:
                // the most heads whose tiles count as few, and one more.
                let (waves, seqlen) = HOPPER_PERSISTENT_CAUSAL_FEW_WAVES;
                let per_head = seqlen.div_ceil(HOPPER_PERSISTENT_ROWS);
                let heads = waves * 132 / per_head;
                let few = HopperCall {
                    batch: 1,
                    heads,
                    seqlen_q: seqlen,
                    ..call(d, mask, seqlen)
                };
                let more = HopperCall {
                    heads: heads + 1,
                    ..few
                };
                // D = 32 stays on `mma.sync` over few keys unless rows are asked.
                let rows = if d == 32 { Some(128) } else { None };
                assert_eq!(persistent(&few, rows, None), i == 1, "{few:?}");
                assert!(!persistent(&more, rows, None), "{more:?}");
                // Nor past its keys, on a grid of as few tiles.
                let longer = HopperCall {
                    heads: heads / 2,
                    seqlen_q: 2 * seqlen,
                    seqlen_k: 2 * seqlen,
                    ..few
                };
                assert!(!persistent(&longer, rows, None), "{longer:?}");
                assert!(persistent(&short, rows, None), "{d} {mask:?}");
                assert!(!persistent(&long, rows, None), "{d} {mask:?}");
                assert!(persistent(&long, Some(128), Some(true)), "{d} {mask:?}");
                assert!(
                    persistent(&long, None, Some(true)) || d == 32,
                    "{d} {mask:?}"
                );
                assert!(!persistent(&short, rows, Some(false)), "{d} {mask:?}");
                assert!(!persistent(&short, Some(64), Some(true)), "{d} {mask:?}");
            }
            // Non-causal D = 64 calls of few queries, up to more keys (a
            // causal call past the keys is a grid of few waves here).
            let (q, k) = HOPPER_PERSISTENT_SHORT_QUERIES_D64;
            for (d, seqlen_q, seqlen_k, taken) in [
                (64, q, k, true),
                (64, q, k + 1, false),
                (64, q + 1, k, false),
                (128, q, k, false),
                (96, q, k, false),
            ] {
                let c = HopperCall {
                    seqlen_q,
                    ..call(d, MaskKind::Full, seqlen_k)
                };
                assert_eq!(persistent(&c, None, None), taken, "{c:?}");
            }
            let short = call(256, mask, 512);
            assert!(!persistent(&short, None, Some(true)));
            // One wave of 128-row tiles or less: no next tile to overlap.
            for (batch, heads, seqlen, sms) in [
                (4, 8, 512, 132),
                (1, 16, 1024, 132),
                (2, 33, 256, 132),
                (1, 9, 1024, 72),
            ] {
                let small = HopperCall {
                    batch,
                    heads,
                    num_sms: sms,
                    ..call(64, mask, seqlen)
                };
                assert!(!persistent(&small, None, None), "{small:?}");
                assert!(persistent(&small, None, Some(true)), "{small:?}");
                let wave = HopperCall {
                    batch: batch + 1,
                    ..small
                };
                assert!(persistent(&wave, None, None), "{wave:?}");
            }
        }
        // Windows bounded on both sides: their width decides, as a
        // non-causal row's keys would. D = 64's window line serves every
        // modifier, D = 96's and 128's plain scores only (D = 32 runs on D = 64's).
        for d in [32, 64, 96, 128] {
            for score in [ScoreKind::Plain, ScoreKind::Modified] {
                let has_line = score == ScoreKind::Plain || hopper_line_head_dim(d) == Some(64);
                let window = |keys| HopperCall {
                    need: need(MaskKind::Local, score, SeqKind::Dense),
                    window_keys: Some(keys),
                    ..call(d, MaskKind::Causal, 8192)
                };
                let max = HOPPER_PERSISTENT_MAX_WINDOW_KEYS[(d > 64) as usize];
                assert_eq!(
                    persistent(&window(max), None, None),
                    has_line,
                    "{d} {score:?}"
                );
                assert!(!persistent(&window(max + 1), None, None), "{d} {score:?}");
                let wide = window(4 * max);
                assert!(!persistent(&wide, None, None), "{d} {score:?}");
                assert_eq!(
                    persistent(&wide, None, Some(true)),
                    has_line,
                    "{d} {score:?}"
                );
                // D = 32 over few keys stays on `mma.sync` unless rows are asked.
                let rows = (d == 32).then_some(128);
                // A wide window over rows of fewer keys than the limit.
                let few_keys = HopperCall {
                    seqlen_q: max,
                    seqlen_k: max,
                    ..wide
                };
                assert_eq!(persistent(&few_keys, rows, None), has_line, "{d} {score:?}");
                // One-sided windows stay off the window lines unless asked.
                let one_sided = HopperCall {
                    window_keys: None,
                    seqlen_q: 512,
                    seqlen_k: 512,
                    ..wide
                };
                assert!(!persistent(&one_sided, rows, None), "{d} {score:?}");
                assert_eq!(
                    persistent(&one_sided, rows, Some(true)),
                    has_line,
                    "{d} {score:?}"
                );
            }
        }
        // Full and causal modified calls: D = 64's window line covers
        // them, but only when asked for.
        for mask in [MaskKind::Full, MaskKind::Causal] {
            let c = HopperCall {
                need: need(mask, ScoreKind::Modified, SeqKind::Dense),
                ..call(64, mask, 512)
            };
            assert!(!persistent(&c, None, None), "{mask:?}");
            assert!(persistent(&c, None, Some(true)), "{mask:?}");
        }
        for (score, seq) in [
            (ScoreKind::Modified, SeqKind::Dense),
            (ScoreKind::Plain, SeqKind::Packed),
        ] {
            let c = HopperCall {
                need: need(MaskKind::Causal, score, seq),
                ..call(128, MaskKind::Causal, 512)
            };
            assert!(!persistent(&c, None, Some(true)), "{score:?} {seq:?}");
        }
    }

    #[test]
    fn hopper_rows_choice() {
        let plain = |mask| Policies {
            mask,
            score: ScoreKind::Plain,
            seq: SeqKind::Dense,
        };
        let base = HopperCall {
            dtype: Dtype::F16,
            head_dim: 64,
            need: plain(MaskKind::Full),
            batch: 1,
            heads: 44,
            seqlen_q: 576,
            seqlen_k: 4096,
            window_keys: None,
            num_sms: 132,
        };
        // 3 x 44 = 132 CTAs of 192 rows: one wave.
        assert_eq!(hopper_rows(&base), 192);
        assert_eq!(
            hopper_rows(&HopperCall {
                seqlen_q: 384,
                ..base
            }),
            128
        );
        assert_eq!(hopper_rows(&HopperCall { heads: 43, ..base }), 128);
        assert_eq!(
            hopper_rows(&HopperCall {
                num_sms: 133,
                ..base
            }),
            128
        );
        let causal = HopperCall {
            need: plain(MaskKind::Causal),
            seqlen_k: HOPPER_WIDE_CAUSAL_MIN_KEYS - 1,
            ..base
        };
        let wide_causal = HopperCall {
            seqlen_k: HOPPER_NARROW_MAX_KEYS_D64[1] + 1,
            ..causal
        };
        assert_eq!(hopper_rows(&wide_causal), 192);
        // Few keys: 64 rows on the D = 64 and 128 lines (D = 32 and 96 run
        // on them), up to each line's limits, non-causal and causal.
        for (d, max) in [
            (32, HOPPER_NARROW_MAX_KEYS_D64),
            (64, HOPPER_NARROW_MAX_KEYS_D64),
            (96, HOPPER_NARROW_MAX_KEYS_D128),
            (128, HOPPER_NARROW_MAX_KEYS_D128),
        ] {
            for (c, max) in [(base, max[0]), (causal, max[1])] {
                let at = |seqlen_k| {
                    hopper_rows(&HopperCall {
                        head_dim: d,
                        seqlen_k,
                        ..c
                    })
                };
                if max > 0 {
                    assert_eq!(at(max), 64, "{d} {c:?}");
                    assert_eq!(at(1), 64, "{d} {c:?}");
                }
                assert_ne!(at(max + 1), 64, "{d} {c:?}");
            }
        }
        // Not past them, nor on lines without 64-row tiles.
        let causal_d128 = HopperCall {
            head_dim: 128,
            ..causal
        };
        assert_eq!(hopper_rows(&causal_d128), 128);
        for d in [192, 256] {
            let short = HopperCall {
                head_dim: d,
                seqlen_k: 128,
                ..causal
            };
            assert_eq!(hopper_rows(&short), 128);
        }
        // A window bounded on both sides counts its width as non-causal
        // keys; one open on a side counts the sequence.
        let local = HopperCall {
            need: plain(MaskKind::Local),
            seqlen_k: 16384,
            ..base
        };
        let w = HOPPER_NARROW_MAX_KEYS_D64[0];
        let with = |window_keys| {
            hopper_rows(&HopperCall {
                window_keys,
                ..local
            })
        };
        assert_eq!(with(Some(w)), 64);
        assert_eq!(with(Some(129)), 64);
        assert_ne!(with(Some(w + 1)), 64);
        assert_ne!(with(None), 64);
        let short = HopperCall {
            seqlen_k: w,
            window_keys: Some(4 * w),
            ..local
        };
        assert_eq!(hopper_rows(&short), 64);
        // Small grids: 64-row CTAs that each get an SM, whatever the keys.
        for d in [64, 128, 256] {
            let small = HopperCall {
                head_dim: d,
                heads: 2,
                seqlen_q: 64 * 66,
                seqlen_k: 16384,
                ..base
            };
            assert_eq!(hopper_rows(&small), 64, "{d}");
            let seqlen_q = small.seqlen_q + 1;
            assert_ne!(hopper_rows(&HopperCall { seqlen_q, ..small }), 64, "{d}");
        }
        let mut reached = HashSet::new();
        for dtype in [Dtype::F16, Dtype::Bf16] {
            for e in HOPPER_ENTRIES
                .iter()
                .filter(|e| e.kind == KernelKind::WgmmaForward)
            {
                let c = HopperCall {
                    dtype,
                    head_dim: e.head_dim,
                    need: e.policies,
                    ..base
                };
                for rows in [Some(64), Some(128), Some(192)] {
                    for persistent in [None, Some(false), Some(true)] {
                        for keys in [None, Some(64), Some(80), Some(128)] {
                            let pick = HopperPick {
                                rows,
                                persistent,
                                keys,
                            };
                            let got = find_hopper_entry(&c, pick).unwrap();
                            // A persistent line only when asked for or chosen
                            // by the heuristic, never with other rows asked for.
                            if got.persistent {
                                let chosen = persistent.unwrap_or(hopper_persistent(&c));
                                assert!(chosen, "{}", got.name);
                                assert_eq!(rows, Some(got.rows), "{}", got.name);
                            }
                            reached.insert(got.name);
                        }
                    }
                }
            }
        }
        for e in HOPPER_ENTRIES
            .iter()
            .filter(|e| e.kind == KernelKind::WgmmaForward)
        {
            assert!(reached.contains(e.name), "{} is never dispatched", e.name);
        }
    }

    #[test]
    fn entry_names_are_unique_and_describe_the_entry() {
        let mut names = HashSet::new();
        let mut keys = HashSet::new();
        for e in ENTRIES {
            assert_eq!(e.name, expected_name(e));
            assert!(names.insert(e.name), "duplicate name {}", e.name);
            assert!(
                keys.insert((e.kind, e.dtype, e.head_dim, e.policies)),
                "duplicate entry {e:?}"
            );
            match e.kind {
                // Move bytes or merge rows: one entry per dtype for every head dim.
                KernelKind::Append
                | KernelKind::Merge
                | KernelKind::BackwardPrep
                | KernelKind::BackwardDq
                | KernelKind::BackwardDkv
                | KernelKind::BackwardSinks => {
                    assert_eq!((e.head_dim, e.policies), (0, Policies::PLAIN), "{e:?}")
                }
                KernelKind::Combine => {
                    assert_eq!(e.policies, Policies::PLAIN, "{e:?}");
                    assert!(SUPPORTED_HEAD_DIMS.contains(&e.head_dim), "{e:?}");
                }
                _ => assert!(SUPPORTED_HEAD_DIMS.contains(&e.head_dim), "{e:?}"),
            }
        }
        assert_eq!(Dtype::F16.name(), "f16");
        assert_eq!(Dtype::Bf16.name(), "bf16");
        assert_eq!(Dtype::F32.name(), "f32");
    }

    fn all_needs() -> Vec<Policies> {
        let mut v = Vec::new();
        for mask in MASKS {
            for score in SCORES {
                for seq in SEQS {
                    v.push(Policies { mask, score, seq });
                }
            }
        }
        v
    }

    #[test]
    fn covers_is_the_policy_order() {
        for a in all_needs() {
            for b in all_needs() {
                let mask = a.mask == MaskKind::Local || a.mask == b.mask;
                // Folded covers itself only (and only it covers itself).
                let folded = [a.seq, b.seq].contains(&SeqKind::Folded);
                let seq = if folded {
                    a.seq == b.seq
                } else {
                    a.seq >= b.seq
                };
                let want = mask && a.score >= b.score && seq;
                assert_eq!(a.covers(b), want, "{a:?} covers {b:?}");
            }
        }
    }

    #[test]
    fn every_problem_finds_the_most_specialised_entry() {
        for kind in KINDS {
            for dtype in DTYPES {
                for hd in SUPPORTED_HEAD_DIMS {
                    for need in all_needs() {
                        // Decode reads its cache through runtime paging, never
                        // packed; its folded entries (16-bit, at twice the
                        // folded head dims 32, 64, 96) are the folded calls'.
                        let folded_hd = matches!(hd, 64 | 128 | 192) && dtype != Dtype::F32;
                        if need.seq == SeqKind::Folded {
                            let found = find_entry(kind, dtype, hd, need);
                            let want = kind == KernelKind::Decode && folded_hd;
                            assert_eq!(found.is_some(), want, "{kind:?} {dtype:?} hd{hd} {need:?}");
                            if let Some(e) = found {
                                assert_eq!(e.policies.seq, SeqKind::Folded);
                                assert_eq!((e.kind, e.dtype, e.head_dim), (kind, dtype, hd));
                                assert!(e.policies.covers(need), "{e:?} for {need:?}");
                                if need.score == ScoreKind::Plain && need.mask != MaskKind::Local {
                                    assert_eq!(e.policies.mask, need.mask, "{e:?}");
                                }
                            }
                            continue;
                        }
                        if kind == KernelKind::Decode && need.seq != SeqKind::Dense {
                            assert!(find_entry(kind, dtype, hd, need).is_none());
                            continue;
                        }
                        let need = if kind == KernelKind::Combine {
                            Policies::PLAIN
                        } else {
                            need
                        };
                        let e = find_entry(kind, dtype, hd, need)
                            .unwrap_or_else(|| panic!("{kind:?} {dtype:?} hd{hd} {need:?}"));
                        assert_eq!((e.kind, e.dtype, e.head_dim), (kind, dtype, hd));
                        assert!(e.policies.covers(need), "{e:?} for {need:?}");
                        // No other entry that covers the need is more
                        // specialised (covered by the chosen one).
                        for other in ENTRIES
                            .iter()
                            .filter(|o| o.kind == kind && o.dtype == dtype && o.head_dim == hd)
                        {
                            if other.policies.covers(need) && e.policies.covers(other.policies) {
                                assert_eq!(other.policies, e.policies, "{e:?} vs {other:?}");
                            }
                        }
                        // f32 has only the general line of each kind (config).
                        if dtype == Dtype::F32 {
                            assert_eq!(
                                e.policies,
                                find_entry(kind, dtype, hd, e.policies).unwrap().policies
                            );
                            continue;
                        }
                        // Forward problems that the specialised lines cover get them.
                        if kind == KernelKind::Forward && need.seq == SeqKind::Dense {
                            if need.mask == MaskKind::Causal {
                                assert_eq!(e.policies.mask, MaskKind::Causal, "{e:?}");
                            }
                            if need.score == ScoreKind::Plain {
                                assert_eq!(e.policies.score, ScoreKind::Plain, "{e:?}");
                            }
                        }
                        // Plain full and causal problems get their plain kernels.
                        if kind != KernelKind::Combine
                            && need.score == ScoreKind::Plain
                            && need.mask != MaskKind::Local
                            && need.seq == SeqKind::Dense
                        {
                            assert_eq!(e.policies.mask, need.mask, "{e:?}");
                            assert_eq!(e.policies.score, ScoreKind::Plain, "{e:?}");
                        }
                    }
                }
            }
        }
        for dtype in DTYPES {
            assert!(find_entry(KernelKind::Append, dtype, 0, Policies::PLAIN).is_some());
            // merge_states takes f16/bf16 (validate::check_dtype refuses f32).
            let merge = find_entry(KernelKind::Merge, dtype, 0, Policies::PLAIN);
            assert_eq!(merge.is_some(), dtype != Dtype::F32);
        }
        assert!(find_entry(KernelKind::Forward, Dtype::F16, 80, Policies::PLAIN).is_none());
    }

    #[test]
    fn tiles_satisfy_the_kernels_assumptions() {
        // Every table line's tile: its head dim's, or a variant of it that
        // differs only in block_n.
        let attention = ENTRIES
            .iter()
            .filter(|e| matches!(e.kind, KernelKind::Forward | KernelKind::Decode));
        let per_arch =
            attention.flat_map(|e| PtxArch::ATTENTION.map(|a| (e.head_dim, e.kind, a, e.tile(a))));
        for (hd, kind, arch, t) in per_arch {
            let base = AttnTile::for_kernel(kind, hd, arch).expect("supported head dim has a tile");
            assert!(AttnTile::supports(hd));
            assert_eq!(base, AttnTile::of(kind, hd, arch));
            assert_eq!(
                AttnTile {
                    block_n: base.block_n,
                    ..t
                },
                base
            );
            assert_eq!(t.head_dim, hd);
            assert_eq!(hd % MMA_K, 0, "hd{hd}");
            assert_eq!(hd % CHUNK_ELEMS, 0, "hd{hd}");
            match t.split {
                WarpSplit::Rows => assert_eq!(t.block_m, t.warps * t.m_tiles * MMA_M, "hd{hd}"),
                WarpSplit::Keys => {
                    assert_eq!(t.block_m, t.m_tiles * MMA_M, "hd{hd}");
                    assert_eq!(t.block_n, t.warps * WARP_KEYS, "hd{hd}");
                }
            }
            assert_eq!(t.warp_rows(), t.m_tiles * MMA_M, "hd{hd}");
            assert_eq!(t.block_n % 16, 0, "hd{hd}");
            assert_eq!(t.threads(), t.warps * WARP_SIZE, "hd{hd}");
            assert!(
                t.smem_bytes() <= arch.max_smem_bytes(),
                "hd{hd}: {} bytes exceed {arch:?}'s {}",
                t.smem_bytes(),
                arch.max_smem_bytes()
            );
            let chunks = t.row_chunks();
            assert_eq!(chunks * CHUNK_ELEMS, hd);
            // Shared-memory rows hold whole swizzle groups (padded), and the
            // strided copies split the threads into whole rows of chunk lanes
            // that cover a block in whole passes.
            let padded = smem_row_chunks(hd);
            assert!(
                padded >= chunks && padded.is_multiple_of(SWIZZLE_ROWS),
                "hd{hd}"
            );
            assert_eq!(t.smem_row_bytes(), padded * CHUNK_BYTES);
            let lanes = copy_row_lanes(hd);
            assert!(lanes >= chunks && lanes.is_power_of_two(), "hd{hd}");
            assert_eq!(t.threads() % lanes, 0, "hd{hd}");
            assert_eq!(t.block_n % (t.threads() / lanes), 0, "hd{hd}");
            // The paged row-by-row copy gives each thread whole chunks.
            assert_eq!((t.block_n * chunks) % t.threads(), 0, "hd{hd}");
            // Shared-memory regions: the (K, V) ring of kv_stages stages, and Q
            // either before it or inside its last stage; everything inside the
            // CTA's allocation and 16-byte aligned.
            assert!(t.kv_stages >= 2, "hd{hd}: the ring needs a stage in flight");
            assert_eq!(t.v_smem_offset(), t.k_smem_offset() + t.kv_smem_bytes());
            assert_eq!(t.stage_bytes(), 2 * t.kv_smem_bytes());
            let ring_end = t.ring_offset() + t.kv_stages * t.stage_bytes();
            assert!(ring_end <= t.smem_bytes());
            assert!(t.q_smem_offset() + t.q_smem_bytes() <= t.smem_bytes());
            if t.q_smem_offset() >= t.ring_offset() {
                // Q borrows the last stage, which the ring fills only after Q.
                assert!(t.kv_stages > 1 && t.q_in_regs, "hd{hd}");
                assert_eq!(
                    t.q_smem_offset(),
                    t.ring_offset() + (t.kv_stages - 1) * t.stage_bytes()
                );
                assert!(t.q_smem_bytes() <= t.stage_bytes());
            } else {
                assert!(t.q_smem_offset() + t.q_smem_bytes() <= t.ring_offset());
            }
            if t.split == WarpSplit::Keys {
                let stats = 2 * t.warps * t.block_m * 4;
                assert_eq!(t.merge_stats_offset(), t.ring_offset() + t.merge_bytes());
                assert!(t.merge_stats_offset() + stats <= t.smem_bytes());
                assert_eq!(t.merge_row_bytes() % CHUNK_BYTES, 0);
            }
            assert_eq!(t.ring_offset() % CHUNK_BYTES, 0);
            assert_eq!(t.q_smem_offset() % CHUNK_BYTES, 0);
            assert_eq!(t.k_smem_offset() % CHUNK_BYTES, 0);
            assert_eq!(t.v_smem_offset() % CHUNK_BYTES, 0);

            // Whole row-wide groups per combine CTA; the threads past them idle.
            let per_row = hd / COMBINE_ELEMS_PER_THREAD;
            let groups = combine_groups(hd);
            assert!(groups * per_row <= COMBINE_THREADS, "hd{hd}");
            assert!((groups + 1) * per_row > COMBINE_THREADS, "hd{hd}");
            assert_eq!(hd % COMBINE_ELEMS_PER_THREAD, 0);
            // Each group's O row and (max, sum), 16-byte aligned rows.
            assert_eq!(combine_smem_bytes(hd), groups * (hd + 2) * 4);
            assert_eq!(hd * 4 % 16, 0);
        }
        assert!(!AttnTile::supports(80));
        assert!(!AttnTile::supports(0));
        for arch in PtxArch::ATTENTION {
            assert!(AttnTile::for_kernel(KernelKind::Decode, 80, arch).is_none());
        }
    }

    #[test]
    fn combine_groups_cover_every_split_once() {
        for hd in SUPPORTED_HEAD_DIMS {
            let groups = combine_groups(hd);
            for splits in 1..=MAX_SPLITS {
                let c = combine_shape(hd, splits);
                let chunks = splits.div_ceil(COMBINE_SPLIT_GROUP);
                let what = format!("hd{hd} splits={splits} {c:?}");
                assert!(c.split_groups >= 1 && c.rows_per_cta >= 1, "{what}");
                assert!(c.split_groups * c.rows_per_cta <= groups, "{what}");
                // No group without a chunk, and no more rounds than the CTA needs.
                assert!(c.split_groups <= chunks, "{what}");
                assert_eq!(
                    chunks.div_ceil(c.split_groups),
                    chunks.div_ceil(groups),
                    "{what}"
                );
                // The kernel's walk: group g takes splits g·8.., then every
                // split_groups-th chunk after it.
                let mut seen = vec![0; splits];
                for g in 0..c.split_groups {
                    let mut s0 = g * COMBINE_SPLIT_GROUP;
                    while s0 < splits {
                        let chunk = s0..(s0 + COMBINE_SPLIT_GROUP).min(splits);
                        seen[chunk].iter_mut().for_each(|n| *n += 1);
                        s0 += c.split_groups * COMBINE_SPLIT_GROUP;
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "{what}");
            }
        }
    }

    #[test]
    fn every_ring_depth_fits_its_launch() {
        let attention = ENTRIES
            .iter()
            .filter(|e| matches!(e.kind, KernelKind::Forward | KernelKind::Decode));
        for (e, arch) in attention.flat_map(|e| PtxArch::ATTENTION.map(|a| (e, a))) {
            let t = e.tile(arch);
            assert!(
                2 <= t.busy_stages && t.busy_stages <= t.kv_stages,
                "{}",
                e.name
            );
            if e.kind == KernelKind::Forward {
                assert_eq!(
                    t.busy_stages, t.kv_stages,
                    "forward launches use the full ring"
                );
            }
            for stages in 0..=t.kv_stages + 1 {
                let u = t.with_stages(stages);
                if !(t.busy_stages..=t.kv_stages).contains(&stages) {
                    assert_eq!(u, t);
                    continue;
                }
                assert_eq!(u.kv_stages, stages);
                // The launch's allocation holds the ring, Q (which may borrow
                // the last stage in use) and the merge tile.
                let smem = u.smem_bytes();
                assert!(smem <= t.smem_bytes(), "{}", e.name);
                assert!(u.ring_offset() + stages * u.stage_bytes() <= smem);
                assert!(u.q_smem_offset() + u.q_smem_bytes() <= smem);
                if u.split == WarpSplit::Keys {
                    assert!(u.merge_stats_offset() + 2 * u.warps * u.block_m * 4 <= smem);
                }
            }
        }
    }

    #[test]
    fn entries_report_their_tiles() {
        for (e, a) in ENTRIES
            .iter()
            .flat_map(|e| PtxArch::ATTENTION.map(|a| (e, a)))
        {
            match e.kind {
                KernelKind::Combine => {
                    assert_eq!(e.threads(a), COMBINE_THREADS);
                    assert_eq!(e.smem_bytes(a), combine_smem_bytes(e.head_dim));
                    assert!(e.smem_bytes(a) <= 48 * 1024, "no opt-in needed");
                }
                KernelKind::Append => {
                    assert_eq!(e.threads(a), APPEND_THREADS);
                    assert_eq!(e.smem_bytes(a), 0);
                    assert_eq!(e.min_ctas_per_sm(a), None);
                }
                KernelKind::Merge => {
                    assert_eq!(e.threads(a), MERGE_THREADS);
                    assert_eq!(e.smem_bytes(a), 0);
                    assert_eq!(e.min_ctas_per_sm(a), None);
                }
                KernelKind::BackwardPrep | KernelKind::BackwardDq | KernelKind::BackwardDkv => {
                    assert_eq!(e.threads(a), BWD_THREADS);
                    assert_eq!(e.smem_bytes(a), 0);
                    assert_eq!(e.min_ctas_per_sm(a), None);
                }
                KernelKind::BackwardSinks => {
                    assert_eq!(e.threads(a), BWD_THREADS);
                    assert_eq!(e.smem_bytes(a), BWD_THREADS / 32 * 4);
                    assert_eq!(e.min_ctas_per_sm(a), None);
                }
                KernelKind::Backward => {
                    let t = BwdTile::of(e.head_dim, a);
                    assert!(BWD_HEAD_DIMS.contains(&e.head_dim), "{e:?}");
                    assert_eq!(e.threads(a), t.threads());
                    assert_eq!(e.smem_bytes(a), t.smem_bytes());
                    assert!(t.smem_bytes() <= a.max_smem_bytes(), "{e:?} on {a:?}");
                    assert_eq!(e.min_ctas_per_sm(a), Some(t.ctas_per_sm));
                    // A warp's dK and dV accumulators (2 x keys x columns
                    // / 32 f32 per thread) stay within 128 registers; the
                    // warps' Sᵀ tiles, dK/dV shares and dQ tiles each cover
                    // the block once, in whole (pairs of) n-tiles.
                    let accumulators = 2 * t.dkv_keys() * e.head_dim / t.col_parts() / 32;
                    assert!(accumulators <= 128, "{e:?} on {a:?}");
                    assert_eq!(
                        t.warps() * 16 * (t.block_m / t.s_parts()),
                        t.block_n * t.block_m
                    );
                    assert_eq!(t.warps() * t.dkv_keys(), t.block_n * t.col_parts());
                    assert_eq!(e.head_dim % (16 * t.col_parts()), 0, "{e:?}");
                    assert_eq!(t.block_m % (8 * t.s_parts()), 0, "{e:?}");
                    assert_eq!(t.warps() % (t.block_m / t.dq_rows()), 0, "{e:?}");
                    assert_eq!(e.head_dim % (16 * t.dq_parts()), 0, "{e:?} on {a:?}");
                    assert!(t.shared_p || t.dkv_keys() == 16, "P in registers: own keys");
                    assert!(
                        2 * t.block_m <= t.threads(),
                        "stats copy: a word per thread"
                    );
                }
                _ => {
                    let t = AttnTile::of_variant(e.kind, e.head_dim, e.policies, a);
                    assert_eq!(e.tile(a), t);
                    assert_eq!(e.threads(a), t.threads());
                    assert_eq!(e.smem_bytes(a), t.smem_bytes());
                    assert_eq!(e.min_ctas_per_sm(a), Some(t.min_ctas_per_sm));
                }
            }
        }
    }

    #[test]
    fn module_env_names_an_older_module_or_is_refused() {
        use flash_attn::{module_for, FlashAttnError};
        for native in [PtxArch::Sm75, PtxArch::Sm80, PtxArch::Sm90] {
            assert_eq!(module_for(native, None).unwrap(), native);
            assert_eq!(module_for(native, Some("sm_75")).unwrap(), PtxArch::Sm75);
            for bad in ["sm_90", "sm_90a", "1", "", "SM_80"] {
                assert!(matches!(
                    module_for(native, Some(bad)),
                    Err(FlashAttnError::Unsupported { entry: "new", .. })
                ));
            }
        }
        assert_eq!(
            module_for(PtxArch::Sm90, Some("sm_80")).unwrap(),
            PtxArch::Sm80
        );
        assert_eq!(
            module_for(PtxArch::Sm80, Some("sm_80")).unwrap(),
            PtxArch::Sm80
        );
        assert!(module_for(PtxArch::Sm75, Some("sm_80")).is_err());
    }

    #[test]
    fn cubins_cover_the_gpus_people_run() {
        use flash_attn::cubins_for;
        // Same major, same or higher minor: sm_87 (Orin) runs sm_80's SASS.
        let picks: [(PtxArch, i32, i32, &[&str]); 9] = [
            (PtxArch::Sm75, 7, 5, &["sm_75/ptxas-12.4"]),
            (PtxArch::Sm80, 8, 0, &["sm_80/ptxas-12.4"]),
            (PtxArch::Sm80, 8, 6, &["sm_86/ptxas-12.4"]),
            (PtxArch::Sm80, 8, 7, &["sm_80/ptxas-12.4"]),
            (PtxArch::Sm80, 8, 9, &["sm_89/ptxas-12.4"]),
            (
                PtxArch::Sm90,
                9,
                0,
                &["sm_90/ptxas-13.0", "sm_90/ptxas-12.4"],
            ),
            (
                PtxArch::Sm90a,
                9,
                0,
                &["sm_90a/ptxas-13.0", "sm_90a/ptxas-12.4"],
            ),
            (PtxArch::Sm90, 10, 0, &[]),
            (PtxArch::Sm80, 12, 0, &[]),
        ];
        // A build whose PTX is the committed one embeds every cubin (build.rs
        // leaves out the ones whose PTX changed, during kernel work).
        let root = env!("CARGO_MANIFEST_DIR");
        let is_committed = |arch: PtxArch| {
            let name = format!(
                "{root}/kernels-gpu/ptx/flash_attn_{}.ptx.zst",
                arch.target_cpu().replace('_', "")
            );
            // The unpacked crate (scripts/package-check.sh) has no kernels-gpu/.
            let Ok(zst) = std::fs::read(name) else {
                return false;
            };
            let mut text = Vec::new();
            let mut frame =
                ruzstd::decoding::StreamingDecoder::new(&zst[..]).expect("a zstd frame");
            std::io::Read::read_to_end(&mut frame, &mut text).expect("a zstd frame");
            text == flash_attn::ptx_text(arch).as_bytes()
        };
        let committed: Vec<(PtxArch, bool)> =
            PtxArch::ALL.iter().map(|&a| (a, is_committed(a))).collect();
        for (arch, major, minor, want) in picks {
            let got = cubins_for(arch, major, minor);
            let names: Vec<&str> = got.iter().map(|&(name, _)| name).collect();
            if committed.contains(&(arch, true)) {
                assert_eq!(names, want, "{arch:?} {major}.{minor}");
            }
            assert!(names.iter().all(|n| want.contains(n)));
            for (_, cubin) in got {
                // An ELF image, not an empty placeholder.
                assert_eq!(&cubin.unpack()[..4], b"\x7fELF");
            }
        }
    }

    #[test]
    fn bf16_is_refused_by_the_sm75_module_only() {
        use flash_attn::validate::check_dtype;
        use flash_attn::FlashAttnError;
        use flash_attn_kernels::config::KernelKind::{Combine, Decode, Forward, Merge};
        let err = check_dtype(PtxArch::Sm75, Dtype::Bf16, &[Forward], "forward");
        assert!(
            matches!(
                err,
                Err(FlashAttnError::UnsupportedDtype {
                    dtype: Dtype::Bf16,
                    arch: "sm_75",
                    call: "forward"
                })
            ),
            "{err:?}"
        );
        assert!(err.unwrap_err().to_string().contains("bf16"));
        for arch in [PtxArch::Sm75, PtxArch::Sm80, PtxArch::Sm90] {
            for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
                let ok = arch.has_dtype(dtype);
                assert_eq!(check_dtype(arch, dtype, &[Forward], "forward").is_ok(), ok);
                assert_eq!(
                    check_dtype(arch, dtype, &[Decode, Combine], "decode").is_ok(),
                    ok
                );
                // merge_states has no f32 kernel.
                let merge = check_dtype(arch, dtype, &[Merge], "merge_states");
                assert_eq!(
                    merge.is_ok(),
                    ok && dtype != Dtype::F32,
                    "{arch:?} {dtype:?}"
                );
            }
        }
    }

    #[test]
    fn modules_are_picked_by_capability_and_shared_memory() {
        let h100 = 227 * 1024;
        // Volta (7.0) and Jetson Xavier (7.2) lack ldmatrix and m16n8k8.
        assert_eq!(PtxArch::for_device(7, 0, 96 * 1024), None);
        assert_eq!(PtxArch::for_device(7, 2, 48 * 1024), None);
        assert_eq!(PtxArch::for_device(6, 1, 48 * 1024), None);
        assert_eq!(PtxArch::for_device(7, 5, 64 * 1024), Some(PtxArch::Sm75));
        assert_eq!(PtxArch::for_device(8, 0, 163 * 1024), Some(PtxArch::Sm80));
        assert_eq!(PtxArch::for_device(8, 6, 99 * 1024), Some(PtxArch::Sm80));
        assert_eq!(PtxArch::for_device(9, 0, h100), Some(PtxArch::Sm90));
        assert_eq!(PtxArch::for_device(10, 0, h100), Some(PtxArch::Sm90));
        // sm_120 (consumer Blackwell): 99 KB per CTA, so the sm_80 tiles.
        assert_eq!(PtxArch::for_device(12, 0, 99 * 1024), Some(PtxArch::Sm80));
        // Every module's tiles fit the GPUs it is picked for.
        for arch in PtxArch::ATTENTION {
            let smem = arch
                .entries()
                .iter()
                .map(|e| e.smem_bytes(arch))
                .max()
                .unwrap();
            assert!(smem <= arch.max_smem_bytes(), "{arch:?}");
        }
    }
}

// ---------------------------------------------------------------------------
// Layout::span
// ---------------------------------------------------------------------------

#[test]
fn contiguous_span_is_the_product() {
    for shape in [[1, 1, 1, 1], [2, 3, 4, 5], [3, 1000, 8, 128]] {
        let l = Layout::contiguous(shape);
        assert_eq!(l.span(), Some(shape.iter().product()));
    }
    assert_eq!(Layout::contiguous([2, 3, 4, 5]).strides, [60, 20, 5, 1]);
}

#[test]
fn strided_span_reaches_the_last_element() {
    // Padded rows: the last element is at 1*S*P + 2*P + 3*D + 7.
    let l = Layout {
        shape: [2, 3, 4, 8],
        strides: [3 * 40, 40, 8, 1],
    };
    assert_eq!(l.span(), Some(120 + 2 * 40 + 3 * 8 + 7 + 1));
    // Broadcast (zero strides) spans one row.
    let l = Layout {
        shape: [5, 6, 7, 8],
        strides: [0, 0, 0, 1],
    };
    assert_eq!(l.span(), Some(8));
}

#[test]
fn zero_dim_span_is_zero() {
    for dim in 0..4 {
        let mut shape = [2, 3, 4, 5];
        shape[dim] = 0;
        assert_eq!(Layout::contiguous(shape).span(), Some(0), "dim {dim}");
        // Even with strides that would overflow.
        let l = Layout {
            shape,
            strides: [usize::MAX; 4],
        };
        assert_eq!(l.span(), Some(0), "dim {dim}");
    }
}

#[test]
fn overflowing_span_is_none() {
    // The product overflows.
    let l = Layout {
        shape: [3, 1, 1, 1],
        strides: [usize::MAX / 2 + 1, 1, 1, 1],
    };
    assert_eq!(l.span(), None);
    // The sum overflows.
    let l = Layout {
        shape: [2, 2, 1, 1],
        strides: [usize::MAX / 2 + 1, usize::MAX / 2 + 1, 1, 1],
    };
    assert_eq!(l.span(), None);
    // Only the final +1 overflows.
    let l = Layout {
        shape: [2, 1, 1, 1],
        strides: [usize::MAX, 1, 1, 1],
    };
    assert_eq!(l.span(), None);
    // One below that fits.
    let l = Layout {
        shape: [2, 1, 1, 1],
        strides: [usize::MAX - 1, 1, 1, 1],
    };
    assert_eq!(l.span(), Some(usize::MAX));
}

#[test]
fn overlapping_output_is_rejected() {
    // Broadcast (stride 0) and strides smaller than a row make two O elements share an address.
    for strides in [
        [0, H * D, D, 1],
        [SQ * H * D, 0, D, 1],
        [SQ * H * D, H * D, 8, 1],
    ] {
        let mut a = Args::new();
        a.o.layout.strides = strides;
        assert!(
            matches!(
                a.forward(),
                Err(FlashAttnError::OverlappingOutput { tensor: "o" })
            ),
            "{strides:?}: {:?}",
            a.forward()
        );
    }
    // A head-major output ([B, H, S, D] in memory) is one-to-one and accepted.
    let mut a = Args::new();
    a.o.layout.strides = [SQ * H * D, D, SQ * D, 1];
    assert!(a.forward().is_ok(), "{:?}", a.forward());
}

#[test]
fn unit_dims_ignore_stride_alignment() {
    // PyTorch leaves arbitrary strides on size-1 dims, e.g. a [B, 1, H, D] decode query.
    let mut a = Args::new();
    a.q.layout.shape[1] = 1;
    a.o.layout.shape[1] = 1;
    a.q.layout.strides[1] = 3;
    a.lse_len = None;
    assert!(a.forward().is_ok(), "{:?}", a.forward());
}

mod kvcache_validation {
    use flash_attn::validate::{check_forward, check_kvcache, AttnOptions, Operands, TensorInfo};
    use flash_attn::{FlashAttnError, Layout};
    use flash_attn_kernels::config::MAX_SPLITS;

    const B: usize = 2;
    const H: usize = 8;
    const HKV: usize = 2;
    const D: usize = 64;
    const PAGE: usize = 32;
    const PAGES: usize = 10;
    const MAX_PAGES: usize = 4;

    /// A contiguous tensor of `shape` at `addr`.
    pub(super) fn t(shape: [usize; 4], addr: u64) -> TensorInfo {
        let layout = Layout::contiguous(shape);
        TensorInfo {
            layout,
            len: layout.span().unwrap(),
            addr,
        }
    }

    struct Case {
        q: TensorInfo,
        k: TensorInfo,
        v: TensorInfo,
        o: TensorInfo,
        seqlens: usize,
        table: Option<(usize, usize)>,
        new: Option<(TensorInfo, TensorInfo)>,
    }

    impl Case {
        /// A valid paged problem with one appended token.
        fn paged() -> Case {
            Case {
                q: t([B, 1, H, D], 1 << 20),
                k: t([PAGES, PAGE, HKV, D], 2 << 20),
                v: t([PAGES, PAGE, HKV, D], 3 << 20),
                o: t([B, 1, H, D], 4 << 20),
                seqlens: B,
                table: Some((B * MAX_PAGES, MAX_PAGES)),
                new: Some((t([B, 1, HKV, D], 5 << 20), t([B, 1, HKV, D], 6 << 20))),
            }
        }
        fn operands(&self) -> Operands {
            Operands {
                q: self.q,
                k: self.k,
                v: self.v,
                o: self.o,
                lse_len: None,
            }
        }

        fn check(&self) -> Result<flash_attn::KvCacheShape, FlashAttnError> {
            check_kvcache(
                &self.operands(),
                self.seqlens,
                self.table,
                self.new.as_ref().map(|(k, v)| (k, v)),
                &AttnOptions::default(),
            )
        }
    }

    #[test]
    fn paged_problem_reports_its_geometry() {
        let shape = Case::paged().check().expect("valid");
        assert_eq!(shape.decode.cache_len, MAX_PAGES * PAGE);
        assert_eq!(shape.decode.batch, B);
        assert_eq!(shape.seqlen_new, 1);
        let p = shape.paging.expect("paged");
        assert_eq!(
            (p.page_size, p.max_pages, p.num_pages),
            (PAGE, MAX_PAGES, PAGES)
        );
    }

    #[test]
    fn num_splits_is_checked_and_decode_only() {
        let c = Case::paged();
        let with = |n| AttnOptions {
            num_splits: Some(n),
            ..Default::default()
        };
        let decode =
            |opts: &AttnOptions| check_kvcache(&c.operands(), c.seqlens, c.table, None, opts);
        for n in [0, MAX_SPLITS + 1] {
            assert!(
                matches!(decode(&with(n)), Err(FlashAttnError::NumSplits { got, max: MAX_SPLITS }) if got == n),
                "{n}"
            );
        }
        for n in [1, 7, MAX_SPLITS] {
            assert_eq!(decode(&with(n)).expect("valid").decode.num_splits, Some(n));
        }
        let (q, kv) = (t([B, 5, H, D], 1 << 20), t([B, 5, HKV, D], 2 << 20));
        let o = t([B, 5, H, D], 3 << 20);
        let dense = Operands {
            q,
            k: kv,
            v: kv,
            o,
            lse_len: None,
        };
        assert!(matches!(
            check_forward(&dense, &with(2)),
            Err(FlashAttnError::Unsupported {
                what: "num_splits",
                entry: "forward"
            })
        ));
        assert!(check_forward(&dense, &AttnOptions::default()).is_ok());
        // hopper_rows: 64, 128 or 192 on the forward, refused by decode.
        let rows = |r| AttnOptions {
            hopper_rows: Some(r),
            ..Default::default()
        };
        for r in [64, 128, 192] {
            assert!(check_forward(&dense, &rows(r)).is_ok());
            assert!(matches!(
                decode(&rows(r)),
                Err(FlashAttnError::Unsupported {
                    what: "hopper_rows",
                    entry: "decode"
                })
            ));
        }
        for r in [0, 32, 127, 256] {
            assert!(matches!(
                check_forward(&dense, &rows(r)),
                Err(FlashAttnError::HopperRows { got }) if got == r
            ));
        }
        // hopper_keys: the keys per block of some line, refused by decode.
        let keys = |n| AttnOptions {
            hopper_keys: Some(n),
            ..Default::default()
        };
        for n in [64, 80, 112, 128] {
            assert!(check_forward(&dense, &keys(n)).is_ok());
            assert!(matches!(
                decode(&keys(n)),
                Err(FlashAttnError::Unsupported {
                    what: "hopper_keys",
                    entry: "decode"
                })
            ));
        }
        for n in [0, 16, 96, 176, 256] {
            assert!(matches!(
                check_forward(&dense, &keys(n)),
                Err(FlashAttnError::HopperKeys { got }) if got == n
            ));
        }
    }

    #[test]
    fn page_size_must_be_a_multiple_of_16() {
        for page in [8, 24, 40] {
            let mut c = Case::paged();
            c.k = t([PAGES, page, HKV, D], c.k.addr);
            c.v = t([PAGES, page, HKV, D], c.v.addr);
            assert!(
                matches!(c.check(), Err(FlashAttnError::PageSize { page_size, multiple: 16 }) if page_size == page),
                "{page}"
            );
        }
    }

    #[test]
    fn block_table_too_short() {
        let mut c = Case::paged();
        c.table = Some((B * MAX_PAGES - 1, MAX_PAGES));
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::BlockTableLength { expected, got }) if expected == B * MAX_PAGES && got == expected - 1
        ));
        c.table = Some((B * MAX_PAGES, 0));
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::ZeroSized {
                tensor: "block_table",
                ..
            })
        ));
    }

    #[test]
    fn paged_pools_must_match() {
        let mut c = Case::paged();
        c.v = t([PAGES + 1, PAGE, HKV, D], c.v.addr);
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::ShapeMismatch {
                tensor: "v_cache",
                ..
            })
        ));
    }

    #[test]
    fn new_tokens_must_match_the_cache() {
        let mut c = Case::paged();
        c.new = Some((t([B, 2, HKV, D], 5 << 20), t([B, 1, HKV, D], 6 << 20)));
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::ShapeMismatch {
                tensor: "v_new",
                ..
            })
        ));
        let mut c = Case::paged();
        c.new = Some((
            t([B, 1, HKV + 1, D], 5 << 20),
            t([B, 1, HKV + 1, D], 6 << 20),
        ));
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::ShapeMismatch {
                tensor: "k_new",
                ..
            })
        ));
        let mut c = Case::paged();
        let too_many = MAX_PAGES * PAGE + 1;
        c.new = Some((
            t([B, too_many, HKV, D], 5 << 20),
            t([B, too_many, HKV, D], 6 << 20),
        ));
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::TooLarge {
                what: "new tokens",
                ..
            })
        ));
    }

    #[test]
    fn contiguous_cache_with_append() {
        let mut c = Case::paged();
        c.table = None;
        c.k = t([B, 100, HKV, D], c.k.addr);
        c.v = t([B, 100, HKV, D], c.v.addr);
        let shape = c.check().expect("valid");
        assert_eq!(
            (shape.decode.cache_len, shape.paging, shape.seqlen_new),
            (100, None, 1)
        );
        c.seqlens = B + 1;
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::SeqlensLength { .. })
        ));
    }
}

// ---------------------------------------------------------------------------
// Index arithmetic of the kernels (flash_attn_kernels::index)
// ---------------------------------------------------------------------------

mod index {
    use flash_attn::Window;
    use flash_attn_kernels::config::{smem_row_chunks, PAGE_SIZE_MULTIPLE, SUPPORTED_HEAD_DIMS};
    use flash_attn_kernels::index::*;
    use proptest::prelude::*;

    fn bound() -> impl Strategy<Value = Option<usize>> {
        prop_oneof![Just(None), Just(Some(0usize)), (0usize..80).prop_map(Some)]
    }

    /// The kernels' window bound: negative = unbounded.
    fn as_i32(b: Option<usize>) -> i32 {
        b.map_or(-1, |v| v as i32)
    }

    /// The specification, in unsigned form: `j + sq + left >= i + sk` and
    /// `j + sq <= i + sk + right`.
    fn sees(sq: usize, sk: usize, w: Window, i: usize, j: usize) -> bool {
        j < sk
            && w.left.is_none_or(|l| j + sq + l >= i + sk)
            && w.right.is_none_or(|r| j + sq <= i + sk + r)
    }

    /// Every range a row can have (empty ones included, `hi < lo`), every
    /// lane start and column offset of a small block: the one-compare test
    /// of the two-sided mask agrees with the two signed ones.
    #[test]
    fn key_span_cuts_outside_its_range() {
        for lo in 0..40 {
            for hi in -1..40 {
                for key0 in 0..20 {
                    let span = KeySpan::new(lo, hi, key0);
                    for offset in 0..24 {
                        let key = key0 + offset;
                        let outside = key < lo || key > hi;
                        assert_eq!(span.cuts(offset), outside, "lo={lo} hi={hi} key={key}");
                    }
                }
            }
        }
    }

    /// A token, length or window bound anywhere below 2^31, often at an end.
    fn any_31() -> impl Strategy<Value = u32> {
        prop_oneof![
            Just(0u32),
            Just(1),
            Just((1 << 31) - 2),
            Just((1 << 31) - 1),
            0u32..1 << 31,
            0u32..300,
        ]
    }

    /// A window bound as the kernels take it: -1 (unbounded) or below 2^31.
    fn any_bound() -> impl Strategy<Value = i32> {
        prop_oneof![Just(-1i32), any_31().prop_map(|b| b as i32)]
    }

    proptest! {
        /// `KeyWindow::first` / `last` against their definition (`t + Skv -
        /// Sq - left` and `t + Skv - Sq + right`, clamped to the keys) over
        /// every length, bound and token below
        /// 2^31, ends included (tokens past the sequence too: a tile's tail
        /// rows ask), where `key_window_is_the_specified_mask` takes small
        /// ones. A `last` below -1 would pass that test (no key is that far
        /// left) and wrap `key_blocks`' block count.
        #[test]
        fn key_window_bounds_over_the_whole_range(
            sq in any_31(), sk in any_31(), left in any_bound(), right in any_bound(), t in any_31(),
        ) {
            let keys = KeyWindow::new(sq, sk, left, right);
            let at = t as i64 + sk as i64 - sq as i64;
            let last = if right < 0 { sk as i64 - 1 } else { (at + right as i64).clamp(-1, sk as i64 - 1) };
            let first = if left < 0 { 0 } else { (at - left as i64).clamp(0, sk as i64) };
            prop_assert_eq!(keys.last(t) as i64, last);
            prop_assert_eq!(keys.first(t) as i64, first);
        }
    }

    /// After the backward's swap of fragment halves between lanes 2k and
    /// 2k + 1, the four values a lane holds are the four columns
    /// `quad_of` names, and the warp covers the 16 x 8 tile once.
    #[test]
    fn quad_of_covers_a_fragment_once() {
        use flash_attn_kernels::index::quad_of;
        // (row, col) of C fragment element e of a lane: e / 2 picks g or
        // g + 8, e % 2 the column of the pair.
        let at = |lane: u32, e: u32| (lane / 4 + 8 * (e / 2), 2 * (lane % 4) + e % 2);
        let mut seen = std::collections::HashSet::new();
        for lane in 0..32u32 {
            let partner = lane ^ 1;
            // The swap: the even lane keeps elements 0, 1 and takes the odd
            // lane's 0, 1; the odd lane takes the even lane's 2, 3 and
            // keeps its own 2, 3.
            let held = if lane % 2 == 0 {
                [at(lane, 0), at(lane, 1), at(partner, 0), at(partner, 1)]
            } else {
                [at(partner, 2), at(partner, 3), at(lane, 2), at(lane, 3)]
            };
            let (row, col) = quad_of(lane);
            for (i, &(r, c)) in held.iter().enumerate() {
                assert_eq!((r, c), (row, col + i as u32), "lane {lane} value {i}");
                assert!(seen.insert((r, c)), "lane {lane}: ({r}, {c}) twice");
            }
        }
        assert_eq!(seen.len(), 16 * 8);
    }

    proptest! {
        #[test]
        fn key_window_is_the_specified_mask(
            sq in 1usize..60, sk in 0usize..60, left in bound(), right in bound(),
        ) {
            let w = Window { left, right };
            let keys = KeyWindow::new(sq as u32, sk as u32, as_i32(left), as_i32(right));
            for i in 0..sq {
                for j in 0..sk + 3 {
                    prop_assert_eq!(keys.sees(i as u32, j as u32), sees(sq, sk, w, i, j), "i={} j={}", i, j);
                }
            }
        }

        /// The backward's head splits divide the group; chosen per call,
        /// they are the fewest that reach the target waves (or the whole
        /// group); forced, the largest divisor up to the request.
        #[test]
        fn backward_head_splits_divide_the_group(
            group in 1u32..=16, ctas in 1u32..5000, slots in 1u32..400,
            forced in proptest::option::of(0u32..40),
        ) {
            let s = backward_head_splits(group, ctas, slots, forced);
            prop_assert!(s >= 1 && group % s == 0);
            let target = BWD_TARGET_WAVES as u64 * slots as u64;
            let divisors: Vec<u32> = (1..=group).filter(|d| group % d == 0).collect();
            match forced {
                Some(f) => {
                    prop_assert!(s <= f.max(1));
                    prop_assert!(divisors.iter().all(|&d| d <= s || d > f.max(1)));
                }
                None => {
                    prop_assert!(s == group || ctas as u64 * s as u64 >= target);
                    prop_assert!(divisors.iter().all(|&d| d >= s || (ctas as u64 * d as u64) < target));
                }
            }
        }

        /// The backward CTA of key block n visits exactly the query blocks
        /// holding a token that sees one of its keys.
        #[test]
        fn query_blocks_are_the_blocks_that_see_a_key_block(
            sq in 1usize..140, sk in 1usize..200, left in bound(), right in bound(),
            bm in prop::sample::select(vec![32u32, 64]),
            bn in prop::sample::select(vec![64u32, 128]),
        ) {
            let keys = KeyWindow::new(sq as u32, sk as u32, as_i32(left), as_i32(right));
            let w = Window { left, right };
            for n in 0..(sk as u32).div_ceil(bn) {
                let (m_lo, m_hi) = query_blocks(&keys, n, bn, bm);
                prop_assert!(m_lo <= m_hi && m_hi as usize <= sq.div_ceil(bm as usize));
                for m in 0..sq.div_ceil(bm as usize) as u32 {
                    let seen = (m * bm..((m + 1) * bm).min(sq as u32)).any(|t| {
                        (n * bn..((n + 1) * bn).min(sk as u32))
                            .any(|j| sees(sq, sk, w, t as usize, j as usize))
                    });
                    prop_assert_eq!((m_lo..m_hi).contains(&m), seen, "n={} m={}", n, m);
                }
            }
        }

        #[test]
        fn key_blocks_partition_the_visible_keys_across_splits(
            sq in 1usize..70, sk in 0usize..300, left in bound(), right in bound(),
            bn in prop::sample::select(vec![16u32, 32, 64]),
            bm in prop::sample::select(vec![16u32, 64, 128]),
            splits in 1u32..6,
        ) {
            let keys = KeyWindow::new(sq as u32, sk as u32, as_i32(left), as_i32(right));
            for t0 in (0..sq as u32).step_by(bm as usize) {
                let t1 = t0 + bm - 1;
                let ranges: Vec<(u32, u32)> =
                    (0..splits).map(|s| key_blocks(&keys, t0, t1, bn, s, splits)).collect();
                // Consecutive and disjoint.
                for w in ranges.windows(2) {
                    prop_assert!(w[0].1 <= w[1].0 || w[1].0 == w[1].1);
                }
                let covered = |j: u32| ranges.iter().any(|&(lo, hi)| lo * bn <= j && j < hi * bn);
                // Every key a row of the CTA sees lies in exactly one split's blocks.
                for t in t0..=t1.min(sq as u32 - 1) {
                    for j in 0..sk as u32 {
                        if keys.sees(t, j) {
                            prop_assert!(covered(j), "t={} j={} {:?}", t, j, ranges);
                            let n = ranges.iter().filter(|&&(lo, hi)| lo * bn <= j && j < hi * bn).count();
                            prop_assert_eq!(n, 1);
                        }
                    }
                }
                // No visited block lies wholly outside every row's window.
                for &(lo, hi) in &ranges {
                    for n in lo..hi {
                        let any = (t0..=t1.min(sq as u32 - 1))
                            .any(|t| (n * bn..(n + 1) * bn).any(|j| keys.sees(t, j)));
                        prop_assert!(any, "block {} of {:?} is visited for nothing", n, ranges);
                    }
                }
            }
        }

        /// Every key a row does not see lies on an end that `mask_edges` names,
        /// so a block that `block_needs_mask` passes over is wholly visible.
        #[test]
        fn mask_edges_name_every_cut(
            sq in 1usize..70, sk in 1usize..300, left in bound(), right in bound(),
            bn in prop::sample::select(vec![16u32, 32, 64]), bm in prop::sample::select(vec![16u32, 64]),
        ) {
            let keys = KeyWindow::new(sq as u32, sk as u32, as_i32(left), as_i32(right));
            for t0 in (0..sq as u32).step_by(bm as usize) {
                let t1 = (t0 + bm - 1).min(sq as u32 - 1);
                for n in 0..(sk as u32).div_ceil(bn) {
                    let edges = mask_edges(&keys, t0, t1, n, bn);
                    prop_assert_eq!(block_needs_mask(&keys, t0, t1, n, bn), edges.left || edges.right);
                    for t in t0..=t1 {
                        for j in n * bn..(n + 1) * bn {
                            let j = j as i32;
                            if j < keys.first(t) {
                                prop_assert!(edges.left, "t={} j={} block {}: left cut", t, j, n);
                            } else if j > keys.last(t) {
                                prop_assert!(edges.right, "t={} j={} block {}: right cut", t, j, n);
                            }
                        }
                    }
                }
            }
        }

        #[test]
        fn origin_sides_hold_for_every_visible_key(
            sq in 1usize..70, sk in 1usize..300, left in bound(), right in bound(),
            bn in prop::sample::select(vec![16u32, 32, 64]), bm in prop::sample::select(vec![16u32, 64]),
        ) {
            let keys = KeyWindow::new(sq as u32, sk as u32, as_i32(left), as_i32(right));
            let mut one_sided = 0;
            for t0 in (0..sq as u32).step_by(bm as usize) {
                let t1 = (t0 + bm - 1).min(sq as u32 - 1);
                for n in 0..(sk as u32).div_ceil(bn) {
                    let side = origin_side(&keys, t0, t1, n, bn);
                    if keys.right == 0 {
                        prop_assert_eq!(side, OriginSide::Left, "a causal block is left of its rows");
                    }
                    let mut sides = [false; 2];
                    for t in t0..=t1 {
                        let pos = t as i64 + keys.diag as i64;
                        for j in (n * bn..(n + 1) * bn).filter(|&j| keys.sees(t, j)) {
                            sides[0] |= (j as i64) < pos;
                            sides[1] |= (j as i64) > pos;
                        }
                    }
                    match side {
                        OriginSide::Left => prop_assert!(!sides[1], "t {}..={} block {}", t0, t1, n),
                        OriginSide::Right => prop_assert!(!sides[0], "t {}..={} block {}", t0, t1, n),
                        // Both is only a missed shortcut where one side is empty.
                        OriginSide::Both => {}
                    }
                    one_sided += (side != OriginSide::Both) as u32;
                }
            }
            // Full attention over many blocks leaves some blocks one-sided.
            if keys.left < 0 && keys.right < 0 && sk as u32 >= 4 * bn.max(sq as u32) {
                prop_assert!(one_sided > 0);
            }
        }

        #[test]
        fn packed_ranges_stay_inside_the_tensor(start in any::<i32>(), end in any::<i32>(), total in 0u32..1000) {
            let (s, len) = clamp_range(start, end, total);
            prop_assert!(s <= total && s + len <= total);
            if 0 <= start && start <= end && end as u32 <= total {
                prop_assert_eq!((s, len), (start as u32, (end - start) as u32));
            }
        }

        #[test]
        fn page_slots_stay_inside_the_pool(entry in any::<i32>(), pages in 1u32..100) {
            let page = page_slot(entry, pages);
            prop_assert!(page < pages as u64);
            if (0..pages as i32).contains(&entry) {
                prop_assert_eq!(page, entry as u64);
            }
        }

        #[test]
        fn fast_division_is_exact(d in 1u32..=u32::MAX, n in 0u32..FastDiv::DIVIDEND_LIMIT) {
            let f = FastDiv::new(d);
            prop_assert_eq!(f.divmod(n), (n / d, n % d));
        }

        #[test]
        fn fast_division_by_page_sizes_is_exact(pages in 1u32..=8192, n in 0u32..FastDiv::DIVIDEND_LIMIT) {
            let d = pages * PAGE_SIZE_MULTIPLE as u32;
            prop_assert_eq!(FastDiv::new(d).divmod(n), (n / d, n % d));
        }
    }

    /// A folded decode row's own chunks: rows cycle through the query heads
    /// of two adjacent KV heads, and each row's chunks are its own KV
    /// head's half of the folded row.
    #[test]
    fn fold_chunks_are_the_rows_own_heads_half() {
        for group in 1..=8u32 {
            let pack = 2 * group;
            for tokens in 1..=4u32 {
                for chunks in [8u32, 16, 24] {
                    for row in 0..tokens * pack {
                        let head = row % pack;
                        let own_kv = head / group;
                        let want = (own_kv * chunks / 2, chunks / 2);
                        assert_eq!(fold_chunks(head, pack, chunks), want, "{group} {row}");
                    }
                }
            }
        }
    }

    #[test]
    fn fast_division_is_exact_at_the_edges() {
        // The largest dividends, around multiples of each divisor, for every
        // divisor up to 2^12 and each power of two and its neighbours.
        let divisors =
            (1..4096u32).chain((12..32).flat_map(|k| [(1u32 << k) - 1, 1 << k, (1 << k) + 1]));
        for d in divisors {
            let f = FastDiv::new(d);
            let top = FastDiv::DIVIDEND_LIMIT - 1;
            let around = |m: u32| [m.saturating_sub(1), m, m.saturating_add(1)];
            let near_top = top - top % d;
            for n in [0, 1, d - 1, d, top, top - 1, near_top]
                .into_iter()
                .chain(around(near_top))
                .chain(around(d.saturating_mul(7)))
                .filter(|&n| n < FastDiv::DIVIDEND_LIMIT)
            {
                assert_eq!(f.divmod(n), (n / d, n % d), "{n} / {d}");
            }
        }
    }

    /// A persistent grid's steps give every (query block, pair) to exactly
    /// one CTA once, whatever the grid; paired (causal) units add up to the
    /// same key blocks (block m sees m + 1; an odd M's middle unit half),
    /// heavy block first, so CTAs' totals differ by at most two units'
    /// (unpaired, one CTA of 132 would carry twice another's); the units of
    /// one wave are
    /// consecutive: a wave's tiles touch at most grid / M + 2 pairs.
    #[test]
    fn persistent_steps_partition_the_grid() {
        for m_blocks in [1u32, 2, 3, 4, 7, 8, 16, 33] {
            for pairs in [1u32, 2, 5, 9, 64, 131, 512] {
                let total = m_blocks * pairs;
                for paired in [false, true] {
                    let g = TileGrid::new(m_blocks, pairs, 1, paired);
                    for grid in [1u32, 7, 132, 264] {
                        let mut seen = vec![false; total as usize];
                        let mut loads = Vec::new();
                        for cta in 0..grid.min(total) {
                            let (mut step, mut load, mut tiles) = (0, 0, Vec::new());
                            while let Some((m, pair, next)) =
                                persistent_step(step, cta, grid, &g, pairs, paired)
                            {
                                assert!(m < m_blocks && pair < pairs, "{step} -> ({m}, {pair})");
                                assert!(next > step);
                                let i = (pair * m_blocks + m) as usize;
                                assert!(
                                    !std::mem::replace(&mut seen[i], true),
                                    "({m}, {pair}) twice"
                                );
                                load += m + 1;
                                tiles.push((step, m, pair));
                                step = next;
                            }
                            if paired {
                                // A unit's second block (odd step) follows
                                // its heavy twin, or the previous pair's
                                // middle block.
                                for &(st, m, pair) in &tiles {
                                    if st % 2 == 1 {
                                        let twin = tiles.iter().find(|t| t.0 == st - 1);
                                        let want = if 2 * m + 1 == m_blocks {
                                            (st - 1, m, pair - 1)
                                        } else {
                                            (st - 1, m_blocks - 1 - m, pair)
                                        };
                                        assert_eq!(twin, Some(&want));
                                        assert!(want.1 >= m);
                                    }
                                }
                            }
                            loads.push(load);
                        }
                        assert!(
                            seen.iter().all(|&s| s),
                            "{m_blocks} x {pairs} on {grid}: a tile missed"
                        );
                        if paired {
                            let (lo, hi) =
                                (loads.iter().min().unwrap(), loads.iter().max().unwrap());
                            assert!(
                                hi - lo <= 2 * (m_blocks + 1),
                                "{m_blocks} x {pairs} on {grid}: {loads:?}"
                            );
                        }
                        // The first wave (step 0 of every CTA) spans few pairs.
                        let first: std::collections::BTreeSet<u32> = (0..grid.min(total))
                            .filter_map(|c| persistent_step(0, c, grid, &g, pairs, paired))
                            .map(|(_, pair, _)| pair)
                            .collect();
                        let per_pair = if paired {
                            (m_blocks / 2).max(1)
                        } else {
                            m_blocks
                        };
                        assert!(first.len() as u32 <= grid / per_pair + 2, "{first:?}");
                    }
                }
            }
        }
    }

    /// The dynamic order visits every (query block, pair) once: pair by
    /// pair, heaviest block first, before the tail, and across the tail's
    /// pairs by weight (never a heavier block after a lighter one). The
    /// claim protocol (each CTA's first tile its index, then grid +
    /// `atom.inc`'s ticket until one lands past the tiles), under any
    /// interleaving of the CTAs, runs every tile exactly once and leaves
    /// the counter at 0 for the next launch.
    #[test]
    fn dynamic_order_and_claims_cover_the_grid() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        for m_blocks in [1u32, 2, 3, 4, 7, 16] {
            for pairs in [1u32, 2, 5, 64, 131, 512] {
                let tiles = m_blocks * pairs;
                for tail in [0u32, 1, 3, pairs, pairs + 5] {
                    let g = TileGrid::new(m_blocks, pairs, 1, false).dynamic(pairs, tail, 1);
                    let tail = tail.clamp(1, pairs);
                    let order: Vec<(u32, u32)> = (0..tiles).map(|i| dynamic_tile(i, &g)).collect();
                    let mut seen = vec![false; tiles as usize];
                    for &(m, pair) in &order {
                        assert!(m < m_blocks && pair < pairs, "({m}, {pair})");
                        assert!(!std::mem::replace(
                            &mut seen[(pair * m_blocks + m) as usize],
                            true
                        ));
                    }
                    let head = ((pairs - tail) * m_blocks) as usize;
                    for w in order[..head].windows(2) {
                        assert!(w[1].1 > w[0].1 || (w[1].1 == w[0].1 && w[1].0 < w[0].0));
                    }
                    for w in order[head..].windows(2) {
                        assert!(w[1].0 <= w[0].0, "{m_blocks} x {pairs}, tail {tail}");
                    }
                    for grid in [1u32, 7, 132] {
                        let grid = grid.min(tiles);
                        let limit = tiles - 1;
                        let mut counter = 0u32;
                        let mut ran = vec![0u32; tiles as usize];
                        let mut live: Vec<u32> = (0..grid).collect();
                        for cta in 0..grid {
                            ran[cta as usize] += 1;
                        }
                        while !live.is_empty() {
                            let k = rng.random_range(0..live.len());
                            let ticket = counter;
                            counter = if counter >= limit { 0 } else { counter + 1 };
                            let i = grid + ticket;
                            if i < tiles {
                                ran[i as usize] += 1;
                            } else {
                                live.swap_remove(k);
                            }
                        }
                        assert!(
                            ran.iter().all(|&n| n == 1),
                            "{m_blocks} x {pairs} on {grid}"
                        );
                        assert_eq!(counter, 0, "{m_blocks} x {pairs} on {grid}");
                    }
                }
            }
        }
    }

    /// A balanced causal grid maps onto itself. In linear block order, a
    /// grid of at most one wave goes pair by pair with each pair's query
    /// blocks heaviest first; past one wave it starts its tiles in the
    /// persistent lines' order ([`dynamic_tile`]) with a tail of at least
    /// `HOPPER_TAIL_WAVES` waves, whole pairs.
    #[test]
    fn balanced_grids_cover_the_grid() {
        let waves = flash_attn_kernels::config::HOPPER_TAIL_WAVES as u32;
        for m_blocks in [1u32, 3, 4, 16, 128] {
            for (heads, batches) in [(1u32, 1u32), (8, 1), (8, 32), (72, 2), (9, 3)] {
                let dims = [m_blocks, heads, batches];
                let pairs = heads * batches;
                let tiles = m_blocks * pairs;
                let heaviest: Vec<(u32, u32)> = (0..tiles)
                    .map(|i| (m_blocks - 1 - i % m_blocks, i / m_blocks))
                    .collect();
                for wave in [64u32, 132, 264] {
                    let mut seen = vec![false; tiles as usize];
                    let mut order = Vec::new();
                    for z in 0..batches {
                        for y in 0..heads {
                            for x in 0..m_blocks {
                                let [m, h, b] = balanced_tile([x, y, z], dims, wave);
                                assert!(m < m_blocks && h < heads && b < batches);
                                let pair = h + heads * b;
                                let k = (pair * m_blocks + m) as usize;
                                assert!(!std::mem::replace(&mut seen[k], true));
                                order.push((m, pair));
                            }
                        }
                    }
                    if tiles <= wave {
                        assert_eq!(order, heaviest, "{m_blocks} x {pairs} on {wave}");
                        continue;
                    }
                    let tail = (waves * wave).div_ceil(m_blocks).min(pairs);
                    let g = TileGrid::new(m_blocks, pairs, 1, false).dynamic(pairs, tail, 1);
                    let persistent: Vec<(u32, u32)> =
                        (0..tiles).map(|i| dynamic_tile(i, &g)).collect();
                    assert_eq!(order, persistent, "{m_blocks} x {pairs} on {wave}");
                    assert!(tail * m_blocks >= (waves * wave).min(tiles));
                }
            }
        }
    }

    /// The host's divisors of a persistent launch reproduce the divisions
    /// they replace: a work unit's (pair, block), a pair's (batch, head) and
    /// a head's KV head, up to the largest unit a launch below the tile
    /// limit computes.
    #[test]
    fn tile_grid_divides_as_the_divisions() {
        let units = [
            0u32,
            1,
            2,
            131,
            4095,
            65_537,
            1 << 20,
            (1 << 30) - 1,
            (1 << 31) - 1,
        ];
        for m_blocks in [1u32, 2, 3, 5, 8, 127, 128, 1000, 65_535] {
            for (heads, kv_heads) in [
                (1u32, 1u32),
                (8, 8),
                (28, 4),
                (32, 8),
                (9, 3),
                (64, 1),
                (96, 12),
            ] {
                let g = TileGrid::new(m_blocks, heads, kv_heads, true);
                assert_eq!(g.m_blocks.divisor, m_blocks);
                assert_eq!(g.half.divisor, m_blocks / 2);
                for n in units {
                    assert_eq!(g.m_blocks.divmod(n), (n / m_blocks, n % m_blocks));
                    assert_eq!(g.heads.divmod(n), (n / heads, n % heads));
                    if m_blocks > 1 {
                        let half = m_blocks / 2;
                        assert_eq!(g.half.divmod(n), (n / half, n % half));
                    }
                }
                for h in 0..heads {
                    assert_eq!(g.group.quotient(h), h / (heads / kv_heads));
                }
            }
        }
        assert!(2 * TileGrid::TILE_LIMIT as u64 <= FastDiv::DIVIDEND_LIMIT as u64);
    }

    #[test]
    fn swizzle_is_a_bijection_on_each_padded_row() {
        for d in SUPPORTED_HEAD_DIMS {
            let chunks = smem_row_chunks(d) as u32;
            for row in 0..64u32 {
                let mut seen = vec![false; chunks as usize];
                for c in 0..chunks {
                    let p = swizzle(row, c);
                    assert!(p < chunks, "hd{d} row {row} chunk {c} -> {p}");
                    assert!(!std::mem::replace(&mut seen[p as usize], true));
                }
            }
            // An ldmatrix phase (8 consecutive rows of one logical chunk) hits 8
            // different chunks: no bank conflict.
            for c in 0..chunks {
                let mut phys: Vec<u32> = (0..8).map(|r| swizzle(r, c) % 8).collect();
                phys.sort_unstable();
                phys.dedup();
                assert_eq!(phys.len(), 8, "hd{d} chunk {c}");
            }
        }
        // The row-pairs layout is an involution on each 16-row group.
        for row in 0..16u32 {
            for chunk in 0..8u32 {
                let (r, c) = row_pairs(row, chunk);
                assert_eq!(row_pairs(r, c), (row, chunk));
            }
        }
    }

    /// The SW128 layout (TMA's 128-byte swizzle, what `wgmma` reads) maps a
    /// tile's 16-byte chunks one to one onto its bytes, 64 columns per group,
    /// each 8-row atom inside its own 1024-byte block, and 8 consecutive rows
    /// of one chunk onto 8 different 16-byte bank groups.
    #[test]
    fn sw128_layout_is_a_bijection_onto_whole_atoms() {
        for rows in [64u32, 80, 128, 176] {
            for cols in [64u32, 128, 176, 256] {
                let groups = cols.div_ceil(64);
                let bytes = groups * rows * SW128_ROW_BYTES;
                let mut seen = vec![false; (bytes / 16) as usize];
                for r in 0..rows {
                    for c in 0..cols / 8 {
                        let o = sw128_offset(r, c, rows);
                        assert!(
                            o.is_multiple_of(16) && o < bytes,
                            "rows {rows} cols {cols}: ({r}, {c}) -> {o}"
                        );
                        assert!(!std::mem::replace(&mut seen[(o / 16) as usize], true));
                        let atom = (c / 8) * rows * SW128_ROW_BYTES + (r / 8) * SW128_ATOM_BYTES;
                        assert!((atom..atom + SW128_ATOM_BYTES).contains(&o));
                    }
                }
                for c in 0..8 {
                    let mut banks: Vec<u32> = (0..8)
                        .map(|r| sw128_offset(r, c, rows) % 128 / 16)
                        .collect();
                    banks.sort_unstable();
                    banks.dedup();
                    assert_eq!(banks.len(), 8);
                }
            }
        }
    }

    /// The descriptor fields, and each k-step's start address against the
    /// layout: K-major step kk starts at chunk 2kk of row 0, MN-major step kk
    /// at row 16kk; the MN-major leading offset is one column group.
    #[test]
    fn wgmma_descriptors_address_the_sw128_layout() {
        let field = |d: u64, lo: u32, bits: u32| (d >> lo) & ((1 << bits) - 1);
        let d = gmma_desc(0x1_2340, 0x5600, 1024);
        assert_eq!(field(d, 0, 14), 0x1_2340 >> 4);
        assert_eq!(field(d, 16, 14), 0x5600 >> 4);
        assert_eq!(field(d, 32, 14), 1024 >> 4);
        assert_eq!(field(d, 49, 3), 0, "base offset: tiles are atom-aligned");
        assert_eq!(field(d, 62, 2), 1, "128-byte swizzle");
        let tile = 3 * SW128_ATOM_BYTES;
        for rows in [64u32, 80, 128, 176] {
            for kk in 0..16u32 {
                let k = k_major_desc(tile, rows, kk);
                assert_eq!(
                    field(k, 0, 14) << 4,
                    (tile + sw128_offset(0, 2 * kk, rows)) as u64
                );
                assert_eq!(field(k, 32, 14) << 4, SW128_ATOM_BYTES as u64);
                if 16 * kk < rows {
                    let m = mn_major_desc(tile, rows, kk);
                    assert_eq!(
                        field(m, 0, 14) << 4,
                        (tile + sw128_offset(16 * kk, 0, rows)) as u64
                    );
                    let group = sw128_offset(0, 8, rows) - sw128_offset(0, 0, rows);
                    assert_eq!(field(m, 16, 14) << 4, group as u64);
                    assert_eq!(field(m, 32, 14) << 4, SW128_ATOM_BYTES as u64);
                }
            }
        }
    }
}

mod varlen_paged_validation {
    use super::kvcache_validation::t;
    use flash_attn::validate::{
        check_varlen, check_varlen_paged, AttnOptions, Operands, TensorInfo,
    };
    use flash_attn::{FlashAttnError, VarlenShape};

    const B: usize = 3;
    const H: usize = 8;
    const HKV: usize = 2;
    const D: usize = 64;
    const PAGE: usize = 32;
    const PAGES: usize = 12;
    const MAX_PAGES: usize = 4;
    const TOTAL_Q: usize = 50;

    struct Case {
        q: TensorInfo,
        k: TensorInfo,
        v: TensorInfo,
        o: TensorInfo,
        cu_q: usize,
        seqlens_k: usize,
        table: (usize, usize),
        max_q: usize,
        lse: Option<usize>,
    }

    impl Case {
        fn valid() -> Case {
            Case {
                q: t([1, TOTAL_Q, H, D], 1 << 20),
                k: t([PAGES, PAGE, HKV, D], 2 << 20),
                v: t([PAGES, PAGE, HKV, D], 3 << 20),
                o: t([1, TOTAL_Q, H, D], 4 << 20),
                cu_q: B + 1,
                seqlens_k: B,
                table: (B * MAX_PAGES, MAX_PAGES),
                max_q: 20,
                lse: Some(H * TOTAL_Q),
            }
        }
        fn operands(&self) -> Operands {
            Operands {
                q: self.q,
                k: self.k,
                v: self.v,
                o: self.o,
                lse_len: self.lse,
            }
        }

        fn check(&self) -> Result<VarlenShape, FlashAttnError> {
            check_varlen_paged(
                &self.operands(),
                self.cu_q,
                self.seqlens_k,
                self.table,
                self.max_q,
                &AttnOptions::default(),
            )
            .map(|(shape, paging)| {
                assert_eq!(
                    (paging.page_size, paging.max_pages, paging.num_pages),
                    (PAGE, MAX_PAGES, PAGES)
                );
                shape
            })
        }
    }

    /// `hopper_rows` picks a tile for packed sequences, against contiguous
    /// or paged K/V (any Hopper line's rows; their lines have 128).
    #[test]
    fn hopper_rows_applies_to_varlen() {
        let c = Case::valid();
        let kv = t([1, 40, HKV, D], 5 << 20);
        let rows = |r| AttnOptions {
            hopper_rows: Some(r),
            ..Default::default()
        };
        let packed = |opts: &AttnOptions| {
            check_varlen(
                &Operands {
                    k: kv,
                    v: kv,
                    lse_len: None,
                    ..c.operands()
                },
                B + 1,
                B + 1,
                20,
                40,
                opts,
            )
        };
        let paged = |opts: &AttnOptions| {
            check_varlen_paged(
                &Operands {
                    lse_len: None,
                    ..c.operands()
                },
                B + 1,
                B,
                c.table,
                20,
                opts,
            )
        };
        assert!(packed(&AttnOptions::default()).is_ok());
        for r in [64, 128, 192] {
            assert!(packed(&rows(r)).is_ok(), "{r}");
            assert!(paged(&rows(r)).is_ok(), "{r}");
        }
        for r in [0, 100, 256] {
            for check in [packed(&rows(r)).map(|_| ()), paged(&rows(r)).map(|_| ())] {
                assert!(matches!(check, Err(FlashAttnError::HopperRows { got }) if got == r));
            }
        }
    }

    #[test]
    fn the_capacity_bounds_every_key_count() {
        let s = Case::valid().check().expect("valid");
        assert_eq!((s.batch, s.total_q, s.max_seqlen_q), (B, TOTAL_Q, 20));
        assert_eq!(
            (s.total_k, s.max_seqlen_k),
            (MAX_PAGES * PAGE, MAX_PAGES * PAGE)
        );
        assert_eq!((s.heads, s.kv_heads, s.head_dim), (H, HKV, D));
    }

    #[test]
    fn one_key_count_per_sequence() {
        for n in [B - 1, B + 1] {
            let mut c = Case::valid();
            c.seqlens_k = n;
            assert!(
                matches!(c.check(), Err(FlashAttnError::SeqlensLength { expected: B, got }) if got == n)
            );
        }
        let mut c = Case::valid();
        c.cu_q = 1;
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::SeqlensLength {
                expected: 2,
                got: 1
            })
        ));
    }

    #[test]
    fn the_pool_rules_of_decode_apply() {
        let mut c = Case::valid();
        c.k = t([PAGES, 24, HKV, D], c.k.addr);
        c.v = t([PAGES, 24, HKV, D], c.v.addr);
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::PageSize { page_size: 24, .. })
        ));
        let mut c = Case::valid();
        c.table = (B * MAX_PAGES - 1, MAX_PAGES);
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::BlockTableLength { .. })
        ));
        let mut c = Case::valid();
        c.v = t([PAGES + 1, PAGE, HKV, D], c.v.addr);
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::ShapeMismatch {
                tensor: "v_cache",
                ..
            })
        ));
    }

    #[test]
    fn packed_query_rules_apply() {
        let mut c = Case::valid();
        c.max_q = 0;
        assert!(matches!(c.check(), Err(FlashAttnError::ZeroSized { .. })));
        c.max_q = TOTAL_Q + 1;
        assert!(matches!(
            c.check(),
            Err(FlashAttnError::TooLarge {
                what: "max_seqlen_q",
                ..
            })
        ));
        let mut c = Case::valid();
        c.lse = Some(H * TOTAL_Q - 1);
        assert!(matches!(c.check(), Err(FlashAttnError::LseLength { .. })));
        let mut c = Case::valid();
        c.q = t([2, TOTAL_Q, H, D], c.q.addr);
        assert!(c.check().is_err());
    }
}

// ---------------------------------------------------------------------------
// Backward: the reference's gradients, and validation
// ---------------------------------------------------------------------------

mod backward_reference {
    use super::{forward_shape, qkv, random_vec, window};
    use flash_attn::reference;
    use flash_attn::validate::{ForwardShape, VarlenShape};
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The loss whose gradient with respect to O is `d_o`: Σ O ∘ dO.
    fn loss(
        s: &ForwardShape,
        [q, k, v]: &[Vec<f64>; 3],
        extras: &reference::Extras,
        d_o: &[f64],
    ) -> f64 {
        let o = reference::attention_ext(s, q, k, v, extras).o;
        o.iter().zip(d_o).map(|(a, b)| a * b).sum()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// `attention_backward_ext` against central differences of the
        /// forward reference at random coordinates of Q, K, V and the sinks,
        /// with masks, windows, GQA, rows that see no key, softcaps, ALiBi
        /// slopes per head or per batch entry, sinks, and V with a head dim
        /// of its own.
        #[test]
        fn reference_gradients_match_finite_differences(
            s in forward_shape(None), w in window(), seed in any::<u64>(),
            softcap in proptest::option::of(0.3f32..4.0),
            alibi in proptest::option::of(any::<bool>()),
            sinks in any::<bool>(),
            v_dims in proptest::option::of(1usize..=16),
        ) {
            let head_dim = s.head_dim.min(16);
            let v_head_dim = v_dims.map_or(0, |v| v.min(head_dim));
            let s = ForwardShape { window: w, head_dim, v_head_dim, softcap, ..s };
            let x = qkv(&s, seed);
            let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
            let d_o = random_vec(&mut rng, s.batch * s.seqlen_q * s.heads * s.v_dim());
            let slopes: Option<Vec<f64>> = alibi.map(|per_batch| {
                let n = if per_batch { s.batch * s.heads } else { s.heads };
                (0..n).map(|_| rng.random_range(0.0..0.6)).collect()
            });
            let mut sink = sinks.then(|| -> Vec<f64> {
                (0..s.heads).map(|_| rng.random_range(-2.0..2.0)).collect()
            });
            let extras = |sink: &Option<Vec<f64>>| -> (Option<Vec<f64>>, Option<Vec<f64>>) {
                (slopes.clone(), sink.clone())
            };
            let (sl, sk) = extras(&sink);
            let ext = reference::Extras { alibi_slopes: sl.as_deref(), sinks: sk.as_deref() };
            let g = reference::attention_backward_ext(&s, &x.q, &x.k, &x.v, &d_o, &ext);
            prop_assert_eq!(g.d_sinks.len(), if sinks { s.heads } else { 0 });
            let h = 1e-5;
            let close = |fd: f64, got: f64| (fd - got).abs() <= 1e-6 * (1.0 + fd.abs());
            for (which, grad) in [(0, &g.dq), (1, &g.dk), (2, &g.dv)] {
                for _ in 0..6 {
                    let mut t = [x.q.clone(), x.k.clone(), x.v.clone()];
                    let i = rng.random_range(0..t[which].len());
                    t[which][i] += h;
                    let up = loss(&s, &t, &ext, &d_o);
                    t[which][i] -= 2.0 * h;
                    let down = loss(&s, &t, &ext, &d_o);
                    let fd = (up - down) / (2.0 * h);
                    prop_assert!(
                        close(fd, grad[i]),
                        "tensor {} element {}: finite difference {} vs {}", which, i, fd, grad[i]
                    );
                }
            }
            let t = [x.q.clone(), x.k.clone(), x.v.clone()];
            for head in 0..g.d_sinks.len() {
                let mut at = |delta: f64| {
                    if let Some(v) = sink.as_mut() {
                        v[head] += delta;
                    }
                    let (sl, sk) = extras(&sink);
                    let ext = reference::Extras { alibi_slopes: sl.as_deref(), sinks: sk.as_deref() };
                    loss(&s, &t, &ext, &d_o)
                };
                let up = at(h);
                let down = at(-2.0 * h);
                at(h);
                let fd = (up - down) / (2.0 * h);
                prop_assert!(
                    close(fd, g.d_sinks[head]),
                    "sink {}: finite difference {} vs {}", head, fd, g.d_sinks[head]
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// `varlen_backward` against central differences of the packed
        /// forward reference (`reference::varlen`), with empty sequences,
        /// rows before and after every sequence, masks, softcaps, ALiBi
        /// slopes per sequence, sinks, and V with a head dim of its own.
        #[test]
        fn varlen_gradients_match_finite_differences(
            lens in proptest::collection::vec((0usize..9, 0usize..9), 1..4),
            pad in 0usize..3,
            (kv_heads, heads) in prop_oneof![Just((1usize, 1usize)), Just((1, 2)), Just((2, 2))],
            causal in any::<bool>(), w in window(), seed in any::<u64>(),
            softcap in proptest::option::of(0.3f32..4.0),
            alibi in proptest::option::of(any::<bool>()),
            sinks in any::<bool>(),
            v_head_dim in prop_oneof![Just(0usize), 1usize..=4],
        ) {
            let batch = lens.len();
            let cu = |len: fn(&(usize, usize)) -> usize| -> Vec<i32> {
                let ends = lens.iter().scan(pad, |acc, l| { *acc += len(l); Some(*acc as i32) });
                std::iter::once(pad as i32).chain(ends).collect()
            };
            let (cu_q, cu_k) = (cu(|l| l.0), cu(|l| l.1));
            let (total_q, total_k) = (cu_q[batch] as usize + pad, cu_k[batch] as usize + pad);
            let head_dim = 4;
            let shape = VarlenShape {
                batch, total_q, total_k,
                max_seqlen_q: lens.iter().map(|l| l.0).max().unwrap(),
                max_seqlen_k: lens.iter().map(|l| l.1).max().unwrap(),
                heads, kv_heads, head_dim, v_head_dim, causal,
                softmax_scale: 0.7, window: w, softcap,
            };
            let mut rng = StdRng::seed_from_u64(seed);
            let q = random_vec(&mut rng, total_q * heads * head_dim);
            let k = random_vec(&mut rng, total_k * kv_heads * head_dim);
            let v = random_vec(&mut rng, total_k * kv_heads * shape.v_dim());
            let d_o = random_vec(&mut rng, total_q * heads * shape.v_dim());
            let slopes: Option<Vec<f64>> = alibi.map(|per_batch| {
                let n = if per_batch { batch * heads } else { heads };
                (0..n).map(|_| rng.random_range(0.0..0.6)).collect()
            });
            let sink: Option<Vec<f64>> = sinks.then(|| (0..heads).map(|_| rng.random_range(-2.0..2.0)).collect());
            let ext = reference::Extras { alibi_slopes: slopes.as_deref(), sinks: sink.as_deref() };
            let g = reference::varlen_backward(&shape, &cu_q, &cu_k, &q, &k, &v, &d_o, &ext);
            let loss = |t: &[Vec<f64>; 3]| -> f64 {
                let o = reference::varlen(&shape, &cu_q, &cu_k, &t[0], &t[1], &t[2], &ext).o;
                o.iter().zip(&d_o).map(|(a, b)| a * b).sum()
            };
            let h = 1e-5;
            for (which, grad) in [(0, &g.dq), (1, &g.dk), (2, &g.dv)] {
                if grad.is_empty() {
                    continue;
                }
                for _ in 0..6 {
                    let mut t = [q.clone(), k.clone(), v.clone()];
                    let i = rng.random_range(0..t[which].len());
                    t[which][i] += h;
                    let up = loss(&t);
                    t[which][i] -= 2.0 * h;
                    let down = loss(&t);
                    let fd = (up - down) / (2.0 * h);
                    prop_assert!(
                        (fd - grad[i]).abs() <= 1e-6 * (1.0 + fd.abs()),
                        "tensor {} element {}: finite difference {} vs {}", which, i, fd, grad[i]
                    );
                }
            }
        }
    }

    /// dQ of a row that sees no key is zero (causal with more queries than
    /// keys), and so are dK and dV of a key no query sees (a window whose
    /// left side leaves the first keys behind).
    #[test]
    fn unseen_keys_and_rows_have_zero_gradients() {
        let base = ForwardShape {
            batch: 1,
            seqlen_q: 6,
            seqlen_k: 4,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            causal: true,
            softmax_scale: 0.3,
            ..Default::default()
        };
        let grads = |s: &ForwardShape| {
            let x = qkv(s, 7);
            let mut rng = StdRng::seed_from_u64(8);
            let d_o = random_vec(&mut rng, x.q.len());
            reference::attention_backward(s, &x.q, &x.k, &x.v, &d_o)
        };
        // Query i sees keys j <= i - 2: rows 0 and 1 see none, and row 2
        // one key, whose P = 1 leaves dS = P (dP - delta) = 0.
        let g = grads(&base);
        let row = 2 * 8;
        assert!(g.dq[..3 * row].iter().all(|&x| x == 0.0));
        assert!(g.dq[3 * row..].iter().all(|&x| x != 0.0));
        // Skv = Sq = 6, left = 1: query i sees keys i - 1 and i, so every
        // key is seen; with Skv = 8 query i sees keys i + 1 and i + 2, and
        // key 0 is seen by none.
        let window = flash_attn::Window {
            left: Some(1),
            right: None,
        };
        let seen = grads(&ForwardShape {
            seqlen_k: 6,
            window,
            ..base
        });
        assert!(seen.dk.iter().chain(&seen.dv).all(|&x| x != 0.0));
        let g = grads(&ForwardShape {
            seqlen_k: 8,
            window,
            ..base
        });
        assert!(g.dk[..8].iter().chain(&g.dv[..8]).all(|&x| x == 0.0));
        assert!(g.dk[8..].iter().chain(&g.dv[8..]).all(|&x| x != 0.0));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// `check_backward` passes the reference against itself, and fails
        /// one gradient value moved past its row's bound (or NaN); the
        /// bounds of a packed problem of one sequence are the fixed
        /// layout's.
        #[test]
        fn backward_bounds_bind(
            sq in 1usize..10, sk in 1usize..10,
            causal in any::<bool>(), w in window(), seed in any::<u64>(),
            softcap in proptest::option::of(0.5f32..4.0),
            sinks in any::<bool>(), which in 0usize..4, nan in any::<bool>(),
        ) {
            let (heads, kv_heads, d) = (2, 1, 4);
            let shape = ForwardShape {
                batch: 1, seqlen_q: sq, seqlen_k: sk, heads, kv_heads, head_dim: d,
                v_head_dim: 0, causal, softmax_scale: 0.7, window: w, softcap,
            };
            let mut rng = StdRng::seed_from_u64(seed);
            let q = random_vec(&mut rng, sq * heads * d);
            let k = random_vec(&mut rng, sk * kv_heads * d);
            let v = random_vec(&mut rng, sk * kv_heads * d);
            let d_o = random_vec(&mut rng, q.len());
            let sink: Vec<f64> = (0..heads).map(|_| rng.random_range(-2.0..2.0)).collect();
            let ext = reference::Extras { alibi_slopes: None, sinks: sinks.then_some(&sink[..]) };
            let model = reference::BwdErrorModel { unit: 1.0 / 2048.0, tanh_rel_err: 5e-4, lse_tol: 2e-3 };
            let want = reference::attention_backward_ext(&shape, &q, &k, &v, &d_o, &ext);
            let o = reference::attention_ext(&shape, &q, &k, &v, &ext).o;
            let bounds = reference::backward_bounds(&shape, &q, &k, &v, &d_o, &o, &ext, &model);
            prop_assert_eq!(reference::check_backward(&want, &want, &bounds, model.unit, (d, d)), Ok(()));

            let packed = VarlenShape {
                batch: 1, total_q: sq, total_k: sk, max_seqlen_q: sq, max_seqlen_k: sk,
                heads, kv_heads, head_dim: d, v_head_dim: 0, causal,
                softmax_scale: 0.7, window: w, softcap,
            };
            let (cu_q, cu_k) = ([0, sq as i32], [0, sk as i32]);
            let one = reference::varlen_backward_bounds(
                &packed, &cu_q, &cu_k, &q, &k, &v, &d_o, &o, &ext, &model,
            );
            prop_assert_eq!(&one, &bounds);

            let mut got = want.clone();
            let (values, tol, refs) = match which {
                0 => (&mut got.dq, &bounds.dq, &want.dq),
                1 => (&mut got.dk, &bounds.dk, &want.dk),
                2 => (&mut got.dv, &bounds.dv, &want.dv),
                _ if sinks => (&mut got.d_sinks, &bounds.d_sinks, &want.d_sinks),
                _ => return Ok(()),
            };
            let i = rng.random_range(0..values.len());
            let width = if which == 3 { 1 } else { d };
            let row_max = if which == 3 {
                0.0
            } else {
                refs[i / d * d..][..d].iter().fold(0f64, |m, x| m.max(x.abs()))
            };
            values[i] = if nan {
                f64::NAN
            } else {
                refs[i] + 1.5 * (tol[i / width] + model.unit * row_max + 1e-6)
            };
            prop_assert!(reference::check_backward(&got, &want, &bounds, model.unit, (d, d)).is_err());
        }
    }
}

mod backward_validation {
    use super::kvcache_validation::t;
    use flash_attn::validate::{check_backward, AttnOptions, BackwardOperands, Operands};
    use flash_attn::{FlashAttnError, Layout, BWD_HEAD_DIMS};

    fn ops(d: usize) -> BackwardOperands {
        let (q, kv) = ([2, 100, 8, d], [2, 70, 2, d]);
        BackwardOperands {
            fwd: Operands {
                q: t(q, 1 << 24),
                k: t(kv, 2 << 24),
                v: t(kv, 3 << 24),
                o: t(q, 4 << 24),
                lse_len: Some(2 * 8 * 100),
            },
            d_o: t(q, 5 << 24),
            dq: t(q, 6 << 24),
            dk: t(kv, 7 << 24),
            dv: t(kv, 8 << 24),
            d_sinks_len: None,
        }
    }

    #[test]
    fn valid_backward_passes_with_masks() {
        let opts = AttnOptions {
            causal: true,
            window: flash_attn::Window {
                left: Some(30),
                right: None,
            },
            ..Default::default()
        };
        for d in BWD_HEAD_DIMS {
            let s = check_backward(&ops(d), &opts).unwrap();
            assert_eq!(
                (s.batch, s.seqlen_q, s.seqlen_k, s.heads, s.kv_heads, s.head_dim),
                (2, 100, 70, 8, 2, d)
            );
        }
    }

    #[test]
    fn backward_refuses_what_its_kernels_lack() {
        let opts = AttnOptions::default();
        for d in [80, 160] {
            assert!(matches!(
                check_backward(&ops(d), &opts),
                Err(FlashAttnError::UnsupportedHeadDim { got, .. }) if got == d
            ));
        }
        let softcap = AttnOptions {
            softcap: Some(30.0),
            ..Default::default()
        };
        assert!(check_backward(&ops(64), &softcap).is_ok());
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let opts = AttnOptions {
                softcap: Some(bad),
                ..Default::default()
            };
            assert!(matches!(
                check_backward(&ops(64), &opts),
                Err(FlashAttnError::InvalidSoftcap(_))
            ));
        }
        // A sinks' gradient without sinks has nothing to be the gradient of.
        let mut d_sinks = ops(64);
        d_sinks.d_sinks_len = Some(8);
        assert!(matches!(
            check_backward(&d_sinks, &opts),
            Err(FlashAttnError::Unsupported {
                what: "d_sinks without sinks",
                entry: "backward"
            })
        ));
        let mut no_lse = ops(64);
        no_lse.fwd.lse_len = None;
        assert!(matches!(
            check_backward(&no_lse, &opts),
            Err(FlashAttnError::Unsupported { .. })
        ));
        let mut v_dim = ops(64);
        v_dim.fwd.v = t([2, 70, 2, 32], 3 << 24);
        v_dim.fwd.o = t([2, 100, 8, 32], 4 << 24);
        v_dim.d_o = t([2, 100, 8, 32], 5 << 24);
        v_dim.dv = t([2, 70, 2, 32], 8 << 24);
        assert!(matches!(
            check_backward(&v_dim, &opts),
            Err(FlashAttnError::Unsupported {
                what: "a V head dim of its own",
                ..
            })
        ));
        let splits = AttnOptions {
            num_splits: Some(2),
            ..Default::default()
        };
        assert!(matches!(
            check_backward(&ops(64), &splits),
            Err(FlashAttnError::Unsupported { .. })
        ));
        // ALiBi slopes, sinks and their gradient live on the device: the GPU
        // suite checks their lengths (`backward_checks_device_options`).
    }

    /// A varlen backward: packed [1, total, heads, D] tensors, cu_seqlens of
    /// one length, the bounds within the totals, and the entry's name in
    /// its refusals.
    #[test]
    fn varlen_backward_checks_its_shapes() {
        use flash_attn::validate::check_backward_varlen;
        let (q, kv) = ([1, 300, 8, 64], [1, 200, 2, 64]);
        let ops = BackwardOperands {
            fwd: Operands {
                q: t(q, 1 << 24),
                k: t(kv, 2 << 24),
                v: t(kv, 3 << 24),
                o: t(q, 4 << 24),
                lse_len: Some(8 * 300),
            },
            d_o: t(q, 5 << 24),
            dq: t(q, 6 << 24),
            dk: t(kv, 7 << 24),
            dv: t(kv, 8 << 24),
            d_sinks_len: None,
        };
        let opts = AttnOptions::default();
        let s = check_backward_varlen(&ops, (4, 4), (150, 120), &opts).unwrap();
        assert_eq!(
            (s.batch, s.seqlen_q, s.seqlen_k, s.packed, s.query_rows()),
            (3, 150, 120, Some((300, 200)), 8 * 300)
        );
        assert!(matches!(
            check_backward_varlen(&ops, (4, 3), (150, 120), &opts),
            Err(FlashAttnError::SeqlensLength { .. })
        ));
        assert!(matches!(
            check_backward_varlen(&ops, (4, 4), (301, 120), &opts),
            Err(FlashAttnError::TooLarge {
                what: "max_seqlen_q",
                ..
            })
        ));
        let mut dk = ops;
        dk.dk = t([1, 199, 2, 64], 7 << 24);
        assert!(matches!(
            check_backward_varlen(&dk, (4, 4), (150, 120), &opts),
            Err(FlashAttnError::ShapeMismatch { tensor: "dk", .. })
        ));
        let mut no_lse = ops;
        no_lse.fwd.lse_len = None;
        assert!(matches!(
            check_backward_varlen(&no_lse, (4, 4), (150, 120), &opts),
            Err(FlashAttnError::Unsupported {
                entry: "backward_varlen",
                ..
            })
        ));
        let mut short_lse = ops;
        short_lse.fwd.lse_len = Some(8 * 300 - 1);
        assert!(matches!(
            check_backward_varlen(&short_lse, (4, 4), (150, 120), &opts),
            Err(FlashAttnError::LseLength { .. })
        ));
    }

    #[test]
    fn backward_checks_every_gradient_and_d_o() {
        let opts = AttnOptions::default();
        let mut lse = ops(64);
        lse.fwd.lse_len = Some(7);
        assert!(matches!(
            check_backward(&lse, &opts),
            Err(FlashAttnError::LseLength { .. })
        ));
        for name in ["d_o", "dq", "dk", "dv"] {
            let mut o = ops(64);
            let wrong = t([2, 99, 8, 64], 9 << 24);
            match name {
                "d_o" => o.d_o = wrong,
                "dq" => o.dq = wrong,
                "dk" => o.dk = wrong,
                _ => o.dv = wrong,
            }
            assert!(
                matches!(check_backward(&o, &opts), Err(FlashAttnError::ShapeMismatch { tensor, .. }) if tensor == name),
                "{name}"
            );
        }
        // A broadcast gradient (head stride 0) would add two heads' rows into one.
        let mut o = ops(64);
        let mut layout = Layout::contiguous([2, 70, 2, 64]);
        layout.strides[2] = 0;
        o.dk.layout = layout;
        assert!(matches!(
            check_backward(&o, &opts),
            Err(FlashAttnError::OverlappingOutput { tensor: "dk" })
        ));
    }
}
