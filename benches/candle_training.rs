//! A training step's attention through candle: `cargo bench --features
//! candle --bench candle_training`.
//!
//! Each row times one forward and `backward()` of causal self-attention on
//! `Var` inputs [B, S, H, D] (K/V with Hkv heads), two ways on the same
//! candle CUDA device, in the same process: flash-attn's candle op
//! (`flash_attn::candle::flash_attn`, whose backward is flash-attn's), and
//! the attention a candle model spells out without it (candle-transformers'
//! Llama: Q·Kᵀ on the tensor cores, the causal mask added, softmax in f32,
//! P·V; K/V repeated for GQA), differentiated by candle's autograd. Both run
//! on candle's stream and are timed alike: the median over batches of
//! back-to-back steps between CUDA events, so the times include candle's
//! graph walk, allocations and casts on both sides. TFLOP/s counts the
//! step's FLOPs over the visible (query, key) pairs (3.5x the forward's
//! four per pair and head-dim element, FlashAttention's convention) on
//! both sides. "API ms" is the same step through flash-attn's own API on
//! buffers allocated once, timed alike: the difference to "ours" is the
//! candle glue and candle's gradient bookkeeping. Before timing, a row
//! checks that the two dQ agree (their
//! largest difference relative to dQ's largest value). Without a GPU it says
//! so and exits 0. `--filter SUBSTR` picks rows by label; `--quick` takes
//! fewer samples; `--json PATH` writes one JSON object per row (default
//! `target/flash-attn-candle.jsonl`), which `scripts/compare-torch-backward.py
//! --step` reads to time PyTorch's SDPA steps on the same shapes.
mod common;

use common::{random, time_median};
use std::io::Write;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use cudarc::driver::CudaStream;
use flash_attn::{
    AttnElement, AttnOptions, BackwardInputs, FlashAttention, Grads, Layout, Out, Qkv, TensorMut,
    TensorRef,
};
use half::{bf16, f16};

/// One row: (B, S, H, Hkv, D, dtype), causal, Sq = Skv = S.
#[derive(Clone, Copy, Debug)]
struct Row {
    batch: usize,
    seqlen: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
}

impl Row {
    fn label(&self) -> String {
        format!(
            "{:?} B={} S={} H={}/{} D={} causal",
            self.dtype, self.batch, self.seqlen, self.heads, self.kv_heads, self.head_dim
        )
        .to_lowercase()
    }

    /// Forward and backward FLOPs over the visible pairs.
    fn flops(&self) -> f64 {
        let s = self.seqlen as f64;
        let pairs = s * (s + 1.0) / 2.0;
        3.5 * 4.0 * (self.batch * self.heads * self.head_dim) as f64 * pairs
    }
}

fn rows() -> Vec<Row> {
    let llama = |batch, seqlen, dtype| Row {
        batch,
        seqlen,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype,
    };
    vec![
        llama(8, 1024, DType::BF16),
        llama(4, 2048, DType::BF16),
        llama(2, 4096, DType::BF16),
        llama(4, 2048, DType::F16),
        // GPT-2 small's attention.
        Row {
            batch: 8,
            seqlen: 1024,
            heads: 12,
            kv_heads: 12,
            head_dim: 64,
            dtype: DType::BF16,
        },
    ]
}

/// The attention of candle-transformers' Llama: scores in the input dtype,
/// the mask and softmax in f32, O back in the input dtype.
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, s, h, d) = q.dims4()?;
    let hkv = k.dim(2)?;
    let heads_first = |t: &Tensor| t.transpose(1, 2)?.contiguous();
    let repeat = |t: Tensor| -> Result<Tensor> {
        t.unsqueeze(2)?
            .expand((b, hkv, h / hkv, s, d))?
            .reshape((b, h, s, d))
    };
    let (q, k, v) = (
        heads_first(q)?,
        repeat(heads_first(k)?)?,
        repeat(heads_first(v)?)?,
    );
    let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
    let scores = scores.broadcast_add(mask)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.to_dtype(q.dtype())?.matmul(&v)?.transpose(1, 2)
}

