//! GPU tests: every kernel against the f64 reference on fresh random inputs.
//!
//! Without a CUDA driver or device every trial is reported *ignored*.
//!
//! Tolerance. The kernels round P to the input dtype before P·V (as
//! FlashAttention-2 does) and round O once at the end; accumulation is f32.
//! With inputs in [-1, 1), |O| <= 1, so the output error is a few units of the
//! dtype's rounding: 2^-11 (f16) and 2^-8 (bf16). We require
//! max |O - O_ref| <= 4 units (`abs_tol`) and a relative L2 error of at most
//! 2 units (`rel_l2_tol`), where O_ref is the f64 reference on the same
//! (rounded) inputs. f32 inputs are rounded to f16 inside the kernels but
//! not for the reference, so f32 allows 8 and 4 units of f16's rounding
//! (`abs_tol`, `rel_l2_tol`). LSE is f32 with approximate exp2/log2:
//! |LSE - LSE_ref| <= 2e-3. NaN or an unwritten element never passes: O and LSE are poisoned with
//! NaN before each launch.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use flash_attn::hopper::probes::Probes;
use flash_attn::reference::{self, BwdErrorModel, Extras, RefGrads};
use flash_attn::validate::{DecodeShape, ForwardShape, VarlenShape};
use flash_attn::{
    AlibiSlopes, AttnElement, AttnOptions, BackwardInputs, BlockTable, DecodeStep, Dtype,
    FlashAttention, FlashAttnError, Grads, KvCache, KvFold, Layout, LoadedCode, ModuleChoice, Out,
    PagedVarlen, Qkv, State, TensorMut, TensorRef, Varlen, Window,
};
use flash_attn_kernels::config::{
    find_hopper_entry, hopper_line_head_dim, hopper_padded_short, AttnTile, HopperCall, HopperPick,
    KernelKind, MaskKind, Policies, PtxArch, ScoreKind, SeqKind, HOPPER_ENTRIES,
};
use flash_attn_kernels::params::{ProbeGemmParams, ProbeTmaParams};
use half::{bf16, f16};
use libtest_mimic::{Arguments, Failed, Trial};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Gpu {
    stream: Arc<CudaStream>,
    fa: FlashAttention,
    /// The sm_90a module's probes, on compute capability 9.0 only.
    hopper: Option<Probes>,
}

fn open_gpu() -> Option<Gpu> {
    // A driver that is present but fails, or a device that does not open, is
    // a failure of the suite, not a reason to skip it.
    let count = flash_attn::cuda_device_count().expect("the CUDA driver is present but fails");
    if count < 1 {
        return None;
    }
    let ctx = CudaContext::new(0).expect("a GPU is present, so its context must open");
    let fa = FlashAttention::new(&ctx).expect("a GPU is present, so the module must load");
    let hopper = Probes::new(&ctx).expect("on compute capability 9.0 the sm_90a module must load");
    Some(Gpu {
        stream: ctx.default_stream(),
        fa,
        hopper,
    })
}

impl Gpu {
    /// A second instance on the same device, set up by `setup`.
    fn variant(&self, setup: impl FnOnce(&FlashAttention)) -> Gpu {
        let fa = FlashAttention::new(self.fa.context()).expect("the module loaded once already");
        setup(&fa);
        Gpu {
            stream: self.stream.clone(),
            fa,
            hopper: None,
        }
    }

    /// Decode calls fold KV heads wherever the call allows it ([`KvFold::On`]).
    fn folding(&self) -> Gpu {
        self.variant(|fa| fa.set_kv_fold(KvFold::On))
    }

    /// Backward calls run the `mma.sync` key-block kernel at every head dim.
    fn mma_backward(&self) -> Gpu {
        self.variant(|fa| fa.set_hopper_backward(false))
    }

    /// Backward calls never split a KV head's query heads across CTAs
    /// (which the suite's small GQA problems otherwise always do).
    fn unsplit_backward(&self) -> Gpu {
        self.variant(|fa| fa.set_backward_head_splits(Some(1)))
    }
}

/// On a [`Gpu::folding`] instance, whether `shape`'s decode folds (the
/// folded trials' strategies draw only foldable calls, so one that does not
/// fold is a failure, not a skipped check).
fn expect_fold<T: AttnElement>(gpu: &Gpu, shape: &DecodeShape) -> Result<(), String> {
    let fold = gpu.fa.decode_kv_fold::<T>(shape);
    if gpu.fa.kv_fold() == KvFold::On && fold != 2 {
        return Err(format!(
            "{shape:?}: expected a folded launch, got fold {fold}"
        ));
    }
    Ok(())
}

/// `(heads, kv_heads, head_dim, seqlen_q)` made foldable: KV heads doubled
/// (an even count), a head dim of 32, 64 or 96 picked by `head_dim`, and at
/// most 8 query rows per KV head (two heads' rows fill one 16-row tile).
fn foldable(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seqlen_q: usize,
) -> (usize, usize, usize, usize) {
    let group = heads / kv_heads;
    let d = [32, 64, 96][head_dim / 32 % 3];
    (2 * heads, 2 * kv_heads, d, seqlen_q.min((8 / group).max(1)))
}

/// Largest acceptable |O - O_ref| for outputs of magnitude <= 1.
fn abs_tol(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F16 => 4.0 / 2048.0,
        Dtype::Bf16 => 4.0 / 256.0,
        // f32: Q, K, V rounded to f16 in the kernel (the reference is not),
        // P rounded to f16, O f32: the f16 path's units plus the inputs'
        // rounding (2^-11 relative each), so twice f16's.
        Dtype::F32 => 8.0 / 2048.0,
    }
}
/// Largest acceptable ‖O - O_ref‖₂ / ‖O_ref‖₂ over a row of `d` elements:
/// 2 units of the dtype's rounding; f32 4 units of f16's, as Q and K
/// rounded to f16 move a score by up to 2^-11 · scale · Σ|q||k| (about one
/// unit of O at the scores of 64 of `lazy_rescale_past_slack`, measured
/// 2.0e-3 on H100). Rows shorter than 32 elements (a V head dim of its
/// own, down to 8) average fewer errors: the bound grows as sqrt(32 / d)
/// (H100: 1.0e-3 and 1.5e-3 on 8-element f16 rows whose largest error was
/// 2.4e-5 and 7.3e-5).
fn rel_l2_tol(dtype: Dtype, d: usize) -> f64 {
    let units = match dtype {
        Dtype::F32 => 8.0 / 2048.0,
        _ => abs_tol(dtype) / 2.0,
    };
    units * (32.0 / d.min(32) as f64).sqrt()
}
const LSE_TOL: f64 = 2e-3;

fn random_values<T: AttnElement>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f64(rng.random_range(-1.0..1.0)))
        .collect()
}

fn to_f64<T: AttnElement>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// A NaN of the element type, to poison outputs.
fn nan<T: AttnElement>() -> T {
    T::from_f64(f64::NAN)
}

/// Elements between the heads of [`gapped_layout`]'s O views: one 16-byte
/// chunk of a 16-bit O (two of an f32 one), where a store of one chunk
/// past a row lands.
const O_GAP: usize = 8;

/// [B, S, H, D] with [`O_GAP`] elements after every head's D.
fn gapped_layout(shape: [usize; 4]) -> Layout {
    let [_, s, h, d] = shape;
    let pitch = d + O_GAP;
    Layout {
        shape,
        strides: [s * h * pitch, h * pitch, pitch, 1],
    }
}

/// V's (and O's) head dim for a case of Q/K head dim `d`: `given`, or for
/// one case in four a multiple of 8 below `d` drawn from the seed (V's
/// missing columns load as zeros; DeepSeek's MLA prefill is 192 / 128).
fn v_dim(d: usize, given: Option<usize>, seed: u64) -> usize {
    given.unwrap_or(if seed.is_multiple_of(4) {
        8 * (1 + (seed >> 32) as usize % (d / 8))
    } else {
        d
    })
}

/// A dense forward call since `launches_before` (this thread's Hopper
/// launch count) ran on the Hopper kernels exactly when they serve it: the
/// instance has the Hopper forward on, the dtype is 16-bit, a line serves
/// the head dim, and the call asked for the line's rows or the dispatch
/// takes it (`hopper_padded_short`). A tensor map the driver refused would
/// otherwise send the call to the `mma.sync` kernels unseen.
fn check_forward_path<T: AttnElement>(
    gpu: &Gpu,
    (head_dim, seqlen_k, hopper_rows): (usize, usize, Option<usize>),
    launches_before: u64,
    what: &str,
) -> Result<(), String> {
    check_path::<T>(
        gpu,
        (head_dim, seqlen_k, hopper_rows),
        SeqKind::Dense,
        launches_before,
        what,
    )
}

/// [`check_forward_path`] for a call whose sequences lie as `seq` says: the
/// packed and paged lines do not cover every line head dim.
fn check_path<T: AttnElement>(
    gpu: &Gpu,
    (head_dim, seqlen_k, hopper_rows): (usize, usize, Option<usize>),
    seq: SeqKind,
    launches_before: u64,
    what: &str,
) -> Result<(), String> {
    let line_d = hopper_line_head_dim(head_dim);
    let has_line = HOPPER_ENTRIES.iter().any(|e| {
        e.kind == KernelKind::WgmmaForward && Some(e.head_dim) == line_d && e.policies.seq >= seq
    });
    let served = gpu.fa.hopper_forward()
        && T::DTYPE != Dtype::F32
        && has_line
        && (hopper_rows.is_some() || !hopper_padded_short(head_dim, seqlen_k));
    let ran = flash_attn::hopper::launches_on_this_thread() - launches_before;
    if ran == served as u64 {
        Ok(())
    } else {
        Err(format!(
            "{what}: {ran} Hopper launches, want {} (hopper_forward() = {})",
            served as u64,
            gpu.fa.hopper_forward()
        ))
    }
}

/// Every element of `got` outside `layout`'s view is still the NaN it was
/// poisoned with.
fn check_untouched_outside<T: AttnElement>(
    got: &[T],
    layout: &Layout,
    what: &str,
) -> Result<(), String> {
    let [b, s, h, d] = layout.shape;
    let mut inside = vec![false; got.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let row = bi * layout.strides[0] + si * layout.strides[1] + hi * layout.strides[2];
                inside[row..row + d].fill(true);
            }
        }
    }
    match (0..got.len()).find(|&i| !inside[i] && !got[i].to_f64().is_nan()) {
        Some(i) => Err(format!(
            "{what}: element {i} outside O's view was written ({})",
            got[i].to_f64()
        )),
        None => Ok(()),
    }
}

