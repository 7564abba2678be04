//! The candle integration (`--features candle`): every function of
//! `flash_attn::candle` on a candle CUDA device, f16, bf16 and f32, against
//! candle's own naive `softmax(q·kᵀ)·v` (in f32) and against flash-attn's f64
//! reference, with non-contiguous inputs (a transposed Q, K/V sliced out of
//! wider tensors). Without a GPU the GPU trials are ignored; the CPU trials
//! (errors on CPU tensors, argument checks) always run. On the sm_75 module
//! (Turing, or `FLASH_ATTN_MODULE=sm_75`) the bf16 trials are ignored and
//! `gpu_bf16_refused_without_sm80` checks that bf16 is refused there.
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, IndexOp, Tensor, Var, D};
use flash_attn::candle as fa;
use flash_attn::candle::AttnArgs;
use flash_attn::reference::{self, BwdErrorModel, Extras, RefGrads};
use flash_attn::validate::{DecodeShape, ForwardShape, VarlenShape};
use flash_attn::{Dtype, FlashAttention, Window};
use half::{bf16, f16};
use libtest_mimic::{Arguments, Failed, Trial};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type R<T> = Result<T, Failed>;

fn c<T>(r: candle_core::Result<T>) -> R<T> {
    r.map_err(|e| Failed::from(format!("candle: {e}")))
}

/// Device 0, or `None` where no driver or no GPU is present. A driver that
/// is present but fails is a failure, not a skip.
fn open_gpu() -> Option<Device> {
    match flash_attn::cuda_device_count().expect("the CUDA driver is present but fails") {
        0 => None,
        _ => Some(Device::new_cuda(0).expect("a GPU is present, so it must open")),
    }
}

/// Largest |O - O_ref| for outputs of magnitude <= 1: a few units in the
/// last place of the output type (as the core GPU suite).
fn abs_tol(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 4.0 / 2048.0,
        // f32 is rounded to f16 inside the kernels (tests/gpu.rs).
        DType::F32 => 8.0 / 2048.0,
        _ => 4.0 / 256.0,
    }
}
const LSE_TOL: f64 = 2e-3;

fn host_f64(t: &Tensor) -> R<Vec<f64>> {
    let v = c(c(c(t.contiguous())?.to_dtype(DType::F32))?.flatten_all())?;
    Ok(c(v.to_vec1::<f32>())?.into_iter().map(f64::from).collect())
}

/// Row by row (each run of `d` values): every element within `abs_tol`.
fn check_rows(got: &[f64], want: &[f64], d: usize, tol: f64, what: &str) -> R<()> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()).into());
    }
    for (row, (g, w)) in got.chunks(d).zip(want.chunks(d)).enumerate() {
        for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
            if !g.is_finite() || (g - w).abs() > tol {
                return Err(format!(
                    "{what}: row {row} elem {i}: got {g}, want {w} (tol {tol:.1e})"
                )
                .into());
            }
        }
    }
    Ok(())
}

fn check_lse(got: &[f64], want: &[f64], what: &str) -> R<()> {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY {
            g == f64::NEG_INFINITY
        } else {
            (g - w).abs() <= LSE_TOL
        };
        if !ok {
            return Err(format!("{what}: lse[{i}] = {g}, want {w}").into());
        }
    }
    Ok(())
}

/// A random [b, s, h, d] tensor of `dtype` that is not contiguous: built as
/// [b, h, s, d] and transposed.
fn transposed(
    rng: &mut StdRng,
    (b, s, h, d): (usize, usize, usize, usize),
    dtype: DType,
    dev: &Device,
) -> R<Tensor> {
    let data: Vec<f32> = (0..b * h * s * d)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let t = c(Tensor::from_vec(data, (b, h, s, d), dev))?;
    c(c(t.to_dtype(dtype))?.transpose(1, 2))
}

/// K and V [b, s, hkv, d] as the two halves of one [b, s, 2·hkv, d] tensor
/// (a fused KV projection's output): strided, V at a non-zero offset.
fn fused_kv(
    rng: &mut StdRng,
    (b, s, hkv, d): (usize, usize, usize, usize),
    dtype: DType,
    dev: &Device,
) -> R<(Tensor, Tensor)> {
    let data: Vec<f32> = (0..b * s * 2 * hkv * d)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let kv = c(c(Tensor::from_vec(data, (b, s, 2 * hkv, d), dev))?.to_dtype(dtype))?;
    Ok((c(kv.narrow(2, 0, hkv))?, c(kv.narrow(2, hkv, hkv))?))
}

/// The mask and bias of one (head, query, key) as the reference defines
/// them: `None` where masked.
#[derive(Clone, Copy)]
struct Mask {
    window: Window,
    alibi: Option<f32>,
}

impl Mask {
    fn bias(&self, i: usize, j: usize, sq: usize, sk: usize) -> Option<f32> {
        let diag = (i + sk) as i64 - sq as i64;
        let j = j as i64;
        if let Some(l) = self.window.left {
            if j < diag - l as i64 {
                return None;
            }
        }
        if let Some(r) = self.window.right {
            if j > diag + r as i64 {
                return None;
            }
        }
        Some(self.alibi.map_or(0.0, |s| -s * (diag - j).abs() as f32))
    }
}

/// Candle's naive attention of one sequence, in f32: q [sq, h, d], k/v
/// [sk, hkv, d]; `slopes` per head.
fn naive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    window: Window,
    softcap: Option<f32>,
    slopes: Option<&[f32]>,
) -> R<Tensor> {
    let (sq, h, d) = c(q.dims3())?;
    let (sk, hkv, _) = c(k.dims3())?;
    let f = |t: &Tensor| -> R<Tensor> {
        c(c(c(t.to_dtype(DType::F32))?.transpose(0, 1))?.contiguous())
    };
    let (q, k, v) = (f(q)?, f(k)?, f(v)?);
    // GQA: each KV head serves h / hkv query heads.
    let rep = |t: Tensor| -> R<Tensor> {
        let t = c(c(t.unsqueeze(1))?.expand((hkv, h / hkv, sk, d)))?;
        c(t.reshape((h, sk, d)))
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let mut s = c(c(q.matmul(&c(k.t())?))? * f64::from(scale))?;
    if let Some(cap) = softcap {
        s = c(c(c(s / f64::from(cap))?.tanh())? * f64::from(cap))?;
    }
    let mut bias = Vec::with_capacity(h * sq * sk);
    for hi in 0..h {
        let m = Mask {
            window,
            alibi: slopes.map(|s| s[hi]),
        };
        for i in 0..sq {
            for j in 0..sk {
                bias.push(m.bias(i, j, sq, sk).unwrap_or(f32::NEG_INFINITY));
            }
        }
    }
    let bias = c(Tensor::from_vec(bias, (h, sq, sk), q.device()))?;
    let p = c(softmax(&c(s + bias)?))?;
    c(c(p.matmul(&v))?.transpose(0, 1))
}

/// Softmax over the last dimension, spelled out.
fn softmax(t: &Tensor) -> candle_core::Result<Tensor> {
    let max = t.max_keepdim(D::Minus1)?;
    let e = t.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// One dense case: shape, mask, score modifier.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hkv: usize,
    d: usize,
    window: Window,
    softcap: Option<f32>,
    alibi: bool,
}

fn random_case(rng: &mut StdRng) -> Case {
    let d = [64, 96, 128, 256][rng.random_range(0..4)];
    let (h, hkv) = [(4, 4), (6, 2), (8, 1)][rng.random_range(0..3)];
    let sk = rng.random_range(1..300);
    let sq = rng.random_range(1..=sk);
    let window = match rng.random_range(0..4) {
        0 => Window::UNBOUNDED,
        1 => Window {
            left: None,
            right: Some(0),
        },
        2 => Window {
            left: Some(rng.random_range(0..64)),
            right: Some(0),
        },
        _ => Window {
            left: Some(rng.random_range(0..64)),
            right: Some(rng.random_range(0..64)),
        },
    };
    Case {
        b: rng.random_range(1..4),
        sq,
        sk,
        h,
        hkv,
        d,
        window,
        softcap: rng.random_bool(0.3).then_some(30.0),
        alibi: rng.random_bool(0.3),
    }
}

fn slopes(h: usize) -> Vec<f32> {
    (0..h).map(|i| 0.5f32.powi(i as i32 + 1)).collect()
}

/// Every dense entry point of candle-flash-attn that can express the case,
/// each against candle's naive attention and the f64 reference.
fn dense_trial(dev: &Device, dtype: DType, seed: u64) -> R<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..8 {
        let cs = random_case(&mut rng);
        dense_case(dev, dtype, &mut rng, &cs).map_err(|e| {
            Failed::from(format!(
                "seed {seed}, {cs:?}: {}",
                e.message().unwrap_or("")
            ))
        })?;
    }
    Ok(())
}

