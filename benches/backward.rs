//! The backward pass's speed: `cargo bench --bench backward`.
//!
//! Each row times `FlashAttention::backward` (its three launches and its two
//! workspace allocations, as a training step runs it) on random inputs,
//! after the forward that makes O and the LSE: the median over batches of
//! back-to-back calls timed with CUDA events. TFLOP/s counts the backward's
//! five GEMMs over the visible (query, key) pairs: 2.5x the forward's four
//! FLOPs per pair and head-dim element, FlashAttention's convention. Prints
//! a table and writes one JSON object per row to `--json PATH` (default
//! `target/flash-attn-backward.jsonl`), which `scripts/compare-torch-backward.py`
//! reads to time PyTorch's SDPA backends on the same shapes. Without a GPU
//! it says so and exits 0. `--filter SUBSTR` picks rows by label; `--quick`
//! takes fewer samples; `--head-splits N` forces how each KV head's query
//! heads split across CTAs (`FlashAttention::set_backward_head_splits`).
//! Rows with a score option (softcap 50, ALiBi slopes,
//! sinks with their gradient) time what it costs over the plain row of the
//! same shape; the PyTorch script skips them (SDPA has no such options).
mod common;

use common::{random, time_median};
use std::io::Write;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use flash_attn::{
    AlibiSlopes, AttnElement, AttnOptions, BackwardInputs, Dtype, FlashAttention, Grads, Layout,
    Out, Qkv, TensorMut, TensorRef, Varlen,
};
use half::{bf16, f16};

/// The score option of a row.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Score {
    Plain,
    /// Gemma 2's softcap of 50.
    Softcap,
    /// Bloom's slopes, 2^(-8 (h + 1) / H).
    Alibi,
    /// gpt-oss's sinks, with their gradient.
    Sinks,
}

impl Score {
    fn name(self) -> &'static str {
        match self {
            Score::Plain => "plain",
            Score::Softcap => "softcap",
            Score::Alibi => "alibi",
            Score::Sinks => "sinks",
        }
    }
}

/// One benchmark row: (B, S, H, Hkv, D, causal, dtype, score); Sq = Skv = S.
#[derive(Clone, Copy, Debug)]
struct Row {
    batch: usize,
    seqlen: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    dtype: Dtype,
    score: Score,
    /// Packed sequences of [`varlen_lens`] (`backward_varlen`) in place of
    /// `batch` x `seqlen`, which then only name the row.
    varlen: bool,
}

/// 16 sequence lengths in 64..=2048 from a fixed xorshift stream, summing
/// to 16k tokens within rounding: the varlen rows' batch.
fn varlen_lens() -> Vec<usize> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let raw: Vec<f64> = (0..16)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            64.0 + (x >> 11) as f64 / (1u64 << 53) as f64 * (2048.0 - 64.0)
        })
        .collect();
    let scale = 16384.0 / raw.iter().sum::<f64>();
    raw.iter()
        .map(|l| ((l * scale).round() as usize).clamp(64, 2048))
        .collect()
}

impl Row {
    fn label(&self) -> String {
        if self.varlen {
            return format!(
                "backward {} varlen 16 seqs 64..2048 (16k tokens) H={}/{} D={}{}",
                self.dtype.name(),
                self.heads,
                self.kv_heads,
                self.head_dim,
                if self.causal { " causal" } else { "" }
            );
        }
        format!(
            "backward {} B={} S={} H={}/{} D={}{}{}",
            self.dtype.name(),
            self.batch,
            self.seqlen,
            self.heads,
            self.kv_heads,
            self.head_dim,
            if self.causal { " causal" } else { "" },
            match self.score {
                Score::Plain => String::new(),
                s => format!(" {}", s.name()),
            }
        )
    }

    /// FLOPs of the five GEMMs over the visible pairs.
    fn flops(&self) -> f64 {
        let pairs = |s: f64| {
            if self.causal {
                s * (s + 1.0) / 2.0
            } else {
                s * s
            }
        };
        let pairs = if self.varlen {
            varlen_lens().iter().map(|&s| pairs(s as f64)).sum()
        } else {
            self.batch as f64 * pairs(self.seqlen as f64)
        };
        2.5 * 4.0 * (self.heads * self.head_dim) as f64 * pairs
    }
}