/// Compares `got` (laid out by `layout`) with the contiguous reference, row
/// by row: each (b, s, h) row of D values must be within `abs_tol` of the
/// reference everywhere and within `rel_l2_tol` in relative L2 norm, so an
/// error confined to a few rows cannot hide in a norm over the tensor.
fn check_output<T: AttnElement>(
    got: &[T],
    layout: &Layout,
    want: &[f64],
    what: &str,
) -> Result<(), String> {
    let [b, s, h, d] = layout.shape;
    let (atol, rtol) = (abs_tol(T::DTYPE), rel_l2_tol(T::DTYPE, d));
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let (mut max_err, mut err2, mut ref2) = (0.0f64, 0.0f64, 0.0f64);
                for di in 0..d {
                    let g = got[bi * layout.strides[0]
                        + si * layout.strides[1]
                        + hi * layout.strides[2]
                        + di]
                        .to_f64();
                    let w = want[((bi * s + si) * h + hi) * d + di];
                    if !g.is_finite() {
                        return Err(format!(
                            "{what}: O[{bi},{si},{hi},{di}] = {g} (unwritten or NaN), want {w}"
                        ));
                    }
                    max_err = max_err.max((g - w).abs());
                    err2 += (g - w) * (g - w);
                    ref2 += w * w;
                }
                let rel = (err2 / ref2.max(1e-30)).sqrt();
                if max_err > atol || (ref2 > 1e-6 && rel > rtol) {
                    return Err(format!(
                        "{what}: row [{bi},{si},{hi}]: max |err| {max_err:.3e} (tol {atol:.1e}), \
                         rel L2 {rel:.3e} (tol {rtol:.1e})"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn check_lse(got: &[f32], want: &[f64], what: &str) -> Result<(), String> {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY {
            g == f32::NEG_INFINITY
        } else {
            (g as f64 - w).abs() <= LSE_TOL
        };
        if !ok {
            return Err(format!("{what}: lse[{i}] = {g}, want {w}"));
        }
    }
    Ok(())
}

/// One forward case. `packed_qkv` lays Q, K, V out as slices of one
/// [B, S, 3H, D] buffer (non-contiguous strides), which needs Sq == Skv, H == Hkv.
#[derive(Clone, Debug)]
struct FwdCase {
    batch: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    with_lse: bool,
    packed_qkv: bool,
    seed: u64,
    /// `AttnOptions::hopper_rows`: which Hopper line of the head dim runs.
    hopper_rows: Option<usize>,
    /// `AttnOptions::hopper_persistent`: its persistent twin, if any.
    hopper_persistent: Option<bool>,
    /// `AttnOptions::hopper_keys`: its line of that many keys per block, if any.
    hopper_keys: Option<usize>,
}

fn run_forward<T: AttnElement>(gpu: &Gpu, c: &FwdCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (b, sq, sk, h, hk, d) = (
        c.batch, c.seqlen_q, c.seqlen_k, c.heads, c.kv_heads, c.head_dim,
    );
    let q_layout = Layout::contiguous([b, sq, h, d]);
    let kv_layout = Layout::contiguous([b, sk, hk, d]);
    let q_host = random_values::<T>(&mut rng, b * sq * h * d);
    let k_host = random_values::<T>(&mut rng, b * sk * hk * d);
    let v_host = random_values::<T>(&mut rng, b * sk * hk * d);
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();

    // Either three contiguous tensors or three strided views into one QKV buffer.
    let (bufs, layouts, offsets): (Vec<CudaSlice<T>>, [Layout; 3], [usize; 3]) = if c.packed_qkv {
        assert!(sq == sk && h == hk);
        let mut packed = vec![T::from_f64(0.0); b * sq * 3 * h * d];
        for (which, src) in [&q_host, &k_host, &v_host].into_iter().enumerate() {
            for bi in 0..b {
                for si in 0..sq {
                    for hi in 0..h {
                        let from = ((bi * sq + si) * h + hi) * d;
                        let to = ((bi * sq + si) * 3 * h + which * h + hi) * d;
                        packed[to..to + d].copy_from_slice(&src[from..from + d]);
                    }
                }
            }
        }
        let l = Layout {
            shape: [b, sq, h, d],
            strides: [sq * 3 * h * d, 3 * h * d, d, 1],
        };
        (
            vec![s.clone_htod(&packed).map_err(e)?],
            [l, l, l],
            [0, h * d, 2 * h * d],
        )
    } else {
        let q = s.clone_htod(&q_host).map_err(e)?;
        let k = s.clone_htod(&k_host).map_err(e)?;
        let v = s.clone_htod(&v_host).map_err(e)?;
        (vec![q, k, v], [q_layout, kv_layout, kv_layout], [0, 0, 0])
    };
    let buf = |i: usize| if c.packed_qkv { &bufs[0] } else { &bufs[i] };
    let view = |i: usize| TensorRef::new(buf(i).slice(offsets[i]..), layouts[i]);

    // O's heads [`O_GAP`] elements apart: a kernel that writes past the
    // head dim (a Hopper line that serves a smaller one stores only its
    // first columns) hits the gap.
    let o_layout = gapped_layout([b, sq, h, d]);
    let o_len = b * o_layout.strides[0];
    let launches = flash_attn::hopper::launches_on_this_thread();
    let mut o = s.clone_htod(&vec![nan::<T>(); o_len]).map_err(e)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    let opts = AttnOptions {
        causal: c.causal,
        softmax_scale: None,
        hopper_rows: c.hopper_rows,
        hopper_persistent: c.hopper_persistent,
        hopper_keys: c.hopper_keys,
        ..Default::default()
    };
    {
        gpu.fa
            .forward(
                s,
                Qkv {
                    q: &view(0),
                    k: &view(1),
                    v: &view(2),
                },
                Out {
                    o: TensorMut::new(o.as_view_mut(), o_layout),
                    lse: c.with_lse.then_some(lse.as_view_mut()),
                },
                &opts,
            )
            .map_err(|x| x.to_string())?;
    }
    check_forward_path::<T>(
        gpu,
        (d, c.seqlen_k, c.hopper_rows),
        launches,
        &format!("{c:?}"),
    )?;
    let o_host = s.clone_dtoh(&o).map_err(e)?;
    let lse_host = s.clone_dtoh(&lse).map_err(e)?;

    let shape = ForwardShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        causal: c.causal,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        ..Default::default()
    };
    let want = reference::attention(&shape, &to_f64(&q_host), &to_f64(&k_host), &to_f64(&v_host));
    check_output(&o_host, &o_layout, &want.o, &format!("{c:?}"))?;
    check_untouched_outside(&o_host, &o_layout, &format!("{c:?}"))?;
    if c.with_lse {
        check_lse(&lse_host, &want.lse, &format!("{c:?}"))?;
    } else if lse_host.iter().any(|x| !x.is_nan()) {
        return Err(format!("{c:?}: lse was written although not requested"));
    }
    Ok(())
}

#[derive(Clone, Debug)]
struct DecodeCase {
    batch: usize,
    seqlen_q: usize,
    cache_len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    /// Per-sequence key counts; entries may be 1 or cache_len.
    seqlens: Vec<i32>,
    seed: u64,
}

impl DecodeCase {
    /// The call's shape, at the default scale 1/sqrt(D).
    fn shape(&self) -> DecodeShape {
        DecodeShape {
            batch: self.batch,
            seqlen_q: self.seqlen_q,
            cache_len: self.cache_len,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            causal: self.causal,
            softmax_scale: 1.0 / (self.head_dim as f32).sqrt(),
            ..Default::default()
        }
    }
}

fn run_decode<T: AttnElement>(gpu: &Gpu, c: &DecodeCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (b, sq, l, h, hk, d) = (
        c.batch,
        c.seqlen_q,
        c.cache_len,
        c.heads,
        c.kv_heads,
        c.head_dim,
    );
    let q_layout = Layout::contiguous([b, sq, h, d]);
    let cache_layout = Layout::contiguous([b, l, hk, d]);
    let q_host = random_values::<T>(&mut rng, b * sq * h * d);
    let k_host = random_values::<T>(&mut rng, b * l * hk * d);
    let v_host = random_values::<T>(&mut rng, b * l * hk * d);
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let q = s.clone_htod(&q_host).map_err(e)?;
    let k = s.clone_htod(&k_host).map_err(e)?;
    let v = s.clone_htod(&v_host).map_err(e)?;
    let seqlens = s.clone_htod(&c.seqlens).map_err(e)?;
    let mut o = s.clone_htod(&vec![nan::<T>(); b * sq * h * d]).map_err(e)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    let opts = AttnOptions {
        causal: c.causal,
        softmax_scale: None,
        ..Default::default()
    };
    {
        gpu.fa
            .decode(
                s,
                Qkv {
                    q: &TensorRef::new(q.as_view(), q_layout),
                    k: &TensorRef::new(k.as_view(), cache_layout),
                    v: &TensorRef::new(v.as_view(), cache_layout),
                },
                &seqlens.as_view(),
                Out::with_lse(TensorMut::new(o.as_view_mut(), q_layout), lse.as_view_mut()),
                &opts,
                None,
            )
            .map_err(|x| x.to_string())?;
    }
    let o_host = s.clone_dtoh(&o).map_err(e)?;
    let lse_host = s.clone_dtoh(&lse).map_err(e)?;
    let shape = c.shape();
    let want = reference::decode(
        &shape,
        &to_f64(&q_host),
        &to_f64(&k_host),
        &to_f64(&v_host),
        &c.seqlens,
    );
    expect_fold::<T>(gpu, &shape)?;
    let splits = gpu.fa.decode_splits::<T>(&shape);
    check_output(
        &o_host,
        &q_layout,
        &want.o,
        &format!("{c:?} splits={splits}"),
    )?;
    check_lse(&lse_host, &want.lse, &format!("{c:?} splits={splits}"))
}

/// One decode step over 2 sequences of a cache of 4 KV heads (MHA, D = 64)
/// whose heads are `pitch` elements apart (64: adjacent; more: NaN gaps),
/// with K's element 3 of head 0 at key 5 replaced by `k_poison` if given;
/// O, and the reference of the unpoisoned inputs.
struct PairProbe<T> {
    o: Vec<T>,
    want: Vec<f64>,
    shape: DecodeShape,
    q_layout: Layout,
}

fn pair_probe<T: AttnElement>(
    fa: &FlashAttention,
    s: &Arc<CudaStream>,
    pitch: usize,
    k_poison: Option<f64>,
) -> Result<PairProbe<T>, String> {
    let (b, l, h, hk, d) = (2, 200, 4, 4, 64);
    let seqlens = vec![200i32, 77];
    let mut rng = StdRng::seed_from_u64(0xf01d);
    let q_layout = Layout::contiguous([b, 1, h, d]);
    let cache_layout = Layout {
        shape: [b, l, hk, d],
        strides: [l * hk * pitch, hk * pitch, pitch, 1],
    };
    let q_host = random_values::<T>(&mut rng, b * h * d);
    let k_host = random_values::<T>(&mut rng, b * l * hk * d);
    let v_host = random_values::<T>(&mut rng, b * l * hk * d);
    let spread = |x: &[T]| {
        let mut out = vec![nan::<T>(); b * l * hk * pitch];
        for (row, chunk) in x.chunks(d).enumerate() {
            out[row * pitch..row * pitch + d].copy_from_slice(chunk);
        }
        out
    };
    let mut k_dev = spread(&k_host);
    if let Some(x) = k_poison {
        k_dev[5 * hk * pitch + 3] = T::from_f64(x);
    }
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let q = s.clone_htod(&q_host).map_err(e)?;
    let k = s.clone_htod(&k_dev).map_err(e)?;
    let v = s.clone_htod(&spread(&v_host)).map_err(e)?;
    let lens = s.clone_htod(&seqlens).map_err(e)?;
    let mut o = s.clone_htod(&vec![nan::<T>(); b * h * d]).map_err(e)?;
    fa.decode(
        s,
        Qkv {
            q: &TensorRef::new(q.as_view(), q_layout),
            k: &TensorRef::new(k.as_view(), cache_layout),
            v: &TensorRef::new(v.as_view(), cache_layout),
        },
        &lens.as_view(),
        Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
        &AttnOptions {
            causal: true,
            ..Default::default()
        },
        None,
    )
    .map_err(|x| x.to_string())?;
    let shape = DecodeShape {
        batch: b,
        seqlen_q: 1,
        cache_len: l,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        causal: true,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        ..Default::default()
    };
    let want = reference::decode(
        &shape,
        &to_f64(&q_host),
        &to_f64(&k_host),
        &to_f64(&v_host),
        &seqlens,
    );
    Ok(PairProbe {
        o: s.clone_dtoh(&o).map_err(e)?,
        want: want.o,
        shape,
        q_layout,
    })
}

/// A cache whose heads are not adjacent (head stride D + 8, the gaps NaN)
/// does not fold, even on a [`Gpu::folding`] instance: a folded launch
/// would read the gap into the first head of each pair's scores.
fn decode_fold_needs_adjacent_heads<T: AttnElement>(gpu: &Gpu) -> Result<(), String> {
    let p = pair_probe::<T>(&gpu.fa, &gpu.stream, 64 + O_GAP, None)?;
    if gpu.fa.decode_kv_fold::<T>(&p.shape) != 2 {
        return Err("the shape would not fold with adjacent heads: the test checks nothing".into());
    }
    check_output(&p.o, &p.q_layout, &p.want, "gapped heads")
}

/// A cache whose heads are adjacent is read in pairs on a [`Gpu::folding`]
/// instance, seen through the fold's one visible effect (`KvFold`): an
/// infinite K element of head 0 makes head 1's output NaN (zero times it),
/// which it leaves finite with the fold off. `expect_fold` asks the planner,
/// which assumes adjacent heads; this checks the call's own decision.
fn decode_fold_reads_adjacent_heads_in_pairs<T: AttnElement>(gpu: &Gpu) -> Result<(), String> {
    let off = FlashAttention::new(gpu.fa.context()).map_err(|x| x.to_string())?;
    off.set_kv_fold(KvFold::Off);
    let head1_nan = |o: &[T]| {
        // O is [2, 1, 4, 64]: head 1 of each sequence.
        (0..2).any(|b| {
            o[(b * 4 + 1) * 64..(b * 4 + 2) * 64]
                .iter()
                .any(|x| x.to_f64().is_nan())
        })
    };
    let unfolded = pair_probe::<T>(&off, &gpu.stream, 64, Some(f64::INFINITY))?;
    if head1_nan(&unfolded.o) {
        return Err("unfolded, head 0's infinite K reached head 1".into());
    }
    let folded = pair_probe::<T>(&gpu.fa, &gpu.stream, 64, Some(f64::INFINITY))?;
    if !head1_nan(&folded.o) {
        return Err("KvFold::On left head 1 finite: the adjacent cache was not folded".into());
    }
    // And without the poison the folded call is exact.
    let clean = pair_probe::<T>(&gpu.fa, &gpu.stream, 64, None)?;
    check_output(
        &clean.o,
        &clean.q_layout,
        &clean.want,
        "adjacent heads, folded",
    )
}

/// A KV-cache decode case: contiguous or paged, optionally appending
/// `seqlen_new` tokens before attending.
#[derive(Clone, Debug)]
struct KvCase {
    batch: usize,
    seqlen_q: usize,
    seqlen_new: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    /// `Some(page_size)` for a paged cache of `max_pages` pages per sequence.
    page_size: Option<usize>,
    max_pages: usize,
    /// Tokens already in the cache, before the append.
    seqlens: Vec<i32>,
    seed: u64,
}

impl KvCase {
    fn capacity(&self) -> usize {
        self.page_size
            .map_or(self.max_pages, |p| p * self.max_pages)
    }
}

/// Logical [B, cap, Hkv, D] cache rows as pool rows: entry (b, i) of `table`
/// holds tokens `i * page..` of sequence b.
fn pool_index(
    table: &[i32],
    max_pages: usize,
    page: usize,
    b: usize,
    pos: usize,
) -> (usize, usize) {
    (table[b * max_pages + pos / page] as usize, pos % page)
}

/// Host state of one KV-cache test: the logical caches (NaN past each
/// sequence), the page table, and the device buffers built from them.
struct KvState<T> {
    k_logical: Vec<T>,
    v_logical: Vec<T>,
    table: Vec<i32>,
    num_pages: usize,
}

fn make_kv_state<T: AttnElement>(c: &KvCase, rng: &mut StdRng) -> KvState<T> {
    let (b, cap, hk, d) = (c.batch, c.capacity(), c.kv_heads, c.head_dim);
    let mut k_logical = vec![nan::<T>(); b * cap * hk * d];
    let mut v_logical = vec![nan::<T>(); b * cap * hk * d];
    for bi in 0..b {
        let n = (c.seqlens[bi].max(0) as usize).min(cap);
        let (lo, hi) = (bi * cap * hk * d, (bi * cap + n) * hk * d);
        k_logical[lo..hi].copy_from_slice(&random_values::<T>(rng, hi - lo));
        v_logical[lo..hi].copy_from_slice(&random_values::<T>(rng, hi - lo));
    }
    // Pages of all sequences, shuffled, out of a pool with spare pages.
    let num_pages = b * c.max_pages + 3;
    let mut pages: Vec<i32> = (0..num_pages as i32).collect();
    for i in (1..pages.len()).rev() {
        pages.swap(i, rng.random_range(0..=i));
    }
    let table = pages[..b * c.max_pages].to_vec();
    KvState {
        k_logical,
        v_logical,
        table,
        num_pages,
    }
}

/// The device image of a logical cache: itself, or a NaN-filled page pool.
fn to_device_layout<T: AttnElement>(c: &KvCase, st: &KvState<T>, logical: &[T]) -> Vec<T> {
    let (cap, hk, d) = (c.capacity(), c.kv_heads, c.head_dim);
    let Some(page) = c.page_size else {
        return logical.to_vec();
    };
    let mut pool = vec![nan::<T>(); st.num_pages * page * hk * d];
    for bi in 0..c.batch {
        for pos in 0..cap {
            let (pg, row) = pool_index(&st.table, c.max_pages, page, bi, pos);
            let from = (bi * cap + pos) * hk * d;
            let to = (pg * page + row) * hk * d;
            pool[to..to + hk * d].copy_from_slice(&logical[from..from + hk * d]);
        }
    }
    pool
}

fn cache_layout(c: &KvCase, num_pages: usize) -> Layout {
    match c.page_size {
        Some(p) => Layout::contiguous([num_pages, p, c.kv_heads, c.head_dim]),
        None => Layout::contiguous([c.batch, c.capacity(), c.kv_heads, c.head_dim]),
    }
}

/// Writes new tokens into the logical caches as the append kernel should.
fn append_logical<T: AttnElement>(c: &KvCase, st: &mut KvState<T>, k_new: &[T], v_new: &[T]) {
    let (cap, hk, d, sn) = (c.capacity(), c.kv_heads, c.head_dim, c.seqlen_new);
    for bi in 0..c.batch {
        for t in 0..sn {
            let pos = c.seqlens[bi].max(0) as usize + t;
            if pos >= cap {
                continue;
            }
            let from = (bi * sn + t) * hk * d;
            let to = (bi * cap + pos) * hk * d;
            st.k_logical[to..to + hk * d].copy_from_slice(&k_new[from..from + hk * d]);
            st.v_logical[to..to + hk * d].copy_from_slice(&v_new[from..from + hk * d]);
        }
    }
}

fn kv_decode_shape(c: &KvCase) -> DecodeShape {
    DecodeShape {
        batch: c.batch,
        seqlen_q: c.seqlen_q,
        cache_len: c.capacity(),
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        causal: c.causal,
        softmax_scale: 1.0 / (c.head_dim as f32).sqrt(),
        ..Default::default()
    }
}

/// Compares the valid rows of the device cache with the expected logical one, bit for bit.
fn check_cache<T: AttnElement>(
    c: &KvCase,
    st: &KvState<T>,
    device: &[T],
    logical: &[T],
    what: &str,
) -> Result<(), String> {
    let (cap, hk, d) = (c.capacity(), c.kv_heads, c.head_dim);
    for bi in 0..c.batch {
        let valid = (c.seqlens[bi].max(0) as usize + c.seqlen_new).min(cap);
        for pos in 0..valid {
            let from = (bi * cap + pos) * hk * d;
            let at = match c.page_size {
                Some(p) => {
                    let (pg, row) = pool_index(&st.table, c.max_pages, p, bi, pos);
                    (pg * p + row) * hk * d
                }
                None => from,
            };
            if device[at..at + hk * d] != logical[from..from + hk * d] {
                return Err(format!(
                    "{what}: cache row b={bi} pos={pos} differs after the append"
                ));
            }
        }
    }
    Ok(())
}

fn run_kvcache<T: AttnElement>(gpu: &Gpu, c: &KvCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (b, sq, h, hk, d, sn) = (
        c.batch,
        c.seqlen_q,
        c.heads,
        c.kv_heads,
        c.head_dim,
        c.seqlen_new,
    );
    let mut st = make_kv_state::<T>(c, &mut rng);
    let q_layout = Layout::contiguous([b, sq, h, d]);
    let new_layout = Layout::contiguous([b, sn.max(1), hk, d]);
    let q_host = random_values::<T>(&mut rng, b * sq * h * d);
    let k_new = random_values::<T>(&mut rng, b * sn.max(1) * hk * d);
    let v_new = random_values::<T>(&mut rng, b * sn.max(1) * hk * d);
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let q = s.clone_htod(&q_host).map_err(e)?;
    let mut k_cache = s
        .clone_htod(&to_device_layout(c, &st, &st.k_logical))
        .map_err(e)?;
    let mut v_cache = s
        .clone_htod(&to_device_layout(c, &st, &st.v_logical))
        .map_err(e)?;
    let table = s.clone_htod(&st.table).map_err(e)?;
    let seqlens = s.clone_htod(&c.seqlens).map_err(e)?;
    let (k_new_dev, v_new_dev) = (
        s.clone_htod(&k_new).map_err(e)?,
        s.clone_htod(&v_new).map_err(e)?,
    );
    let mut o = s.clone_htod(&vec![nan::<T>(); b * sq * h * d]).map_err(e)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    let layout = cache_layout(c, st.num_pages);
    {
        let mut cache = KvCache {
            k: TensorMut::new(k_cache.as_view_mut(), layout),
            v: TensorMut::new(v_cache.as_view_mut(), layout),
            seqlens: seqlens.as_view(),
            block_table: c.page_size.map(|_| BlockTable {
                table: table.as_view(),
                max_pages: c.max_pages,
            }),
        };
        let (kn, vn) = (
            TensorRef::new(k_new_dev.as_view(), new_layout),
            TensorRef::new(v_new_dev.as_view(), new_layout),
        );
        gpu.fa
            .decode_kvcache(
                s,
                DecodeStep {
                    q: &TensorRef::new(q.as_view(), q_layout),
                    new_kv: if sn > 0 { Some((&kn, &vn)) } else { None },
                },
                &mut cache,
                Out::with_lse(TensorMut::new(o.as_view_mut(), q_layout), lse.as_view_mut()),
                &AttnOptions {
                    causal: c.causal,
                    softmax_scale: None,
                    ..Default::default()
                },
                None,
            )
            .map_err(|x| x.to_string())?;
    }
    expect_fold::<T>(gpu, &kv_decode_shape(c))?;
    append_logical(c, &mut st, &k_new, &v_new);
    let (k_dev, v_dev) = (
        s.clone_dtoh(&k_cache).map_err(e)?,
        s.clone_dtoh(&v_cache).map_err(e)?,
    );
    check_cache(c, &st, &k_dev, &st.k_logical, &format!("{c:?} K"))?;
    check_cache(c, &st, &v_dev, &st.v_logical, &format!("{c:?} V"))?;
    let attended: Vec<i32> = c
        .seqlens
        .iter()
        .map(|&n| (n.max(0) as usize + sn).min(c.capacity()) as i32)
        .collect();
    let want = reference::decode(
        &kv_decode_shape(c),
        &to_f64(&q_host),
        &to_f64(&st.k_logical),
        &to_f64(&st.v_logical),
        &attended,
    );
    check_output(
        &s.clone_dtoh(&o).map_err(e)?,
        &q_layout,
        &want.o,
        &format!("{c:?}"),
    )?;
    check_lse(
        &s.clone_dtoh(&lse).map_err(e)?,
        &want.lse,
        &format!("{c:?}"),
    )
}

fn kvcache_strategy() -> impl Strategy<Value = KvCase> {
    (
        1usize..=3,
        1usize..=3,
        0usize..=3,
        head_counts(),
        head_dims(),
        any::<bool>(),
        prop::option::of(prop::sample::select(vec![16usize, 32, 48, 64, 256])),
        any::<u64>(),
    )
        .prop_flat_map(
            |(
                batch,
                seqlen_q,
                seqlen_new,
                (heads, kv_heads),
                head_dim,
                causal,
                page_size,
                seed,
            )| {
                // Pages per sequence (paged) or the capacity itself (contiguous).
                let max_pages = match page_size {
                    Some(p) => (1usize..=(2048 / p).max(2)).boxed(),
                    None => (seqlen_new.max(1)..=1500usize).boxed(),
                };
                (
                    Just((
                        batch, seqlen_q, seqlen_new, heads, kv_heads, head_dim, causal, page_size,
                        seed,
                    )),
                    max_pages,
                )
            },
        )
        .prop_flat_map(
            |(
                (batch, seqlen_q, seqlen_new, heads, kv_heads, head_dim, causal, page_size, seed),
                max_pages,
            )| {
                let cap = page_size.map_or(max_pages, |p| p * max_pages);
                let room = (cap - seqlen_new.min(cap)) as i32;
                // Device-side lengths past the room drop the new tokens
                // without a slot; negative ones read as 0.
                let len = prop_oneof![
                    Just(room),
                    Just(1.min(room)),
                    0..=room,
                    room + 1..=cap as i32 + 2,
                    -2..=-1i32,
                ];
                prop::collection::vec(len, batch).prop_map(move |seqlens| KvCase {
                    batch,
                    seqlen_q,
                    seqlen_new,
                    heads,
                    kv_heads,
                    head_dim,
                    causal,
                    page_size,
                    max_pages,
                    seqlens,
                    seed,
                })
            },
        )
}

/// One decode step (append one token, then attend) captured in a CUDA graph and
/// replayed for several steps, the step's lengths and new K/V written to the
/// same device buffers before each replay.
fn graph_replay<T: AttnElement>() -> Result<(), String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let ctx = CudaContext::new(0).map_err(e)?;
    // Capture needs a non-default stream and no cross-stream event waits.
    unsafe { ctx.disable_event_tracking() };
    let s = ctx.new_stream().map_err(e)?;
    let fa = FlashAttention::new(&ctx).map_err(|x| x.to_string())?;
    let mut c = KvCase {
        batch: 2,
        seqlen_q: 1,
        seqlen_new: 1,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        causal: true,
        page_size: Some(64),
        max_pages: 40,
        seqlens: vec![700, 1],
        seed: 5,
    };
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (b, h, hk, d) = (c.batch, c.heads, c.kv_heads, c.head_dim);
    let mut st = make_kv_state::<T>(&c, &mut rng);
    let q_layout = Layout::contiguous([b, 1, h, d]);
    let new_layout = Layout::contiguous([b, 1, hk, d]);
    let layout = cache_layout(&c, st.num_pages);
    let mut k_cache = s
        .clone_htod(&to_device_layout(&c, &st, &st.k_logical))
        .map_err(e)?;
    let mut v_cache = s
        .clone_htod(&to_device_layout(&c, &st, &st.v_logical))
        .map_err(e)?;
    let table = s.clone_htod(&st.table).map_err(e)?;
    let mut seqlens = s.clone_htod(&c.seqlens).map_err(e)?;
    let mut q = s.alloc_zeros::<T>(b * h * d).map_err(e)?;
    let mut k_new = s.alloc_zeros::<T>(b * hk * d).map_err(e)?;
    let mut v_new = s.alloc_zeros::<T>(b * hk * d).map_err(e)?;
    let mut o = s.alloc_zeros::<T>(b * h * d).map_err(e)?;
    let shape = kv_decode_shape(&c);
    let mut workspace = fa
        .decode_workspace::<T>(&s, &shape)
        .map_err(|x| x.to_string())?;
    s.synchronize().map_err(e)?;

    s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e)?;
    let captured = {
        let mut cache = KvCache {
            k: TensorMut::new(k_cache.as_view_mut(), layout),
            v: TensorMut::new(v_cache.as_view_mut(), layout),
            seqlens: seqlens.as_view(),
            block_table: Some(BlockTable {
                table: table.as_view(),
                max_pages: c.max_pages,
            }),
        };
        let (kn, vn) = (
            TensorRef::new(k_new.as_view(), new_layout),
            TensorRef::new(v_new.as_view(), new_layout),
        );
        fa.decode_kvcache(
            &s,
            DecodeStep {
                q: &TensorRef::new(q.as_view(), q_layout),
                new_kv: Some((&kn, &vn)),
            },
            &mut cache,
            Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
            &AttnOptions {
                causal: true,
                softmax_scale: None,
                ..Default::default()
            },
            Some(&mut workspace),
        )
    };
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .map_err(e)?;
    captured.map_err(|x| x.to_string())?;
    let graph = graph.ok_or("stream capture produced no graph")?;
    if fa.decode_splits::<T>(&shape) < 2 {
        return Err("the captured step should exercise split-KV and the combine kernel".into());
    }

    for step in 0..6 {
        let q_host = random_values::<T>(&mut rng, b * h * d);
        let kn_host = random_values::<T>(&mut rng, b * hk * d);
        let vn_host = random_values::<T>(&mut rng, b * hk * d);
        s.memcpy_htod(&q_host, &mut q).map_err(e)?;
        s.memcpy_htod(&kn_host, &mut k_new).map_err(e)?;
        s.memcpy_htod(&vn_host, &mut v_new).map_err(e)?;
        s.memcpy_htod(&c.seqlens, &mut seqlens).map_err(e)?;
        graph.launch().map_err(e)?;
        s.synchronize().map_err(e)?;
        append_logical(&c, &mut st, &kn_host, &vn_host);
        let attended: Vec<i32> = c.seqlens.iter().map(|&n| n + 1).collect();
        let want = reference::decode(
            &shape,
            &to_f64(&q_host),
            &to_f64(&st.k_logical),
            &to_f64(&st.v_logical),
            &attended,
        );
        check_output(
            &s.clone_dtoh(&o).map_err(e)?,
            &q_layout,
            &want.o,
            &format!("graph step {step}"),
        )?;
        c.seqlens = attended;
    }
    Ok(())
}

/// Split decode steps that append new tokens first, issued back to back on
/// one stream with one workspace, each with its own inputs and checked only
/// after the last. Each cache holds NaN where its tokens are appended, so a
/// decode grid that reads the cache before the append grid's writes land
/// yields NaN; each cache must hold its step's tokens afterwards; and every
/// combine must read its own step's partials: also when both are
/// programmatic dependent launches whose CTAs start while the grid before
/// them still runs (the `sm_90` module's default). Steps append 1, 256 or
/// 2048 tokens: with 132 SMs the host lets the decode grid start at the
/// first two's append start (f16, bf16: 1 or 64 append CTAs beside 32 decode
/// CTAs) and at the last one's end (512 append CTAs). Run with those
/// launches, with plain ones, and with a 300-key window, outside which most
/// of a 2048-token step's tokens lie (read by no CTA, still appended).
fn chained_decode_steps<T: AttnElement>() -> Result<(), String> {
    const NEW: [usize; 3] = [1, 256, 2048];
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let ctx = CudaContext::new(0).map_err(e)?;
    let s = ctx.new_stream().map_err(e)?;
    let fa = FlashAttention::new(&ctx).map_err(|x| x.to_string())?;
    let (b, h, hk, d) = (2, 8, 1, 128);
    // Lengths before the append.
    let seqlens_host = vec![3000, 900];
    let l = 3000 + NEW[2];
    let shape = DecodeShape {
        batch: b,
        seqlen_q: 1,
        cache_len: l,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        causal: true,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        ..Default::default()
    };
    if fa.decode_splits::<T>(&shape) < 2 {
        return Err("the chained steps should exercise split-KV and the combine kernel".into());
    }
    let mut workspace = fa
        .decode_workspace::<T>(&s, &shape)
        .map_err(|x| x.to_string())?;
    let seqlens = s.clone_htod(&seqlens_host).map_err(e)?;
    let (q_layout, cache_layout) = (
        Layout::contiguous([b, 1, h, d]),
        Layout::contiguous([b, l, hk, d]),
    );
    let mut rng = StdRng::seed_from_u64(29);
    for (programmatic, window) in [
        (true, Window::UNBOUNDED),
        (false, Window::UNBOUNDED),
        (true, Window::left(300)),
    ] {
        fa.set_programmatic_launch(programmatic);
        let shape = DecodeShape { window, ..shape };
        let opts = AttnOptions {
            causal: true,
            softmax_scale: None,
            window,
            ..Default::default()
        };
        let mut steps = Vec::new();
        for new in NEW.into_iter().chain(NEW) {
            let row = hk * d;
            let q_host = random_values::<T>(&mut rng, b * h * d);
            let mut k_host = random_values::<T>(&mut rng, b * l * row);
            let mut v_host = random_values::<T>(&mut rng, b * l * row);
            let k_new = random_values::<T>(&mut rng, b * new * row);
            let v_new = random_values::<T>(&mut rng, b * new * row);
            let slots = |i: usize| {
                let start = (i * l + seqlens_host[i] as usize) * row;
                start..start + new * row
            };
            for i in 0..b {
                k_host[slots(i)].fill(nan::<T>());
                v_host[slots(i)].fill(nan::<T>());
            }
            let (q, mut k, mut v, kn, vn) = (
                s.clone_htod(&q_host).map_err(e)?,
                s.clone_htod(&k_host).map_err(e)?,
                s.clone_htod(&v_host).map_err(e)?,
                s.clone_htod(&k_new).map_err(e)?,
                s.clone_htod(&v_new).map_err(e)?,
            );
            let new_layout = Layout::contiguous([b, new, hk, d]);
            let mut o = s.clone_htod(&vec![nan::<T>(); b * h * d]).map_err(e)?;
            fa.decode_kvcache(
                &s,
                DecodeStep {
                    q: &TensorRef::new(q.as_view(), q_layout),
                    new_kv: Some((
                        &TensorRef::new(kn.as_view(), new_layout),
                        &TensorRef::new(vn.as_view(), new_layout),
                    )),
                },
                &mut KvCache {
                    k: TensorMut::new(k.as_view_mut(), cache_layout),
                    v: TensorMut::new(v.as_view_mut(), cache_layout),
                    seqlens: seqlens.as_view(),
                    block_table: None,
                },
                Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
                &opts,
                Some(&mut workspace),
            )
            .map_err(|x| x.to_string())?;
            for i in 0..b {
                let from = i * new * row..(i + 1) * new * row;
                k_host[slots(i)].copy_from_slice(&k_new[from.clone()]);
                v_host[slots(i)].copy_from_slice(&v_new[from]);
            }
            let attended: Vec<i32> = seqlens_host.iter().map(|&n| n + new as i32).collect();
            // The buffers live until the stream has run every step.
            steps.push((q_host, k_host, v_host, attended, o, (q, k, v, kn, vn)));
        }
        s.synchronize().map_err(e)?;
        for (i, (q_host, k_host, v_host, attended, o, (_, k, v, _, _))) in steps.iter().enumerate()
        {
            for (what, dev, want) in [("K", k, k_host), ("V", v, v_host)] {
                if s.clone_dtoh(dev).map_err(e)? != *want {
                    return Err(format!(
                        "step {i}: the {what} cache differs after the append"
                    ));
                }
            }
            let want = reference::decode(
                &shape,
                &to_f64(q_host),
                &to_f64(k_host),
                &to_f64(v_host),
                attended,
            );
            check_output(
                &s.clone_dtoh(o).map_err(e)?,
                &q_layout,
                &want.o,
                &format!(
                    "step {i}, programmatic launches {}, {window:?}",
                    fa.programmatic_launch()
                ),
            )?;
        }
    }
    Ok(())
}

