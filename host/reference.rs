//! Naive host attention, the oracle for the kernels' tests and for users who
//! want to check results. It materialises every score and probability and
//! accumulates in f64, trading speed for being obviously correct: keep it
//! free of any of the kernels' tricks (tiling, online softmax, splits).
use crate::validate::{DecodeShape, ForwardShape};

/// Output of the reference: `o` is [batch, seqlen_q, heads, head_dim] row-major,
/// `lse` is [batch, heads, seqlen_q] (natural log).
#[derive(Clone, Debug, PartialEq)]
pub struct RefOutput {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

/// One (query, key/value) problem, shared by forward and decode so the loop
/// nest exists once. K and V hold `kv_rows` rows per batch entry, of which a
/// batch entry may use only a prefix (decode's `cache_seqlens`).
struct Problem<'a> {
    batch: usize,
    seqlen_q: usize,
    kv_rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    scale: f64,
    q: &'a [f64],
    k: &'a [f64],
}

/// Softmax of one query row over the keys it uses.
struct Row {
    /// Probabilities of the visible keys, which are always a prefix `0..p.len()`
    /// of the keys in use.
    p: Vec<f64>,
    /// Natural-log sum of exp(scores) over visible keys; -inf when none is.
    lse: f64,
}

impl Problem<'_> {
    fn check_len(&self, name: &str, got: usize, rows: usize, heads: usize) {
        let needed = self.batch * rows * heads * self.head_dim;
        assert!(
            got >= needed,
            "reference: {name} has {got} elements, the shape needs {needed}"
        );
    }

    fn q_row(&self, b: usize, i: usize, h: usize) -> &[f64] {
        let start = ((b * self.seqlen_q + i) * self.heads + h) * self.head_dim;
        &self.q[start..start + self.head_dim]
    }

    /// Row `j` of K or V for query head `h`: MQA/GQA maps consecutive groups of
    /// `heads / kv_heads` query heads onto one KV head.
    fn kv_row<'t>(&self, t: &'t [f64], b: usize, j: usize, h: usize) -> &'t [f64] {
        let kv_head = h / (self.heads / self.kv_heads);
        let start = ((b * self.kv_rows + j) * self.kv_heads + kv_head) * self.head_dim;
        &t[start..start + self.head_dim]
    }

    /// Keys `0..visible` are what query `i` sees among the `n_keys` in use: the
    /// causal mask is aligned to the bottom-right (the last query sees the last
    /// key), so `j <= i + n_keys - seqlen_q`, computed signed because the bound
    /// is negative when there are more queries than keys.
    fn visible(&self, i: usize, n_keys: usize) -> usize {
        if !self.causal {
            return n_keys;
        }
        let last = i as i128 + n_keys as i128 - self.seqlen_q as i128;
        (last + 1).clamp(0, n_keys as i128) as usize
    }

    fn row(&self, b: usize, i: usize, h: usize, n_keys: usize) -> Row {
        let visible = self.visible(i, n_keys);
        let q = self.q_row(b, i, h);
        let scores: Vec<f64> = (0..visible)
            .map(|j| {
                let k = self.kv_row(self.k, b, j, h);
                self.scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()
            })
            .collect();
        if visible == 0 {
            return Row {
                p: Vec::new(),
                lse: f64::NEG_INFINITY,
            };
        }
        // Subtracting the maximum keeps exp() from overflowing.
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        let p = scores.iter().map(|s| (s - max).exp() / sum).collect();
        Row {
            p,
            lse: max + sum.ln(),
        }
    }

    /// O and LSE, where batch entry `b` uses the first `n_keys(b)` rows of K/V.
    fn attend(&self, v: &[f64], n_keys: impl Fn(usize) -> usize) -> RefOutput {
        let (sq, h_n, d) = (self.seqlen_q, self.heads, self.head_dim);
        let mut o = vec![0.0; self.batch * sq * h_n * d];
        let mut lse = vec![0.0; self.batch * h_n * sq];
        for b in 0..self.batch {
            let n = n_keys(b);
            for h in 0..h_n {
                for i in 0..sq {
                    let row = self.row(b, i, h, n);
                    lse[(b * h_n + h) * sq + i] = row.lse;
                    let out_start = ((b * sq + i) * h_n + h) * d;
                    let out = &mut o[out_start..out_start + d];
                    // Only visible keys contribute, so whatever lies behind the
                    // mask (even a non-finite value) cannot reach the output.
                    for (j, &pj) in row.p.iter().enumerate() {
                        for (oc, vc) in out.iter_mut().zip(self.kv_row(v, b, j, h)) {
                            *oc += pj * vc;
                        }
                    }
                }
            }
        }
        RefOutput { o, lse }
    }
}