/// The additive causal mask [S, S]: -inf above the diagonal.
fn causal_mask(s: usize, dev: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..s * s)
        .map(|i| {
            if i % s > i / s {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(m, (s, s), dev)
}

/// The same step through flash-attn's own API on buffers allocated once:
/// `forward` with the LSE, then `backward` (what the candle op adds to it is
/// candle's graph, the gradients' allocations and the LSE it keeps).
fn direct<T: AttnElement>(stream: &Arc<CudaStream>, r: &Row, reps: usize) -> f64 {
    let fa = FlashAttention::new(stream.context()).expect("module");
    let (b, s, h, hkv, d) = (r.batch, r.seqlen, r.heads, r.kv_heads, r.head_dim);
    let (ql, kl) = (
        Layout::contiguous([b, s, h, d]),
        Layout::contiguous([b, s, hkv, d]),
    );
    // Seeds spread by a golden-ratio multiple, as this bench drew them.
    let rand =
        |n: usize, seed: u64| random::<T>(stream, n, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let (q, k, v, d_o) = (
        rand(b * s * h * d, 1),
        rand(b * s * hkv * d, 2),
        rand(b * s * hkv * d, 3),
        rand(b * s * h * d, 4),
    );
    let alloc = |n: usize| stream.alloc_zeros::<T>(n).expect("alloc");
    let (mut o, mut dq, mut dk, mut dv) = (
        alloc(b * s * h * d),
        alloc(b * s * h * d),
        alloc(b * s * hkv * d),
        alloc(b * s * hkv * d),
    );
    let mut lse = stream.alloc_zeros::<f32>(b * h * s).expect("alloc");
    let opts = AttnOptions {
        causal: true,
        ..Default::default()
    };
    let (qr, kr, vr, dor) = (
        TensorRef::new(q.as_view(), ql),
        TensorRef::new(k.as_view(), kl),
        TensorRef::new(v.as_view(), kl),
        TensorRef::new(d_o.as_view(), ql),
    );
    let qkv = Qkv {
        q: &qr,
        k: &kr,
        v: &vr,
    };
    time_median(stream, reps, (50.0, 20), || {
        let out = Out::with_lse(TensorMut::new(o.as_view_mut(), ql), lse.as_view_mut());
        fa.forward(stream, qkv, out, &opts).expect("forward");
        let (or, lv) = (TensorRef::new(o.as_view(), ql), lse.as_view());
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
        fa.backward(stream, qkv, saved, grads, &opts)
            .expect("backward");
    })
}

/// (flash-attn ms, naive ms, dQ's largest relative difference).
fn run(dev: &Device, stream: &Arc<CudaStream>, r: &Row, reps: usize) -> Result<(f64, f64, f64)> {
    let var = |heads: usize| -> Result<Var> {
        let t = Tensor::randn(0f32, 1.0, (r.batch, r.seqlen, heads, r.head_dim), dev)?;
        Var::from_tensor(&t.to_dtype(r.dtype)?)
    };
    let (q, k, v) = (var(r.heads)?, var(r.kv_heads)?, var(r.kv_heads)?);
    let scale = 1.0 / (r.head_dim as f64).sqrt();
    let mask = causal_mask(r.seqlen, dev)?;
    let ours = || -> Result<Tensor> {
        let o = flash_attn::candle::flash_attn(&q, &k, &v, scale as f32, true)?;
        let grads = o.backward()?;
        Ok(grads.get(&q).expect("dq").clone())
    };
    let theirs = || -> Result<Tensor> {
        let o = naive(&q, &k, &v, &mask, scale)?;
        let grads = o.backward()?;
        Ok(grads.get(&q).expect("dq").clone())
    };
    let (a, b) = (
        ours()?.to_dtype(DType::F32)?,
        theirs()?.to_dtype(DType::F32)?,
    );
    let largest = b.abs()?.max_all()?.to_scalar::<f32>()?;
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let ours_ms = time_median(stream, reps, (50.0, 20), || {
        ours().expect("flash-attn step");
    });
    let naive_ms = time_median(stream, reps, (50.0, 20), || {
        theirs().expect("naive step");
    });
    Ok((ours_ms, naive_ms, (diff / largest) as f64))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let filter = value_of("--filter");
    let reps = if args.iter().any(|a| a == "--quick") {
        5
    } else {
        15
    };
    let json_path = value_of("--json").unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        format!("{dir}/flash-attn-candle.jsonl")
    });
    if flash_attn::cuda_device_count().map_err(candle_core::Error::wrap)? < 1 {
        println!("no CUDA GPU: nothing to time");
        return Ok(());
    }
    let dev = Device::new_cuda(0)?;
    let cuda = dev.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let gpu = stream.context().name().unwrap_or_default();
    if let Some(dir) = std::path::Path::new(&json_path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut json = std::fs::File::create(&json_path)?;
    println!("{gpu}: attention forward + backward through candle, median ms per step");
    println!(
        "{:<40} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "row", "ours ms", "TFLOP/s", "API ms", "naive ms", "TFLOP/s", "speedup", "dQ diff"
    );
    for r in rows() {
        if filter.as_deref().is_some_and(|f| !r.label().contains(f)) {
            continue;
        }
        let (ours, naive, diff) = run(&dev, &stream, &r, reps)?;
        let api = match r.dtype {
            DType::F16 => direct::<f16>(&stream, &r, reps),
            _ => direct::<bf16>(&stream, &r, reps),
        };
        let tflops = |ms: f64| r.flops() / (ms * 1e-3) / 1e12;
        println!(
            "{:<40} {:>9.3} {:>9.1} {:>9.3} {:>9.3} {:>9.1} {:>7.2}x {:>9.1e}",
            r.label(),
            ours,
            tflops(ours),
            api,
            naive,
            tflops(naive),
            naive / ours,
            diff
        );
        writeln!(
            json,
            "{{\"label\":\"{}\",\"dtype\":\"{}\",\"causal\":true,\"batch\":{},\"seqlen\":{},\"heads\":{},\"kv_heads\":{},\"head_dim\":{},\"ours_ms\":{},\"api_ms\":{},\"naive_ms\":{},\"dq_rel_diff\":{},\"gpu\":\"{}\"}}",
            r.label(),
            if r.dtype == DType::F16 { "f16" } else { "bf16" },
            r.batch,
            r.seqlen,
            r.heads,
            r.kv_heads,
            r.head_dim,
            ours,
            api,
            naive,
            diff,
            gpu
        )?;
    }
    Ok(())
}