/// Random Q, K and V (`nq`, `nkv`, `nkv` elements) on the host and the device.
struct Inputs<T> {
    q_host: Vec<T>,
    k_host: Vec<T>,
    v_host: Vec<T>,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
}

fn random_inputs<T: AttnElement>(
    gpu: &Gpu,
    rng: &mut StdRng,
    [q, k, v]: [&Layout; 3],
) -> Result<Inputs<T>, String> {
    // Contiguous layouts: their elements are the product of their shapes.
    let len = |l: &Layout| l.shape.iter().product();
    let (q_host, k_host, v_host) = (
        random_values::<T>(rng, len(q)),
        random_values::<T>(rng, len(k)),
        random_values::<T>(rng, len(v)),
    );
    upload_inputs(gpu, q_host, k_host, v_host)
}

/// Q, K and V on the device beside their host copies.
fn upload_inputs<T: AttnElement>(
    gpu: &Gpu,
    q_host: Vec<T>,
    k_host: Vec<T>,
    v_host: Vec<T>,
) -> Result<Inputs<T>, String> {
    let up = |x: &[T]| gpu.stream.clone_htod(x).map_err(|e| e.to_string());
    Ok(Inputs {
        q: up(&q_host)?,
        k: up(&k_host)?,
        v: up(&v_host)?,
        q_host,
        k_host,
        v_host,
    })
}

/// A dense forward of `x` (laid out as `[ql, kl, vl]`) into O (`ol`) and
/// the LSE.
fn forward_with_lse<T: AttnElement>(
    gpu: &Gpu,
    x: &Inputs<T>,
    [ql, kl, vl]: [Layout; 3],
    (o, ol): (&mut CudaSlice<T>, Layout),
    lse: &mut CudaSlice<f32>,
    opts: &AttnOptions,
) -> Result<(), String> {
    gpu.fa
        .forward(
            &gpu.stream,
            Qkv {
                q: &TensorRef::new(x.q.as_view(), ql),
                k: &TensorRef::new(x.k.as_view(), kl),
                v: &TensorRef::new(x.v.as_view(), vl),
            },
            Out::with_lse(TensorMut::new(o.as_view_mut(), ol), lse.as_view_mut()),
            opts,
        )
        .map_err(|x| x.to_string())
}

/// A device buffer of `n` NaNs, so unwritten outputs cannot pass.
fn poisoned<T: AttnElement>(gpu: &Gpu, n: usize) -> Result<CudaSlice<T>, String> {
    gpu.stream
        .clone_htod(&vec![nan::<T>(); n])
        .map_err(|e| e.to_string())
}

/// The policies of one case, with the device-side values drawn per case.
#[derive(Clone, Debug)]
struct Policy {
    causal: bool,
    window: Window,
    softcap: Option<f32>,
    /// None, Some(false): slopes [H], Some(true): slopes [B, H].
    alibi: Option<bool>,
    sinks: bool,
}

fn policy_strategy() -> impl Strategy<Value = Policy> {
    let bound =
        prop_oneof![2 => Just(None), 1 => Just(Some(0usize)), 2 => (1usize..=400).prop_map(Some)];
    (
        any::<bool>(),
        bound.clone(),
        bound,
        prop::option::weighted(0.4, 0.5f32..30.0),
        prop::option::weighted(0.4, any::<bool>()),
        prop::bool::weighted(0.4),
    )
        .prop_map(|(causal, left, right, softcap, alibi, sinks)| Policy {
            causal,
            window: Window { left, right },
            softcap,
            alibi,
            sinks,
        })
}

/// Host values and device buffers of a case's ALiBi slopes and sinks.
struct PolicyData {
    slopes: Option<(Vec<f64>, CudaSlice<f32>)>,
    sinks: Option<(Vec<f64>, CudaSlice<f32>)>,
}

fn policy_data(
    gpu: &Gpu,
    pol: &Policy,
    batch: usize,
    heads: usize,
    rng: &mut StdRng,
) -> Result<PolicyData, String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let mut upload = |n: usize, lo: f32, hi: f32| -> Result<(Vec<f64>, CudaSlice<f32>), String> {
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
        let dev = gpu.stream.clone_htod(&v).map_err(e)?;
        Ok((v.iter().map(|&x| x as f64).collect(), dev))
    };
    let slopes = match pol.alibi {
        None => None,
        Some(per_batch) => Some(upload(
            if per_batch { batch * heads } else { heads },
            0.0,
            0.5,
        )?),
    };
    let sinks = if pol.sinks {
        Some(upload(heads, -2.0, 3.0)?)
    } else {
        None
    };
    Ok(PolicyData { slopes, sinks })
}

/// Runs `f` with the case's options and the reference's extras.
fn with_options<R>(
    pol: &Policy,
    data: &PolicyData,
    f: impl FnOnce(&AttnOptions, &reference::Extras) -> R,
) -> R {
    let slope_view = data.slopes.as_ref().map(|(_, d)| d.as_view());
    let sink_view = data.sinks.as_ref().map(|(_, d)| d.as_view());
    let opts = AttnOptions {
        causal: pol.causal,
        window: pol.window,
        softcap: pol.softcap,
        alibi_slopes: slope_view.as_ref().map(|v| {
            if pol.alibi == Some(true) {
                AlibiSlopes::PerBatchHead(v)
            } else {
                AlibiSlopes::PerHead(v)
            }
        }),
        sinks: sink_view.as_ref(),
        ..Default::default()
    };
    let extras = reference::Extras {
        alibi_slopes: data.slopes.as_ref().map(|(h, _)| h.as_slice()),
        sinks: data.sinks.as_ref().map(|(h, _)| h.as_slice()),
    };
    f(&opts, &extras)
}

#[derive(Clone, Debug)]
struct PolicyFwdCase {
    batch: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    policy: Policy,
    seed: u64,
    /// `AttnOptions::hopper_rows`.
    hopper_rows: Option<usize>,
    /// `AttnOptions::hopper_persistent`.
    hopper_persistent: Option<bool>,
    /// V's head dim ([`v_dim`]).
    v_head_dim: Option<usize>,
}

fn run_forward_policy<T: AttnElement>(gpu: &Gpu, c: &PolicyFwdCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (b, sq, sk, h, hk, d) = (
        c.batch, c.seqlen_q, c.seqlen_k, c.heads, c.kv_heads, c.head_dim,
    );
    let dv = v_dim(d, c.v_head_dim, c.seed);
    let (ql, kl, vl) = (
        Layout::contiguous([b, sq, h, d]),
        Layout::contiguous([b, sk, hk, d]),
        Layout::contiguous([b, sk, hk, dv]),
    );
    let x = random_inputs::<T>(gpu, &mut rng, [&ql, &kl, &vl])?;
    let data = policy_data(gpu, &c.policy, b, h, &mut rng)?;
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    // As in `run_forward`: O with gaps, and the path checked.
    let ol = gapped_layout([b, sq, h, dv]);
    let mut o = poisoned::<T>(gpu, b * ol.strides[0])?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    let launches = flash_attn::hopper::launches_on_this_thread();
    let shape = ForwardShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        v_head_dim: dv,
        causal: c.policy.causal,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        window: c.policy.window,
        softcap: c.policy.softcap,
    };
    let want = with_options(&c.policy, &data, |opts, extras| {
        let opts = &AttnOptions {
            hopper_rows: c.hopper_rows,
            hopper_persistent: c.hopper_persistent,
            ..*opts
        };
        forward_with_lse(gpu, &x, [ql, kl, vl], (&mut o, ol), &mut lse, opts)?;
        Ok::<_, String>(reference::attention_ext(
            &shape,
            &to_f64(&x.q_host),
            &to_f64(&x.k_host),
            &to_f64(&x.v_host),
            extras,
        ))
    })?;
    let what = format!("{c:?} dv={dv}");
    check_forward_path::<T>(gpu, (d, c.seqlen_k, c.hopper_rows), launches, &what)?;
    let o_host = s.clone_dtoh(&o).map_err(e)?;
    check_output(&o_host, &ol, &want.o, &what)?;
    check_untouched_outside(&o_host, &ol, &what)?;
    check_lse(&s.clone_dtoh(&lse).map_err(e)?, &want.lse, &what)
}

fn policy_fwd_strategy() -> impl Strategy<Value = PolicyFwdCase> {
    (
        1usize..=2,
        seqlen(),
        seqlen(),
        head_counts(),
        head_dims(),
        policy_strategy(),
        any::<u64>(),
    )
        .prop_map(
            |(batch, seqlen_q, seqlen_k, (heads, kv_heads), head_dim, policy, seed)| {
                PolicyFwdCase {
                    batch,
                    seqlen_q,
                    seqlen_k,
                    heads,
                    kv_heads,
                    head_dim,
                    policy,
                    seed,
                    hopper_rows: None,
                    hopper_persistent: None,
                    v_head_dim: None,
                }
            },
        )
}

#[derive(Clone, Debug)]
struct VarlenCase {
    /// (query, key) lengths per sequence; 0 and 1 included.
    lens: Vec<(usize, usize)>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    policy: Policy,
    seed: u64,
    /// `AttnOptions::hopper_rows` (packed sequences have 128-row lines).
    hopper_rows: Option<usize>,
}

fn run_varlen<T: AttnElement>(gpu: &Gpu, c: &VarlenCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (h, hk, d) = (c.heads, c.kv_heads, c.head_dim);
    let dv = v_dim(d, None, c.seed);
    let mut cu_q = vec![0i32];
    let mut cu_k = vec![0i32];
    for &(lq, lk) in &c.lens {
        cu_q.push(cu_q.last().unwrap() + lq as i32);
        cu_k.push(cu_k.last().unwrap() + lk as i32);
    }
    let (tq, tk) = (
        *cu_q.last().unwrap() as usize,
        *cu_k.last().unwrap() as usize,
    );
    let (tq, tk) = (tq.max(1), tk.max(1));
    let max_q = c.lens.iter().map(|l| l.0).max().unwrap().max(1);
    let max_k = c.lens.iter().map(|l| l.1).max().unwrap().max(1);
    let (ql, kl) = (Layout::packed([tq, h, d]), Layout::packed([tk, hk, d]));
    let (vl, ol) = (Layout::packed([tk, hk, dv]), Layout::packed([tq, h, dv]));
    let x = random_inputs::<T>(gpu, &mut rng, [&ql, &kl, &vl])?;
    let batch = c.lens.len();
    let data = policy_data(gpu, &c.policy, batch, h, &mut rng)?;
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let (cuq, cuk) = (
        s.clone_htod(&cu_q).map_err(e)?,
        s.clone_htod(&cu_k).map_err(e)?,
    );
    let mut o = poisoned::<T>(gpu, tq * h * dv)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; h * tq]).map_err(e)?;
    let shape = VarlenShape {
        batch,
        total_q: tq,
        total_k: tk,
        max_seqlen_q: max_q,
        max_seqlen_k: max_k,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        v_head_dim: dv,
        causal: c.policy.causal,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        window: c.policy.window,
        softcap: c.policy.softcap,
    };
    let launches = flash_attn::hopper::launches_on_this_thread();
    let want = with_options(&c.policy, &data, |opts, extras| {
        let (cq, ck) = (cuq.as_view(), cuk.as_view());
        let opts = &AttnOptions {
            hopper_rows: c.hopper_rows,
            ..*opts
        };
        gpu.fa
            .forward_varlen(
                s,
                Qkv {
                    q: &TensorRef::new(x.q.as_view(), ql),
                    k: &TensorRef::new(x.k.as_view(), kl),
                    v: &TensorRef::new(x.v.as_view(), vl),
                },
                Out::with_lse(TensorMut::new(o.as_view_mut(), ol), lse.as_view_mut()),
                &Varlen {
                    cu_seqlens_q: &cq,
                    cu_seqlens_k: &ck,
                    max_seqlen_q: max_q,
                    max_seqlen_k: max_k,
                },
                opts,
            )
            .map_err(|x| x.to_string())?;
        Ok::<_, String>(reference::varlen(
            &shape,
            &cu_q,
            &cu_k,
            &to_f64(&x.q_host),
            &to_f64(&x.k_host),
            &to_f64(&x.v_host),
            extras,
        ))
    })?;
    let what = format!("{c:?} dv={dv}");
    let path = (d, max_k, c.hopper_rows);
    check_path::<T>(gpu, path, SeqKind::Packed, launches, &what)?;
    check_packed_outputs(gpu, &o, &lse, &cu_q, (tq, h, dv), &want, &what)
}

/// Checks a varlen call's O [total_q, H, D] and LSE [H, total_q] against the
/// reference. Rows owned by no sequence (the padding row of an all-empty
/// batch) are not written: only the owned ones are compared.
fn check_packed_outputs<T: AttnElement>(
    gpu: &Gpu,
    o: &CudaSlice<T>,
    lse: &CudaSlice<f32>,
    cu_q: &[i32],
    (tq, h, d): (usize, usize, usize),
    want: &reference::RefOutput,
    what: &str,
) -> Result<(), String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let owned = *cu_q.last().unwrap() as usize;
    let o_host = gpu.stream.clone_dtoh(o).map_err(e)?;
    if owned > 0 {
        check_output(
            &o_host[..owned * h * d],
            &Layout::packed([owned, h, d]),
            &want.o[..owned * h * d],
            what,
        )?;
    }
    let lse_host = gpu.stream.clone_dtoh(lse).map_err(e)?;
    for hi in 0..h {
        let row = hi * tq;
        check_lse(
            &lse_host[row..row + owned],
            &want.lse[row..row + owned],
            &format!("{what} head {hi}"),
        )?;
    }
    Ok(())
}

fn varlen_strategy() -> impl Strategy<Value = VarlenCase> {
    let len = prop_oneof![1 => Just(0usize), 1 => Just(1usize), 4 => 2usize..=300];
    (
        prop::collection::vec((len.clone(), len), 1..=5),
        head_counts(),
        head_dims(),
        policy_strategy(),
        any::<u64>(),
    )
        .prop_map(
            |(lens, (heads, kv_heads), head_dim, policy, seed)| VarlenCase {
                lens,
                heads,
                kv_heads,
                head_dim,
                policy,
                seed,
                hopper_rows: None,
            },
        )
}

/// A packed sequence's last key block runs into the next sequence's rows
/// (a Hopper line's TMA box reads them): with the middle sequence's Q and K
/// all NaN and its V infinite or NaN, the other sequences' O and LSE still
/// match the reference. Those keys are masked, and their V rows must be
/// zeroed too, since P = 0 times an infinite V is NaN.
fn run_varlen_isolation<T: AttnElement>(
    gpu: &Gpu,
    head_dim: usize,
    causal: bool,
) -> Result<(), String> {
    let lens = [300usize, 200, 77];
    let (h, hk, d) = (4, 2, head_dim);
    let mut cu = vec![0i32];
    for l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    let total = *cu.last().unwrap() as usize;
    let bad = cu[1] as usize..cu[2] as usize;
    let mut rng = StdRng::seed_from_u64(17 + d as u64);
    let mut q_host = random_values::<T>(&mut rng, total * h * d);
    let mut k_host = random_values::<T>(&mut rng, total * hk * d);
    let mut v_host = random_values::<T>(&mut rng, total * hk * d);
    q_host[bad.start * h * d..bad.end * h * d].fill(nan::<T>());
    k_host[bad.start * hk * d..bad.end * hk * d].fill(nan::<T>());
    for (i, x) in v_host[bad.start * hk * d..bad.end * hk * d]
        .iter_mut()
        .enumerate()
    {
        *x = T::from_f64(if i % 3 == 0 { f64::NAN } else { f64::INFINITY });
    }
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let up = |x: &[T]| s.clone_htod(x).map_err(e);
    let (q, k, v, cu_d) = (
        up(&q_host)?,
        up(&k_host)?,
        up(&v_host)?,
        s.clone_htod(&cu).map_err(e)?,
    );
    let mut o = poisoned::<T>(gpu, total * h * d)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; h * total]).map_err(e)?;
    let (ql, kvl) = (
        Layout::packed([total, h, d]),
        Layout::packed([total, hk, d]),
    );
    let max = *lens.iter().max().unwrap();
    let launches = flash_attn::hopper::launches_on_this_thread();
    let cu_view = cu_d.as_view();
    gpu.fa
        .forward_varlen(
            s,
            Qkv {
                q: &TensorRef::new(q.as_view(), ql),
                k: &TensorRef::new(k.as_view(), kvl),
                v: &TensorRef::new(v.as_view(), kvl),
            },
            Out::with_lse(TensorMut::new(o.as_view_mut(), ql), lse.as_view_mut()),
            &Varlen {
                cu_seqlens_q: &cu_view,
                cu_seqlens_k: &cu_view,
                max_seqlen_q: max,
                max_seqlen_k: max,
            },
            &AttnOptions {
                causal,
                ..Default::default()
            },
        )
        .map_err(|x| x.to_string())?;
    let what = format!("isolation D={d} causal={causal}");
    check_path::<T>(gpu, (d, max, None), SeqKind::Packed, launches, &what)?;
    let shape = VarlenShape {
        batch: lens.len(),
        total_q: total,
        total_k: total,
        max_seqlen_q: max,
        max_seqlen_k: max,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        v_head_dim: d,
        causal,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        window: Window::default(),
        softcap: None,
    };
    let want = reference::varlen(
        &shape,
        &cu,
        &cu,
        &to_f64(&q_host),
        &to_f64(&k_host),
        &to_f64(&v_host),
        &reference::Extras::default(),
    );
    let o_host = s.clone_dtoh(&o).map_err(e)?;
    let lse_host = s.clone_dtoh(&lse).map_err(e)?;
    for b in [0, 2] {
        let rows = cu[b] as usize..cu[b + 1] as usize;
        let span = rows.start * h * d..rows.end * h * d;
        let layout = Layout::packed([rows.len(), h, d]);
        let what = format!("{what}, sequence {b}");
        check_output(&o_host[span.clone()], &layout, &want.o[span], &what)?;
        for hi in 0..h {
            let span = hi * total + rows.start..hi * total + rows.end;
            check_lse(&lse_host[span.clone()], &want.lse[span], &what)?;
        }
    }
    Ok(())
}

/// Packed sequences on the Hopper lines: their head dims (with rows asked
/// for or not, so D = 32 runs its line too), longer sequences whose tiles
/// and key blocks cross into the next sequence's rows (which the kernel
/// must mask and not store), empty ones and ones of a single row.
fn hopper_varlen_strategy() -> impl Strategy<Value = VarlenCase> {
    let len = prop_oneof![1 => Just(0usize), 1 => Just(1usize), 5 => 2usize..=700];
    (
        varlen_strategy(),
        prop::collection::vec((len.clone(), len), 1..=6),
        hopper_line(),
    )
        .prop_map(|(c, lens, (head_dim, hopper_rows))| VarlenCase {
            lens,
            head_dim,
            hopper_rows,
            ..c
        })
}

/// Packed queries against a paged KV cache (chunked prefill). The
/// device-side key counts may be negative or past the capacity
/// `page_size x max_pages`: the kernel clamps them to `[0, capacity]`.
#[derive(Clone, Debug)]
struct PagedVarlenCase {
    /// (query rows, device-side key count) per sequence.
    lens: Vec<(usize, i32)>,
    page_size: usize,
    max_pages: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    policy: Policy,
    seed: u64,
    /// `AttnOptions::hopper_rows` (the paged lines have 128 rows).
    hopper_rows: Option<usize>,
}

fn run_varlen_paged<T: AttnElement>(gpu: &Gpu, c: &PagedVarlenCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (h, hk, d, batch) = (c.heads, c.kv_heads, c.head_dim, c.lens.len());
    // V's own head dim: the first `dv` columns of a D-wide pool, read
    // through a layout of V's shape with the pool's strides.
    let dv = v_dim(d, None, c.seed);
    // The cache as the decode tests build it: each sequence's first
    // (clamped) keys random, the rest NaN, pages shuffled in a pool with
    // spare NaN pages, so any read past a sequence poisons its output.
    let kv = KvCase {
        batch,
        seqlen_q: 0,
        seqlen_new: 0,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        causal: false,
        page_size: Some(c.page_size),
        max_pages: c.max_pages,
        seqlens: c.lens.iter().map(|l| l.1).collect(),
        seed: c.seed,
    };
    let cap = kv.capacity();
    let st = make_kv_state::<T>(&kv, &mut rng);
    let mut cu_q = vec![0i32];
    let mut cu_k = vec![0i32];
    let (mut k_packed, mut v_packed) = (Vec::new(), Vec::new());
    for (bi, &(lq, n)) in c.lens.iter().enumerate() {
        let keys = (n.max(0) as usize).min(cap);
        let rows = bi * cap * hk * d..(bi * cap + keys) * hk * d;
        k_packed.extend(to_f64(&st.k_logical[rows.clone()]));
        for v_row in st.v_logical[rows].chunks(d) {
            v_packed.extend(to_f64(&v_row[..dv]));
        }
        cu_q.push(cu_q.last().unwrap() + lq as i32);
        cu_k.push(cu_k.last().unwrap() + keys as i32);
    }
    let tq = (*cu_q.last().unwrap() as usize).max(1);
    let tk = *cu_k.last().unwrap() as usize;
    let max_q = c.lens.iter().map(|l| l.0).max().unwrap().max(1);
    let ql = Layout::packed([tq, h, d]);
    let pool = cache_layout(&kv, st.num_pages);
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let q_host = random_values::<T>(&mut rng, tq * h * d);
    let q = s.clone_htod(&q_host).map_err(e)?;
    let k_pool = s
        .clone_htod(&to_device_layout(&kv, &st, &st.k_logical))
        .map_err(e)?;
    let v_pool = s
        .clone_htod(&to_device_layout(&kv, &st, &st.v_logical))
        .map_err(e)?;
    let cuq = s.clone_htod(&cu_q).map_err(e)?;
    let seqlens_k = s.clone_htod(&kv.seqlens).map_err(e)?;
    let table = s.clone_htod(&st.table).map_err(e)?;
    let data = policy_data(gpu, &c.policy, batch, h, &mut rng)?;
    let v_pool_layout = Layout {
        shape: [pool.shape[0], pool.shape[1], pool.shape[2], dv],
        ..pool
    };
    let ol = Layout::packed([tq, h, dv]);
    let mut o = poisoned::<T>(gpu, tq * h * dv)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; h * tq]).map_err(e)?;
    let shape = VarlenShape {
        batch,
        total_q: tq,
        total_k: tk,
        max_seqlen_q: max_q,
        max_seqlen_k: cap,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        v_head_dim: dv,
        causal: c.policy.causal,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        window: c.policy.window,
        softcap: c.policy.softcap,
    };
    let launches = flash_attn::hopper::launches_on_this_thread();
    let want = with_options(&c.policy, &data, |opts, extras| {
        let (cq, sk) = (cuq.as_view(), seqlens_k.as_view());
        let block_table = BlockTable {
            table: table.as_view(),
            max_pages: c.max_pages,
        };
        let opts = &AttnOptions {
            hopper_rows: c.hopper_rows,
            ..*opts
        };
        gpu.fa
            .forward_varlen_paged(
                s,
                Qkv {
                    q: &TensorRef::new(q.as_view(), ql),
                    k: &TensorRef::new(k_pool.as_view(), pool),
                    v: &TensorRef::new(v_pool.as_view(), v_pool_layout),
                },
                Out::with_lse(TensorMut::new(o.as_view_mut(), ol), lse.as_view_mut()),
                &PagedVarlen {
                    cu_seqlens_q: &cq,
                    max_seqlen_q: max_q,
                    seqlens_k: &sk,
                    block_table: &block_table,
                },
                opts,
            )
            .map_err(|x| x.to_string())?;
        Ok::<_, String>(reference::varlen(
            &shape,
            &cu_q,
            &cu_k,
            &to_f64(&q_host),
            &k_packed,
            &v_packed,
            extras,
        ))
    })?;
    let what = format!("{c:?} dv={dv}");
    let path = (d, cap, c.hopper_rows);
    check_path::<T>(gpu, path, SeqKind::Ragged, launches, &what)?;
    check_packed_outputs(gpu, &o, &lse, &cu_q, (tq, h, dv), &want, &what)
}