/// 16k tokens per batch at every head dim, causal and not, plus GQA rows,
/// the score options at D = 64 and 128, 4k causal, and packed sequences of
/// mean length 1k (`varlen_lens`) beside B = 16 x 1k at D = 128.
fn rows() -> Vec<Row> {
    let mut v = Vec::new();
    for dtype in [Dtype::F16, Dtype::Bf16] {
        for head_dim in flash_attn::BWD_HEAD_DIMS {
            for seqlen in [1024, 4096] {
                for causal in [false, true] {
                    let heads = 2048 / head_dim;
                    v.push(Row {
                        batch: 16384 / seqlen,
                        seqlen,
                        heads,
                        kv_heads: heads,
                        head_dim,
                        causal,
                        dtype,
                        score: Score::Plain,
                        varlen: false,
                    });
                }
            }
        }
        for head_dim in [64, 128] {
            for score in [Score::Softcap, Score::Alibi, Score::Sinks] {
                v.push(Row {
                    batch: 4,
                    seqlen: 4096,
                    heads: 2048 / head_dim,
                    kv_heads: 2048 / head_dim,
                    head_dim,
                    causal: true,
                    dtype,
                    score,
                    varlen: false,
                });
            }
        }
        // Llama-3-8B's attention (GQA 32/8, D = 128): a 4k prompt, and
        // training batches of 8k tokens.
        for (batch, seqlen) in [(1, 4096), (2, 4096), (8, 1024)] {
            v.push(Row {
                batch,
                seqlen,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                causal: true,
                dtype,
                score: Score::Plain,
                varlen: false,
            });
        }
        for causal in [false, true] {
            v.push(Row {
                batch: 16,
                seqlen: 1024,
                heads: 16,
                kv_heads: 16,
                head_dim: 128,
                causal,
                dtype,
                score: Score::Plain,
                varlen: true,
            });
        }
    }
    v
}