fn dense_case(dev: &Device, dtype: DType, rng: &mut StdRng, cs: &Case) -> R<()> {
    let Case {
        b,
        sq,
        sk,
        h,
        hkv,
        d,
        window,
        softcap,
        alibi,
    } = *cs;
    let q = transposed(rng, (b, sq, h, d), dtype, dev)?;
    let (k, v) = fused_kv(rng, (b, sk, hkv, d), dtype, dev)?;
    let scale = 1.0 / (d as f32).sqrt();
    let sl = slopes(h);
    let sl_t = c(Tensor::from_vec(sl.clone(), h, dev))?;
    let causal = window.left.is_none() && window.right == Some(0);
    let (l, r) = (window.left, window.right);
    // What each public function computes for this case, by name.
    let mut outs: Vec<(&str, Tensor)> = Vec::new();
    match (alibi, softcap) {
        (false, None) => {
            outs.push((
                "flash_attn_windowed",
                c(fa::flash_attn_windowed(&q, &k, &v, scale, l, r))?,
            ));
            if window.is_unbounded() || causal {
                outs.push(("flash_attn", c(fa::flash_attn(&q, &k, &v, scale, causal))?));
            }
        }
        (true, None) => {
            outs.push((
                "flash_attn_alibi_windowed",
                c(fa::flash_attn_alibi_windowed(
                    &q, &k, &v, &sl_t, scale, l, r,
                ))?,
            ));
            if window.is_unbounded() || causal {
                outs.push((
                    "flash_attn_alibi",
                    c(fa::flash_attn_alibi(&q, &k, &v, &sl_t, scale, causal))?,
                ));
            }
        }
        (_, Some(cap)) => {
            let a = alibi.then_some(&sl_t);
            outs.push((
                "flash_attn_alibi_windowed_softcap",
                c(fa::flash_attn_alibi_windowed_softcap(
                    &q, &k, &v, a, scale, l, r, cap,
                ))?,
            ));
        }
    }
    let args = AttnArgs {
        softmax_scale: Some(scale),
        window_size_left: l,
        window_size_right: r,
        softcap,
        alibi_slopes: alibi.then_some(&sl_t),
        ..Default::default()
    };
    let (o_lse, lse) = c(fa::flash_attn_lse(&q, &k, &v, &args))?;
    outs.push(("flash_attn_lse", o_lse));

    let shape = ForwardShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        v_head_dim: d,
        causal: false,
        softmax_scale: scale,
        window,
        softcap,
    };
    let sl64: Vec<f64> = sl.iter().map(|&x| x as f64).collect();
    let extras = Extras {
        alibi_slopes: alibi.then_some(&sl64[..]),
        sinks: None,
    };
    let want = reference::attention_ext(
        &shape,
        &host_f64(&q)?,
        &host_f64(&k)?,
        &host_f64(&v)?,
        &extras,
    );
    let naive_o: Vec<Tensor> = (0..b)
        .map(|bi| {
            naive(
                &c(q.i(bi))?,
                &c(k.i(bi))?,
                &c(v.i(bi))?,
                scale,
                window,
                softcap,
                alibi.then_some(&sl[..]),
            )
        })
        .collect::<R<_>>()?;
    let naive_o = host_f64(&c(Tensor::stack(&naive_o, 0))?)?;
    let tol = abs_tol(dtype);
    for (name, o) in &outs {
        if o.dims() != [b, sq, h, d] {
            return Err(format!("{name}: shape {:?}", o.dims()).into());
        }
        let got = host_f64(o)?;
        check_rows(&got, &want.o, d, tol, &format!("{name} vs f64 reference"))?;
        check_rows(&got, &naive_o, d, tol, &format!("{name} vs candle naive"))?;
    }
    if lse.dims() != [b, h, sq] {
        return Err(format!("lse shape {:?}", lse.dims()).into());
    }
    check_lse(&host_f64(&lse)?, &want.lse, "flash_attn_lse")
}

/// Cumulative lengths and packed [total, heads, d] tensors of `lens`.
fn packed(
    rng: &mut StdRng,
    lens: &[usize],
    heads: usize,
    d: usize,
    dtype: DType,
    dev: &Device,
) -> R<(Vec<u32>, Tensor)> {
    let mut cu = vec![0u32];
    for &n in lens {
        cu.push(cu.last().unwrap() + n as u32);
    }
    let total = *cu.last().unwrap() as usize;
    let t = transposed(rng, (1, total, heads, d), dtype, dev)?;
    Ok((cu, c(t.squeeze(0))?))
}

/// The varlen functions (and the paged one, over the same keys in a
/// shuffled page pool) against the reference and candle's naive attention
/// per sequence.
fn varlen_trial(dev: &Device, dtype: DType, seed: u64) -> R<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..6 {
        let cs = random_case(&mut rng);
        varlen_case(dev, dtype, &mut rng, &cs).map_err(|e| {
            Failed::from(format!(
                "seed {seed}, {cs:?}: {}",
                e.message().unwrap_or("")
            ))
        })?;
    }
    Ok(())
}