fn varlen_paged_strategy() -> impl Strategy<Value = PagedVarlenCase> {
    let q_len = prop_oneof![1 => Just(0usize), 1 => Just(1usize), 4 => 2usize..=200];
    let k_len = prop_oneof![1 => -3i32..=0, 1 => Just(1i32), 6 => 2i32..=700];
    (
        prop::collection::vec((q_len, k_len), 1..=4),
        // Below, at and above the forward tiles' 32/64-key blocks: pages that
        // split a block are read row by row.
        prop::sample::select(vec![16usize, 48, 64, 256]),
        // Some capacities are one page short of the longest sequence.
        prop::bool::weighted(0.3),
        head_counts(),
        head_dims(),
        policy_strategy(),
        any::<u64>(),
    )
        .prop_map(
            |(lens, page_size, short, (heads, kv_heads), head_dim, policy, seed)| {
                let longest = lens.iter().map(|l| l.1.max(1) as usize).max().unwrap();
                let pages = longest.div_ceil(page_size);
                PagedVarlenCase {
                    lens,
                    page_size,
                    max_pages: if short { pages.max(2) - 1 } else { pages },
                    heads,
                    kv_heads,
                    head_dim,
                    policy,
                    seed,
                    hopper_rows: None,
                }
            },
        )
}

/// Chunked prefill on the Hopper lines: their head dims, pages smaller than,
/// equal to and larger than a key block and ones that do not divide it (the
/// boxes are `index::paged_box_rows` rows), longer key counts than
/// `varlen_paged_strategy`'s.
fn hopper_varlen_paged_strategy() -> impl Strategy<Value = PagedVarlenCase> {
    let k_len = prop_oneof![1 => -3i32..=0, 1 => Just(1i32), 6 => 2i32..=1100];
    (
        varlen_paged_strategy(),
        prop::collection::vec(k_len, 4),
        prop::sample::select(vec![16usize, 48, 64, 128, 256]),
        prop::bool::weighted(0.3),
        hopper_line(),
    )
        .prop_map(|(c, keys, page_size, short, (head_dim, hopper_rows))| {
            let lens: Vec<(usize, i32)> = c.lens.iter().zip(keys).map(|(l, k)| (l.0, k)).collect();
            let longest = lens.iter().map(|l| l.1.max(1) as usize).max().unwrap();
            let pages = longest.div_ceil(page_size);
            PagedVarlenCase {
                lens,
                page_size,
                max_pages: if short { pages.max(2) - 1 } else { pages },
                head_dim,
                hopper_rows,
                ..c
            }
        })
}

#[derive(Clone, Debug)]
struct PolicyDecodeCase {
    batch: usize,
    seqlen_q: usize,
    cache_len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seqlens: Vec<i32>,
    policy: Policy,
    /// Forced split count (`AttnOptions::num_splits`), else the heuristic's.
    num_splits: Option<usize>,
    seed: u64,
}

fn run_decode_policy<T: AttnElement>(gpu: &Gpu, c: &PolicyDecodeCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (b, sq, l, h, hk, d) = (
        c.batch,
        c.seqlen_q,
        c.cache_len,
        c.heads,
        c.kv_heads,
        c.head_dim,
    );
    let ql = Layout::contiguous([b, sq, h, d]);
    let cl = Layout::contiguous([b, l, hk, d]);
    let x = random_inputs::<T>(gpu, &mut rng, [&ql, &cl, &cl])?;
    let data = policy_data(gpu, &c.policy, b, h, &mut rng)?;
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let seqlens = s.clone_htod(&c.seqlens).map_err(e)?;
    let mut o = poisoned::<T>(gpu, b * sq * h * d)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    let shape = DecodeShape {
        batch: b,
        seqlen_q: sq,
        cache_len: l,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        causal: c.policy.causal,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        window: c.policy.window,
        softcap: c.policy.softcap,
        num_splits: c.num_splits,
    };
    let want = with_options(&c.policy, &data, |opts, extras| {
        let opts = &AttnOptions {
            num_splits: c.num_splits,
            ..*opts
        };
        gpu.fa
            .decode(
                s,
                Qkv {
                    q: &TensorRef::new(x.q.as_view(), ql),
                    k: &TensorRef::new(x.k.as_view(), cl),
                    v: &TensorRef::new(x.v.as_view(), cl),
                },
                &seqlens.as_view(),
                Out::with_lse(TensorMut::new(o.as_view_mut(), ql), lse.as_view_mut()),
                opts,
                None,
            )
            .map_err(|x| x.to_string())?;
        Ok::<_, String>(reference::decode_ext(
            &shape,
            &to_f64(&x.q_host),
            &to_f64(&x.k_host),
            &to_f64(&x.v_host),
            &c.seqlens,
            extras,
        ))
    })?;
    expect_fold::<T>(gpu, &shape)?;
    let splits = gpu.fa.decode_splits::<T>(&shape);
    let what = format!("{c:?} splits={splits}");
    check_output(&s.clone_dtoh(&o).map_err(e)?, &ql, &want.o, &what)?;
    check_lse(&s.clone_dtoh(&lse).map_err(e)?, &want.lse, &what)
}

fn policy_decode_strategy() -> impl Strategy<Value = PolicyDecodeCase> {
    (
        1usize..=3,
        1usize..=4,
        prop_oneof![1usize..=200, 201usize..=3000],
        head_counts(),
        head_dims(),
        policy_strategy(),
        prop_oneof![2 => Just(None), 1 => (1usize..=16).prop_map(Some)],
        any::<u64>(),
    )
        .prop_flat_map(
            |(
                batch,
                seqlen_q,
                cache_len,
                (heads, kv_heads),
                head_dim,
                policy,
                num_splits,
                seed,
            )| {
                let len = prop_oneof![Just(1i32), Just(cache_len as i32), 1i32..=cache_len as i32];
                prop::collection::vec(len, batch).prop_map(move |seqlens| PolicyDecodeCase {
                    batch,
                    seqlen_q,
                    cache_len,
                    heads,
                    kv_heads,
                    head_dim,
                    seqlens,
                    policy: policy.clone(),
                    num_splits,
                    seed,
                })
            },
        )
}

/// merge_states of the forward over two disjoint key ranges equals the
/// forward over all keys (and the reference merge of the same two states).
fn run_merge<T: AttnElement>(gpu: &Gpu, c: &PolicyFwdCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (b, sq, sk, h, hk, d) = (
        c.batch,
        c.seqlen_q,
        c.seqlen_k.max(2),
        c.heads,
        c.kv_heads,
        c.head_dim,
    );
    let cut = rng.random_range(1..sk);
    let ql = Layout::contiguous([b, sq, h, d]);
    let full = Layout::contiguous([b, sk, hk, d]);
    let x = random_inputs::<T>(gpu, &mut rng, [&ql, &full, &full])?;
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    // The two key ranges as strided views of the same K/V.
    let part = |lo: usize, hi: usize| Layout {
        shape: [b, hi - lo, hk, d],
        strides: full.strides,
    };
    let mut states = Vec::new();
    for (lo, hi) in [(0, cut), (cut, sk)] {
        let mut o = poisoned::<T>(gpu, b * sq * h * d)?;
        let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
        {
            gpu.fa
                .forward(
                    s,
                    Qkv {
                        q: &TensorRef::new(x.q.as_view(), ql),
                        k: &TensorRef::new(x.k.slice(lo * hk * d..), part(lo, hi)),
                        v: &TensorRef::new(x.v.slice(lo * hk * d..), part(lo, hi)),
                    },
                    Out::with_lse(TensorMut::new(o.as_view_mut(), ql), lse.as_view_mut()),
                    &AttnOptions::default(),
                )
                .map_err(|x| x.to_string())?;
        }
        states.push((o, lse));
    }
    let mut o = s.clone_htod(&vec![nan::<T>(); b * sq * h * d]).map_err(e)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    {
        gpu.fa
            .merge_states(
                s,
                State {
                    o: &TensorRef::new(states[0].0.as_view(), ql),
                    lse: &states[0].1.as_view(),
                },
                State {
                    o: &TensorRef::new(states[1].0.as_view(), ql),
                    lse: &states[1].1.as_view(),
                },
                Out::with_lse(TensorMut::new(o.as_view_mut(), ql), lse.as_view_mut()),
            )
            .map_err(|x| x.to_string())?;
    }
    let o_host = s.clone_dtoh(&o).map_err(e)?;
    let lse_host = s.clone_dtoh(&lse).map_err(e)?;
    // Against the reference merge of the very states the GPU produced (O
    // rows [B, Sq, H, D] against LSE rows [B, H, Sq]: reorder the LSE).
    let lse_rows = |l: &[f32]| -> Vec<f64> {
        let mut out = vec![0.0; b * sq * h];
        for bi in 0..b {
            for hi in 0..h {
                for t in 0..sq {
                    out[(bi * sq + t) * h + hi] = l[(bi * h + hi) * sq + t] as f64;
                }
            }
        }
        out
    };
    let (oa, ob) = (
        to_f64(&s.clone_dtoh(&states[0].0).map_err(e)?),
        to_f64(&s.clone_dtoh(&states[1].0).map_err(e)?),
    );
    let (la, lb) = (
        lse_rows(&s.clone_dtoh(&states[0].1).map_err(e)?),
        lse_rows(&s.clone_dtoh(&states[1].1).map_err(e)?),
    );
    let merged = reference::merge_states(&oa, &la, &ob, &lb, d);
    check_output(&o_host, &ql, &merged.o, &format!("{c:?} cut={cut} (merge)"))?;
    // And against attention over all keys: two roundings of the states plus one
    // of the merge stay within the tolerance of one kernel's output.
    let shape = ForwardShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads: h,
        kv_heads: hk,
        head_dim: d,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        ..Default::default()
    };
    let want = reference::attention(
        &shape,
        &to_f64(&x.q_host),
        &to_f64(&x.k_host),
        &to_f64(&x.v_host),
    );
    check_output(&o_host, &ql, &want.o, &format!("{c:?} cut={cut} (full)"))?;
    check_lse(&lse_host, &want.lse, &format!("{c:?} cut={cut}"))
}

/// A [`run_rescale`] case: the keys that point along Q, the Hopper line's
/// persistence (`AttnOptions::hopper_persistent`) and the softcap.
struct RescaleCase {
    head_dim: usize,
    causal: bool,
    aligned: std::ops::Range<usize>,
    persistent: Option<bool>,
    softcap: Option<f32>,
}

/// Scores that grow by far more than the lazy rescale's slack from the first
/// key block visited (the last) to the later ones: keys `aligned` of block 0
/// point along Q, so the running max jumps when they arrive and O and l must
/// be rescaled, or P = exp2(S - stale m) overflows. Eight aligned keys lie in
/// one 8-key n-tile of S, so a row max that missed that n-tile (one of the
/// D = 64 causal persistent line's four max chains) overflows too. Under a
/// softcap of 20 the aligned scores still jump by more than the slack
/// (to c·tanh(D/2 / c)), and on the D = 256 line, whose row max comes
/// from the raw scores, a max that missed the cap would sit (6.4 - 1)·20
/// nats above row 0's scores: every P of row 0 would underflow, O = 0.
fn run_rescale<T: AttnElement>(gpu: &Gpu, c: &RescaleCase) -> Result<(), String> {
    let (head_dim, causal) = (c.head_dim, c.causal);
    let mut rng = StdRng::seed_from_u64(head_dim as u64);
    let (b, sq, sk, h, d) = (1, 70, 300, 2, head_dim);
    let q_host = random_values::<T>(&mut rng, b * sq * h * d);
    let mut k_host = random_values::<T>(&mut rng, b * sk * h * d);
    let v_host = random_values::<T>(&mut rng, b * sk * h * d);
    for j in c.aligned.clone() {
        for hi in 0..h {
            for t in 0..d {
                // Key j aligned with query 0's signs, scaled up: q·k ~ D/2.
                let sign = q_host[hi * d + t].to_f64().signum();
                k_host[(j * h + hi) * d + t] = T::from_f64(sign);
            }
        }
    }
    let l = Layout::contiguous([b, sk, h, d]);
    let ql = Layout::contiguous([b, sq, h, d]);
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let (q, k, v) = (
        s.clone_htod(&q_host).map_err(e)?,
        s.clone_htod(&k_host).map_err(e)?,
        s.clone_htod(&v_host).map_err(e)?,
    );
    let mut o = s.clone_htod(&vec![nan::<T>(); b * sq * h * d]).map_err(e)?;
    // Scale 1: scores of the aligned keys reach D/2 against about ±sqrt(D)/3.
    let opts = AttnOptions {
        causal,
        softmax_scale: Some(1.0),
        softcap: c.softcap,
        hopper_persistent: c.persistent,
        ..Default::default()
    };
    gpu.fa
        .forward(
            s,
            Qkv {
                q: &TensorRef::new(q.as_view(), ql),
                k: &TensorRef::new(k.as_view(), l),
                v: &TensorRef::new(v.as_view(), l),
            },
            Out::new(TensorMut::new(o.as_view_mut(), ql)),
            &opts,
        )
        .map_err(|x| x.to_string())?;
    let shape = ForwardShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads: h,
        kv_heads: h,
        head_dim: d,
        causal,
        softmax_scale: 1.0,
        softcap: c.softcap,
        ..Default::default()
    };
    let want = reference::attention(&shape, &to_f64(&q_host), &to_f64(&k_host), &to_f64(&v_host));
    check_output(
        &s.clone_dtoh(&o).map_err(e)?,
        &ql,
        &want.o,
        &format!(
            "rescale hd{d} causal={causal} aligned={:?} persistent={:?} softcap={:?}",
            c.aligned, c.persistent, c.softcap
        ),
    )
}

/// A [`run_softcap_range`] case.
#[derive(Clone, Copy, Debug)]
struct CapRangeCase {
    head_dim: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    causal: bool,
    softcap: f32,
    /// Sinks of -100 (head 0) and 2 (head 1).
    sinks: bool,
}

/// Capped logits at both ends of their range, where a softmax without a row
/// max (`AttnParams::fixed_max`: bf16, a cap of at most 51.98, no ALiBi)
/// keeps P at 2^-72 and 2^72 (c = 50): Q rows point along or against one
/// direction `u` that every key shares (`q = a u`, `k = s u` plus noise,
/// s in [0.5, 1)), with a gain that puts a·s·scale·q·k / c at ±6 to ±12
/// for |a| = 1 (tanh saturated, every logit ±c up to 2e-5 c) and at about
/// ±0.02 to ±0.05 for |a| = 1/256 (logits spread over about a nat, small
/// enough that `tanh.approx`'s relative error keeps the LSE within its
/// tolerance). With m held anywhere but near the middle of the range, the
/// bottom rows' P flush to 0 or the top rows' overflow; with the fixed max
/// on f16 (P up to 2^16) or past the span (c = 100: 2^-144), they do too.
/// Sq > Skv causal rows see no key: with the sink of -100 their LSE is
/// -100, which the fixed max (2^(sink - 0) flushed) loses unless the sink
/// step treats them as rows with no key.
fn run_softcap_range<T: AttnElement>(gpu: &Gpu, c: &CapRangeCase) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(c.head_dim as u64 + c.seqlen_q as u64);
    let (b, sq, sk, h, d) = (1, c.seqlen_q, c.seqlen_k, 2, c.head_dim);
    let u: Vec<f64> = (0..d)
        .map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 })
        .collect();
    let gains = [-1.0, 1.0, -1.0 / 256.0, 1.0 / 256.0];
    let mut q_host = Vec::with_capacity(sq * h * d);
    for i in 0..sq {
        for hi in 0..h {
            let a = gains[(i + hi) % gains.len()];
            q_host.extend(u.iter().map(|&x| T::from_f64(a * x)));
        }
    }
    let mut k_host = Vec::with_capacity(sk * d);
    for j in 0..sk {
        let s = 0.5 + (j % 8) as f64 / 16.0;
        k_host.extend(
            u.iter()
                .map(|&x| T::from_f64(s * x + rng.random_range(-0.25..0.25))),
        );
    }
    let v_host = random_values::<T>(&mut rng, sk * d);
    let x = upload_inputs(gpu, q_host, k_host, v_host)?;
    let (ql, kl) = (
        Layout::contiguous([b, sq, h, d]),
        Layout::contiguous([b, sk, 1, d]),
    );
    let s = &gpu.stream;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let sinks_host = [-100.0f32, 2.0];
    let sinks = s.clone_htod(&sinks_host).map_err(e)?;
    let ol = gapped_layout([b, sq, h, d]);
    let mut o = poisoned::<T>(gpu, b * ol.strides[0])?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    // q·k = a·s·D (plus noise): this scale takes a·s·12 to the tanh.
    let softmax_scale = c.softcap * 12.0 / d as f32;
    let sink_view = sinks.as_view();
    let opts = AttnOptions {
        causal: c.causal,
        softmax_scale: Some(softmax_scale),
        softcap: Some(c.softcap),
        sinks: c.sinks.then_some(&sink_view),
        ..Default::default()
    };
    let launches = flash_attn::hopper::launches_on_this_thread();
    forward_with_lse(gpu, &x, [ql, kl, kl], (&mut o, ol), &mut lse, &opts)?;
    let shape = ForwardShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads: h,
        kv_heads: 1,
        head_dim: d,
        causal: c.causal,
        softmax_scale,
        softcap: Some(c.softcap),
        ..Default::default()
    };
    let sinks_f64 = sinks_host.map(f64::from);
    let extras = reference::Extras {
        alibi_slopes: None,
        sinks: c.sinks.then_some(&sinks_f64[..]),
    };
    let want = reference::attention_ext(
        &shape,
        &to_f64(&x.q_host),
        &to_f64(&x.k_host),
        &to_f64(&x.v_host),
        &extras,
    );
    let what = format!("{c:?}");
    check_forward_path::<T>(gpu, (d, sk, None), launches, &what)?;
    let o_host = s.clone_dtoh(&o).map_err(e)?;
    check_output(&o_host, &ol, &want.o, &what)?;
    check_untouched_outside(&o_host, &ol, &what)?;
    check_lse(&s.clone_dtoh(&lse).map_err(e)?, &want.lse, &what)
}

/// [`run_softcap_range`]'s cases: every head dim, caps inside (50) and past
/// (100) the fixed max's span, non-causal, causal with sinks, and causal
/// with sinks where Sq > Skv.
fn softcap_range_cases() -> Vec<CapRangeCase> {
    let mut v = Vec::new();
    for &head_dim in &flash_attn::SUPPORTED_HEAD_DIMS {
        for softcap in [50.0, 100.0] {
            for (seqlen_q, seqlen_k, causal, sinks) in [
                (70, 300, false, false),
                (70, 300, true, true),
                (300, 70, true, true),
            ] {
                v.push(CapRangeCase {
                    head_dim,
                    seqlen_q,
                    seqlen_k,
                    causal,
                    softcap,
                    sinks,
                });
            }
        }
    }
    v
}

/// Forced split counts that give the combine one chunk of splits per row
/// (several rows per CTA), a few chunks (groups of a row meeting in shared
/// memory) and more chunks than a CTA has groups (a group merging several),
/// over rows that do not fill the last CTA and a sequence whose later splits
/// see no key.
fn combine_group_cases() -> Vec<PolicyDecodeCase> {
    let mut v = Vec::new();
    for &head_dim in &flash_attn::SUPPORTED_HEAD_DIMS {
        for num_splits in [3, 11, 40, 128] {
            for sinks in [false, true] {
                let cache_len = 16384 + 77;
                v.push(PolicyDecodeCase {
                    batch: 2,
                    seqlen_q: 3,
                    cache_len,
                    heads: 6,
                    kv_heads: 2,
                    head_dim,
                    seqlens: vec![cache_len as i32, 1000],
                    policy: Policy {
                        causal: true,
                        window: Window::default(),
                        softcap: None,
                        alibi: None,
                        sinks,
                    },
                    num_splits: Some(num_splits),
                    seed: 40 + num_splits as u64,
                });
            }
        }
    }
    v
}

fn head_dims() -> impl Strategy<Value = usize> {
    prop::sample::select(flash_attn::SUPPORTED_HEAD_DIMS.to_vec())
}

/// (heads, kv_heads) with heads / kv_heads in {1, 2, 4, 8}.
fn head_counts() -> impl Strategy<Value = (usize, usize)> {
    (1usize..=3, prop::sample::select(vec![1usize, 2, 4, 8])).prop_map(|(hk, g)| (hk * g, hk))
}

