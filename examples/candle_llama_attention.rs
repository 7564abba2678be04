//! A Llama-style attention block in candle running on flash-attn's kernels:
//! Q/K/V projections, RoPE, grouped-query attention, a causal prefill of the
//! prompt and then decode steps against a KV cache that the kernel appends
//! to in place. Every attention output is checked against candle's own
//! naive `softmax(q·kᵀ/√d + mask)·v` in f32.
//!
//! `cargo run --release --features candle --example candle_llama_attention`
//! (an NVIDIA GPU, sm_80+; building the `candle` feature needs nvcc:
//! `eval "$(scripts/setup-candle-cuda.sh)"` installs one from PyPI).
use candle_core::{DType, Device, Result, Tensor, D};
use flash_attn::candle::{flash_attn, flash_attn_with_kvcache, AttnArgs};

/// Llama-3-8B's attention geometry, fewer layers' worth of nothing else.
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const HIDDEN: usize = HEADS * HEAD_DIM;
const ROPE_THETA: f32 = 500_000.0;
/// bf16 rounds at 2^-8 relative; outputs are averages of values of magnitude
/// about 1, so a few units of that bound the difference from f32.
const TOLERANCE: f32 = 4.0 / 256.0;

struct Attention {
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
}

impl Attention {
    fn random(dev: &Device) -> Result<Attention> {
        let w = |rows: usize| -> Result<Tensor> {
            (Tensor::randn(0f32, 1.0, (rows, HIDDEN), dev)? / (HIDDEN as f64).sqrt())?
                .to_dtype(DType::BF16)
        };
        Ok(Attention {
            wq: w(HEADS * HEAD_DIM)?,
            wk: w(KV_HEADS * HEAD_DIM)?,
            wv: w(KV_HEADS * HEAD_DIM)?,
            wo: w(HIDDEN)?,
        })
    }

    /// Q [b, s, H, D] and K, V [b, s, Hkv, D] of tokens at positions `pos..`.
    fn qkv(&self, x: &Tensor, pos: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, s, _) = x.dims3()?;
        let proj = |w: &Tensor, heads: usize| {
            x.broadcast_matmul(&w.t()?)?
                .reshape((b, s, heads, HEAD_DIM))
        };
        let q = rope(&proj(&self.wq, HEADS)?, pos)?;
        let k = rope(&proj(&self.wk, KV_HEADS)?, pos)?;
        Ok((q, k, proj(&self.wv, KV_HEADS)?))
    }

    fn out(&self, o: &Tensor) -> Result<Tensor> {
        let (b, s, _, _) = o.dims4()?;
        o.reshape((b, s, HIDDEN))?.broadcast_matmul(&self.wo.t()?)
    }
}

/// Rotary embedding (rotate-half form) of x [b, s, h, D] at positions `pos..`.
fn rope(x: &Tensor, pos: usize) -> Result<Tensor> {
    let (_, s, _, d) = x.dims4()?;
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| ROPE_THETA.powf(-2.0 * i as f32 / d as f32))
        .collect();
    let inv_freq = Tensor::from_vec(inv_freq, (1, d / 2), x.device())?;
    let t = Tensor::arange(pos as u32, (pos + s) as u32, x.device())?
        .to_dtype(DType::F32)?
        .reshape((s, 1))?;
    let angles = t.matmul(&inv_freq)?; // [s, D/2]
    let (cos, sin) = (
        Tensor::cat(&[&angles.cos()?, &angles.cos()?], D::Minus1)?.reshape((1, s, 1, d))?,
        Tensor::cat(&[&angles.sin()?, &angles.sin()?], D::Minus1)?.reshape((1, s, 1, d))?,
    );
    let xf = x.to_dtype(DType::F32)?;
    let (x1, x2) = (
        xf.narrow(D::Minus1, 0, d / 2)?,
        xf.narrow(D::Minus1, d / 2, d / 2)?,
    );
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    (xf.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.to_dtype(x.dtype())
}