fn varlen_case(dev: &Device, dtype: DType, rng: &mut StdRng, cs: &Case) -> R<()> {
    let Case {
        b,
        h,
        hkv,
        d,
        window,
        softcap,
        alibi,
        ..
    } = *cs;
    let lens_k: Vec<usize> = (0..b).map(|_| rng.random_range(1..200)).collect();
    let lens_q: Vec<usize> = lens_k.iter().map(|&n| rng.random_range(1..=n)).collect();
    let (cu_q, q) = packed(rng, &lens_q, h, d, dtype, dev)?;
    let (cu_k, k) = packed(rng, &lens_k, hkv, d, dtype, dev)?;
    let (_, v) = packed(rng, &lens_k, hkv, d, dtype, dev)?;
    let (max_q, max_k) = (*lens_q.iter().max().unwrap(), *lens_k.iter().max().unwrap());
    let cu_q_t = c(Tensor::new(&cu_q[..], dev))?;
    let cu_k_t = c(Tensor::new(&cu_k[..], dev))?;
    let scale = 1.0 / (d as f32).sqrt();
    let sl = slopes(h);
    let sl_t = c(Tensor::from_vec(sl.clone(), h, dev))?;
    let (l, r) = (window.left, window.right);
    let causal = l.is_none() && r == Some(0);
    let mut outs: Vec<(&str, Tensor)> = Vec::new();
    match (alibi, softcap) {
        (false, None) => {
            outs.push((
                "flash_attn_varlen_windowed",
                c(fa::flash_attn_varlen_windowed(
                    &q, &k, &v, &cu_q_t, &cu_k_t, max_q, max_k, scale, l, r,
                ))?,
            ));
            if window.is_unbounded() || causal {
                outs.push((
                    "flash_attn_varlen",
                    c(fa::flash_attn_varlen(
                        &q, &k, &v, &cu_q_t, &cu_k_t, max_q, max_k, scale, causal,
                    ))?,
                ));
            }
        }
        (true, None) => {
            outs.push((
                "flash_attn_varlen_alibi_windowed",
                c(fa::flash_attn_varlen_alibi_windowed(
                    &q, &k, &v, &sl_t, &cu_q_t, &cu_k_t, max_q, max_k, scale, l, r,
                ))?,
            ));
            if window.is_unbounded() || causal {
                outs.push((
                    "flash_attn_varlen_alibi",
                    c(fa::flash_attn_varlen_alibi(
                        &q, &k, &v, &sl_t, &cu_q_t, &cu_k_t, max_q, max_k, scale, causal,
                    ))?,
                ));
            }
        }
        (_, Some(cap)) => {
            let a = alibi.then_some(&sl_t);
            outs.push((
                "flash_attn_varlen_alibi_windowed_softcap",
                c(fa::flash_attn_varlen_alibi_windowed_softcap(
                    &q, &k, &v, a, &cu_q_t, &cu_k_t, max_q, max_k, scale, l, r, cap,
                ))?,
            ));
        }
    }
    let args = AttnArgs {
        softmax_scale: Some(scale),
        window_size_left: l,
        window_size_right: r,
        softcap,
        alibi_slopes: alibi.then_some(&sl_t),
        ..Default::default()
    };
    let (o_lse, lse) = c(fa::flash_attn_varlen_lse(
        &q, &k, &v, &cu_q_t, &cu_k_t, max_q, max_k, &args,
    ))?;
    outs.push(("flash_attn_varlen_lse", o_lse));
    if !alibi {
        // The same keys in 16-token pages, scattered over a pool in reverse order.
        let page = 16;
        let pages_per_seq: Vec<usize> = lens_k.iter().map(|n| n.div_ceil(page)).collect();
        let max_pages = *pages_per_seq.iter().max().unwrap();
        let num_pages = b * max_pages;
        let mut table = vec![0u32; b * max_pages];
        let (mut k_pool, mut v_pool) = (
            vec![0f32; num_pages * page * hkv * d],
            vec![0f32; num_pages * page * hkv * d],
        );
        let (k_host, v_host) = (host_f64(&k)?, host_f64(&v)?);
        for bi in 0..b {
            for p in 0..max_pages {
                let phys = num_pages - 1 - (bi * max_pages + p);
                table[bi * max_pages + p] = phys as u32;
                for t in 0..page {
                    let pos = p * page + t;
                    if pos >= lens_k[bi] {
                        break;
                    }
                    let src = (cu_k[bi] as usize + pos) * hkv * d;
                    let dst = (phys * page + t) * hkv * d;
                    for x in 0..hkv * d {
                        k_pool[dst + x] = k_host[src + x] as f32;
                        v_pool[dst + x] = v_host[src + x] as f32;
                    }
                }
            }
        }
        let pool = |x: Vec<f32>| -> R<Tensor> {
            c(c(Tensor::from_vec(x, (num_pages, page, hkv, d), dev))?.to_dtype(dtype))
        };
        let table_t = c(Tensor::from_vec(table, (b, max_pages), dev))?;
        let o = c(fa::flash_attn_varlen_paged_windowed(
            &q,
            &pool(k_pool)?,
            &pool(v_pool)?,
            &cu_q_t,
            &cu_k_t,
            &table_t,
            None,
            max_q,
            max_k,
            scale,
            l,
            r,
            page,
            softcap,
        ))?;
        outs.push(("flash_attn_varlen_paged_windowed", o));
    }
    let shape = VarlenShape {
        batch: b,
        total_q: *cu_q.last().unwrap() as usize,
        total_k: *cu_k.last().unwrap() as usize,
        max_seqlen_q: max_q,
        max_seqlen_k: max_k,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        v_head_dim: d,
        causal: false,
        softmax_scale: scale,
        window,
        softcap,
    };
    let sl64: Vec<f64> = sl.iter().map(|&x| x as f64).collect();
    let extras = Extras {
        alibi_slopes: alibi.then_some(&sl64[..]),
        sinks: None,
    };
    let cu_qi: Vec<i32> = cu_q.iter().map(|&x| x as i32).collect();
    let cu_ki: Vec<i32> = cu_k.iter().map(|&x| x as i32).collect();
    let want = reference::varlen(
        &shape,
        &cu_qi,
        &cu_ki,
        &host_f64(&q)?,
        &host_f64(&k)?,
        &host_f64(&v)?,
        &extras,
    );
    let mut naive_o = Vec::new();
    for bi in 0..b {
        let (q0, k0) = (cu_q[bi] as usize, cu_k[bi] as usize);
        let qs = c(q.narrow(0, q0, lens_q[bi]))?;
        let (ks, vs) = (
            c(k.narrow(0, k0, lens_k[bi]))?,
            c(v.narrow(0, k0, lens_k[bi]))?,
        );
        naive_o.push(naive(
            &qs,
            &ks,
            &vs,
            scale,
            window,
            softcap,
            alibi.then_some(&sl[..]),
        )?);
    }
    let naive_o = host_f64(&c(Tensor::cat(&naive_o, 0))?)?;
    let tol = abs_tol(dtype);
    for (name, o) in &outs {
        let got = host_f64(o)?;
        check_rows(&got, &want.o, d, tol, &format!("{name} vs f64 reference"))?;
        check_rows(&got, &naive_o, d, tol, &format!("{name} vs candle naive"))?;
    }
    check_lse(&host_f64(&lse)?, &want.lse, "flash_attn_varlen_lse")
}