/// Sequence lengths: mostly short and ragged, sometimes past a few tiles.
fn seqlen() -> impl Strategy<Value = usize> {
    prop_oneof![3 => 1usize..=80, 2 => 81usize..=300, 1 => 900usize..=1100]
}

fn fwd_strategy() -> impl Strategy<Value = FwdCase> {
    (
        1usize..=2,
        seqlen(),
        seqlen(),
        head_counts(),
        head_dims(),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(batch, seqlen_q, seqlen_k, (heads, kv_heads), head_dim, causal, with_lse, seed)| {
                FwdCase {
                    batch,
                    seqlen_q,
                    seqlen_k,
                    heads,
                    kv_heads,
                    head_dim,
                    causal,
                    with_lse,
                    packed_qkv: false,
                    seed,
                    hopper_rows: None,
                    hopper_persistent: None,
                    hopper_keys: None,
                }
            },
        )
}

fn decode_strategy() -> impl Strategy<Value = DecodeCase> {
    (
        1usize..=4,
        1usize..=4,
        prop_oneof![1usize..=200, 201usize..=3000],
        head_counts(),
        head_dims(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(
            |(batch, seqlen_q, cache_len, (heads, kv_heads), head_dim, causal, seed)| {
                let len = prop_oneof![Just(1i32), Just(cache_len as i32), 1i32..=cache_len as i32];
                prop::collection::vec(len, batch).prop_map(move |seqlens| DecodeCase {
                    batch,
                    seqlen_q,
                    cache_len,
                    heads,
                    kv_heads,
                    head_dim,
                    causal,
                    seqlens,
                    seed,
                })
            },
        )
}

/// Random cases per proptest trial; `FLASH_ATTN_GPU_CASES` lowers it for
/// slow runs such as compute-sanitizer's.
fn case_count() -> u32 {
    match std::env::var("FLASH_ATTN_GPU_CASES") {
        Err(_) => 48,
        Ok(v) => match v.parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("FLASH_ATTN_GPU_CASES={v:?}: expected a positive number of cases"),
        },
    }
}

fn proptest_trial<S, F>(
    gpu: &Arc<Option<Gpu>>,
    cases: u32,
    strategy: S,
    run: F,
) -> Result<(), Failed>
where
    S: Strategy,
    S::Value: std::fmt::Debug,
    F: Fn(&Gpu, &S::Value) -> Result<(), String>,
{
    let gpu = gpu.as_ref().as_ref().expect("trial runs only with a GPU");
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, |c| run(gpu, &c).map_err(TestCaseError::fail))
        .map_err(|e| Failed::from(e.to_string()))
}

fn fixed_forward_cases() -> Vec<FwdCase> {
    let base = FwdCase {
        batch: 1,
        seqlen_q: 1,
        seqlen_k: 1,
        heads: 2,
        kv_heads: 2,
        head_dim: 64,
        causal: false,
        with_lse: true,
        packed_qkv: false,
        seed: 7,
        hopper_rows: None,
        hopper_persistent: None,
        hopper_keys: None,
    };
    let mut v = Vec::new();
    for &head_dim in &flash_attn::SUPPORTED_HEAD_DIMS {
        for causal in [false, true] {
            for (sq, sk) in [
                (1, 1),
                (17, 17),
                (1000, 1000),
                (1, 1000),
                (1000, 17),
                (17, 1000),
                (64, 128),
                (129, 65),
            ] {
                v.push(FwdCase {
                    seqlen_q: sq,
                    seqlen_k: sk,
                    head_dim,
                    causal,
                    ..base.clone()
                });
            }
            v.push(FwdCase {
                batch: 2,
                seqlen_q: 333,
                seqlen_k: 333,
                head_dim,
                causal,
                packed_qkv: true,
                ..base.clone()
            });
            v.push(FwdCase {
                heads: 8,
                kv_heads: 1,
                seqlen_q: 200,
                seqlen_k: 300,
                head_dim,
                causal,
                ..base.clone()
            });
        }
        // A causal grid of over two waves on every GPU up to 132 SMs (576
        // tiles of 128 rows, 864 of 64), so that the balanced order's tail
        // and the pairs before it both run on the `mma.sync` kernels too
        // (`index::balanced_tile`; the `hopper_*` trials reach them only
        // on Hopper with FLASH_ATTN_FORCE_SM80=1).
        v.push(FwdCase {
            batch: 3,
            heads: 96,
            kv_heads: 8,
            seqlen_q: 129,
            seqlen_k: 130,
            head_dim,
            causal: true,
            ..base.clone()
        });
    }
    v
}

fn env_is_1(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// The module named by `FLASH_ATTN_MODULE` is loaded exactly when it is
/// set; else the sm_75 module is not (the suite does not run on Turing).
fn check_module(gpu: &Gpu) -> Result<(), Failed> {
    let forced = std::env::var(flash_attn::MODULE_ENV).ok();
    let arch = gpu.fa.ptx_arch();
    let ok = match forced.as_deref() {
        Some("sm_75") => arch == PtxArch::Sm75,
        Some("sm_80") => arch == PtxArch::Sm80,
        Some(_) => false,
        None => arch == PtxArch::Sm90 || arch == PtxArch::Sm80,
    };
    if !ok {
        return Err(format!("module {arch:?} with {}={forced:?}", flash_attn::MODULE_ENV).into());
    }
    Ok(())
}

/// On compute capability 9.0 the forward runs on the Hopper kernels unless
/// `FLASH_ATTN_FORCE_SM80=1` or `FLASH_ATTN_MODULE` (the suite's other
/// passes) asks otherwise.
fn check_hopper_path(gpu: &Gpu) -> Result<(), Failed> {
    check_module(gpu)?;
    let sm80 = env_is_1(flash_attn::hopper::FORCE_SM80_ENV);
    let forced = std::env::var(flash_attn::MODULE_ENV).is_ok();
    if gpu.fa.hopper_forward() == (sm80 || forced) {
        return Err(format!(
            "hopper_forward() = {} with {}={}, {} set: {}",
            gpu.fa.hopper_forward(),
            flash_attn::hopper::FORCE_SM80_ENV,
            sm80 as u8,
            flash_attn::MODULE_ENV,
            forced
        )
        .into());
    }
    Ok(())
}

/// The head dims the Hopper forward serves: its lines' own and the smaller
/// ones that run on them with zero columns (`hopper_line_head_dim`).
fn hopper_head_dims() -> Vec<usize> {
    flash_attn::SUPPORTED_HEAD_DIMS
        .into_iter()
        .filter(|&d| hopper_line_head_dim(d).is_some())
        .collect()
}

/// Every row count of the Hopper lines that serve a head dim, as
/// `hopper_rows` asks for them: the fixed cases run each of those lines.
fn hopper_rows_of(head_dim: usize) -> Vec<Option<usize>> {
    let mut rows: Vec<usize> = [false, true]
        .into_iter()
        .flat_map(|causal| hopper_lines_of(head_dim, causal, ScoreKind::Plain))
        .map(|(r, _, _)| r)
        .collect();
    rows.sort();
    rows.dedup();
    rows.into_iter().map(Some).collect()
}

/// Every (rows, persistent, keys per block) of the Hopper lines that serve
/// a dense call of a head dim with `score`, full or causal, sorted: the
/// fixed cases run each (a line that covers only causal calls, such as D =
/// 256's 64-key one, would run its full cases on another line twice).
fn hopper_lines_of(head_dim: usize, causal: bool, score: ScoreKind) -> Vec<(usize, bool, usize)> {
    let line_d = hopper_line_head_dim(head_dim);
    let need = Policies {
        mask: if causal {
            MaskKind::Causal
        } else {
            MaskKind::Full
        },
        score,
        seq: SeqKind::Dense,
    };
    let mut lines: Vec<(usize, bool, usize)> = HOPPER_ENTRIES
        .iter()
        .filter(|e| {
            e.kind == KernelKind::WgmmaForward
                && Some(e.head_dim) == line_d
                && e.policies.covers(need)
        })
        .map(|e| (e.rows, e.persistent, e.hopper_tile().block_n))
        .collect();
    lines.sort();
    lines.dedup();
    lines
}

/// A Hopper head dim with the heuristic's rows or either line's
/// (`AttnOptions::hopper_rows`): the small random shapes alone would mostly
/// run the 128-row lines.
fn hopper_line() -> impl Strategy<Value = (usize, Option<usize>)> {
    (
        prop::sample::select(hopper_head_dims()),
        prop::sample::select(vec![None, Some(64), Some(128), Some(192)]),
    )
}

/// Forward cases the Hopper kernels serve (their head dims, plain, dense),
/// with `fwd_strategy`'s ragged lengths, GQA, LSE and causal masks; the
/// persistent lines asked for in one case of three, keys per block (D =
/// 256's three sizes) in three of four.
fn hopper_fwd_strategy() -> impl Strategy<Value = FwdCase> {
    (
        fwd_strategy(),
        hopper_line(),
        prop::sample::select(vec![None, Some(false), Some(true)]),
        prop::sample::select(vec![None, Some(64), Some(80), Some(128)]),
    )
        .prop_map(
            |(c, (head_dim, hopper_rows), hopper_persistent, hopper_keys)| FwdCase {
                head_dim,
                hopper_rows,
                hopper_persistent,
                hopper_keys,
                ..c
            },
        )
}

/// Every (batch, Sq, Skv, heads, KV heads) shape in both mask kinds, per
/// Hopper forward line (head dim and rows).
fn hopper_cases(
    shapes: &[(usize, usize, usize, usize, usize)],
    with_lse: bool,
    packed_qkv: bool,
    seed: u64,
) -> Vec<FwdCase> {
    let mut v = Vec::new();
    for causal in [false, true] {
        for head_dim in hopper_head_dims() {
            for (rows, persistent, keys) in hopper_lines_of(head_dim, causal, ScoreKind::Plain) {
                for &(batch, seqlen_q, seqlen_k, heads, kv_heads) in shapes {
                    v.push(FwdCase {
                        batch,
                        seqlen_q,
                        seqlen_k,
                        heads,
                        kv_heads,
                        head_dim,
                        causal,
                        with_lse,
                        packed_qkv,
                        seed,
                        hopper_rows: Some(rows),
                        hopper_persistent: Some(persistent),
                        hopper_keys: Some(keys),
                    });
                }
            }
        }
    }
    v
}

/// `policy_fwd_strategy`'s windows, softcaps, ALiBi slopes and sinks at
/// the head dims the Hopper kernels serve.
fn hopper_policy_strategy() -> impl Strategy<Value = PolicyFwdCase> {
    (
        policy_fwd_strategy(),
        hopper_line(),
        prop::sample::select(vec![None, None, Some(true)]),
    )
        .prop_map(
            |(c, (head_dim, hopper_rows), hopper_persistent)| PolicyFwdCase {
                head_dim,
                hopper_rows,
                hopper_persistent,
                ..c
            },
        )
}

/// Windows on the persistent window lines (D = 64 with every modifier,
/// D = 96 and 128 plain), on grids of more tiles than an H100/H200 has SMs:
/// windows narrower than a key block and wider, one-sided
/// and two-sided, causal, with Sq = Skv and Sq != Skv either way (rows
/// that see no key where Sq > Skv), and the softcap, ALiBi and sinks
/// alone and together. Each case's call is checked to reach a persistent
/// line, so that the line is what the reference checks. (D = 32, which
/// runs on D = 64's lines padded, passed them too on the H200 in session
/// 38; left out for the suite's time.)
fn hopper_window_persistent_cases() -> Vec<PolicyFwdCase> {
    let window = |left, right| Window { left, right };
    let windows = [
        (true, window(Some(128), Some(0))),
        (false, window(Some(100), Some(27))),
        (false, window(Some(300), None)),
        (true, window(Some(0), Some(0))),
        (false, window(Some(513), Some(700))),
    ];
    let mut v = Vec::new();
    for head_dim in [64, 96, 128] {
        let modifiers = if head_dim == 64 { 4 } else { 1 };
        for (i, &(causal, window)) in windows.iter().enumerate() {
            for (j, &(batch, seqlen_q, seqlen_k, heads)) in
                [(2, 1000, 1000, 24), (1, 700, 1300, 32), (1, 1300, 700, 32)]
                    .iter()
                    .enumerate()
            {
                let k = (i * 3 + j) % modifiers;
                v.push(PolicyFwdCase {
                    batch,
                    seqlen_q,
                    seqlen_k,
                    heads,
                    kv_heads: heads / 8,
                    head_dim,
                    policy: Policy {
                        causal,
                        window,
                        softcap: (k == 1 || k == 3).then_some(20.0),
                        alibi: (k >= 2).then_some(k == 3),
                        sinks: k == 2 || k == 3,
                    },
                    seed: 71 + (i * 3 + j) as u64,
                    hopper_rows: Some(128),
                    hopper_persistent: Some(true),
                    v_head_dim: None,
                });
            }
        }
    }
    for c in &v {
        let p = &c.policy;
        let modified = p.softcap.is_some() || p.alibi.is_some() || p.sinks;
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let call = HopperCall {
                dtype,
                head_dim: c.head_dim,
                need: Policies {
                    mask: MaskKind::Local,
                    score: if modified {
                        ScoreKind::Modified
                    } else {
                        ScoreKind::Plain
                    },
                    seq: SeqKind::Dense,
                },
                batch: c.batch,
                heads: c.heads,
                seqlen_q: c.seqlen_q,
                seqlen_k: c.seqlen_k,
                window_keys: None,
                num_sms: 132,
            };
            let pick = HopperPick {
                rows: c.hopper_rows,
                persistent: c.hopper_persistent,
                keys: None,
            };
            let line = find_hopper_entry(&call, pick);
            assert!(line.is_some_and(|e| e.persistent), "{c:?}: {line:?}");
        }
    }
    v
}

/// The softcap on every Hopper line that runs modified scores, each head
/// dim's own lines with their rows and persistence forced (the random
/// policy cases reach only some of them): rows and keys that are not tile
/// multiples, GQA, full and causal, the softcap alone and with ALiBi and
/// sinks.
fn hopper_softcap_line_cases() -> Vec<PolicyFwdCase> {
    let mut v = Vec::new();
    for head_dim in hopper_head_dims() {
        if hopper_line_head_dim(head_dim) != Some(head_dim) {
            continue;
        }
        for causal in [false, true] {
            // The cases cannot force the keys per block.
            let mut lines: Vec<(usize, bool)> =
                hopper_lines_of(head_dim, causal, ScoreKind::Modified)
                    .into_iter()
                    .map(|(rows, persistent, _)| (rows, persistent))
                    .collect();
            lines.dedup();
            for (rows, persistent) in lines {
                for (k, &(batch, seqlen_q, seqlen_k, heads, kv_heads)) in
                    [(1, 300, 333, 4, 2), (2, 190, 1000, 2, 1)]
                        .iter()
                        .enumerate()
                {
                    v.push(PolicyFwdCase {
                        batch,
                        seqlen_q,
                        seqlen_k,
                        heads,
                        kv_heads,
                        head_dim,
                        policy: Policy {
                            causal,
                            window: Window::default(),
                            softcap: Some(20.0),
                            alibi: (k == 1).then_some(false),
                            sinks: k == 1,
                        },
                        seed: 83 + (head_dim + rows + k) as u64,
                        hopper_rows: Some(rows),
                        hopper_persistent: Some(persistent),
                        v_head_dim: None,
                    });
                }
            }
        }
    }
    assert!(!v.is_empty(), "no modified Hopper line");
    v
}

/// V with a head dim of its own, each call's V an exact allocation (so
/// that memcheck sees a load of V's missing columns in its last row):
/// DeepSeek's MLA prefill (192 / 128, causal and not), the smallest V
/// (8 columns), D = 96, whose second 64-column group is half used
/// (96 / 40), a head dim padded on its Hopper line (32 / 24); varlen and
/// chunked prefill with seeds that draw V's head dim ([`v_dim`]).
fn v_head_dim_cases<T: AttnElement>(gpu: &Gpu) -> Result<(), String> {
    let plain = |causal| Policy {
        causal,
        window: Window::default(),
        softcap: None,
        alibi: None,
        sinks: false,
    };
    for (d, dv, causal, kv_heads) in [
        (192, 128, true, 2),
        (192, 128, false, 4),
        (128, 8, true, 1),
        (64, 32, false, 2),
        (96, 40, true, 4),
        (32, 24, true, 2),
    ] {
        run_forward_policy::<T>(
            gpu,
            &PolicyFwdCase {
                batch: 2,
                seqlen_q: 300,
                seqlen_k: 517,
                heads: 4,
                kv_heads,
                head_dim: d,
                policy: plain(causal),
                seed: 7 + d as u64,
                hopper_rows: None,
                hopper_persistent: None,
                v_head_dim: Some(dv),
            },
        )?;
    }
    // Seeds that are multiples of 4 draw a V head dim below D.
    for (d, seed) in [(192, 4u64 << 32), (128, 12 << 32), (64, 20)] {
        let c = VarlenCase {
            lens: vec![(300, 517), (0, 40), (129, 1), (64, 200)],
            heads: 4,
            kv_heads: 2,
            head_dim: d,
            policy: plain(true),
            seed,
            hopper_rows: None,
        };
        run_varlen::<T>(gpu, &c)?;
        // The same sequences' keys from 16-token pages.
        run_varlen_paged::<T>(
            gpu,
            &PagedVarlenCase {
                lens: c.lens.iter().map(|&(q, k)| (q, k as i32)).collect(),
                page_size: 16,
                max_pages: 33,
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: d,
                policy: c.policy.clone(),
                seed,
                hopper_rows: None,
            },
        )?;
    }
    Ok(())
}

/// [`alibi_side_cases`] on every Hopper head dim's lines.
fn hopper_alibi_side_cases() -> Vec<PolicyFwdCase> {
    alibi_side_cases(
        hopper_head_dims()
            .into_iter()
            .flat_map(|d| hopper_rows_of(d).into_iter().map(move |r| (d, r))),
    )
}

/// [`alibi_side_cases`] for every head dim and dtype on the lines the
/// dispatch picks: off Hopper (or with `FLASH_ATTN_FORCE_SM80=1`) the
/// `mma.sync` kernels, whose only ALiBi cases the random policy trials
/// drew before.
fn forward_alibi_side_cases() -> Vec<PolicyFwdCase> {
    alibi_side_cases(
        flash_attn::SUPPORTED_HEAD_DIMS
            .into_iter()
            .map(|d| (d, None)),
    )
}

/// ALiBi over key blocks on either side of every row's origin and across
/// it (`index::OriginSide`) for each (head dim, Hopper rows) line: full
/// attention with Sq = Skv, Sq < Skv and Sq > Skv, a two-sided window and
/// causal, plain and under a softcap, with [H] and [B, H] slopes.
fn alibi_side_cases(lines: impl Iterator<Item = (usize, Option<usize>)>) -> Vec<PolicyFwdCase> {
    let mut v = Vec::new();
    let windows = [
        (false, Window::default()),
        (true, Window::default()),
        (
            false,
            Window {
                left: Some(300),
                right: Some(200),
            },
        ),
    ];
    for (head_dim, hopper_rows) in lines {
        for (i, &(causal, window)) in windows.iter().enumerate() {
            for (j, &(batch, seqlen_q, seqlen_k)) in
                [(1, 1000, 1000), (2, 300, 1500), (1, 1500, 300)]
                    .iter()
                    .enumerate()
            {
                let k = i * 3 + j;
                v.push(PolicyFwdCase {
                    batch,
                    seqlen_q,
                    seqlen_k,
                    heads: 2,
                    kv_heads: 1,
                    head_dim,
                    policy: Policy {
                        causal,
                        window,
                        softcap: (k % 2 == 1).then_some(20.0),
                        alibi: Some(k % 4 >= 2),
                        sinks: false,
                    },
                    seed: 29 + k as u64,
                    hopper_rows,
                    hopper_persistent: None,
                    v_head_dim: None,
                });
            }
        }
    }
    v
}

/// Sequences of many key blocks (both ring stages reused many times) and
/// query tiles, in both mask kinds, with Sq != Skv either way, and packed
/// QKV strides.
fn hopper_long_cases() -> Vec<FwdCase> {
    let mut v = hopper_cases(
        &[
            (1, 2049, 2049, 2, 1),
            (2, 700, 3001, 2, 1),
            (1, 3001, 700, 2, 2),
            (3, 128, 128, 1, 1),
        ],
        true,
        false,
        13,
    );
    v.extend(hopper_cases(&[(2, 1100, 1100, 2, 2)], false, true, 17));
    v
}

/// Grids of several waves (more tiles than an H100/H200 has SMs), with
/// GQA 9:1 and 6:1, tiles of different key-block counts (causal) and tiles
/// with none at all where causal rows see no key (Sq > Skv), and one of
/// fewer tiles than SMs (a causal launch then does not pair its tiles,
/// `index::TileGrid::paired`): the shapes a persistent schedule has to get
/// right.
fn hopper_many_tile_cases() -> Vec<FwdCase> {
    hopper_cases(
        &[
            (2, 260, 333, 72, 8),
            (2, 700, 150, 48, 8),
            (1, 900, 1000, 9, 3),
        ],
        true,
        false,
        19,
    )
}

/// D = 256's split-key tiles (64 rows, two consumers on alternate key
/// blocks, their states merged at the tile's end; `HopperTile::split_keys`),
/// full and causal, with LSE: one key block (the second consumer merges an
/// empty state), an odd and an even number of blocks, rows and keys that
/// are not tile multiples, GQA, and causal rows that see no key (Sq > Skv:
/// tiles where neither consumer has a block).
fn hopper_split_key_cases() -> Vec<FwdCase> {
    let shapes = [
        (1, 100, 60, 2, 1),
        (2, 130, 200, 3, 1),
        (1, 64, 300, 2, 2),
        (1, 300, 90, 4, 2),
        (2, 190, 1000, 2, 1),
    ];
    d256_line_cases(&shapes, 23, "split-key", |c| c.hopper_rows == Some(64))
}

/// D = 256's serial tiles (128-key blocks through K and V rings of half
/// blocks, one GEMM per ping-pong turn; `HopperTile::serial`), full, with
/// LSE: one block (only the first S and the last P·V) and a partial one,
/// two blocks, and enough blocks that the rings' three and two stages wrap
/// several times (each phase parity reused), rows and keys that are not
/// tile multiples, GQA.
fn hopper_serial_cases() -> Vec<FwdCase> {
    let shapes = [
        (1, 100, 60, 2, 1),
        (2, 130, 200, 3, 1),
        (1, 300, 512, 4, 2),
        (2, 190, 1000, 2, 1),
        (1, 129, 2049, 2, 2),
    ];
    d256_line_cases(&shapes, 29, "serial", |c| c.hopper_keys == Some(128))
}