fn run<T: AttnElement>(fa: &FlashAttention, stream: &Arc<CudaStream>, r: &Row, reps: usize) -> f64 {
    let (h, hkv, d) = (r.heads, r.kv_heads, r.head_dim);
    let lens = varlen_lens();
    let total: usize = lens.iter().sum();
    // Packed rows are a batch of one of `total` tokens.
    let (b, s) = if r.varlen {
        (1, total)
    } else {
        (r.batch, r.seqlen)
    };
    let (ql, kl) = if r.varlen {
        (Layout::packed([s, h, d]), Layout::packed([s, hkv, d]))
    } else {
        (
            Layout::contiguous([b, s, h, d]),
            Layout::contiguous([b, s, hkv, d]),
        )
    };
    let cu: Vec<i32> = std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &l| {
            *acc += l as i32;
            Some(*acc)
        }))
        .collect();
    let cu = stream.clone_htod(&cu).expect("upload");
    let cu = cu.as_view();
    let max = *lens.iter().max().expect("16 lengths");
    let seqs = Varlen {
        cu_seqlens_q: &cu,
        cu_seqlens_k: &cu,
        max_seqlen_q: max,
        max_seqlen_k: max,
    };
    let (q, k, v) = (
        random::<T>(stream, b * s * h * d, 1),
        random::<T>(stream, b * s * hkv * d, 2),
        random::<T>(stream, b * s * hkv * d, 3),
    );
    let d_o = random::<T>(stream, b * s * h * d, 4);
    let mut o = stream.alloc_zeros::<T>(b * s * h * d).expect("alloc");
    let mut lse = stream.alloc_zeros::<f32>(b * h * s).expect("alloc");
    let mut dq = stream.alloc_zeros::<T>(b * s * h * d).expect("alloc");
    let mut dk = stream.alloc_zeros::<T>(b * s * hkv * d).expect("alloc");
    let mut dv = stream.alloc_zeros::<T>(b * s * hkv * d).expect("alloc");
    let slopes: Vec<f32> = (0..h)
        .map(|i| (-8.0 * (i + 1) as f32 / h as f32).exp2())
        .collect();
    let slopes = stream.clone_htod(&slopes).expect("upload");
    let sinks = stream.clone_htod(&vec![0.5f32; h]).expect("upload");
    let mut d_sinks = stream.alloc_zeros::<f32>(h).expect("alloc");
    let (slopes, sinks) = (slopes.as_view(), sinks.as_view());
    let opts = AttnOptions {
        causal: r.causal,
        softcap: (r.score == Score::Softcap).then_some(50.0),
        alibi_slopes: (r.score == Score::Alibi).then_some(AlibiSlopes::PerHead(&slopes)),
        sinks: (r.score == Score::Sinks).then_some(&sinks),
        ..Default::default()
    };
    let (qr, kr, vr) = (
        TensorRef::new(q.as_view(), ql),
        TensorRef::new(k.as_view(), kl),
        TensorRef::new(v.as_view(), kl),
    );
    let qkv = Qkv {
        q: &qr,
        k: &kr,
        v: &vr,
    };
    let out = Out::with_lse(TensorMut::new(o.as_view_mut(), ql), lse.as_view_mut());
    if r.varlen {
        fa.forward_varlen(stream, qkv, out, &seqs, &opts)
    } else {
        fa.forward(stream, qkv, out, &opts)
    }
    .expect("forward");
    let (or, dor, lv) = (
        TensorRef::new(o.as_view(), ql),
        TensorRef::new(d_o.as_view(), ql),
        lse.as_view(),
    );
    time_median(stream, reps, (20.0, 50), || {
        let saved = BackwardInputs {
            o: &or,
            lse: &lv,
            d_o: &dor,
        };
        let grads = Grads::new(
            TensorMut::new(dq.as_view_mut(), ql),
            TensorMut::new(dk.as_view_mut(), kl),
            TensorMut::new(dv.as_view_mut(), kl),
        );
        let grads = if r.score == Score::Sinks {
            grads.with_sinks(d_sinks.as_view_mut())
        } else {
            grads
        };
        if r.varlen {
            fa.backward_varlen(stream, qkv, saved, grads, &seqs, &opts)
        } else {
            fa.backward(stream, qkv, saved, grads, &opts)
        }
        .expect("backward")
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let filter = value_of("--filter");
    let reps = if args.iter().any(|a| a == "--quick") {
        7
    } else {
        21
    };
    let json_path = value_of("--json").unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        format!("{dir}/flash-attn-backward.jsonl")
    });
    if flash_attn::cuda_device_count().expect("the CUDA driver is present but fails") < 1 {
        println!("no CUDA GPU: nothing to time");
        return;
    }
    let ctx = CudaContext::new(0).expect("context");
    let stream = ctx.default_stream();
    let fa = FlashAttention::new(&ctx).expect("module");
    if let Some(n) = value_of("--head-splits") {
        fa.set_backward_head_splits(Some(n.parse().expect("--head-splits takes a count")));
    }
    let gpu = ctx.name().unwrap_or_default();
    if let Some(dir) = std::path::Path::new(&json_path).parent() {
        std::fs::create_dir_all(dir).expect("the JSON file's folder");
    }
    let mut json = std::fs::File::create(&json_path).expect("json file");
    println!("{gpu}: backward, median ms of CUDA-event-timed batches");
    println!("{:<48} {:>10} {:>9}", "row", "ms", "TFLOP/s");
    for r in rows() {
        if filter.as_deref().is_some_and(|f| !r.label().contains(f)) {
            continue;
        }
        let ms = match r.dtype {
            Dtype::F16 => run::<f16>(&fa, &stream, &r, reps),
            _ => run::<bf16>(&fa, &stream, &r, reps),
        };
        let tflops = r.flops() / (ms * 1e-3) / 1e12;
        println!("{:<48} {:>10.4} {:>9.1}", r.label(), ms, tflops);
        writeln!(
            json,
            "{{\"label\":\"{}\",\"dtype\":\"{}\",\"batch\":{},\"seqlen\":{},\"heads\":{},\"kv_heads\":{},\"head_dim\":{},\"causal\":{},\"score\":\"{}\",\"varlen\":{},\"median_ms\":{},\"tflops\":{},\"gpu\":\"{}\"}}",
            r.label(),
            r.dtype.name(),
            r.batch,
            r.seqlen,
            r.heads,
            r.kv_heads,
            r.head_dim,
            r.causal,
            r.score.name(),
            r.varlen,
            ms,
            tflops,
            gpu
        )
        .expect("json line");
    }
}