/// Decode with append into a contiguous and a paged cache: the caches are
/// updated in place, O and LSE match the reference over the grown cache,
/// and sinks enter the LSE.
fn kvcache_trial(dev: &Device, dtype: DType, seed: u64) -> R<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..6 {
        let paged = round % 2 == 1;
        kvcache_case(dev, dtype, &mut rng, paged).map_err(|e| {
            Failed::from(format!(
                "seed {seed}, round {round}: {}",
                e.message().unwrap_or("")
            ))
        })?;
    }
    Ok(())
}

fn kvcache_case(dev: &Device, dtype: DType, rng: &mut StdRng, paged: bool) -> R<()> {
    let d = [64, 128][rng.random_range(0..2)];
    let (b, h, hkv, page) = (rng.random_range(1..4), 8, 2, 16);
    let capacity = 16 * rng.random_range(2..20);
    let snew = rng.random_range(1..4);
    let lens: Vec<usize> = (0..b)
        .map(|_| rng.random_range(0..=capacity - snew))
        .collect();
    let with_sinks = rng.random_bool(0.5);
    let causal = rng.random_bool(0.5);
    let rnd = |rng: &mut StdRng, n: usize| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    // Logical caches [b, capacity, hkv, d].
    let (k_log, v_log) = (
        rnd(rng, b * capacity * hkv * d),
        rnd(rng, b * capacity * hkv * d),
    );
    let row = hkv * d;
    let (k_cache, v_cache, table) = if paged {
        let max_pages = capacity / page;
        let num_pages = b * max_pages;
        let table: Vec<i32> = (0..num_pages as i32).rev().collect();
        let scatter = |log: &[f32]| {
            let mut pool = vec![0f32; num_pages * page * row];
            for bi in 0..b {
                for pos in 0..capacity {
                    let phys = table[bi * max_pages + pos / page] as usize;
                    let dst = (phys * page + pos % page) * row;
                    pool[dst..dst + row]
                        .copy_from_slice(&log[(bi * capacity + pos) * row..][..row]);
                }
            }
            pool
        };
        let mk = |x: Vec<f32>| -> R<Tensor> {
            c(c(Tensor::from_vec(x, (num_pages, page, hkv, d), dev))?.to_dtype(dtype))
        };
        (
            mk(scatter(&k_log))?,
            mk(scatter(&v_log))?,
            Some(c(Tensor::from_vec(table, (b, max_pages), dev))?),
        )
    } else {
        let mk = |x: Vec<f32>| -> R<Tensor> {
            c(c(Tensor::from_vec(x, (b, capacity, hkv, d), dev))?.to_dtype(dtype))
        };
        (mk(k_log.clone())?, mk(v_log.clone())?, None)
    };
    let q = transposed(rng, (b, snew, h, d), dtype, dev)?;
    let (k_new, v_new) = fused_kv(rng, (b, snew, hkv, d), dtype, dev)?;
    let seqlens = c(Tensor::from_vec(
        lens.iter().map(|&n| n as u32).collect::<Vec<_>>(),
        b,
        dev,
    ))?;
    let sinks: Vec<f32> = (0..h).map(|i| 0.25 * i as f32 - 1.0).collect();
    let sinks_t = c(Tensor::from_vec(sinks.clone(), h, dev))?;
    let scale = 1.0 / (d as f32).sqrt();
    let args = AttnArgs {
        softmax_scale: Some(scale),
        causal,
        sinks: with_sinks.then_some(&sinks_t),
        ..Default::default()
    };
    let (o, lse) = c(fa::flash_attn_with_kvcache(
        &q,
        &k_cache,
        &v_cache,
        &seqlens,
        table.as_ref(),
        Some(&k_new),
        Some(&v_new),
        &args,
    ))?;

    // The reference's view: the logical caches (rounded to dtype) with the new rows written.
    let round = |x: Vec<f32>, t: &Tensor| -> R<Vec<f64>> {
        host_f64(
            &c(Tensor::from_vec(x, t.elem_count(), dev))?
                .to_dtype(dtype)
                .map_err(|e| Failed::from(e.to_string()))?,
        )
    };
    let (mut k_ref, mut v_ref) = (round(k_log, &k_cache)?, round(v_log, &v_cache)?);
    let (kn, vn) = (host_f64(&k_new)?, host_f64(&v_new)?);
    for (bi, &len) in lens.iter().enumerate() {
        for t in 0..snew {
            let dst = (bi * capacity + len + t) * row;
            let src = (bi * snew + t) * row;
            k_ref[dst..dst + row].copy_from_slice(&kn[src..src + row]);
            v_ref[dst..dst + row].copy_from_slice(&vn[src..src + row]);
        }
    }
    // The cache tensors were written in place.
    if !paged {
        check_rows(&host_f64(&k_cache)?, &k_ref, d, 0.0, "k_cache after append")?;
        check_rows(&host_f64(&v_cache)?, &v_ref, d, 0.0, "v_cache after append")?;
    } else {
        let (kp, table_h) = (
            host_f64(&k_cache)?,
            table
                .as_ref()
                .map(|t| t.flatten_all().and_then(|t| t.to_vec1::<i32>()))
                .unwrap()
                .map_err(|e| Failed::from(e.to_string()))?,
        );
        let max_pages = capacity / page;
        for bi in 0..b {
            for t in 0..snew {
                let pos = lens[bi] + t;
                let phys = table_h[bi * max_pages + pos / page] as usize;
                let got = &kp[(phys * page + pos % page) * row..][..row];
                check_rows(
                    got,
                    &k_ref[(bi * capacity + pos) * row..][..row],
                    d,
                    0.0,
                    "paged k_cache after append",
                )?;
            }
        }
    }
    let shape = DecodeShape {
        batch: b,
        seqlen_q: snew,
        cache_len: capacity,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        causal,
        softmax_scale: scale,
        window: Window::UNBOUNDED,
        softcap: None,
        num_splits: None,
    };
    let sinks64: Vec<f64> = sinks.iter().map(|&x| x as f64).collect();
    let extras = Extras {
        alibi_slopes: None,
        sinks: with_sinks.then_some(&sinks64[..]),
    };
    let seq_after: Vec<i32> = lens.iter().map(|&n| (n + snew) as i32).collect();
    let want = reference::decode_ext(&shape, &host_f64(&q)?, &k_ref, &v_ref, &seq_after, &extras);
    check_rows(
        &host_f64(&o)?,
        &want.o,
        d,
        abs_tol(dtype),
        "flash_attn_with_kvcache O",
    )?;
    if lse.dims() != [b, h, snew] {
        return Err(format!("lse shape {:?}", lse.dims()).into());
    }
    check_lse(&host_f64(&lse)?, &want.lse, "flash_attn_with_kvcache LSE")
}