/// [`hopper_cases`] with LSE, on the D = 256 lines that `line` picks
/// (forced through their rows or keys per block); there must be one.
fn d256_line_cases(
    shapes: &[(usize, usize, usize, usize, usize)],
    seed: u64,
    what: &str,
    line: fn(&FwdCase) -> bool,
) -> Vec<FwdCase> {
    let cases: Vec<FwdCase> = hopper_cases(shapes, true, false, seed)
        .into_iter()
        .filter(|c| c.head_dim == 256 && line(c))
        .collect();
    assert!(!cases.is_empty(), "no {what} line");
    cases
}

/// The persistent lines' two tile orders on a grid of more tiles than
/// SMs, each line forced (D = 64 and 128, full and causal, GQA 3:1): the
/// dynamic order (tiles claimed from a counter), the static order that
/// captured launches fall back to once their counters run out
/// ([`FlashAttention::set_static_tile_order`]), and one dynamic launch
/// captured in a CUDA graph and replayed four times, O poisoned with NaN
/// before each: the graph reuses its launch's counter, so a replay runs
/// every tile only if the launch before left that counter at 0.
fn tile_orders<T: AttnElement>() -> Result<(), String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let ctx = CudaContext::new(0).map_err(e)?;
    // Capture needs a non-default stream and no cross-stream event waits.
    unsafe { ctx.disable_event_tracking() };
    let s = ctx.new_stream().map_err(e)?;
    let fa = FlashAttention::new(&ctx).map_err(|x| x.to_string())?;
    let hopper = fa.hopper_forward();
    let (b, n, h, hk) = (4, 600, 12, 4);
    for d in [64, 128] {
        for causal in [false, true] {
            let what = |how: &str| format!("D = {d}, causal {causal}, {how}");
            let mut rng = StdRng::seed_from_u64(d as u64 + causal as u64);
            let q_host = random_values::<T>(&mut rng, b * n * h * d);
            let k_host = random_values::<T>(&mut rng, b * n * hk * d);
            let v_host = random_values::<T>(&mut rng, b * n * hk * d);
            let (q_layout, kv_layout) = (
                Layout::contiguous([b, n, h, d]),
                Layout::contiguous([b, n, hk, d]),
            );
            let o_layout = gapped_layout([b, n, h, d]);
            let poison = vec![nan::<T>(); b * o_layout.strides[0]];
            let q = s.clone_htod(&q_host).map_err(e)?;
            let k = s.clone_htod(&k_host).map_err(e)?;
            let v = s.clone_htod(&v_host).map_err(e)?;
            let mut o = s.clone_htod(&poison).map_err(e)?;
            let shape = ForwardShape {
                batch: b,
                seqlen_q: n,
                seqlen_k: n,
                heads: h,
                kv_heads: hk,
                head_dim: d,
                causal,
                softmax_scale: 1.0 / (d as f32).sqrt(),
                ..Default::default()
            };
            let want =
                reference::attention(&shape, &to_f64(&q_host), &to_f64(&k_host), &to_f64(&v_host));
            let opts = AttnOptions {
                causal,
                hopper_rows: Some(128),
                hopper_persistent: Some(true),
                ..Default::default()
            };
            let call = |o: &mut CudaSlice<T>| {
                let launches = flash_attn::hopper::launches_on_this_thread();
                fa.forward(
                    &s,
                    Qkv {
                        q: &TensorRef::new(q.as_view(), q_layout),
                        k: &TensorRef::new(k.as_view(), kv_layout),
                        v: &TensorRef::new(v.as_view(), kv_layout),
                    },
                    Out::new(TensorMut::new(o.as_view_mut(), o_layout)),
                    &opts,
                )
                .map_err(|x| x.to_string())?;
                if hopper && flash_attn::hopper::launches_on_this_thread() != launches + 1 {
                    return Err("the call did not run on a Hopper line".to_string());
                }
                Ok(())
            };
            let check = |o: &CudaSlice<T>, how: &str| -> Result<(), String> {
                let got = s.clone_dtoh(o).map_err(e)?;
                check_output(&got, &o_layout, &want.o, &what(how))?;
                check_untouched_outside(&got, &o_layout, &what(how))
            };
            for static_order in [false, true] {
                fa.set_static_tile_order(static_order);
                s.memcpy_htod(&poison, &mut o).map_err(e)?;
                call(&mut o)?;
                check(
                    &o,
                    if static_order {
                        "static order"
                    } else {
                        "dynamic order"
                    },
                )?;
            }
            fa.set_static_tile_order(false);
            s.synchronize().map_err(e)?;
            s.begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(e)?;
            let captured = call(&mut o);
            let graph = s
                .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
                .map_err(e)?;
            captured?;
            let graph = graph.ok_or("stream capture produced no graph")?;
            for replay in 0..4 {
                s.memcpy_htod(&poison, &mut o).map_err(e)?;
                graph.launch().map_err(e)?;
                s.synchronize().map_err(e)?;
                check(&o, &format!("graph replay {replay}"))?;
            }
        }
    }
    Ok(())
}

/// The `wgmma` probe shapes, (dtype, N, K), from the module's entry list.
fn wgmma_probe_shapes() -> Vec<(Dtype, usize, usize)> {
    HOPPER_ENTRIES
        .iter()
        .filter_map(|e| {
            let rest = e.name.strip_prefix("flash_probe_wgmma_")?;
            let (_, nk) = rest.split_once("_n")?;
            let (n, k) = nk.split_once("_k")?;
            Some((e.dtype, n.parse().ok()?, k.parse().ok()?))
        })
        .collect()
}

/// Every `wgmma` probe in each form its shape allows (SS with a K-major B
/// needs K % 64 == 0, RS with an MN-major B N % 64 == 0) against the host
/// product of the same rounded inputs, C poisoned with NaN (and the kernel's
/// accumulators start as NaN: the first k-step must ignore them). The bound
/// |err| <= 2^-20 · Σ|a·b| + 2^-30 per element is empirical (f32 accumulation
/// in the tensor cores' order; the worst case at K = 256 is ~2^-16): a wrong
/// descriptor, layout or fence gives errors of the size of the values.
fn run_wgmma_probes(gpu: &Gpu) -> Result<(), String> {
    fn one<T: AttnElement>(
        gpu: &Gpu,
        n: usize,
        k: usize,
        mode: u32,
        seed: u64,
    ) -> Result<(), String> {
        let probes = gpu.hopper.as_ref().unwrap();
        let s = &gpu.stream;
        let e = |x: cudarc::driver::DriverError| x.to_string();
        let mut rng = StdRng::seed_from_u64(seed);
        let a: Vec<T> = random_values(&mut rng, 64 * k);
        let b: Vec<T> = random_values(&mut rng, n * k);
        let (a_d, b_d) = (s.clone_htod(&a).map_err(e)?, s.clone_htod(&b).map_err(e)?);
        let mut c_d = s.clone_htod(&vec![f32::NAN; 64 * n]).map_err(e)?;
        probes
            .wgmma_gemm(s, n, k, mode, &a_d, &b_d, &mut c_d)
            .map_err(|e| e.to_string())?;
        let c = s.clone_dtoh(&c_d).map_err(e)?;
        for i in 0..64 {
            for j in 0..n {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for kk in 0..k {
                    let bv = if mode == ProbeGemmParams::RS_MN_MAJOR {
                        b[kk * n + j]
                    } else {
                        b[j * k + kk]
                    };
                    let p = a[i * k + kk].to_f64() * bv.to_f64();
                    want += p;
                    mag += p.abs();
                }
                let got = c[i * n + j] as f64;
                // NaN (an unwritten element) fails too.
                let within = (got - want).abs() <= mag * 2f64.powi(-20) + 2f64.powi(-30);
                if !within {
                    return Err(format!(
                        "wgmma {:?} n{n} k{k} mode {mode}: C[{i}][{j}] = {got}, want {want}",
                        T::DTYPE
                    ));
                }
            }
        }
        Ok(())
    }
    let shapes = wgmma_probe_shapes();
    if shapes.len() < 4 {
        return Err(format!(
            "expected the wgmma probes in HOPPER_ENTRIES, found {shapes:?}"
        ));
    }
    for (i, &(dtype, n, k)) in shapes.iter().enumerate() {
        let modes = [
            (k % 64 == 0).then_some(ProbeGemmParams::SS_K_MAJOR),
            (n % 64 == 0).then_some(ProbeGemmParams::RS_MN_MAJOR),
        ];
        for mode in modes.into_iter().flatten() {
            match dtype {
                Dtype::F16 => one::<f16>(gpu, n, k, mode, i as u64)?,
                Dtype::Bf16 => one::<bf16>(gpu, n, k, mode, i as u64)?,
                Dtype::F32 => return Err("no f32 wgmma probe".into()),
            }
        }
    }
    Ok(())
}

/// The TMA probes: [S, H, D] through the two-stage ring in tiles of `rows`
/// rows, over enough tiles for several phase flips of each barrier, with a
/// partial last tile (and one case of a single full tile); the threads' copy
/// must equal the input (zeros past S) and the TMA-stored copy must equal it
/// byte for byte; f16 maps, and bf16 for one case. `map_source`: the maps by
/// value (read in param space) or from global memory.
fn run_tma_probes(gpu: &Gpu, map_source: u32) -> Result<(), String> {
    fn one<T: AttnElement>(
        gpu: &Gpu,
        (d, rows, seqlen, heads): (usize, usize, usize, usize),
        map_source: u32,
        seed: u64,
    ) -> Result<(), String> {
        let probes = gpu.hopper.as_ref().unwrap();
        let s = &gpu.stream;
        let e = |x: cudarc::driver::DriverError| x.to_string();
        let what = format!(
            "tma {:?} d{d} rows {rows} S {seqlen} H {heads} maps from {map_source}",
            T::DTYPE
        );
        let src: Vec<T> = random_values(&mut StdRng::seed_from_u64(seed), seqlen * heads * d);
        let padded = seqlen.div_ceil(rows) * rows;
        let src_d = s.clone_htod(&src).map_err(e)?;
        let mut copied_d = s
            .clone_htod(&vec![nan::<T>(); padded * heads * d])
            .map_err(e)?;
        let mut stored_d = s
            .clone_htod(&vec![nan::<T>(); seqlen * heads * d])
            .map_err(e)?;
        probes
            .tma_copy(
                s,
                d,
                rows,
                seqlen,
                heads,
                map_source,
                &src_d,
                &mut copied_d,
                &mut stored_d,
            )
            .map_err(|e| format!("{what}: {e}"))?;
        let copied = s.clone_dtoh(&copied_d).map_err(e)?;
        let stored = s.clone_dtoh(&stored_d).map_err(e)?;
        // Exact and one to one for every non-NaN value, -0 included.
        let bits = |x: &T| x.to_f64().to_bits();
        if let Some(i) = (0..src.len()).find(|&i| bits(&stored[i]) != bits(&src[i])) {
            return Err(format!(
                "{what}: stored[{i}] = {:?}, want {:?}",
                stored[i], src[i]
            ));
        }
        for (i, got) in copied.iter().enumerate() {
            let want = src.get(i).map_or(0f64.to_bits(), bits);
            if bits(got) != want {
                return Err(format!(
                    "{what}: copied[{i}] = {got:?}, want bits {want:#x}"
                ));
            }
        }
        Ok(())
    }
    for (i, shape) in [
        (64, 64, 1000, 3),
        (128, 176, 2000, 2),
        (256, 80, 777, 2),
        (192, 112, 1000, 2),
        (128, 128, 128, 1),
    ]
    .into_iter()
    .enumerate()
    {
        one::<f16>(gpu, shape, map_source, 17 + i as u64)?;
    }
    one::<bf16>(gpu, (128, 176, 2000, 2), map_source, 29)
}

/// `merge_states` has no f32 kernel: a typed error, O untouched.
fn merge_f32_refused(gpu: &Gpu) -> Result<(), String> {
    let s = &gpu.stream;
    let l = Layout::contiguous([1, 5, 2, 32]);
    let poison = vec![-7.25f32; 5 * 2 * 32];
    let oa = s.clone_htod(&poison).map_err(|e| e.to_string())?;
    let lse = s.clone_htod(&[0f32; 10]).map_err(|e| e.to_string())?;
    let mut o = s.clone_htod(&poison).map_err(|e| e.to_string())?;
    let r = gpu.fa.merge_states(
        s,
        State {
            o: &TensorRef::new(oa.as_view(), l),
            lse: &lse.as_view(),
        },
        State {
            o: &TensorRef::new(oa.as_view(), l),
            lse: &lse.as_view(),
        },
        Out::new(TensorMut::new(o.as_view_mut(), l)),
    );
    if !matches!(
        r,
        Err(FlashAttnError::UnsupportedDtype {
            dtype: Dtype::F32,
            call: "merge_states",
            ..
        })
    ) {
        return Err(format!(
            "merge_states::<f32>: expected UnsupportedDtype, got {r:?}"
        ));
    }
    if s.clone_dtoh(&o).map_err(|e| e.to_string())? != poison {
        return Err("O changed after a refused merge".into());
    }
    Ok(())
}

/// On a module without bf16 (sm_75): forward and decode with an append get
/// `UnsupportedDtype` before any launch; O and the cache keep their poison.
fn bf16_refused(gpu: &Gpu) -> Result<(), String> {
    let s = &gpu.stream;
    let (b, sq, h, d, lmax) = (2, 3, 4, 64, 32);
    let ql = Layout::contiguous([b, sq, h, d]);
    let cl = Layout::contiguous([b, lmax, h, d]);
    let poison = vec![bf16::from_f32(-7.25); b * sq * h * d];
    let cache_poison = vec![bf16::from_f32(-3.5); b * lmax * h * d];
    let q = s.clone_htod(&poison).map_err(|e| e.to_string())?;
    let mut o = s.clone_htod(&poison).map_err(|e| e.to_string())?;
    let mut kc = s.clone_htod(&cache_poison).map_err(|e| e.to_string())?;
    let mut vc = s.clone_htod(&cache_poison).map_err(|e| e.to_string())?;
    let seqlens = s.clone_htod(&[5i32, 9]).map_err(|e| e.to_string())?;
    let refused = |r: Result<(), FlashAttnError>, what: &str| match r {
        Err(FlashAttnError::UnsupportedDtype {
            dtype: Dtype::Bf16,
            arch: "sm_75",
            ..
        }) => Ok(()),
        other => Err(format!("{what}: expected UnsupportedDtype, got {other:?}")),
    };
    refused(
        gpu.fa.forward(
            s,
            Qkv {
                q: &TensorRef::new(q.as_view(), ql),
                k: &TensorRef::new(q.as_view(), ql),
                v: &TensorRef::new(q.as_view(), ql),
            },
            Out::new(TensorMut::new(o.as_view_mut(), ql)),
            &AttnOptions::default(),
        ),
        "forward",
    )?;
    let mut cache = KvCache {
        k: TensorMut::new(kc.as_view_mut(), cl),
        v: TensorMut::new(vc.as_view_mut(), cl),
        seqlens: seqlens.as_view(),
        block_table: None,
    };
    let new = TensorRef::new(q.as_view(), ql);
    refused(
        gpu.fa.decode_kvcache(
            s,
            DecodeStep {
                q: &TensorRef::new(q.as_view(), ql),
                new_kv: Some((&new, &new)),
            },
            &mut cache,
            Out::new(TensorMut::new(o.as_view_mut(), ql)),
            &AttnOptions::default(),
            None,
        ),
        "decode_kvcache with append",
    )?;
    s.synchronize().map_err(|e| e.to_string())?;
    if s.clone_dtoh(&o).map_err(|e| e.to_string())? != poison {
        return Err("O changed after a refused bf16 call".into());
    }
    for c in [&kc, &vc] {
        if s.clone_dtoh(c).map_err(|e| e.to_string())? != cache_poison {
            return Err("the cache changed after a refused bf16 append".into());
        }
    }
    Ok(())
}

/// [B, S, H, D] stored head-major, as [B, H, S, D].
fn head_major(shape: [usize; 4]) -> Layout {
    let [_, s, h, d] = shape;
    Layout {
        shape,
        strides: [h * s * d, d, s * d, 1],
    }
}

/// The (b, s, h) rows of `layout`: each row's offset in its buffer, in
/// contiguous [B, S, H] order.
fn row_offsets(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
    let [b, s, h, _] = layout.shape;
    let st = layout.strides;
    (0..b * s * h).map(move |r| (r / (s * h)) * st[0] + (r / h % s) * st[1] + (r % h) * st[2])
}

/// Contiguous [B, S, H, D] values placed by `layout` in a buffer of its
/// span; NaN between the rows.
fn scatter<T: AttnElement>(logical: &[T], layout: &Layout) -> Vec<T> {
    let d = layout.shape[3];
    let mut out = vec![nan::<T>(); layout.span().unwrap()];
    for (r, at) in row_offsets(layout).enumerate() {
        out[at..at + d].copy_from_slice(&logical[r * d..][..d]);
    }
    out
}

/// A buffer laid out by `layout`, as contiguous [B, S, H, D] values.
fn gather<T: AttnElement>(got: &[T], layout: &Layout) -> Vec<f64> {
    let d = layout.shape[3];
    row_offsets(layout)
        .flat_map(|at| got[at..at + d].iter().map(|v| v.to_f64()))
        .collect()
}

/// A backward problem: the forward's policies, which the backward takes.
#[derive(Clone, Debug)]
struct BwdCase {
    batch: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    policy: Policy,
    softmax_scale: Option<f32>,
    seed: u64,
}

/// As [`seqlen`] but at most 400: the f64 reference backward is
/// O(B·H·Sq·Skv·D), which keeps a case to seconds.
fn bwd_seqlen() -> impl Strategy<Value = usize> {
    prop_oneof![3 => 1usize..=80, 2 => 81usize..=300, 1 => 301usize..=400]
}

fn bwd_strategy() -> impl Strategy<Value = BwdCase> {
    (
        (1usize..=2, bwd_seqlen(), bwd_seqlen(), head_counts()),
        prop::sample::select(flash_attn::BWD_HEAD_DIMS.to_vec()),
        policy_strategy(),
        proptest::option::of(0.05f32..2.0),
        any::<u64>(),
    )
        .prop_map(
            |(
                (batch, seqlen_q, seqlen_k, (heads, kv_heads)),
                head_dim,
                policy,
                softmax_scale,
                seed,
            )| {
                BwdCase {
                    batch,
                    seqlen_q,
                    seqlen_k,
                    heads,
                    kv_heads,
                    head_dim,
                    policy,
                    softmax_scale,
                    seed,
                }
            },
        )
}

/// `tanh.approx.f32`'s largest relative error (PTX ISA: 2^-10.987).
const TANH_REL_ERR: f64 = 5.0e-4;

/// The backward against the f64 reference of the same (rounded) inputs,
/// row by row within [`reference::backward_bounds`] (the dtype's unit
/// roundoff, `tanh.approx`'s error under a softcap, the LSE's tolerance for
/// the sinks' gradient). The forward that makes O and the LSE is ours. dQ
/// is written through strides with a gap after each head, which must stay
/// untouched; every gradient starts as NaN.
fn run_backward<T: AttnElement>(gpu: &Gpu, c: &BwdCase) -> Result<(), String> {
    let (b, sq, sk, h, hkv, d) = (
        c.batch, c.seqlen_q, c.seqlen_k, c.heads, c.kv_heads, c.head_dim,
    );
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let s = &gpu.stream;
    let mut rng = StdRng::seed_from_u64(c.seed);
    let (ql, kl) = (
        Layout::contiguous([b, sq, h, d]),
        Layout::contiguous([b, sk, hkv, d]),
    );
    let x = random_inputs::<T>(gpu, &mut rng, [&ql, &kl, &kl])?;
    let data = policy_data(gpu, &c.policy, b, h, &mut rng)?;
    // O, dO and the gradients each in a layout of their own (gapped or
    // head-major), so that no tensor is read or written through another's
    // strides unnoticed.
    let (ol, dol, dql) = (
        gapped_layout([b, sq, h, d]),
        head_major([b, sq, h, d]),
        gapped_layout([b, sq, h, d]),
    );
    let (dkl, dvl) = (gapped_layout([b, sk, hkv, d]), head_major([b, sk, hkv, d]));
    let mut o = poisoned::<T>(gpu, ol.span().unwrap())?;
    let mut lse = s.clone_htod(&vec![f32::NAN; b * h * sq]).map_err(e)?;
    let do_host = random_values::<T>(&mut rng, b * sq * h * d);
    let d_o = s.clone_htod(&scatter(&do_host, &dol)).map_err(e)?;
    let mut dq = poisoned::<T>(gpu, dql.span().unwrap())?;
    let mut dk = poisoned::<T>(gpu, dkl.span().unwrap())?;
    let mut dv = poisoned::<T>(gpu, dvl.span().unwrap())?;
    let mut d_sinks = s.clone_htod(&vec![f32::NAN; h]).map_err(e)?;
    let want = with_options(&c.policy, &data, |opts, extras| {
        let opts = AttnOptions {
            softmax_scale: c.softmax_scale,
            ..*opts
        };
        forward_with_lse(gpu, &x, [ql, kl, kl], (&mut o, ol), &mut lse, &opts)?;
        let launches = flash_attn::hopper::launches_on_this_thread();
        let call = BwdCall {
            qkv: [(&x.q, ql), (&x.k, kl), (&x.v, kl)],
            o: (&o, ol),
            d_o: (&d_o, dol),
            lse: &lse,
        };
        call.run(
            gpu,
            [(&mut dq, dql), (&mut dk, dkl), (&mut dv, dvl)],
            c.policy.sinks.then_some(&mut d_sinks),
            None,
            &opts,
        )
        .map_err(|x| x.to_string())?;
        let ran = flash_attn::hopper::launches_on_this_thread() - launches;
        let shape = ForwardShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
            heads: h,
            kv_heads: hkv,
            head_dim: d,
            causal: c.policy.causal,
            softmax_scale: c.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt()),
            window: c.policy.window,
            softcap: c.policy.softcap,
            ..Default::default()
        };
        let (q64, k64, v64, do64) = (
            to_f64(&x.q_host),
            to_f64(&x.k_host),
            to_f64(&x.v_host),
            to_f64(&do_host),
        );
        let want = reference::attention_backward_ext(&shape, &q64, &k64, &v64, &do64, extras);
        Ok::<_, String>((want, shape, [q64, k64, v64, do64], ran))
    })?;
    let (want, shape, [q64, k64, v64, do64], ran) = want;
    let hopper = gpu.fa.hopper_backward() && flash_attn::HOPPER_BWD_HEAD_DIMS.contains(&d);
    if ran != hopper as u64 {
        return Err(format!("{ran} Hopper launches, want {}", hopper as u64));
    }
    let (dq_got, dk_got, dv_got) = (
        s.clone_dtoh(&dq).map_err(e)?,
        s.clone_dtoh(&dk).map_err(e)?,
        s.clone_dtoh(&dv).map_err(e)?,
    );
    let d_sinks_got = s.clone_dtoh(&d_sinks).map_err(e)?;
    let o_host = gather(&s.clone_dtoh(&o).map_err(e)?, &ol);
    check_untouched_outside(&dq_got, &dql, "dq")?;
    check_untouched_outside(&dk_got, &dkl, "dk")?;
    if !c.policy.sinks && !d_sinks_got.iter().all(|x| x.is_nan()) {
        return Err("d_sinks written without being asked for".into());
    }

    let u = abs_tol(T::DTYPE) / 4.0;
    let model = BwdErrorModel {
        unit: u,
        tanh_rel_err: TANH_REL_ERR,
        lse_tol: LSE_TOL,
    };
    let extras = Extras {
        alibi_slopes: data.slopes.as_ref().map(|(s64, _)| s64.as_slice()),
        sinks: data.sinks.as_ref().map(|(s64, _)| s64.as_slice()),
    };
    let bounds =
        reference::backward_bounds(&shape, &q64, &k64, &v64, &do64, &o_host, &extras, &model);
    let got = RefGrads {
        dq: gather(&dq_got, &dql),
        dk: gather(&dk_got, &dkl),
        dv: gather(&dv_got, &dvl),
        d_sinks: if c.policy.sinks {
            d_sinks_got.iter().map(|&x| x as f64).collect()
        } else {
            Vec::new()
        },
    };
    reference::check_backward(&got, &want, &bounds, u, (d, d))
}