/// candle's naive causal GQA attention in f32: q [b, sq, H, D] over the
/// last keys of k, v [b, sk, Hkv, D] (bottom-right aligned).
fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let heads_first = |t: &Tensor| t.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous();
    let repeat = |t: Tensor| -> Result<Tensor> {
        t.unsqueeze(2)?
            .expand((b, hkv, h / hkv, sk, d))?
            .reshape((b, h, sk, d))
    };
    let (q, k, v) = (
        heads_first(q)?,
        repeat(heads_first(k)?)?,
        repeat(heads_first(v)?)?,
    );
    let scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
    let mask: Vec<f32> = (0..sq)
        .flat_map(|i| {
            (0..sk).map(move |j| {
                if j <= i + sk - sq {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let scores = scores.broadcast_add(&Tensor::from_vec(mask, (sq, sk), q.device())?)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()
}

fn main() -> Result<()> {
    if flash_attn::cuda_device_count().map_err(candle_core::Error::wrap)? < 1 {
        println!("no CUDA device found; nothing to run");
        return Ok(());
    }
    let dev = Device::new_cuda(0)?;
    let (batch, prompt, steps, capacity) = (2, 333, 8, 512);
    let attn = Attention::random(&dev)?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let mut worst = 0f32;

    // Prefill: causal attention over the prompt.
    let x = Tensor::randn(0f32, 1.0, (batch, prompt, HIDDEN), &dev)?.to_dtype(DType::BF16)?;
    let (q, k, v) = attn.qkv(&x, 0)?;
    let o = flash_attn(&q, &k, &v, scale, true)?;
    let diff = max_diff(&o, &naive_attention(&q, &k, &v)?)?;
    println!("prefill  {batch} x {prompt} tokens, GQA {HEADS}/{KV_HEADS}: max |flash - naive| = {diff:.2e}");
    worst = worst.max(diff);
    let _hidden = attn.out(&o)?;

    // The KV cache: [batch, capacity, Hkv, D], the prompt's K/V at the front.
    let k_cache = Tensor::zeros((batch, capacity, KV_HEADS, HEAD_DIM), DType::BF16, &dev)?;
    let v_cache = Tensor::zeros((batch, capacity, KV_HEADS, HEAD_DIM), DType::BF16, &dev)?;
    k_cache.slice_set(&k, 1, 0)?;
    v_cache.slice_set(&v, 1, 0)?;
    let (mut k_all, mut v_all) = (k, v);

    // Decode: each step appends its token's K/V in the kernel and attends to
    // the whole cache.
    let args = AttnArgs {
        softmax_scale: Some(scale),
        causal: true,
        ..Default::default()
    };
    for step in 0..steps {
        let pos = prompt + step;
        let x = Tensor::randn(0f32, 1.0, (batch, 1, HIDDEN), &dev)?.to_dtype(DType::BF16)?;
        let (q, k, v) = attn.qkv(&x, pos)?;
        let seqlens = Tensor::from_vec(vec![pos as u32; batch], batch, &dev)?;
        let (o, _lse) = flash_attn_with_kvcache(
            &q,
            &k_cache,
            &v_cache,
            &seqlens,
            None,
            Some(&k),
            Some(&v),
            &args,
        )?;
        k_all = Tensor::cat(&[&k_all, &k], 1)?;
        v_all = Tensor::cat(&[&v_all, &v], 1)?;
        let diff = max_diff(&o, &naive_attention(&q, &k_all, &v_all)?)?;
        let cached = max_diff(&k_cache.narrow(1, 0, pos + 1)?, &k_all)?;
        println!("decode step {step}: {} cached tokens, max |flash - naive| = {diff:.2e}, cache vs history {cached:.1e}", pos + 1);
        worst = worst.max(diff).max(cached);
        let _hidden = attn.out(&o)?;
    }
    if worst > TOLERANCE {
        candle_core::bail!(
            "flash-attn differs from candle's naive attention by {worst:.2e} (> {TOLERANCE:.2e})"
        );
    }
    println!("ok: flash-attn matches candle's naive attention within {TOLERANCE:.2e} (worst {worst:.2e})");
    Ok(())
}