/// Attention over two halves of the keys, merged, equals attention over all.
fn merge_trial(dev: &Device, dtype: DType, seed: u64) -> R<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (b, sq, sk, h, hkv, d) = (2, 37, 150, 4, 2, 128);
    let q = transposed(&mut rng, (b, sq, h, d), dtype, dev)?;
    let (k, v) = fused_kv(&mut rng, (b, sk, hkv, d), dtype, dev)?;
    let args = AttnArgs::default();
    let split = 61;
    let (o_a, lse_a) = c(fa::flash_attn_lse(
        &q,
        &c(k.narrow(1, 0, split))?,
        &c(v.narrow(1, 0, split))?,
        &args,
    ))?;
    let rest = sk - split;
    let (o_b, lse_b) = c(fa::flash_attn_lse(
        &q,
        &c(k.narrow(1, split, rest))?,
        &c(v.narrow(1, split, rest))?,
        &args,
    ))?;
    let (o, lse) = c(fa::merge_states(&o_a, &lse_a, &o_b, &lse_b))?;
    let (o_all, lse_all) = c(fa::flash_attn_lse(&q, &k, &v, &args))?;
    // One extra rounding of O to the dtype from the merge.
    check_rows(
        &host_f64(&o)?,
        &host_f64(&o_all)?,
        d,
        2.0 * abs_tol(dtype),
        "merge_states O",
    )?;
    check_lse(&host_f64(&lse)?, &host_f64(&lse_all)?, "merge_states LSE")
}

/// Refusals on the GPU: f64 tensors, a head dim without kernels, one that
/// breaks 16-byte rows, mismatched heads, wrong ALiBi length; each an error,
/// not a panic.
fn errors_gpu(dev: &Device) -> R<()> {
    let q = c(Tensor::zeros((1, 8, 2, 64), DType::F64, dev))?;
    expect_err(fa::flash_attn(&q, &q, &q, 0.1, false), "f16, bf16 and f32")?;
    let q = c(Tensor::zeros((1, 8, 2, 72), DType::F16, dev))?;
    expect_err(fa::flash_attn(&q, &q, &q, 0.1, false), "head dim")?;
    let q = c(Tensor::zeros((1, 8, 2, 60), DType::F16, dev))?;
    expect_err(fa::flash_attn(&q, &q, &q, 0.1, false), "aligned")?;
    let q = c(Tensor::zeros((1, 8, 4, 64), DType::F16, dev))?;
    let k = c(Tensor::zeros((1, 8, 3, 64), DType::F16, dev))?;
    expect_err(fa::flash_attn(&q, &k, &k, 0.1, false), "heads")?;
    let wrong_slopes = c(Tensor::zeros(3, DType::F32, dev))?;
    expect_err(
        fa::flash_attn_alibi(&q, &q, &q, &wrong_slopes, 0.1, false),
        "alibi",
    )?;
    Ok(())
}

fn expect_err<T>(r: candle_core::Result<T>, needle: &str) -> R<()> {
    match r {
        Ok(_) => Err(format!("expected an error mentioning {needle:?}, got Ok").into()),
        Err(e)
            if e.to_string()
                .to_lowercase()
                .contains(&needle.to_lowercase()) =>
        {
            Ok(())
        }
        Err(e) => Err(format!("expected an error mentioning {needle:?}, got: {e}").into()),
    }
}

/// CPU tensors get a candle error from every entry point.
fn errors_cpu() -> R<()> {
    let cpu = Device::Cpu;
    let q = c(Tensor::zeros((1, 8, 2, 64), DType::F16, &cpu))?;
    let cu = c(Tensor::new(&[0u32, 8], &cpu))?;
    let slopes = c(Tensor::zeros(2, DType::F32, &cpu))?;
    let lens = c(Tensor::new(&[4u32], &cpu))?;
    let table = c(Tensor::new(&[[0u32]], &cpu))?;
    let p = c(q.squeeze(0))?;
    let args = AttnArgs::default();
    let want = "CUDA";
    expect_err(fa::flash_attn(&q, &q, &q, 0.1, true), want)?;
    expect_err(
        fa::flash_attn_windowed(&q, &q, &q, 0.1, Some(2), Some(0)),
        want,
    )?;
    expect_err(fa::flash_attn_alibi(&q, &q, &q, &slopes, 0.1, true), want)?;
    expect_err(
        fa::flash_attn_alibi_windowed(&q, &q, &q, &slopes, 0.1, None, None),
        want,
    )?;
    expect_err(
        fa::flash_attn_alibi_windowed_softcap(&q, &q, &q, None, 0.1, None, None, 5.0),
        want,
    )?;
    expect_err(fa::flash_attn_lse(&q, &q, &q, &args), want)?;
    expect_err(
        fa::flash_attn_varlen(&p, &p, &p, &cu, &cu, 8, 8, 0.1, true),
        want,
    )?;
    expect_err(
        fa::flash_attn_varlen_windowed(&p, &p, &p, &cu, &cu, 8, 8, 0.1, None, Some(0)),
        want,
    )?;
    expect_err(
        fa::flash_attn_varlen_alibi(&p, &p, &p, &slopes, &cu, &cu, 8, 8, 0.1, false),
        want,
    )?;
    expect_err(
        fa::flash_attn_varlen_alibi_windowed(&p, &p, &p, &slopes, &cu, &cu, 8, 8, 0.1, None, None),
        want,
    )?;
    expect_err(
        fa::flash_attn_varlen_alibi_windowed_softcap(
            &p, &p, &p, None, &cu, &cu, 8, 8, 0.1, None, None, 5.0,
        ),
        want,
    )?;
    expect_err(
        fa::flash_attn_varlen_lse(&p, &p, &p, &cu, &cu, 8, 8, &args),
        want,
    )?;
    let pool = c(Tensor::zeros((1, 16, 2, 64), DType::F16, &cpu))?;
    expect_err(
        fa::flash_attn_varlen_paged_windowed(
            &p,
            &pool,
            &pool,
            &cu,
            &cu,
            &table,
            None,
            8,
            8,
            0.1,
            None,
            Some(0),
            16,
            None,
        ),
        want,
    )?;
    expect_err(
        fa::flash_attn_with_kvcache(&q, &q, &q, &lens, None, None, None, &args),
        want,
    )?;
    let lse = c(Tensor::zeros((1, 2, 8), DType::F32, &cpu))?;
    expect_err(fa::merge_states(&q, &lse, &q, &lse), want)?;
    // Argument checks that need no device at all.
    expect_err(
        fa::flash_attn_varlen_paged_windowed(
            &p,
            &pool,
            &pool,
            &cu,
            &cu,
            &table,
            Some(&cu),
            8,
            8,
            0.1,
            None,
            Some(0),
            16,
            None,
        ),
        "mm_prefix_ranges",
    )?;
    expect_err(
        fa::flash_attn_varlen_paged_windowed(
            &p,
            &pool,
            &pool,
            &cu,
            &cu,
            &table,
            None,
            8,
            8,
            0.1,
            None,
            Some(0),
            32,
            None,
        ),
        "page_block_size",
    )?;
    expect_err(
        fa::flash_attn_with_kvcache(&q, &q, &q, &lens, None, Some(&q), None, &args),
        "together",
    )?;
    Ok(())
}