/// A varlen backward problem: (query, key) lengths per sequence, the
/// first non-empty, the others possibly empty or of one token, and packed
/// rows that no sequence owns before and after them (query front, query
/// back, key front, key back).
#[derive(Clone, Debug)]
struct BwdVarlenCase {
    lens: Vec<(usize, usize)>,
    pads: [usize; 4],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    policy: Policy,
    seed: u64,
}

fn bwd_varlen_strategy() -> impl Strategy<Value = BwdVarlenCase> {
    let len = || prop_oneof![1 => Just(0usize), 1 => Just(1usize), 4 => 2usize..=200];
    (
        (
            (1usize..=200, 1usize..=200),
            prop::collection::vec((len(), len()), 0..4),
        ),
        head_counts(),
        prop::sample::select(flash_attn::BWD_HEAD_DIMS.to_vec()),
        policy_strategy(),
        (any::<u64>(), prop::array::uniform4(0usize..3)),
    )
        .prop_map(
            |((first, rest), (heads, kv_heads), head_dim, policy, (seed, pads))| BwdVarlenCase {
                lens: std::iter::once(first).chain(rest).collect(),
                pads,
                heads,
                kv_heads,
                head_dim,
                policy,
                seed,
            },
        )
}

/// One sequence's dense forward and backward (a batch of one), as host
/// rows: O, LSE [H, Sq], dQ, dK, dV and the sinks' gradient.
type SeqGrads<T> = (Vec<T>, Vec<f32>, Vec<T>, Vec<T>, Vec<T>, Vec<f32>);

/// The varlen backward against each sequence's fixed-batch backward (a
/// batch of one, which `backward_random_*` checks against the reference),
/// fed the same O and LSE: dK and dV must match bit for bit (the same
/// sums in the same order), dQ within one rounding of the dtype (its f32
/// buffer adds the key blocks' shares in either order), the sinks'
/// gradient within f32 rounding of the sum over sequences. A sequence
/// without queries has dK = dV = 0, one without keys dQ = 0; rows no
/// sequence owns (whose O is noise and LSE NaN) get dQ = 0 and keep their
/// dK and dV; every output starts as NaN.
fn run_backward_varlen<T: AttnElement>(gpu: &Gpu, c: &BwdVarlenCase) -> Result<(), String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let s = &gpu.stream;
    let (h, hkv, d) = (c.heads, c.kv_heads, c.head_dim);
    let mut rng = StdRng::seed_from_u64(c.seed);
    let batch = c.lens.len();
    let [q_front, q_back, k_front, k_back] = c.pads;
    let mut cu_q = vec![q_front];
    let mut cu_k = vec![k_front];
    for &(sq, sk) in &c.lens {
        cu_q.push(cu_q.last().unwrap() + sq);
        cu_k.push(cu_k.last().unwrap() + sk);
    }
    let (total_q, total_k) = (cu_q[batch] + q_back, cu_k[batch] + k_back);
    let (q_row, k_row) = (h * d, hkv * d);
    let q_host = random_values::<T>(&mut rng, total_q * q_row);
    let k_host = random_values::<T>(&mut rng, total_k * k_row);
    let v_host = random_values::<T>(&mut rng, total_k * k_row);
    let do_host = random_values::<T>(&mut rng, total_q * q_row);
    // Slopes [B, H] when the case asks for per-batch ones.
    let data = policy_data(gpu, &c.policy, batch, h, &mut rng)?;
    // Rows no sequence owns: O noise, LSE NaN; owned rows of sequences
    // without keys: O = 0, LSE = the sink (or -inf), as the forward leaves them.
    let mut o_host = random_values::<T>(&mut rng, total_q * q_row);
    let sink_lse = |hi: usize| {
        data.sinks
            .as_ref()
            .map_or(f32::NEG_INFINITY, |(v, _)| v[hi] as f32)
    };
    let mut lse_host = vec![f32::NAN; h * total_q];
    let mut want_dq = vec![T::from_f64(0.0); total_q * q_row];
    let mut want_dk = vec![nan::<T>(); total_k * k_row];
    let mut want_dv = vec![nan::<T>(); total_k * k_row];
    let mut want_sinks = vec![0f64; h];
    let mut sinks_scale = vec![0f64; h];
    for (b, &(sq, sk)) in c.lens.iter().enumerate() {
        for hi in 0..h {
            lse_host[hi * total_q + cu_q[b]..][..sq].fill(sink_lse(hi));
        }
        o_host[cu_q[b] * q_row..cu_q[b + 1] * q_row].fill(T::from_f64(0.0));
        want_dk[cu_k[b] * k_row..cu_k[b + 1] * k_row].fill(T::from_f64(0.0));
        want_dv[cu_k[b] * k_row..cu_k[b + 1] * k_row].fill(T::from_f64(0.0));
        if sq == 0 || sk == 0 {
            continue;
        }
        let (qs, ks) = (
            cu_q[b] * q_row..cu_q[b + 1] * q_row,
            cu_k[b] * k_row..cu_k[b + 1] * k_row,
        );
        // This sequence's slopes: row b of [B, H] ones.
        let one_data = PolicyData {
            slopes: match (&data.slopes, c.policy.alibi) {
                (Some((v, _)), Some(true)) => {
                    let row: Vec<f32> = v[b * h..(b + 1) * h].iter().map(|&x| x as f32).collect();
                    Some((vec![], s.clone_htod(&row).map_err(e)?))
                }
                (Some((v, dev)), _) => Some((v.clone(), dev.clone())),
                (None, _) => None,
            },
            sinks: data.sinks.clone(),
        };
        let one_policy = Policy {
            alibi: c.policy.alibi.map(|_| false),
            ..c.policy.clone()
        };
        let (o1, lse1, dq1, dk1, dv1, ds1): SeqGrads<T> =
            with_options(&one_policy, &one_data, |opts, _| {
                dense_backward_of_one(
                    gpu,
                    [
                        &q_host[qs.clone()],
                        &k_host[ks.clone()],
                        &v_host[ks.clone()],
                    ],
                    &do_host[qs.clone()],
                    [sq, sk, h, hkv, d],
                    opts,
                )
            })?;
        o_host[qs.clone()].copy_from_slice(&o1);
        for hi in 0..h {
            lse_host[hi * total_q + cu_q[b]..][..sq].copy_from_slice(&lse1[hi * sq..][..sq]);
        }
        want_dq[qs.clone()].copy_from_slice(&dq1);
        want_dk[ks.clone()].copy_from_slice(&dk1);
        want_dv[ks.clone()].copy_from_slice(&dv1);
        for hi in 0..ds1.len() {
            want_sinks[hi] += ds1[hi] as f64;
            sinks_scale[hi] += (ds1[hi] as f64).abs();
        }
    }

    let up = |x: &[T]| s.clone_htod(x).map_err(e);
    let (q, k, v, o, d_o) = (
        up(&q_host)?,
        up(&k_host)?,
        up(&v_host)?,
        up(&o_host)?,
        up(&do_host)?,
    );
    let lse = s.clone_htod(&lse_host).map_err(e)?;
    let to_i32 = |cu: &[usize]| cu.iter().map(|&x| x as i32).collect::<Vec<_>>();
    let (cq, ck) = (
        s.clone_htod(&to_i32(&cu_q)).map_err(e)?,
        s.clone_htod(&to_i32(&cu_k)).map_err(e)?,
    );
    let mut dq = poisoned::<T>(gpu, total_q * q_row)?;
    let mut dk = poisoned::<T>(gpu, total_k * k_row)?;
    let mut dv = poisoned::<T>(gpu, total_k * k_row)?;
    let mut d_sinks = s.clone_htod(&vec![f32::NAN; h]).map_err(e)?;
    let (ql, kl) = (
        Layout::packed([total_q, h, d]),
        Layout::packed([total_k, hkv, d]),
    );
    let seqlens = Varlen {
        cu_seqlens_q: &cq.as_view(),
        cu_seqlens_k: &ck.as_view(),
        max_seqlen_q: c.lens.iter().map(|l| l.0).max().unwrap(),
        max_seqlen_k: c.lens.iter().map(|l| l.1).max().unwrap(),
    };
    let call = BwdCall {
        qkv: [(&q, ql), (&k, kl), (&v, kl)],
        o: (&o, ql),
        d_o: (&d_o, ql),
        lse: &lse,
    };
    with_options(&c.policy, &data, |opts, _| {
        call.run(
            gpu,
            [(&mut dq, ql), (&mut dk, kl), (&mut dv, kl)],
            c.policy.sinks.then_some(&mut d_sinks),
            Some(&seqlens),
            opts,
        )
        .map_err(|x| x.to_string())
    })?;
    let (dq_got, dk_got, dv_got) = (
        s.clone_dtoh(&dq).map_err(e)?,
        s.clone_dtoh(&dk).map_err(e)?,
        s.clone_dtoh(&dv).map_err(e)?,
    );
    // The owner of the element's packed row, for messages.
    let row_of = |i: usize, width: usize, cu: &[usize]| {
        let r = i / width;
        let b = cu.partition_point(|&x| x <= r);
        let owner = if b == 0 || b == cu.len() {
            "no sequence".to_string()
        } else {
            format!("sequence {}", b - 1)
        };
        (owner, r)
    };
    for (name, got, want) in [("dk", &dk_got, &want_dk), ("dv", &dv_got, &want_dv)] {
        if let Some(i) =
            (0..got.len()).find(|&i| got[i].to_f64().to_bits() != want[i].to_f64().to_bits())
        {
            let (b, r) = row_of(i, k_row, &cu_k);
            return Err(format!(
                "{name} ({b}, packed row {r}, element {}): got {}, want {}",
                i % k_row,
                got[i].to_f64(),
                want[i].to_f64()
            ));
        }
    }
    let u = abs_tol(T::DTYPE) / 4.0;
    // Two roundings of one value to the dtype differ by at most its spacing
    // there: 2u relative, or below the normal range (f16 under 2^-14) the
    // subnormal step.
    let subnormal_step = match T::DTYPE {
        Dtype::F16 => 2f64.powi(-24),
        _ => 2f64.powi(-133),
    };
    for i in 0..dq_got.len() {
        let (g, w) = (dq_got[i].to_f64(), want_dq[i].to_f64());
        // Plus f32 rounding of the head row's sums, for entries near 0.
        let head_row = &want_dq[i / d * d..][..d];
        let row_max = head_row.iter().fold(0f64, |m, x| m.max(x.to_f64().abs()));
        let bound = 2.0 * u * w.abs() + 1e-6 * row_max + subnormal_step;
        if (g - w).is_nan() || (g - w).abs() > bound {
            let (b, r) = row_of(i, q_row, &cu_q);
            return Err(format!(
                "dq ({b}, packed row {r}, element {}): got {g}, want {w}",
                i % q_row
            ));
        }
    }
    let sinks_got = s.clone_dtoh(&d_sinks).map_err(e)?;
    for hi in 0..h {
        let g = sinks_got[hi] as f64;
        if !c.policy.sinks {
            if !g.is_nan() {
                return Err("d_sinks written without being asked for".into());
            }
            continue;
        }
        let bound = 1e-5 * sinks_scale[hi] + 1e-7;
        if (g - want_sinks[hi]).is_nan() || (g - want_sinks[hi]).abs() > bound {
            return Err(format!(
                "d_sinks head {hi}: got {g}, want {} (bound {bound:.3e})",
                want_sinks[hi]
            ));
        }
    }
    Ok(())
}

/// `cu_seqlens` the host cannot check (decreasing, negative, past the
/// packed rows): the kernels clamp them (`block_info::packed_range`), so
/// the call runs to completion and every sequence stays inside the
/// tensors. Its values are not checked; the suite runs it under memcheck,
/// which sees any access outside the buffers.
fn backward_varlen_clamps_device_offsets(gpu: &Gpu) -> Result<(), String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let s = &gpu.stream;
    let (total, h, d) = (100, 2, 64);
    let l = Layout::packed([total, h, d]);
    let x = s
        .clone_htod(&vec![f16::from_f32(0.25); total * h * d])
        .map_err(e)?;
    let lse = s.clone_htod(&vec![0f32; h * total]).map_err(e)?;
    let cu = s.clone_htod(&[0i32, 90, 30, 5000, -7]).map_err(e)?;
    let seqlens = Varlen {
        cu_seqlens_q: &cu.as_view(),
        cu_seqlens_k: &cu.as_view(),
        max_seqlen_q: total,
        max_seqlen_k: total,
    };
    let opts = AttnOptions {
        causal: true,
        ..Default::default()
    };
    backward_of_one(gpu, &x, l, &lse, &opts, None, Some(&seqlens))?.map_err(|x| x.to_string())?;
    s.synchronize().map_err(e)
}

/// [`SeqGrads`] of one sequence ([sq, sk, h, hkv, d]) from host rows.
fn dense_backward_of_one<T: AttnElement>(
    gpu: &Gpu,
    [q, k, v]: [&[T]; 3],
    d_o: &[T],
    [sq, sk, h, hkv, d]: [usize; 5],
    opts: &AttnOptions,
) -> Result<SeqGrads<T>, String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let s = &gpu.stream;
    let x = upload_inputs(gpu, q.to_vec(), k.to_vec(), v.to_vec())?;
    let (ql, kl) = (
        Layout::contiguous([1, sq, h, d]),
        Layout::contiguous([1, sk, hkv, d]),
    );
    let mut o = poisoned::<T>(gpu, sq * h * d)?;
    let mut lse = s.clone_htod(&vec![f32::NAN; h * sq]).map_err(e)?;
    forward_with_lse(gpu, &x, [ql, kl, kl], (&mut o, ql), &mut lse, opts)?;
    let d_o = s.clone_htod(d_o).map_err(e)?;
    let mut dq = poisoned::<T>(gpu, sq * h * d)?;
    let mut dk = poisoned::<T>(gpu, sk * hkv * d)?;
    let mut dv = poisoned::<T>(gpu, sk * hkv * d)?;
    let mut d_sinks = s.clone_htod(&vec![f32::NAN; h]).map_err(e)?;
    let call = BwdCall {
        qkv: [(&x.q, ql), (&x.k, kl), (&x.v, kl)],
        o: (&o, ql),
        d_o: (&d_o, ql),
        lse: &lse,
    };
    call.run(
        gpu,
        [(&mut dq, ql), (&mut dk, kl), (&mut dv, kl)],
        opts.sinks.is_some().then_some(&mut d_sinks),
        None,
        opts,
    )
    .map_err(|x| x.to_string())?;
    let sinks = if opts.sinks.is_some() {
        s.clone_dtoh(&d_sinks).map_err(e)?
    } else {
        vec![]
    };
    Ok((
        s.clone_dtoh(&o).map_err(e)?,
        s.clone_dtoh(&lse).map_err(e)?,
        s.clone_dtoh(&dq).map_err(e)?,
        s.clone_dtoh(&dk).map_err(e)?,
        s.clone_dtoh(&dv).map_err(e)?,
        sinks,
    ))
}