fn forward_problem<'a>(shape: &ForwardShape, q: &'a [f64], k: &'a [f64]) -> Problem<'a> {
    let p = Problem {
        batch: shape.batch,
        seqlen_q: shape.seqlen_q,
        kv_rows: shape.seqlen_k,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        causal: shape.causal,
        scale: f64::from(shape.softmax_scale),
        q,
        k,
    };
    p.check_len("q", q.len(), p.seqlen_q, p.heads);
    p.check_len("k", k.len(), p.kv_rows, p.kv_heads);
    p
}

/// Attention of `q` over `k`/`v`. q: [B, Sq, H, D], k/v: [B, Skv, Hkv, D], all
/// contiguous row-major f64.
///
/// Panics if a slice is shorter than `shape` requires.
pub fn attention(shape: &ForwardShape, q: &[f64], k: &[f64], v: &[f64]) -> RefOutput {
    let p = forward_problem(shape, q, k);
    p.check_len("v", v.len(), p.kv_rows, p.kv_heads);
    p.attend(v, |_| shape.seqlen_k)
}

/// Softmax probabilities P as [B, H, Sq, Skv] row-major (masked entries 0; a row
/// with no visible key is all 0).
///
/// Panics if a slice is shorter than `shape` requires.
pub fn probabilities(shape: &ForwardShape, q: &[f64], k: &[f64]) -> Vec<f64> {
    let p = forward_problem(shape, q, k);
    let mut out = Vec::with_capacity(p.batch * p.heads * p.seqlen_q * p.kv_rows);
    for b in 0..p.batch {
        for h in 0..p.heads {
            for i in 0..p.seqlen_q {
                let row = p.row(b, i, h, p.kv_rows).p;
                let masked = p.kv_rows - row.len();
                out.extend(row);
                out.extend(std::iter::repeat_n(0.0, masked));
            }
        }
    }
    out
}

/// Decode: q [B, Sq, H, D]; k_cache/v_cache [B, cache_len, Hkv, D]; sequence `b`
/// uses the first `clamp(cache_seqlens[b], 0, cache_len)` keys, the same clamp
/// the kernel applies; causal (if `shape.causal`) aligned bottom-right within
/// those keys.
///
/// Panics if a slice is shorter than `shape` requires.
pub fn decode(
    shape: &DecodeShape,
    q: &[f64],
    k_cache: &[f64],
    v_cache: &[f64],
    cache_seqlens: &[i32],
) -> RefOutput {
    let p = Problem {
        batch: shape.batch,
        seqlen_q: shape.seqlen_q,
        kv_rows: shape.cache_len,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        causal: shape.causal,
        scale: f64::from(shape.softmax_scale),
        q,
        k: k_cache,
    };
    p.check_len("q", q.len(), p.seqlen_q, p.heads);
    p.check_len("k_cache", k_cache.len(), p.kv_rows, p.kv_heads);
    p.check_len("v_cache", v_cache.len(), p.kv_rows, p.kv_heads);
    assert!(
        cache_seqlens.len() >= p.batch,
        "reference: cache_seqlens has {} entries, the batch is {}",
        cache_seqlens.len(),
        p.batch
    );
    let cache_len = shape.cache_len;
    p.attend(v_cache, |b| {
        usize::try_from(cache_seqlens[b]).map_or(0, |n| n.min(cache_len))
    })
}