/// Whether the module flash-attn loads for `gpu` runs bf16: the sm_75
/// module (Turing, or `FLASH_ATTN_MODULE=sm_75`) refuses bf16 with a typed
/// error, which [`bf16_refused`] checks where the bf16 trials are ignored.
fn module_has_bf16(gpu: &Option<Device>) -> bool {
    match gpu {
        Some(Device::Cuda(dev)) => FlashAttention::new(dev.cuda_stream().context())
            .expect("a GPU is present, so flash-attn must load")
            .ptx_arch()
            .has_dtype(Dtype::Bf16),
        _ => false,
    }
}

/// bf16 on a module without it: dense and kvcache calls are errors naming
/// the requirement, and the append leaves the caches untouched.
fn bf16_refused(dev: &Device) -> R<()> {
    let q = c(Tensor::ones((1, 2, 4, 64), DType::BF16, dev))?;
    expect_err(fa::flash_attn(&q, &q, &q, 0.1, true), "bf16 needs sm_80")?;
    let cache = c(Tensor::zeros((1, 16, 4, 64), DType::BF16, dev))?;
    let lens = c(Tensor::new(&[3u32], dev))?;
    expect_err(
        fa::flash_attn_with_kvcache(
            &q,
            &cache,
            &cache,
            &lens,
            None,
            Some(&q),
            Some(&q),
            &AttnArgs::default(),
        ),
        "bf16 needs sm_80",
    )?;
    let touched = c(c(c(cache.abs())?.sum_all())?.to_dtype(DType::F32))?;
    let sum = c(touched.to_scalar::<f32>())?;
    if sum != 0.0 {
        return Err(format!("the refused append wrote the cache (sum of |cache| {sum})").into());
    }
    Ok(())
}

/// Unit roundoff of the arithmetic the backward runs in for `dtype` (f32
/// inputs run as f16).
fn unit(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1.0 / 256.0,
        _ => 1.0 / 2048.0,
    }
}

/// `n` random values in -1..1 that `dtype` holds exactly, and that f16
/// holds exactly for f32 (which the kernels round to f16): the reference
/// then sees what the kernels see.
fn exact_values(rng: &mut StdRng, n: usize, dtype: DType) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x: f32 = rng.random_range(-1.0..1.0);
            match dtype {
                DType::BF16 => bf16::from_f32(x).to_f32(),
                _ => f16::from_f32(x).to_f32(),
            }
        })
        .collect()
}

fn exact_var(rng: &mut StdRng, dims: &[usize], dtype: DType, dev: &Device) -> R<Var> {
    let data = exact_values(rng, dims.iter().product(), dtype);
    let t = c(c(Tensor::from_vec(data, dims, dev))?.to_dtype(dtype))?;
    c(Var::from_tensor(&t))
}

/// The loss `Σ O ∘ W` for fixed random weights W of `dims`: its gradient
/// with respect to O is W (exact in the dtype, so dO is W as given).
fn weighted_loss(rng: &mut StdRng, o: &Tensor, dtype: DType) -> R<(Tensor, Vec<f64>)> {
    let data = exact_values(rng, o.elem_count(), dtype);
    let w64 = data.iter().map(|&x| x as f64).collect();
    let w = c(Tensor::from_vec(data, o.dims(), o.device()))?;
    let loss = c(c(c(o.to_dtype(DType::F32))? * w)?.sum_all())?;
    Ok((loss, w64))
}

/// The window candle-flash-attn's functions mean by `window` for keys of
/// length `seqlen_k` (the longest sequence's for varlen): a side wider
/// than that is unbounded (the same mask unless a sequence has more
/// queries than keys).
fn candle_fa_window(window: Window, seqlen_k: usize) -> Window {
    Window {
        left: window.left.filter(|&w| w <= seqlen_k),
        right: window.right.filter(|&w| w <= seqlen_k),
    }
}

/// The error model of `reference::backward_bounds` for `dtype`.
fn bwd_model(dtype: DType) -> BwdErrorModel {
    BwdErrorModel {
        unit: unit(dtype),
        // `tanh.approx.f32`'s largest relative error (PTX ISA: 2^-10.987).
        tanh_rel_err: 5.0e-4,
        lse_tol: LSE_TOL,
    }
}

/// A variable's gradient, which must exist and have its shape.
fn grad_of(grads: &GradStore, var: &Var, what: &str) -> R<Tensor> {
    let g = grads
        .get(var.as_tensor())
        .ok_or_else(|| Failed::from(format!("no gradient for {what}")))?;
    if g.dims() != var.dims() {
        return Err(format!(
            "{what}: gradient shape {:?}, want {:?}",
            g.dims(),
            var.dims()
        )
        .into());
    }
    Ok(g.clone())
}

/// Training through the ops: `loss.backward()` through each dense entry
/// point reaches Q (a transposed view of a [b, h, s, d] variable), K and V
/// (halves of one fused variable) and the sinks, against the f64
/// reference's gradients within `reference::backward_bounds`. f32 losses
/// are also scaled by 2^-24, which puts dO below f16's smallest
/// subnormal, and by 2^12, whose gradients pass f16's largest value: the
/// f32 backward's own loss scaling keeps both within the bounds.
fn backward_trial(dev: &Device, dtype: DType, seed: u64) -> R<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    for i in 0..6 {
        let loss_scale = match dtype {
            DType::F32 => [1.0, 2f32.powi(-24), 2f32.powi(12)][i % 3],
            _ => 1.0,
        };
        let mut cs = random_case(&mut rng);
        cs.d = flash_attn::BWD_HEAD_DIMS[rng.random_range(0..flash_attn::BWD_HEAD_DIMS.len())];
        // Even cases through candle-flash-attn's functions (no LSE asked
        // for, so the op keeps one for its backward by itself), odd ones
        // through `flash_attn_lse` with sinks and per-batch slopes.
        let extras = i % 2 == 1;
        backward_case(dev, (dtype, loss_scale), &mut rng, &cs, extras).map_err(|e| {
            Failed::from(format!(
                "seed {seed}, {cs:?}, extras {extras}, loss scale {loss_scale}: {}",
                e.message().unwrap_or("")
            ))
        })?;
    }
    Ok(())
}