/// The tensors of one backward call: Q, K and V, the forward's O, dO (each
/// with its layout) and the LSE.
struct BwdCall<'a, T> {
    qkv: [(&'a CudaSlice<T>, Layout); 3],
    o: (&'a CudaSlice<T>, Layout),
    d_o: (&'a CudaSlice<T>, Layout),
    lse: &'a CudaSlice<f32>,
}

impl<'a, T: AttnElement> BwdCall<'a, T> {
    /// Our backward (with `seqlens`, the varlen one) into `grads` (dQ, dK
    /// and dV with their layouts) and, if given, `d_sinks`.
    fn run(
        &self,
        gpu: &Gpu,
        [dq, dk, dv]: [(&mut CudaSlice<T>, Layout); 3],
        d_sinks: Option<&mut CudaSlice<f32>>,
        seqlens: Option<&Varlen>,
        opts: &AttnOptions,
    ) -> Result<(), FlashAttnError> {
        let r = |&(x, l): &(&'a CudaSlice<T>, Layout)| TensorRef::new(x.as_view(), l);
        let [q, k, v] = self.qkv.each_ref().map(r);
        let (o, d_o, lse) = (r(&self.o), r(&self.d_o), self.lse.as_view());
        let qkv = Qkv {
            q: &q,
            k: &k,
            v: &v,
        };
        let saved = BackwardInputs {
            o: &o,
            lse: &lse,
            d_o: &d_o,
        };
        let grads = Grads::new(
            TensorMut::new(dq.0.as_view_mut(), dq.1),
            TensorMut::new(dk.0.as_view_mut(), dk.1),
            TensorMut::new(dv.0.as_view_mut(), dv.1),
        );
        let grads = match d_sinks {
            Some(d) => grads.with_sinks(d.as_view_mut()),
            None => grads,
        };
        match seqlens {
            Some(s) => gpu
                .fa
                .backward_varlen(&gpu.stream, qkv, saved, grads, s, opts),
            None => gpu.fa.backward(&gpu.stream, qkv, saved, grads, opts),
        }
    }
}

/// A backward call (with `seqlens`, the varlen one) with Q = K = V = O =
/// dO = `x` ([`Layout`] `l`) and gradients (and `d_sinks`, `d_sinks_len`
/// f32, if given) poisoned with NaN; returns the call's result after
/// checking that nothing was written if it was refused.
fn backward_of_one<T: AttnElement>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    l: Layout,
    lse: &CudaSlice<f32>,
    opts: &AttnOptions,
    d_sinks_len: Option<usize>,
    seqlens: Option<&Varlen>,
) -> Result<Result<(), FlashAttnError>, String> {
    let n = x.len();
    let mut g = [
        poisoned::<T>(gpu, n)?,
        poisoned::<T>(gpu, n)?,
        poisoned::<T>(gpu, n)?,
    ];
    let mut d_sinks = gpu
        .stream
        .clone_htod(&vec![f32::NAN; d_sinks_len.unwrap_or(1)])
        .map_err(|e| e.to_string())?;
    let [dq, dk, dv] = &mut g;
    let call = BwdCall {
        qkv: [(x, l), (x, l), (x, l)],
        o: (x, l),
        d_o: (x, l),
        lse,
    };
    let got = call.run(
        gpu,
        [(dq, l), (dk, l), (dv, l)],
        d_sinks_len.map(|_| &mut d_sinks),
        seqlens,
        opts,
    );
    if got.is_err() {
        for buf in &g {
            let host = gpu.stream.clone_dtoh(buf).map_err(|e| e.to_string())?;
            if !host.iter().all(|v| v.to_f64().is_nan()) {
                return Err(format!("a refused call wrote a gradient: {got:?}"));
            }
        }
        let host = gpu.stream.clone_dtoh(&d_sinks).map_err(|e| e.to_string())?;
        if !host.iter().all(|v| v.is_nan()) {
            return Err(format!("a refused call wrote d_sinks: {got:?}"));
        }
    }
    Ok(got)
}

/// The backward's typed refusals on the GPU, each before any launch with
/// every output untouched: ALiBi slopes, sinks and the sinks' gradient
/// shorter than they must be, and f32.
fn backward_checks_device_options(gpu: &Gpu) -> Result<(), String> {
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let s = &gpu.stream;
    let (b, sq, h, d) = (1, 20, 2, 64);
    let l = Layout::contiguous([b, sq, h, d]);
    let x = s
        .clone_htod(&vec![f16::from_f32(0.5); b * sq * h * d])
        .map_err(e)?;
    let lse = s.clone_htod(&vec![0f32; b * h * sq]).map_err(e)?;
    let short = s.clone_htod(&vec![0.5f32; h - 1]).map_err(e)?;
    let full = s.clone_htod(&vec![0.5f32; h]).map_err(e)?;
    let (short, full) = (short.as_view(), full.as_view());
    let alibi = AttnOptions {
        alibi_slopes: Some(AlibiSlopes::PerHead(&short)),
        ..Default::default()
    };
    let sinks = AttnOptions {
        sinks: Some(&short),
        ..Default::default()
    };
    let with_sinks = AttnOptions {
        sinks: Some(&full),
        ..Default::default()
    };
    for (opts, d_sinks, what) in [
        (alibi, None, "alibi_slopes"),
        (sinks, None, "sinks"),
        (with_sinks, Some(h - 1), "d_sinks"),
    ] {
        match backward_of_one(gpu, &x, l, &lse, &opts, d_sinks, None)? {
            Err(FlashAttnError::ParamLength { what: w, .. }) if w == what => {}
            other => return Err(format!("{what}: expected ParamLength, got {other:?}")),
        }
    }
    let x32 = s.clone_htod(&vec![0.5f32; b * sq * h * d]).map_err(e)?;
    match backward_of_one(gpu, &x32, l, &lse, &AttnOptions::default(), None, None)? {
        Err(FlashAttnError::UnsupportedDtype { .. }) => Ok(()),
        other => Err(format!("f32: expected UnsupportedDtype, got {other:?}")),
    }
}

fn main() {
    let args = Arguments::from_args();
    let gpu = Arc::new(open_gpu());
    let have_gpu = gpu.is_some();
    let mut trials = Vec::new();

    // A proptest trial per (label, dtype): `cases` random cases of `strategy`
    // through `run`.
    macro_rules! random_trial {
        ($label:literal, $name:literal, $cases:expr, $strategy:expr, $run:expr) => {{
            let g = gpu.clone();
            trials.push(Trial::test(concat!($label, $name), move || {
                proptest_trial(&g, $cases, $strategy, $run)
            }));
        }};
    }

    // Every case of a fixed list (the run's error names its case).
    macro_rules! fixed_trial {
        ($label:literal, $name:literal, $cases:expr, $run:expr) => {{
            let g = gpu.clone();
            trials.push(Trial::test(concat!($label, $name), move || {
                let gpu = g.as_ref().as_ref().unwrap();
                for c in $cases {
                    $run(gpu, &c)?;
                }
                Ok(())
            }));
        }};
    }

    macro_rules! dtype_trials {
        ($t:ty, $name:literal) => {{
            random_trial!(
                "forward_random_",
                $name,
                case_count(),
                fwd_strategy(),
                run_forward::<$t>
            );
            fixed_trial!(
                "forward_fixed_shapes_",
                $name,
                fixed_forward_cases(),
                run_forward::<$t>
            );
            random_trial!(
                "decode_random_",
                $name,
                case_count(),
                decode_strategy(),
                run_decode::<$t>
            );
            random_trial!(
                "kvcache_paged_append_random_",
                $name,
                case_count(),
                kvcache_strategy(),
                run_kvcache::<$t>
            );
            trials.push(Trial::test(
                concat!("kvcache_graph_replay_", $name),
                move || graph_replay::<$t>().map_err(Failed::from),
            ));
            trials.push(Trial::test(
                concat!("decode_chained_steps_", $name),
                move || chained_decode_steps::<$t>().map_err(Failed::from),
            ));
            random_trial!(
                "forward_policies_random_",
                $name,
                case_count(),
                policy_fwd_strategy(),
                run_forward_policy::<$t>
            );
            fixed_trial!(
                "forward_alibi_sides_",
                $name,
                forward_alibi_side_cases(),
                run_forward_policy::<$t>
            );
            random_trial!(
                "varlen_random_",
                $name,
                case_count(),
                varlen_strategy(),
                run_varlen::<$t>
            );
            random_trial!(
                "varlen_paged_random_",
                $name,
                case_count(),
                varlen_paged_strategy(),
                run_varlen_paged::<$t>
            );
            random_trial!(
                "decode_policies_random_",
                $name,
                case_count(),
                policy_decode_strategy(),
                run_decode_policy::<$t>
            );
            fixed_trial!(
                "decode_combine_groups_",
                $name,
                combine_group_cases(),
                run_decode_policy::<$t>
            );
            let g = gpu.clone();
            trials.push(Trial::test(concat!("v_head_dim_", $name), move || {
                let gpu = g.as_ref().as_ref().unwrap();
                v_head_dim_cases::<$t>(gpu).map_err(Failed::from)
            }));
            fixed_trial!(
                "softcap_range_",
                $name,
                softcap_range_cases(),
                run_softcap_range::<$t>
            );
            let g = gpu.clone();
            trials.push(Trial::test(
                concat!("lazy_rescale_past_slack_", $name),
                move || {
                    let gpu = g.as_ref().as_ref().unwrap();
                    for &head_dim in &flash_attn::SUPPORTED_HEAD_DIMS {
                        for causal in [false, true] {
                            for softcap in [None, Some(20.0)] {
                                let c = RescaleCase {
                                    head_dim,
                                    causal,
                                    aligned: 0..16,
                                    persistent: None,
                                    softcap,
                                };
                                run_rescale::<$t>(gpu, &c)?;
                            }
                        }
                    }
                    // One n-tile of aligned keys per max chain of the D = 64
                    // causal persistent line (four: `hopper::forward`).
                    for first in [0, 8, 16, 24] {
                        let c = RescaleCase {
                            head_dim: 64,
                            causal: true,
                            aligned: first..first + 8,
                            persistent: Some(true),
                            softcap: None,
                        };
                        run_rescale::<$t>(gpu, &c)?;
                    }
                    Ok(())
                },
            ));
        }};
    }
    dtype_trials!(f16, "f16");
    dtype_trials!(bf16, "bf16");
    dtype_trials!(f32, "f32");

    // Folded KV heads (`KvFold::On`) on calls drawn to allow them: decode
    // alone, with every policy and forced splits, and over paged caches
    // after appends. `KvFold::Auto` folds only big grids on sm_90, which
    // the random shapes rarely are.
    let gpu_fold = Arc::new(gpu.as_ref().as_ref().map(Gpu::folding));
    // A random trial of foldable cases (`foldable`) on that instance.
    macro_rules! folded_trial {
        ($label:literal, $name:literal, $case:ident, $strategy:expr, $run:expr) => {{
            let g = gpu_fold.clone();
            trials.push(Trial::test(concat!($label, $name), move || {
                let strategy = $strategy.prop_map(|c| {
                    let (heads, kv_heads, head_dim, seqlen_q) =
                        foldable(c.heads, c.kv_heads, c.head_dim, c.seqlen_q);
                    $case {
                        heads,
                        kv_heads,
                        head_dim,
                        seqlen_q,
                        ..c
                    }
                });
                proptest_trial(&g, case_count(), strategy, $run)
            }));
        }};
    }
    macro_rules! fold_trials {
        ($t:ty, $name:literal) => {{
            folded_trial!(
                "decode_folded_random_",
                $name,
                DecodeCase,
                decode_strategy(),
                run_decode::<$t>
            );
            folded_trial!(
                "decode_policies_folded_random_",
                $name,
                PolicyDecodeCase,
                policy_decode_strategy(),
                run_decode_policy::<$t>
            );
            folded_trial!(
                "kvcache_paged_append_folded_random_",
                $name,
                KvCase,
                kvcache_strategy(),
                run_kvcache::<$t>
            );
            let g = gpu_fold.clone();
            trials.push(Trial::test(
                concat!("decode_fold_needs_adjacent_heads_", $name),
                move || {
                    decode_fold_needs_adjacent_heads::<$t>(g.as_ref().as_ref().unwrap())
                        .map_err(Failed::from)
                },
            ));
            let g = gpu_fold.clone();
            trials.push(Trial::test(
                concat!("decode_fold_reads_adjacent_heads_in_pairs_", $name),
                move || {
                    decode_fold_reads_adjacent_heads_in_pairs::<$t>(g.as_ref().as_ref().unwrap())
                        .map_err(Failed::from)
                },
            ));
        }};
    }
    fold_trials!(f16, "f16");
    fold_trials!(bf16, "bf16");
    // merge_states takes f16/bf16 (f32 is refused: module_and_dtypes_as_configured).
    random_trial!(
        "merge_states_random_",
        "f16",
        case_count().div_ceil(2),
        policy_fwd_strategy(),
        run_merge::<f16>
    );
    random_trial!(
        "backward_random_",
        "f16",
        case_count().div_ceil(2),
        bwd_strategy(),
        run_backward::<f16>
    );
    random_trial!(
        "backward_random_",
        "bf16",
        case_count().div_ceil(2),
        bwd_strategy(),
        run_backward::<bf16>
    );
    random_trial!(
        "backward_varlen_random_",
        "f16",
        case_count().div_ceil(2),
        bwd_varlen_strategy(),
        run_backward_varlen::<f16>
    );
    random_trial!(
        "backward_varlen_random_",
        "bf16",
        case_count().div_ceil(2),
        bwd_varlen_strategy(),
        run_backward_varlen::<bf16>
    );
    let g = gpu.clone();
    trials.push(Trial::test(
        "backward_varlen_clamps_device_offsets",
        move || {
            backward_varlen_clamps_device_offsets(g.as_ref().as_ref().unwrap())
                .map_err(Failed::from)
        },
    ));
    // The `mma.sync` kernel at the head dims the Hopper one takes, and the
    // default kernels without head splits (the suite's small GQA problems
    // split by default, the only way the other trials run them).
    let gpu_mma = Arc::new(gpu.as_ref().as_ref().map(Gpu::mma_backward));
    let gpu_unsplit = Arc::new(gpu.as_ref().as_ref().map(Gpu::unsplit_backward));
    macro_rules! mma_backward_trial {
        ($t:ty, $name:literal) => {{
            let g = gpu_mma.clone();
            trials.push(Trial::test(
                concat!("backward_mma_random_", $name),
                move || {
                    proptest_trial(
                        &g,
                        case_count().div_ceil(2),
                        bwd_strategy(),
                        run_backward::<$t>,
                    )
                },
            ));
            let g = gpu_unsplit.clone();
            trials.push(Trial::test(
                concat!("backward_unsplit_random_", $name),
                move || {
                    proptest_trial(
                        &g,
                        case_count().div_ceil(2),
                        bwd_strategy(),
                        run_backward::<$t>,
                    )
                },
            ));
        }};
    }
    mma_backward_trial!(f16, "f16");
    mma_backward_trial!(bf16, "bf16");
    let g = gpu.clone();
    trials.push(Trial::test("backward_checks_device_options", move || {
        backward_checks_device_options(g.as_ref().as_ref().unwrap()).map_err(Failed::from)
    }));
    random_trial!(
        "merge_states_random_",
        "bf16",
        case_count().div_ceil(2),
        policy_fwd_strategy(),
        run_merge::<bf16>
    );

    let g = gpu.clone();
    trials.push(Trial::test("loads_machine_code_when_embedded", move || {
        let gpu = g.as_ref().as_ref().unwrap();
        let (major, minor) = gpu.fa.compute_capability();
        // The driver here is R580+ (CUDA 13), which takes the first cubin.
        let want = match flash_attn::cubins_for(gpu.fa.ptx_arch(), major, minor).first() {
            Some(&(name, _)) => LoadedCode::Cubin(name),
            None => LoadedCode::Ptx(gpu.fa.ptx_arch().target_cpu()),
        };
        if gpu.fa.loaded_code() != want {
            return Err(format!("loaded {:?}, expected {want:?}", gpu.fa.loaded_code()).into());
        }
        // The PTX of the same module (the fallback) loads and decodes right.
        let ptx = Gpu {
            stream: gpu.stream.clone(),
            fa: FlashAttention::new_with(gpu.fa.context(), ModuleChoice::Ptx)
                .map_err(|e| e.to_string())?,
            hopper: None,
        };
        if ptx.fa.loaded_code() != LoadedCode::Ptx(gpu.fa.ptx_arch().target_cpu()) {
            return Err(format!("ModuleChoice::Ptx loaded {:?}", ptx.fa.loaded_code()).into());
        }
        // The Hopper module likewise: its first cubin, or with
        // `ModuleChoice::Ptx` its PTX, which then runs a Hopper forward.
        if let Some(loaded) = gpu.fa.hopper_loaded_code() {
            let want = match flash_attn::cubins_for(PtxArch::Sm90a, major, minor).first() {
                Some(&(name, _)) => LoadedCode::Cubin(name),
                None => LoadedCode::Ptx(PtxArch::Sm90a.target_cpu()),
            };
            if loaded != want {
                return Err(format!("Hopper module: loaded {loaded:?}, expected {want:?}").into());
            }
            let ptx_hopper = ptx.fa.hopper_loaded_code();
            if ptx_hopper != Some(LoadedCode::Ptx(PtxArch::Sm90a.target_cpu())) {
                return Err(format!("ModuleChoice::Ptx, Hopper module: {ptx_hopper:?}").into());
            }
            check_hopper_path(&ptx)?;
            let c = FwdCase {
                batch: 2,
                seqlen_q: 300,
                seqlen_k: 555,
                heads: 4,
                kv_heads: 2,
                head_dim: 128,
                causal: true,
                with_lse: true,
                packed_qkv: false,
                seed: 7,
                hopper_rows: None,
                hopper_persistent: None,
                hopper_keys: None,
            };
            run_forward::<f16>(&ptx, &c)?;
        }
        let c = DecodeCase {
            batch: 2,
            seqlen_q: 1,
            cache_len: 3000,
            heads: 8,
            kv_heads: 2,
            head_dim: 128,
            causal: true,
            seqlens: vec![3000, 1234],
            seed: 5,
        };
        run_decode::<f16>(&ptx, &c)?;
        Ok(())
    }));

    let g = gpu.clone();
    trials.push(Trial::test("decode_long_cache_uses_splits", move || {
        let gpu = g.as_ref().as_ref().unwrap();
        // D = 128, 192 and 256: sm_90 decode tiles whose ring depth the
        // launch picks.
        for head_dim in [128, 192, 256] {
            let mut depths = std::collections::BTreeSet::new();
            for (batch, cache_len, heads, kv_heads) in
                // 3 KV heads of one sequence: dozens of splits, several combine
                // groups. The grids of 96 and 256 CTAs take both ring depths of
                // an sm_90 decode tile.
                [
                    (1, 16384, 32, 8),
                    (2, 5000, 9, 9),
                    (3, 4096, 8, 1),
                    (1, 16384, 9, 3),
                ]
            {
                let c = DecodeCase {
                    batch,
                    seqlen_q: 1,
                    cache_len,
                    heads,
                    kv_heads,
                    head_dim,
                    causal: true,
                    seqlens: (0..batch).map(|i| (cache_len - 97 * i) as i32).collect(),
                    seed: 11,
                };
                let shape = c.shape();
                if gpu.fa.decode_splits::<f16>(&shape) < 2 {
                    return Err(format!("{c:?}: expected a split-KV launch").into());
                }
                depths.insert(gpu.fa.decode_ring_stages::<f16>(&shape));
                run_decode::<f16>(gpu, &c)?;
                // f32: its own decode and combine kernels (f32 output of the combine).
                if gpu.fa.decode_splits::<f32>(&shape) < 2 {
                    return Err(format!("{c:?}: expected a split-KV launch in f32").into());
                }
                run_decode::<f32>(gpu, &c)?;
            }
            let tile = AttnTile::of(KernelKind::Decode, head_dim, gpu.fa.ptx_arch());
            let want: std::collections::BTreeSet<usize> = [tile.busy_stages, tile.kv_stages].into();
            if depths != want {
                return Err(format!(
                    "D = {head_dim}: ring depths used {depths:?}, expected {want:?}"
                )
                .into());
            }
        }
        Ok(())
    }));

    let g = gpu.clone();
    trials.push(Trial::test(
        "decode_row_tiled_streams_take_the_deep_ring",
        move || {
            let gpu = g.as_ref().as_ref().unwrap();
            // Qwen 28/4 with 4 new tokens: 28 rows per KV head, two row tiles that
            // read the same K/V. A quarter as many sequences as SMs makes a grid
            // of about two CTAs per SM but at most one K/V stream per SM, which
            // the sm_90 D = 128 tile runs at its deepest ring (v65).
            let batch = (gpu.fa.num_sms() / 4).max(1);
            let c = DecodeCase {
                batch,
                seqlen_q: 4,
                cache_len: 1024,
                heads: 28,
                kv_heads: 4,
                head_dim: 128,
                causal: true,
                seqlens: (0..batch).map(|i| (1024 - 13 * (i % 64)) as i32).collect(),
                seed: 12,
            };
            let shape = c.shape();
            let tile = AttnTile::of(KernelKind::Decode, 128, gpu.fa.ptx_arch());
            if tile.kv_stages > tile.busy_stages {
                // One split: two CTAs per stream, all resident at the deep ring.
                let row_tiles = (c.heads / c.kv_heads * c.seqlen_q).div_ceil(tile.block_m);
                let streams = batch * c.kv_heads;
                let splits = gpu.fa.decode_splits::<f16>(&shape);
                let grid = streams * row_tiles * splits;
                if row_tiles != 2 || splits != 1 || grid <= gpu.fa.num_sms() {
                    return Err(format!(
                        "{c:?}: {row_tiles} row tiles, {splits} splits, {grid} CTAs"
                    )
                    .into());
                }
                let stages = gpu.fa.decode_ring_stages::<f16>(&shape);
                if stages != tile.kv_stages {
                    return Err(format!(
                        "{c:?}: {grid} CTAs of {streams} streams ran {stages} stages, expected {}",
                        tile.kv_stages
                    )
                    .into());
                }
            }
            run_decode::<f16>(gpu, &c)?;
            Ok(())
        },
    ));

    let g = gpu.clone();
    trials.push(Trial::test(
        "invalid_input_leaves_output_untouched",
        move || {
            let gpu = g.as_ref().as_ref().unwrap();
            let s = &gpu.stream;
            let poison = vec![f16::from_f32(-7.25); 2 * 16 * 3 * 64];
            let q = s
                .clone_htod(&vec![f16::from_f32(0.5); 2 * 16 * 3 * 64])
                .unwrap();
            let kv = s
                .clone_htod(&vec![f16::from_f32(0.5); 2 * 16 * 2 * 64])
                .unwrap();
            let mut o = s.clone_htod(&poison).unwrap();
            let ql = Layout::contiguous([2, 16, 3, 64]);
            let kvl = Layout::contiguous([2, 16, 2, 64]);
            let err = gpu.fa.forward(
                s,
                Qkv {
                    q: &TensorRef::new(q.as_view(), ql),
                    k: &TensorRef::new(kv.as_view(), kvl),
                    v: &TensorRef::new(kv.as_view(), kvl),
                },
                Out::new(TensorMut::new(o.as_view_mut(), ql)),
                &AttnOptions::default(),
            );
            if !matches!(
                err,
                Err(FlashAttnError::HeadsNotDivisible {
                    heads: 3,
                    kv_heads: 2
                })
            ) {
                return Err(format!("expected HeadsNotDivisible, got {err:?}").into());
            }
            s.synchronize().unwrap();
            if s.clone_dtoh(&o).unwrap() != poison {
                return Err("O changed after a rejected call".into());
            }
            Ok(())
        },
    ));

    let g = gpu.clone();
    trials.push(Trial::test("module_and_dtypes_as_configured", move || {
        let gpu = g.as_ref().as_ref().unwrap();
        if gpu.hopper.is_some() {
            check_hopper_path(gpu)?;
        } else {
            check_module(gpu)?;
        }
        merge_f32_refused(gpu).map_err(Failed::from)?;
        if gpu.fa.ptx_arch().has_dtype(Dtype::Bf16) {
            return Ok(());
        }
        // bf16 on sm_75: a typed error before any launch, outputs and the
        // cache untouched (the append would run first).
        bf16_refused(gpu).map_err(Failed::from)
    }));

    let have_hopper = gpu.as_ref().as_ref().is_some_and(|g| g.hopper.is_some());
    let have_bf16 = gpu
        .as_ref()
        .as_ref()
        .is_some_and(|g| g.fa.ptx_arch().has_dtype(Dtype::Bf16));
    let mut hopper_trials = Vec::new();
    macro_rules! hopper_random_trial {
        ($label:literal, $name:literal, $strategy:expr, $run:expr) => {{
            let g = gpu.clone();
            hopper_trials.push(Trial::test(concat!($label, $name), move || {
                check_hopper_path(g.as_ref().as_ref().unwrap())?;
                proptest_trial(&g, case_count(), $strategy, $run)
            }));
        }};
    }
    // Every case of each fixed list on the Hopper path (the error names its case).
    macro_rules! hopper_fixed_trials {
        ($name:literal, $run:expr, $(($kind:literal, $cases:expr)),+ $(,)?) => {{
            $({
                let g = gpu.clone();
                hopper_trials.push(Trial::test(
                    concat!("hopper_forward_", $kind, "_", $name),
                    move || {
                        let gpu = g.as_ref().as_ref().unwrap();
                        check_hopper_path(gpu)?;
                        for c in $cases() {
                            $run(gpu, &c).map_err(|e| format!("{c:?}: {e}"))?;
                        }
                        Ok(())
                    },
                ));
            })+
        }};
    }
    macro_rules! hopper_forward_trials {
        ($t:ty, $name:literal) => {{
            hopper_random_trial!(
                "hopper_forward_random_",
                $name,
                hopper_fwd_strategy(),
                run_forward::<$t>
            );
            hopper_random_trial!(
                "hopper_forward_policies_random_",
                $name,
                hopper_policy_strategy(),
                run_forward_policy::<$t>
            );
            hopper_random_trial!(
                "hopper_varlen_random_",
                $name,
                hopper_varlen_strategy(),
                run_varlen::<$t>
            );
            hopper_random_trial!(
                "hopper_varlen_paged_random_",
                $name,
                hopper_varlen_paged_strategy(),
                run_varlen_paged::<$t>
            );
            let g = gpu.clone();
            hopper_trials.push(Trial::test(
                concat!("hopper_varlen_isolation_", $name),
                move || {
                    let gpu = g.as_ref().as_ref().unwrap();
                    check_hopper_path(gpu)?;
                    for d in hopper_head_dims() {
                        for causal in [false, true] {
                            run_varlen_isolation::<$t>(gpu, d, causal)?;
                        }
                    }
                    Ok(())
                },
            ));
            hopper_fixed_trials!(
                $name,
                run_forward_policy::<$t>,
                ("alibi_sides", hopper_alibi_side_cases),
                ("window_persistent", hopper_window_persistent_cases),
                ("softcap_lines", hopper_softcap_line_cases),
            );
            hopper_trials.push(Trial::test(
                concat!("hopper_forward_tile_orders_", $name),
                move || tile_orders::<$t>().map_err(Failed::from),
            ));
            hopper_fixed_trials!(
                $name,
                run_forward::<$t>,
                ("long", hopper_long_cases),
                ("many_tiles", hopper_many_tile_cases),
                ("split_keys", hopper_split_key_cases),
                ("serial", hopper_serial_cases),
            );
        }};
    }
    hopper_forward_trials!(f16, "f16");
    hopper_forward_trials!(bf16, "bf16");
    for (name, run) in [
        (
            "hopper_wgmma_probes",
            run_wgmma_probes as fn(&Gpu) -> Result<(), String>,
        ),
        ("hopper_tma_probes_maps_global", |g| {
            run_tma_probes(g, ProbeTmaParams::MAPS_GLOBAL)
        }),
        ("hopper_tma_probes_maps_param", |g| {
            run_tma_probes(g, ProbeTmaParams::MAPS_PARAM)
        }),
    ] {
        let g = gpu.clone();
        hopper_trials.push(Trial::test(name, move || {
            run(g.as_ref().as_ref().unwrap()).map_err(Failed::from)
        }));
    }
    // The loaded module's dtypes: bf16 trials are ignored on sm_75, whose
    // refusal of bf16 `module_and_dtypes_as_configured` checks.
    let ignore_unless = |present: bool| {
        move |t: Trial| {
            let ignored = !present || (!have_bf16 && t.name().ends_with("_bf16"));
            t.with_ignored_flag(ignored)
        }
    };
    let trials: Vec<Trial> = trials
        .into_iter()
        .map(ignore_unless(have_gpu))
        .chain(hopper_trials.into_iter().map(ignore_unless(have_hopper)))
        .collect();
    if !have_gpu {
        eprintln!("no CUDA device found: every GPU test is ignored");
    } else if !have_hopper {
        eprintln!("not compute capability 9.0: the sm_90a (Hopper) tests are ignored");
    }
    if have_gpu && !have_bf16 {
        eprintln!("the loaded module has no bf16 kernels (sm_75): the bf16 trials are ignored");
    }
    libtest_mimic::run(&args, trials).exit();
}
