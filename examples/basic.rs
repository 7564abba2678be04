//! Forward and decode on random data, checked against the f64 reference.
//! `cargo run --release --example basic` (needs an NVIDIA GPU, sm_80+).
//! Prints the time to load the kernels and of the first launch (inputs
//! already on the device), which `CUDA_CACHE_DISABLE=1` shows without the
//! driver's cache.
use cudarc::driver::CudaContext;
use flash_attn::validate::ForwardShape;
use flash_attn::{reference, AttnOptions, FlashAttention, Layout, Out, Qkv, TensorMut, TensorRef};
use half::f16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if flash_attn::cuda_device_count()? < 1 {
        println!("no CUDA device found; nothing to run");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let load = std::time::Instant::now();
    let fa = FlashAttention::new(&ctx)?;
    let load_ms = load.elapsed().as_secs_f64() * 1e3;

    let (b, s, h, hkv, d) = (2, 777, 8, 2, 128);
    let q_layout = Layout::contiguous([b, s, h, d]);
    let kv_layout = Layout::contiguous([b, s, hkv, d]);
    let mut seed = 1u64;
    let mut rand = |n: usize| -> Vec<f16> {
        (0..n)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                f16::from_f64((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)
            })
            .collect()
    };
    let (q, k, v) = (
        rand(b * s * h * d),
        rand(b * s * hkv * d),
        rand(b * s * hkv * d),
    );
    let (q_dev, k_dev, v_dev) = (
        stream.clone_htod(&q)?,
        stream.clone_htod(&k)?,
        stream.clone_htod(&v)?,
    );
    let mut o_dev = stream.alloc_zeros::<f16>(q.len())?;
    let opts = AttnOptions {
        causal: true,
        softmax_scale: None,
        ..Default::default()
    };
    stream.synchronize()?;
    let first = std::time::Instant::now();
    fa.forward(
        &stream,
        Qkv {
            q: &TensorRef::new(q_dev.as_view(), q_layout),
            k: &TensorRef::new(k_dev.as_view(), kv_layout),
            v: &TensorRef::new(v_dev.as_view(), kv_layout),
        },
        Out::new(TensorMut::new(o_dev.as_view_mut(), q_layout)),
        &opts,
    )?;
    stream.synchronize()?;
    let first_ms = first.elapsed().as_secs_f64() * 1e3;
    println!(
        "FlashAttention::new {load_ms:.1} ms ({:?}), first forward launch to completion {first_ms:.1} ms",
        fa.loaded_code()
    );
    let o = stream.clone_dtoh(&o_dev)?;

    let f = |x: &[f16]| x.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
    let shape = ForwardShape {
        batch: b,
        seqlen_q: s,
        seqlen_k: s,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        causal: true,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        ..Default::default()
    };
    let want = reference::attention(&shape, &f(&q), &f(&k), &f(&v));
    let max_err = o
        .iter()
        .zip(&want.o)
        .map(|(g, w)| (g.to_f64() - w).abs())
        .fold(0.0, f64::max);
    println!(
        "causal GQA forward B={b} S={s} H={h}/{hkv} D={d}: max |O - reference| = {max_err:.2e}"
    );
    Ok(())
}