fn backward_case(
    dev: &Device,
    (dtype, loss_scale): (DType, f32),
    rng: &mut StdRng,
    cs: &Case,
    extras: bool,
) -> R<()> {
    let Case {
        b,
        sq,
        sk,
        h,
        hkv,
        d,
        window,
        softcap,
        alibi,
    } = *cs;
    let q_var = exact_var(rng, &[b, h, sq, d], dtype, dev)?;
    let kv_var = exact_var(rng, &[b, sk, 2 * hkv, d], dtype, dev)?;
    let q = c(q_var.transpose(1, 2))?;
    let (k, v) = (c(kv_var.narrow(2, 0, hkv))?, c(kv_var.narrow(2, hkv, hkv))?);
    let scale = 1.0 / (d as f32).sqrt();
    let (l, r) = (window.left, window.right);
    let slope_count = if extras { b * h } else { h };
    let sl: Vec<f32> = (0..slope_count)
        .map(|_| rng.random_range(0.0..0.5))
        .collect();
    let sl_t = c(Tensor::from_vec(sl.clone(), slope_count, dev))?;
    let sl_t = if extras {
        c(sl_t.reshape((b, h)))?
    } else {
        sl_t
    };
    let sinks: Vec<f32> = (0..h).map(|_| rng.random_range(-2.0..3.0)).collect();
    let sinks_var = c(Var::from_vec(sinks.clone(), h, dev))?;
    let o = if extras {
        let args = AttnArgs {
            softmax_scale: Some(scale),
            window_size_left: l,
            window_size_right: r,
            softcap,
            alibi_slopes: alibi.then_some(&sl_t),
            sinks: Some(sinks_var.as_tensor()),
            ..Default::default()
        };
        c(fa::flash_attn_lse(&q, &k, &v, &args))?.0
    } else {
        match (alibi, softcap) {
            (false, None) => c(fa::flash_attn_windowed(&q, &k, &v, scale, l, r))?,
            (true, None) => c(fa::flash_attn_alibi_windowed(
                &q, &k, &v, &sl_t, scale, l, r,
            ))?,
            (_, Some(cap)) => c(fa::flash_attn_alibi_windowed_softcap(
                &q,
                &k,
                &v,
                alibi.then_some(&sl_t),
                scale,
                l,
                r,
                cap,
            ))?,
        }
    };
    let (loss, do64) = weighted_loss(rng, &o, dtype)?;
    // dO = W · loss_scale, exactly; the gradients are scaled back exactly.
    let grads = c(c(loss.affine(loss_scale as f64, 0.0))?.backward())?;
    let unscaled = |t: &Tensor| -> R<Vec<f64>> {
        Ok(host_f64(t)?
            .into_iter()
            .map(|x| x / loss_scale as f64)
            .collect())
    };
    let dq = grad_of(&grads, &q_var, "q")?;
    let dkv = grad_of(&grads, &kv_var, "the fused kv")?;
    let got = RefGrads {
        dq: unscaled(&c(dq.transpose(1, 2))?)?,
        dk: unscaled(&c(dkv.narrow(2, 0, hkv))?)?,
        dv: unscaled(&c(dkv.narrow(2, hkv, hkv))?)?,
        d_sinks: if extras {
            unscaled(&grad_of(&grads, &sinks_var, "sinks")?)?
        } else {
            Vec::new()
        },
    };
    let shape = ForwardShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        v_head_dim: d,
        causal: false,
        softmax_scale: scale,
        window: if extras {
            window
        } else {
            candle_fa_window(window, sk)
        },
        softcap,
    };
    let (sl64, sinks64): (Vec<f64>, Vec<f64>) = (
        sl.iter().map(|&x| x as f64).collect(),
        sinks.iter().map(|&x| x as f64).collect(),
    );
    let ext = Extras {
        alibi_slopes: alibi.then_some(&sl64[..]),
        sinks: extras.then_some(&sinks64[..]),
    };
    let (q64, k64, v64, o64) = (host_f64(&q)?, host_f64(&k)?, host_f64(&v)?, host_f64(&o)?);
    let want = reference::attention_backward_ext(&shape, &q64, &k64, &v64, &do64, &ext);
    let bounds = reference::backward_bounds(
        &shape,
        &q64,
        &k64,
        &v64,
        &do64,
        &o64,
        &ext,
        &bwd_model(dtype),
    );
    Ok(reference::check_backward(
        &got,
        &want,
        &bounds,
        unit(dtype),
        (d, d),
    )?)
}

/// Training through the varlen ops: sequences of 0, 1 and up to 200
/// tokens, rows after the last sequence that no sequence owns (their
/// gradients 0), Q a transposed view of a [h, total, d] variable.
fn varlen_backward_trial(dev: &Device, dtype: DType, seed: u64) -> R<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    for i in 0..6 {
        let mut cs = random_case(&mut rng);
        cs.d = flash_attn::BWD_HEAD_DIMS[rng.random_range(0..flash_attn::BWD_HEAD_DIMS.len())];
        let extras = i % 2 == 1;
        varlen_backward_case(dev, dtype, &mut rng, &cs, extras).map_err(|e| {
            Failed::from(format!(
                "seed {seed}, {cs:?}, extras {extras}: {}",
                e.message().unwrap_or("")
            ))
        })?;
    }
    Ok(())
}

fn varlen_backward_case(
    dev: &Device,
    dtype: DType,
    rng: &mut StdRng,
    cs: &Case,
    extras: bool,
) -> R<()> {
    let Case {
        b,
        h,
        hkv,
        d,
        window,
        softcap,
        alibi,
        ..
    } = *cs;
    let len = |rng: &mut StdRng| match rng.random_range(0..6) {
        0 => 0,
        1 => 1,
        _ => rng.random_range(2..200),
    };
    let lens: Vec<(usize, usize)> = (0..b).map(|_| (len(rng), len(rng))).collect();
    let cum = |f: fn(&(usize, usize)) -> usize| -> Vec<i32> {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, x| {
                *acc += f(x) as i32;
                Some(*acc)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (cum(|x| x.0), cum(|x| x.1));
    let (pad_q, pad_k) = (rng.random_range(0..3), rng.random_range(0..3));
    let total_q = *cu_q.last().unwrap() as usize + pad_q;
    let total_k = *cu_k.last().unwrap() as usize + pad_k;
    if total_q == 0 || total_k == 0 {
        return Ok(()); // candle has no empty tensors to pack
    }
    let max_q = lens.iter().map(|x| x.0).max().unwrap().max(1);
    let max_k = lens.iter().map(|x| x.1).max().unwrap().max(1);
    let q_var = exact_var(rng, &[h, total_q, d], dtype, dev)?;
    let kv_var = exact_var(rng, &[total_k, 2 * hkv, d], dtype, dev)?;
    let q = c(q_var.transpose(0, 1))?;
    let (k, v) = (c(kv_var.narrow(1, 0, hkv))?, c(kv_var.narrow(1, hkv, hkv))?);
    let (cu_q_t, cu_k_t) = (
        c(Tensor::new(&cu_q[..], dev))?,
        c(Tensor::new(&cu_k[..], dev))?,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let (l, r) = (window.left, window.right);
    let slope_count = if extras { b * h } else { h };
    let sl: Vec<f32> = (0..slope_count)
        .map(|_| rng.random_range(0.0..0.5))
        .collect();
    let sl_t = c(Tensor::from_vec(sl.clone(), slope_count, dev))?;
    let sl_t = if extras {
        c(sl_t.reshape((b, h)))?
    } else {
        sl_t
    };
    let sinks: Vec<f32> = (0..h).map(|_| rng.random_range(-2.0..3.0)).collect();
    let sinks_var = c(Var::from_vec(sinks.clone(), h, dev))?;
    let o = if extras {
        let args = AttnArgs {
            softmax_scale: Some(scale),
            window_size_left: l,
            window_size_right: r,
            softcap,
            alibi_slopes: alibi.then_some(&sl_t),
            sinks: Some(sinks_var.as_tensor()),
            ..Default::default()
        };
        c(fa::flash_attn_varlen_lse(
            &q, &k, &v, &cu_q_t, &cu_k_t, max_q, max_k, &args,
        ))?
        .0
    } else {
        c(fa::flash_attn_varlen_alibi_windowed_softcap(
            &q,
            &k,
            &v,
            alibi.then_some(&sl_t),
            &cu_q_t,
            &cu_k_t,
            max_q,
            max_k,
            scale,
            l,
            r,
            softcap.unwrap_or(0.0),
        ))?
    };
    let (loss, do64) = weighted_loss(rng, &o, dtype)?;
    let grads = c(loss.backward())?;
    let dq = grad_of(&grads, &q_var, "q")?;
    let dkv = grad_of(&grads, &kv_var, "the fused kv")?;
    let got = RefGrads {
        dq: host_f64(&c(dq.transpose(0, 1))?)?,
        dk: host_f64(&c(dkv.narrow(1, 0, hkv))?)?,
        dv: host_f64(&c(dkv.narrow(1, hkv, hkv))?)?,
        d_sinks: if extras {
            host_f64(&grad_of(&grads, &sinks_var, "sinks")?)?
        } else {
            Vec::new()
        },
    };
    let shape = VarlenShape {
        batch: b,
        total_q,
        total_k,
        max_seqlen_q: max_q,
        max_seqlen_k: max_k,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        v_head_dim: d,
        causal: false,
        softmax_scale: scale,
        window: if extras {
            window
        } else {
            candle_fa_window(window, max_k)
        },
        softcap,
    };
    let (sl64, sinks64): (Vec<f64>, Vec<f64>) = (
        sl.iter().map(|&x| x as f64).collect(),
        sinks.iter().map(|&x| x as f64).collect(),
    );
    let ext = Extras {
        alibi_slopes: alibi.then_some(&sl64[..]),
        sinks: extras.then_some(&sinks64[..]),
    };
    let (q64, k64, v64, o64) = (host_f64(&q)?, host_f64(&k)?, host_f64(&v)?, host_f64(&o)?);
    let at = |e: Failed| {
        Failed::from(format!(
            "lens (q, k) {lens:?}, pads ({pad_q}, {pad_k}): {}",
            e.message().unwrap_or("")
        ))
    };
    let fwd = reference::varlen(&shape, &cu_q, &cu_k, &q64, &k64, &v64, &ext);
    check_rows(&o64, &fwd.o, d, abs_tol(dtype), "O").map_err(at)?;
    let want = reference::varlen_backward(&shape, &cu_q, &cu_k, &q64, &k64, &v64, &do64, &ext);
    let bounds = reference::varlen_backward_bounds(
        &shape,
        &cu_q,
        &cu_k,
        &q64,
        &k64,
        &v64,
        &do64,
        &o64,
        &ext,
        &bwd_model(dtype),
    );
    reference::check_backward(&got, &want, &bounds, unit(dtype), (d, d))
        .map_err(|e| at(Failed::from(e)))
}

/// What the backward refuses, as errors from `loss.backward()` (the
/// forward ran): a V head dim of its own, a paged K/V cache, the ops
/// without a backward (decode against a KV cache, `merge_states`).
fn backward_errors(dev: &Device) -> R<()> {
    let mut rng = StdRng::seed_from_u64(7);
    let q = exact_var(&mut rng, &[1, 8, 2, 128], DType::F16, dev)?;
    let v = exact_var(&mut rng, &[1, 8, 2, 64], DType::F16, dev)?;
    let o = c(fa::flash_attn(&q, &q, &v, 0.1, true))?;
    expect_err(c(o.sum_all())?.backward(), "V head dim")?;
    let q = exact_var(&mut rng, &[16, 2, 64], DType::F16, dev)?;
    let pool = c(Tensor::zeros((2, 16, 2, 64), DType::F16, dev))?;
    let cu_q = c(Tensor::new(&[0u32, 16], dev))?;
    let cu_k = c(Tensor::new(&[0u32, 16], dev))?;
    let table = c(Tensor::new(&[[1u32]], dev))?;
    let o = c(fa::flash_attn_varlen_paged_windowed(
        &q,
        &pool,
        &pool,
        &cu_q,
        &cu_k,
        &table,
        None,
        16,
        16,
        0.1,
        None,
        Some(0),
        16,
        None,
    ))?;
    expect_err(c(o.sum_all())?.backward(), "paged")?;
    let q = exact_var(&mut rng, &[1, 1, 2, 64], DType::F16, dev)?;
    let cache = c(Tensor::zeros((1, 16, 2, 64), DType::F16, dev))?;
    let lens = c(Tensor::new(&[4u32], dev))?;
    let args = AttnArgs::default();
    let (o, lse) = c(fa::flash_attn_with_kvcache(
        &q, &cache, &cache, &lens, None, None, None, &args,
    ))?;
    expect_err(c(o.sum_all())?.backward(), "backward is not supported")?;
    let (o, _) = c(fa::merge_states(&o, &lse, &o, &lse))?;
    expect_err(c(o.sum_all())?.backward(), "backward is not supported")
}

fn main() {
    let args = Arguments::from_args();
    let gpu = Arc::new(open_gpu());
    let have_bf16 = module_has_bf16(&gpu);
    let seed: u64 = std::env::var("FLASH_ATTN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("candle tests: seed {seed} (FLASH_ATTN_SEED to replay)");
    let mut trials = vec![Trial::test(
        "cpu_tensors_and_arguments_are_errors",
        errors_cpu,
    )];
    type GpuTest = fn(&Device, DType, u64) -> R<()>;
    let tests: [(&str, GpuTest); 6] = [
        ("dense", dense_trial),
        ("varlen_and_paged", varlen_trial),
        ("kvcache_append_sinks", kvcache_trial),
        ("merge_states", merge_trial),
        ("backward", backward_trial),
        ("varlen_backward", varlen_backward_trial),
    ];
    for (name, run) in tests {
        for (dtype, dname) in [
            (DType::F16, "f16"),
            (DType::BF16, "bf16"),
            (DType::F32, "f32"),
        ] {
            if name == "merge_states" && dtype == DType::F32 {
                continue; // merge_states takes f16/bf16
            }
            let g = gpu.clone();
            trials.push(
                Trial::test(format!("gpu_{name}_{dname}"), move || {
                    run(g.as_ref().as_ref().unwrap(), dtype, seed)
                })
                .with_ignored_flag(g_absent(&gpu) || (dtype == DType::BF16 && !have_bf16)),
            );
        }
    }
    let g = gpu.clone();
    trials.push(
        Trial::test("gpu_errors", move || {
            errors_gpu(g.as_ref().as_ref().unwrap())
        })
        .with_ignored_flag(g_absent(&gpu)),
    );
    let g = gpu.clone();
    trials.push(
        Trial::test("gpu_backward_errors", move || {
            backward_errors(g.as_ref().as_ref().unwrap())
        })
        .with_ignored_flag(g_absent(&gpu)),
    );
    let g = gpu.clone();
    trials.push(
        Trial::test("gpu_bf16_refused_without_sm80", move || {
            bf16_refused(g.as_ref().as_ref().unwrap())
        })
        .with_ignored_flag(g_absent(&gpu) || have_bf16),
    );
    libtest_mimic::run(&args, trials).exit();
}

fn g_absent(gpu: &Arc<Option<Device>>) -> bool {
    gpu.is_none()
}
