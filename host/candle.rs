//! Candle custom ops over flash-attn's kernels (cargo feature `candle`).
//!
//! A drop-in for `candle-flash-attn` 0.11: the same function names, argument
//! order, shapes and window semantics, so switching is a change of the `use`
//! line (`use flash_attn::candle as candle_flash_attn;`). Beyond it:
//! [`flash_attn_lse`] and [`flash_attn_varlen_lse`] return the log-sum-exp
//! beside O, take attention sinks and ALiBi per batch, [`flash_attn_with_kvcache`]
//! decodes against a contiguous or paged KV cache after appending new K/V,
//! and [`merge_states`] combines two partial attentions. The attention ops
//! (all but the paged one, the KV-cache decode and `merge_states`) have a
//! backward: `loss.backward()` gives Q, K, V and trained sinks their
//! gradients through flash-attn's backward kernels (every head dim of the
//! forward; see `docs/candle.md`, Training).
//!
//! Tensors live on a candle CUDA device, in f16 or bf16. Any strides work
//! where the last (head) dimension is contiguous: a transposed or sliced
//! tensor is read in place, not copied. CPU tensors and other dtypes get a
//! candle error; so does anything flash-attn's validation refuses (the
//! message is the [`FlashAttnError`](crate::FlashAttnError)'s). The kernels
//! of each CUDA context are loaded on its first call and kept for the
//! process (which keeps that context alive).
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use flash_attn::candle::flash_attn;
//!
//! let dev = Device::new_cuda(0)?;
//! let q = Tensor::randn(0f32, 1.0, (2, 512, 32, 128), &dev)?.to_dtype(DType::BF16)?;
//! let k = Tensor::randn(0f32, 1.0, (2, 512, 8, 128), &dev)?.to_dtype(DType::BF16)?;
//! let v = k.clone();
//! let o = flash_attn(&q, &k, &v, 1.0 / (128f32).sqrt(), true)?;
//! assert_eq!(o.dims(), &[2, 512, 32, 128]);
//! # Ok::<(), candle_core::Error>(())
//! ```
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout as CandleLayout, Result, Shape, Storage,
    StorageRef, Tensor,
};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr};
use half::{bf16, f16};

use crate::{
    AlibiSlopes, AttnElement, AttnOptions, BackwardInputs, BlockTable, DecodeStep, FlashAttention,
    Grads, KvCache, Layout, Out, PagedVarlen, Qkv, State, TensorMut, TensorRef, Varlen, Window,
};

/// Options of the entry points candle-flash-attn lacks.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnArgs<'a> {
    /// The scale of q·k; `None` is `1 / sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    /// Bottom-right-aligned causal mask (query `i` of `Sq` sees keys
    /// `j <= i + Skv - Sq`).
    pub causal: bool,
    /// Keys left of the diagonal each query sees; `None` is unbounded.
    pub window_size_left: Option<usize>,
    /// Keys right of the diagonal each query sees; `None` is unbounded
    /// (`causal` makes it 0).
    pub window_size_right: Option<usize>,
    /// Gemma-style logit softcap `c`: score = `c * tanh(scale * q·k / c)`.
    pub softcap: Option<f32>,
    /// f32 ALiBi slopes, `[heads]` or `[batch, heads]`.
    pub alibi_slopes: Option<&'a Tensor>,
    /// f32 `[heads]` attention-sink logits (gpt-oss); the LSE includes them.
    pub sinks: Option<&'a Tensor>,
}

/// The attention policies an op carries, tensors owned (candle ops are `'static`).
#[derive(Clone, Debug, Default)]
struct Policy {
    softmax_scale: Option<f32>,
    causal: bool,
    window: Window,
    softcap: Option<f32>,
    alibi_slopes: Option<Tensor>,
    sinks: Option<Tensor>,
}

impl Policy {
    fn new(args: &AttnArgs) -> Policy {
        Policy {
            softmax_scale: args.softmax_scale,
            causal: args.causal,
            window: Window {
                left: args.window_size_left,
                right: args.window_size_right,
            },
            softcap: args.softcap,
            alibi_slopes: args.alibi_slopes.cloned(),
            sinks: args.sinks.cloned(),
        }
    }

    /// candle-flash-attn's arguments: a window side wider than `seqlen_k` is
    /// unbounded, `(None, Some(0))` is the causal mask (which then runs the
    /// causal kernels rather than a window's), and a softcap of 0 is none
    /// (FlashAttention-2 caps only with a positive one).
    fn windowed(
        softmax_scale: f32,
        left: Option<usize>,
        right: Option<usize>,
        seqlen_k: usize,
        softcap: Option<f32>,
        alibi_slopes: Option<&Tensor>,
    ) -> Policy {
        let left = left.filter(|&w| w <= seqlen_k);
        let right = right.filter(|&w| w <= seqlen_k);
        let causal = left.is_none() && right == Some(0);
        Policy {
            softmax_scale: Some(softmax_scale),
            causal,
            window: if causal {
                Window::UNBOUNDED
            } else {
                Window { left, right }
            },
            softcap: softcap.filter(|&c| c != 0.0),
            alibi_slopes: alibi_slopes.cloned(),
            sinks: None,
        }
    }
}

/// Loaded kernels by the address of their CUDA context.
type Loaded = Mutex<Vec<(usize, Arc<FlashAttention>)>>;

/// The loaded kernels of `dev`'s context, loaded on first use.
fn kernels(dev: &CudaDevice) -> Result<Arc<FlashAttention>> {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    // The cached FlashAttention holds the context, so its address is not reused.
    let key = Arc::as_ptr(ctx) as usize;
    let mut loaded = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, fa)) = loaded.iter().find(|(k, _)| *k == key) {
        return Ok(fa.clone());
    }
    let fa = Arc::new(FlashAttention::new(ctx).map_err(candle_core::Error::wrap)?);
    loaded.push((key, fa.clone()));
    Ok(fa)
}

/// A candle operand's elements from its layout's origin, and its layout as
/// flash-attn's 4-D [`Layout`]: rank 4 as is, rank 3 (packed varlen rows) as
/// one batch entry.
fn operand<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &CandleLayout,
    name: &str,
) -> Result<(CudaView<'a, T>, Layout)> {
    let view = storage.as_cuda_slice::<T>()?.slice(layout.start_offset()..);
    let (dims, strides) = (layout.dims(), layout.stride());
    let layout = match (dims, strides) {
        (&[b, s, h, d], &[sb, ss, sh, sd]) => Layout {
            shape: [b, s, h, d],
            strides: [sb, ss, sh, sd],
        },
        (&[t, h, d], &[st, sh, sd]) => Layout {
            shape: [1, t, h, d],
            strides: [t * st, st, sh, sd],
        },
        _ => {
            bail!("flash-attn: {name} must have rank 4 (or 3 for packed rows), got shape {dims:?}")
        }
    };
    Ok((view, layout))
}

/// An auxiliary tensor's storage, read-locked for the op.
fn cuda_storage<'g>(storage: &'g Storage, name: &str) -> Result<&'g CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        _ => bail!("flash-attn: {name} must be a CUDA tensor"),
    }
}

/// An auxiliary tensor's contiguous elements.
fn aux_view<'g, T: CudaDType>(
    guard: &'g (StorageRef<'_>, &CandleLayout),
    name: &str,
) -> Result<CudaView<'g, T>> {
    let (storage, layout) = guard;
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("flash-attn: {name} must be contiguous")
    };
    Ok(cuda_storage(storage, name)?
        .as_cuda_slice::<T>()?
        .slice(start..end))
}

/// An i32 index tensor (sequence lengths, block tables), given as i32 or as
/// u32 as candle-flash-attn takes them; values past i32::MAX are negative
/// after the reinterpretation, which the kernels clamp like any bad length.
fn index_view<'g>(
    guard: &'g (StorageRef<'_>, &CandleLayout),
    name: &str,
) -> Result<CudaView<'g, i32>> {
    match guard.0.dtype() {
        DType::I32 => aux_view::<i32>(guard, name),
        DType::U32 => {
            let view = aux_view::<u32>(guard, name)?;
            // SAFETY: u32 and i32 have the same size and every bit pattern is valid.
            Ok(unsafe { view.transmute::<i32>(view.len()) }.expect("same element size"))
        }
        dt => bail!("flash-attn: {name} must be u32 or i32, got {dt:?}"),
    }
}

fn f32_view<'g>(
    guard: &'g (StorageRef<'_>, &CandleLayout),
    name: &str,
) -> Result<CudaView<'g, f32>> {
    match guard.0.dtype() {
        DType::F32 => aux_view::<f32>(guard, name),
        dt => bail!("flash-attn: {name} must be f32, got {dt:?}"),
    }
}

fn wrap(e: crate::FlashAttnError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The policies' device-side tensors, locked for a launch.
struct PolicyGuards<'t> {
    alibi: Option<(StorageRef<'t>, &'t CandleLayout)>,
    sinks: Option<(StorageRef<'t>, &'t CandleLayout)>,
}

struct PolicyViews<'g> {
    alibi: Option<(CudaView<'g, f32>, usize)>,
    sinks: Option<CudaView<'g, f32>>,
}

impl Policy {
    fn lock(&self) -> PolicyGuards<'_> {
        PolicyGuards {
            alibi: self.alibi_slopes.as_ref().map(|t| t.storage_and_layout()),
            sinks: self.sinks.as_ref().map(|t| t.storage_and_layout()),
        }
    }
}

impl PolicyGuards<'_> {
    fn views(&self) -> Result<PolicyViews<'_>> {
        Ok(PolicyViews {
            alibi: match &self.alibi {
                Some(g) => Some((f32_view(g, "alibi_slopes")?, g.1.dims().len())),
                None => None,
            },
            sinks: match &self.sinks {
                Some(g) => Some(f32_view(g, "sinks")?),
                None => None,
            },
        })
    }
}

impl<'g> PolicyViews<'g> {
    fn options<'o>(&'o self, p: &Policy) -> Result<AttnOptions<'o>> {
        let alibi_slopes = match &self.alibi {
            Some((view, 1)) => Some(AlibiSlopes::PerHead(view)),
            Some((view, 2)) => Some(AlibiSlopes::PerBatchHead(view)),
            Some((_, rank)) => {
                bail!("flash-attn: alibi_slopes must be [heads] or [batch, heads], got rank {rank}")
            }
            None => None,
        };
        Ok(AttnOptions {
            causal: p.causal,
            softmax_scale: p.softmax_scale,
            window: p.window,
            softcap: p.softcap,
            alibi_slopes,
            sinks: self.sinks.as_ref(),
            num_splits: None,
            hopper_rows: None,
            hopper_persistent: None,
            hopper_keys: None,
        })
    }
}

/// Where the keys of each query sequence are.
#[derive(Clone, Debug)]
enum Seqs {
    /// [B, S, H, D] tensors.
    Dense,
    /// Packed rows with cumulative lengths [B + 1].
    Varlen {
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    },
    /// Packed queries against page pools; `seqlens_k` holds key counts [B].
    Paged {
        cu_seqlens_q: Tensor,
        max_seqlen_q: usize,
        seqlens_k: Tensor,
        block_table: Tensor,
    },
}

/// Where an op leaves a tensor it makes beside its output: the LSE (for the
/// caller of a `*_lse` function, and in training for the op's backward) or
/// the sinks' gradient (for [`SinksTie`]). Shared, because candle owns an op
/// once the op is in the graph.
#[derive(Clone, Default)]
struct Slot(Arc<Mutex<Option<Tensor>>>);

impl Slot {
    fn put(&self, t: Tensor) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
    }

    /// A clone (cheap: candle tensors share their storage).
    fn get(&self, what: &str) -> Result<Tensor> {
        match &*self.0.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(t) => Ok(t.clone()),
            None => bail!("flash-attn: the op ran without producing its {what}"),
        }
    }

    fn take(&self, what: &str) -> Result<Tensor> {
        match self.0.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(t) => Ok(t),
            None => bail!("flash-attn: the op ran without producing its {what}"),
        }
    }
}

/// A device buffer as a candle tensor of `dims`, outside the graph.
fn tensor_of<T: CudaDType>(data: CudaSlice<T>, dims: Vec<usize>, dev: &CudaDevice) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(data, dev.clone()));
    Tensor::from_storage(storage, dims, BackpropOp::none(), false)
}

impl Seqs {
    /// `f` over the device views of packed sequences' offsets; an error for
    /// the other layouts.
    fn with_varlen<R>(&self, f: impl FnOnce(&Varlen<'_>) -> R) -> Result<R> {
        let Seqs::Varlen {
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        } = self
        else {
            bail!("flash-attn: not packed sequences")
        };
        let (gq, gk) = (
            cu_seqlens_q.storage_and_layout(),
            cu_seqlens_k.storage_and_layout(),
        );
        let (cu_q, cu_k) = (index_view(&gq, "seqlens_q")?, index_view(&gk, "seqlens_k")?);
        Ok(f(&Varlen {
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
            max_seqlen_q: *max_seqlen_q,
            max_seqlen_k: *max_seqlen_k,
        }))
    }
}

/// Forward attention as a candle op over (q, k, v); its backward is
/// flash-attn's.
struct Attn {
    policy: Policy,
    seqs: Seqs,
    /// The LSE of the launch, when the caller or the backward needs it.
    lse: Option<Slot>,
    /// The sinks' gradient, when the sinks take one.
    d_sinks: Option<Slot>,
}

impl Attn {
    fn new(policy: Policy, seqs: Seqs) -> Attn {
        Attn {
            policy,
            seqs,
            lse: None,
            d_sinks: None,
        }
    }

    /// O, and the LSE when `with_lse`. When any of q, k, v or the sinks is
    /// tracked by candle's graph, the op enters the graph with its backward
    /// and keeps the LSE for it (4 bytes a query row and head, as
    /// FlashAttention keeps it for PyTorch's autograd); otherwise nothing is
    /// kept.
    fn apply(
        mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        with_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let sinks = self.policy.sinks.clone().filter(Tensor::track_op);
        let train = sinks.is_some() || [q, k, v].iter().any(|t| t.track_op());
        let lse = (with_lse || train).then(Slot::default);
        self.lse = lse.clone();
        let o = if train {
            let k = match sinks {
                Some(sinks) => {
                    let d_sinks = Slot::default();
                    self.d_sinks = Some(d_sinks.clone());
                    k.apply_op2(&sinks, SinksTie { d_sinks })?
                }
                None => k.clone(),
            };
            q.apply_op3(&k, v, self)?
        } else {
            q.apply_op3_no_bwd(k, v, &self)?
        };
        let lse = match lse.filter(|_| with_lse) {
            Some(slot) => Some(slot.get("LSE")?),
            None => None,
        };
        Ok((o, lse))
    }

    fn run<T: AttnElement + CudaDType>(
        &self,
        q: &CudaStorage,
        q_l: &CandleLayout,
        k: &CudaStorage,
        k_l: &CandleLayout,
        v: &CudaStorage,
        v_l: &CandleLayout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = q.device();
        let fa = kernels(dev)?;
        let stream = dev.cuda_stream();
        let (q_view, q_layout) = operand::<T>(q, q_l, "q")?;
        let (k_view, k_layout) = operand::<T>(k, k_l, "k")?;
        let (v_view, v_layout) = operand::<T>(v, v_l, "v")?;
        let (q, k, v) = (
            TensorRef::new(q_view, q_layout),
            TensorRef::new(k_view, k_layout),
            TensorRef::new(v_view, v_layout),
        );
        let guards = self.policy.lock();
        let views = guards.views()?;
        let opts = views.options(&self.policy)?;
        // O is Q's shape with V's head dim (which may be its own, as in
        // DeepSeek's MLA prefill).
        let mut dims = q_l.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = v_layout.shape[3];
        }
        let shape = Shape::from(dims);
        let [b, s, h, _] = q_layout.shape;
        let o_layout = Layout::contiguous([b, s, h, v_layout.shape[3]]);
        let mut o = match self.seqs {
            // SAFETY: the dense kernel writes every element of O (rows that
            // see no key get 0); a refused call drops the buffer unread.
            Seqs::Dense => unsafe { dev.alloc::<T>(shape.elem_count())? },
            // Varlen leaves rows outside every sequence unwritten: start from 0.
            _ => dev.alloc_zeros::<T>(shape.elem_count())?,
        };
        let mut lse = match &self.lse {
            Some(_) => Some(dev.alloc_zeros::<f32>(b * s * h)?),
            None => None,
        };
        let lse_dims = match self.seqs {
            Seqs::Dense => vec![b, h, s],
            _ => vec![h, s],
        };
        let out = Out {
            o: TensorMut::new(o.as_view_mut(), o_layout),
            lse: lse.as_mut().map(|l| l.as_view_mut()),
        };
        let qkv = Qkv {
            q: &q,
            k: &k,
            v: &v,
        };
        match &self.seqs {
            Seqs::Dense => fa.forward(&stream, qkv, out, &opts),
            Seqs::Varlen { .. } => self
                .seqs
                .with_varlen(|seqs| fa.forward_varlen(&stream, qkv, out, seqs, &opts))?,
            Seqs::Paged {
                cu_seqlens_q,
                max_seqlen_q,
                seqlens_k,
                block_table,
            } => {
                let gq = cu_seqlens_q.storage_and_layout();
                let gk = seqlens_k.storage_and_layout();
                let gt = block_table.storage_and_layout();
                let (cu_q, lens_k) = (index_view(&gq, "seqlens_q")?, index_view(&gk, "seqlens_k")?);
                let table = BlockTable {
                    table: index_view(&gt, "block_table")?,
                    max_pages: block_table.dims2()?.1,
                };
                let seqs = PagedVarlen {
                    cu_seqlens_q: &cu_q,
                    max_seqlen_q: *max_seqlen_q,
                    seqlens_k: &lens_k,
                    block_table: &table,
                };
                fa.forward_varlen_paged(&stream, qkv, out, &seqs, &opts)
            }
        }
        .map_err(wrap)?;
        if let (Some(slot), Some(lse)) = (&self.lse, lse) {
            slot.put(tensor_of(lse, lse_dims, dev));
        }
        Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), shape))
    }
}

/// A candle op over (q, k, v) whose `run::<T>` does the work: CPU tensors
/// and dtypes without kernels are candle errors.
macro_rules! qkv_op {
    ($op:ty, $name:literal $(, $backward:ident)?) => {
        impl CustomOp3 for $op {
            fn name(&self) -> &'static str {
                $name
            }

            $(
                fn bwd(
                    &self,
                    q: &Tensor,
                    k: &Tensor,
                    v: &Tensor,
                    o: &Tensor,
                    d_o: &Tensor,
                ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
                    let [dq, dk, dv] = self.$backward(q, k, v, o, d_o)?;
                    Ok((Some(dq), Some(dk), Some(dv)))
                }
            )?

            fn cpu_fwd(
                &self,
                _: &CpuStorage,
                _: &CandleLayout,
                _: &CpuStorage,
                _: &CandleLayout,
                _: &CpuStorage,
                _: &CandleLayout,
            ) -> Result<(CpuStorage, Shape)> {
                bail!("flash-attn runs on CUDA tensors only (got CPU tensors)")
            }

            fn cuda_fwd(
                &self,
                q: &CudaStorage,
                q_l: &CandleLayout,
                k: &CudaStorage,
                k_l: &CandleLayout,
                v: &CudaStorage,
                v_l: &CandleLayout,
            ) -> Result<(CudaStorage, Shape)> {
                match q.dtype() {
                    DType::F16 => self.run::<f16>(q, q_l, k, k_l, v, v_l),
                    DType::BF16 => self.run::<bf16>(q, q_l, k, k_l, v, v_l),
                    DType::F32 => self.run::<f32>(q, q_l, k, k_l, v, v_l),
                    dt => bail!("flash-attn supports f16, bf16 and f32 tensors, got {dt:?}"),
                }
            }
        }
    };
}

qkv_op!(Attn, "flash-attn", backward);

impl Attn {
    /// dQ, dK and dV of the op's forward, given its O and dO, by
    /// [`FlashAttention::backward`] (or `backward_varlen`) with the
    /// forward's options and LSE; the sinks' gradient goes to
    /// [`SinksTie`]. f32 inputs run as f16, as the forward rounds them,
    /// with dO scaled by a power of two ([`f16_loss_scale`]) and the
    /// gradients, which are linear in dO, scaled back in f32.
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<[Tensor; 3]> {
        if let Seqs::Paged { .. } = self.seqs {
            bail!("flash-attn: no backward through a paged K/V cache (an inference layout)")
        }
        let lse = match &self.lse {
            Some(slot) => slot.get("LSE")?,
            None => bail!("flash-attn: the forward kept no LSE for a backward"),
        };
        match q.dtype() {
            DType::F16 => self.backward_as::<f16>([q, k, v, o, d_o], &lse, 1.0),
            DType::BF16 => self.backward_as::<bf16>([q, k, v, o, d_o], &lse, 1.0),
            DType::F32 => {
                // The most dO rows one gradient element sums: a key's dV
                // over its KV head's query heads and the queries of its
                // sequence (all packed rows for varlen, an upper bound).
                let (rank, heads) = (q.rank(), q.dims()[q.rank() - 2]);
                let rows = if rank == 4 { q.dims()[1] } else { q.dims()[0] };
                let group = heads / k.dims()[rank - 2].max(1);
                let scale = f16_loss_scale(d_o, rows * group)?;
                let h = |t: &Tensor| t.to_dtype(DType::F16);
                let by = |t: &Tensor, m: f64| {
                    if m == 1.0 {
                        Ok(t.clone())
                    } else {
                        t.affine(m, 0.0)
                    }
                };
                let x = [h(q)?, h(k)?, h(v)?, h(o)?, h(&by(d_o, scale)?)?];
                let grads = self.backward_as::<f16>(x.each_ref(), &lse, 1.0 / scale)?;
                let back = |g: &Tensor| by(&g.to_dtype(DType::F32)?, 1.0 / scale);
                let [dq, dk, dv] = grads.each_ref().map(back);
                Ok([dq?, dk?, dv?])
            }
            dt => bail!("flash-attn supports f16, bf16 and f32 tensors, got {dt:?}"),
        }
    }

    /// The backward in `T`; the sinks' gradient is multiplied by
    /// `sinks_unscale` (the inverse of dO's loss scale).
    fn backward_as<T: AttnElement + CudaDType>(
        &self,
        [q, k, v, o, d_o]: [&Tensor; 5],
        lse: &Tensor,
        sinks_unscale: f64,
    ) -> Result<[Tensor; 3]> {
        // candle's backprop hands `bwd` a gradient it has just summed
        // (contiguous); a layout the kernels cannot read would be refused by
        // validation like any other operand.
        let dev = q.device().as_cuda_device()?;
        let fa = kernels(dev)?;
        let stream = dev.cuda_stream();
        let names = ["q", "k", "v", "o", "d_o"];
        let guards = [q, k, v, o, d_o].map(Tensor::storage_and_layout);
        let mut views = Vec::with_capacity(5);
        for ((storage, layout), name) in guards.iter().zip(names) {
            let (view, layout) = operand::<T>(cuda_storage(storage, name)?, layout, name)?;
            views.push(TensorRef::new(view, layout));
        }
        let [q_ref, k_ref, v_ref, o_ref, do_ref] = <[TensorRef<T>; 5]>::try_from(views)
            .map_err(|_| candle_core::Error::Msg("five operands".into()))?;
        let lse_guard = lse.storage_and_layout();
        let lse_view = f32_view(&lse_guard, "lse")?;
        let shapes = [&q_ref, &k_ref, &v_ref].map(|t| t.layout.shape);
        let alloc = |shape: [usize; 4]| -> Result<CudaSlice<T>> {
            let n = shape.iter().product();
            match self.seqs {
                // SAFETY: the fixed-batch backward writes every element of
                // dQ, dK and dV (0 where no query or key is seen); a refused
                // call drops the buffers unread.
                Seqs::Dense => Ok(unsafe { dev.alloc::<T>(n)? }),
                // Packed rows that no sequence owns keep their dK and dV.
                _ => dev.alloc_zeros::<T>(n),
            }
        };
        let [mut dq, mut dk, mut dv] = [alloc(shapes[0])?, alloc(shapes[1])?, alloc(shapes[2])?];
        let heads = q_ref.layout.shape[2];
        let mut d_sinks = match &self.d_sinks {
            Some(_) => Some(dev.alloc_zeros::<f32>(heads)?),
            None => None,
        };
        let guards = self.policy.lock();
        let policy_views = guards.views()?;
        let opts = policy_views.options(&self.policy)?;
        let [dql, dkl, dvl] = shapes.map(Layout::contiguous);
        let mut out = Grads::new(
            TensorMut::new(dq.as_view_mut(), dql),
            TensorMut::new(dk.as_view_mut(), dkl),
            TensorMut::new(dv.as_view_mut(), dvl),
        );
        if let Some(d) = d_sinks.as_mut() {
            out = out.with_sinks(d.as_view_mut());
        }
        let qkv = Qkv {
            q: &q_ref,
            k: &k_ref,
            v: &v_ref,
        };
        let saved = BackwardInputs {
            o: &o_ref,
            lse: &lse_view,
            d_o: &do_ref,
        };
        match self.seqs {
            Seqs::Dense => fa.backward(&stream, qkv, saved, out, &opts),
            _ => self
                .seqs
                .with_varlen(|seqs| fa.backward_varlen(&stream, qkv, saved, out, seqs, &opts))?,
        }
        .map_err(wrap)?;
        if let (Some(slot), Some(d)) = (&self.d_sinks, d_sinks) {
            let d_sinks = tensor_of(d, vec![heads], dev);
            slot.put(match sinks_unscale {
                1.0 => d_sinks,
                m => d_sinks.affine(m, 0.0)?,
            });
        }
        Ok([
            tensor_of(dq, q.dims().to_vec(), dev),
            tensor_of(dk, k.dims().to_vec(), dev),
            tensor_of(dv, v.dims().to_vec(), dev),
        ])
    }
}

/// The power of two by which the f32 backward scales dO before rounding it
/// to f16, so that a small dO (a mean over many outputs) keeps its bits and
/// a large one does not overflow: the one that brings dO's largest
/// magnitude into [2^t, 2^(t+1)), t = 0 while a gradient element sums at
/// most 2^14 dO rows (`terms`), else 14 - ceil(log2 terms), which keeps
/// such a sum (dV of a key that every query attends to) under 2^15, within
/// f16's 65504. The exponent is clamped to ±126 (candle's `affine` takes
/// an f32 factor); dO of zeros, infinities or NaNs gets 1. A power of two
/// scales exactly, both ways. Reading the maximum waits for the stream once
/// per backward.
fn f16_loss_scale(d_o: &Tensor, terms: usize) -> Result<f64> {
    let max = d_o.abs()?.max_all()?.to_scalar::<f32>()?;
    if !(max.is_finite() && max > 0.0) {
        return Ok(1.0);
    }
    let headroom = (terms.max(1) as f64).log2().ceil() as i32;
    let t = (14 - headroom).min(0);
    let e = (t - (max as f64).log2().floor() as i32).clamp(-126, 126);
    Ok(2f64.powi(e))
}

/// Gives the sinks a gradient. candle's custom ops take up to three
/// tensors, and attention's are q, k and v, so trained sinks join the graph
/// through K: this op's output is K (a contiguous copy, made only when the
/// sinks are tracked), its backward passes dK through and hands the sinks
/// the gradient that attention's backward left in `d_sinks`. candle runs
/// attention's backward first, as its K is this op's output.
struct SinksTie {
    d_sinks: Slot,
}

impl CustomOp2 for SinksTie {
    fn name(&self) -> &'static str {
        "flash-attn-sinks"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &CandleLayout,
        _: &CpuStorage,
        _: &CandleLayout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("flash-attn runs on CUDA tensors only (got CPU tensors)")
    }

    fn cuda_fwd(
        &self,
        k: &CudaStorage,
        k_l: &CandleLayout,
        _: &CudaStorage,
        _: &CandleLayout,
    ) -> Result<(CudaStorage, Shape)> {
        let mut copy = k.device().zeros_impl(k_l.shape(), k.dtype())?;
        k.copy_strided_src(&mut copy, 0, k_l)?;
        Ok((copy, k_l.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        d_k: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            Some(d_k.clone()),
            Some(self.d_sinks.take("sinks' gradient")?),
        ))
    }
}

/// Flash attention: `softmax(q·kᵀ · softmax_scale) · v`, as candle-flash-attn's.
///
/// `q` is `[batch, seq_len_q, num_heads_q, head_size]`, `k` and `v`
/// `[batch, seq_len_kv, num_heads_kv, head_size]` (num_heads_kv divides
/// num_heads_q: MQA/GQA); the result has `q`'s shape. `causal` is the
/// bottom-right-aligned mask. `v` may have a head size of its own, a
/// multiple of 8 up to q/k's (DeepSeek's MLA prefill: 192 for q·k, 128 for
/// v); the result then has that last dimension, in every forward op here.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let right = causal.then_some(0);
    flash_attn_alibi_windowed_impl(q, k, v, None, softmax_scale, None, right, None)
}

/// [`flash_attn`] with a sliding window: query `i` sees keys
/// `i + Skv - Sq - left ..= i + Skv - Sq + right`; `None` (or a size past
/// `seq_len_kv`) leaves that side unbounded, and `(None, Some(0))` is causal.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_alibi_windowed_impl(
        q,
        k,
        v,
        None,
        softmax_scale,
        window_size_left,
        window_size_right,
        None,
    )
}

/// [`flash_attn`] with ALiBi: f32 `alibi_slopes` `[num_heads_q]` (or
/// `[batch, num_heads_q]`); the bias `-slope · |i + Skv - Sq - j|` is added to
/// the scaled scores.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let right = causal.then_some(0);
    flash_attn_alibi_windowed_impl(
        q,
        k,
        v,
        Some(alibi_slopes),
        softmax_scale,
        None,
        right,
        None,
    )
}

/// [`flash_attn_alibi`] with a sliding window (see [`flash_attn_windowed`]).
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_alibi_windowed_impl(
        q,
        k,
        v,
        Some(alibi_slopes),
        softmax_scale,
        window_size_left,
        window_size_right,
        None,
    )
}

/// Optional ALiBi, a sliding window and a Gemma-style logit softcap:
/// score = `softcap · tanh(softmax_scale · q·k / softcap)`; a softcap of 0
/// is none, as in candle-flash-attn.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    flash_attn_alibi_windowed_impl(
        q,
        k,
        v,
        alibi_slopes,
        softmax_scale,
        window_size_left,
        window_size_right,
        Some(softcap),
    )
}

#[allow(clippy::too_many_arguments)]
fn flash_attn_alibi_windowed_impl(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    left: Option<usize>,
    right: Option<usize>,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let seqlen_k = k.dims().get(1).copied().unwrap_or(0);
    let policy = Policy::windowed(softmax_scale, left, right, seqlen_k, softcap, alibi_slopes);
    Ok(Attn::new(policy, Seqs::Dense).apply(q, k, v, false)?.0)
}

/// Attention over full sequences with the log-sum-exp: returns O (`q`'s
/// shape) and the f32 LSE `[batch, num_heads_q, seq_len_q]` (natural log;
/// `-inf` for a row that sees no key; with sinks, their terms included).
pub fn flash_attn_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    args: &AttnArgs,
) -> Result<(Tensor, Tensor)> {
    let (o, lse) = Attn::new(Policy::new(args), Seqs::Dense).apply(q, k, v, true)?;
    Ok((o, lse.expect("asked for")))
}

/// Flash attention over variable-length sequences packed without padding, as
/// candle-flash-attn's.
///
/// `q` is `[total_q, num_heads_q, head_size]`, `k` and `v` `[total_kv,
/// num_heads_kv, head_size]`; `seqlens_q` and `seqlens_k` are the cumulative
/// lengths `[batch + 1]` (u32 or i32, on the device: `0, len_0, len_0 + len_1,
/// ...`); masks are per sequence. The result has `q`'s shape.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let right = causal.then_some(0);
    varlen_impl(
        q,
        k,
        v,
        (seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k),
        Policy::windowed(softmax_scale, None, right, max_seqlen_k, None, None),
    )
}

/// [`flash_attn_varlen`] with a sliding window (see [`flash_attn_windowed`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    varlen_impl(
        q,
        k,
        v,
        (seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k),
        Policy::windowed(
            softmax_scale,
            window_size_left,
            window_size_right,
            max_seqlen_k,
            None,
            None,
        ),
    )
}

/// [`flash_attn_varlen`] with ALiBi slopes (see [`flash_attn_alibi`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let right = causal.then_some(0);
    varlen_impl(
        q,
        k,
        v,
        (seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k),
        Policy::windowed(
            softmax_scale,
            None,
            right,
            max_seqlen_k,
            None,
            Some(alibi_slopes),
        ),
    )
}

/// [`flash_attn_varlen_alibi`] with a sliding window.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    varlen_impl(
        q,
        k,
        v,
        (seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k),
        Policy::windowed(
            softmax_scale,
            window_size_left,
            window_size_right,
            max_seqlen_k,
            None,
            Some(alibi_slopes),
        ),
    )
}

/// [`flash_attn_varlen`] with optional ALiBi, a sliding window and a logit
/// softcap (see [`flash_attn_alibi_windowed_softcap`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    varlen_impl(
        q,
        k,
        v,
        (seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k),
        Policy::windowed(
            softmax_scale,
            window_size_left,
            window_size_right,
            max_seqlen_k,
            Some(softcap),
            alibi_slopes,
        ),
    )
}

/// Packed queries against a paged K/V cache (chunked prefill), as
/// candle-flash-attn's.
///
/// `q` is `[total_q, num_heads_q, head_size]`; `k` and `v` are page pools
/// `[num_blocks, page_block_size, num_heads_kv, head_size]` (page_block_size
/// a multiple of 16); `seqlens_q` and `seqlens_k` are cumulative lengths
/// `[batch + 1]` (u32); `block_table` `[batch, max_blocks]` (u32 or i32)
/// lists each sequence's pages. Sequence `b`'s queries are the last of its
/// `seqlens_k[b + 1] - seqlens_k[b]` keys. `mm_prefix_ranges` (ranges that
/// bypass the mask) is not supported: `Some` is an error.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    if mm_prefix_ranges.is_some() {
        bail!("flash-attn: mm_prefix_ranges is not supported")
    }
    let pool_page = k.dims().get(1).copied();
    if pool_page != Some(page_block_size) {
        bail!("flash-attn: page_block_size {page_block_size} disagrees with k's page dimension {pool_page:?}")
    }
    let policy = Policy::windowed(
        softmax_scale,
        window_size_left,
        window_size_right,
        max_seqlen_k,
        softcap,
        None,
    );
    // The kernels take key counts [B]; the cumulative form's differences are those.
    let batch = seqlens_k.dims1()?.saturating_sub(1);
    let counts = seqlens_k
        .narrow(0, 1, batch)?
        .sub(&seqlens_k.narrow(0, 0, batch)?)?;
    let seqs = Seqs::Paged {
        cu_seqlens_q: seqlens_q.clone(),
        max_seqlen_q,
        seqlens_k: counts,
        block_table: block_table.clone(),
    };
    Ok(Attn::new(policy, seqs).apply(q, k, v, false)?.0)
}

fn varlen_impl(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k): (&Tensor, &Tensor, usize, usize),
    policy: Policy,
) -> Result<Tensor> {
    let seqs = Seqs::Varlen {
        cu_seqlens_q: seqlens_q.clone(),
        cu_seqlens_k: seqlens_k.clone(),
        max_seqlen_q,
        max_seqlen_k,
    };
    Ok(Attn::new(policy, seqs).apply(q, k, v, false)?.0)
}

/// [`flash_attn_varlen`] with [`AttnArgs`], returning O and the f32 LSE
/// `[num_heads_q, total_q]`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    args: &AttnArgs,
) -> Result<(Tensor, Tensor)> {
    let seqs = Seqs::Varlen {
        cu_seqlens_q: seqlens_q.clone(),
        cu_seqlens_k: seqlens_k.clone(),
        max_seqlen_q,
        max_seqlen_k,
    };
    let (o, lse) = Attn::new(Policy::new(args), seqs).apply(q, k, v, true)?;
    Ok((o, lse.expect("asked for")))
}

/// Decode against a KV cache, as FlashAttention's `flash_attn_with_kvcache`.
struct KvDecode {
    policy: Policy,
    cache_seqlens: Tensor,
    block_table: Option<Tensor>,
    new_kv: Option<(Tensor, Tensor)>,
    lse: Slot,
}

/// Device memory candle owns, handed to flash-attn as writable for one call
/// (candle's ops take their inputs read-locked; the cache update is in place
/// by design). Forgets the allocation on drop: candle frees it.
struct InPlace<T>(Option<CudaSlice<T>>);

impl<T> InPlace<T> {
    fn new(stream: &Arc<CudaStream>, storage: &CudaStorage) -> Result<InPlace<T>>
    where
        T: CudaDType,
    {
        let slice = storage.as_cuda_slice::<T>()?;
        let (ptr, _sync) = slice.device_ptr(stream);
        // SAFETY: `ptr` is candle's live allocation of `slice.len()` elements
        // of T, which outlives this handle (the op holds its storage); the
        // handle is leaked, never freed, on drop.
        Ok(InPlace(Some(unsafe {
            stream.upgrade_device_ptr::<T>(ptr, slice.len())
        })))
    }

    fn slice(&mut self) -> &mut CudaSlice<T> {
        self.0.as_mut().expect("present until drop")
    }
}

impl<T> Drop for InPlace<T> {
    fn drop(&mut self) {
        if let Some(slice) = self.0.take() {
            slice.leak();
        }
    }
}

impl KvDecode {
    #[allow(clippy::too_many_arguments)]
    fn run<T: AttnElement + CudaDType>(
        &self,
        q: &CudaStorage,
        q_l: &CandleLayout,
        k: &CudaStorage,
        k_l: &CandleLayout,
        v: &CudaStorage,
        v_l: &CandleLayout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = q.device();
        let fa = kernels(dev)?;
        let stream = dev.cuda_stream();
        let (q_view, q_layout) = operand::<T>(q, q_l, "q")?;
        let q = TensorRef::new(q_view, q_layout);
        let (_, k_layout) = operand::<T>(k, k_l, "k_cache")?;
        let (_, v_layout) = operand::<T>(v, v_l, "v_cache")?;
        let (mut k_cache, mut v_cache) = (
            InPlace::<T>::new(&stream, k)?,
            InPlace::<T>::new(&stream, v)?,
        );
        let new_guards = self
            .new_kv
            .as_ref()
            .map(|(kn, vn)| (kn.storage_and_layout(), vn.storage_and_layout()));
        let new_views = match &new_guards {
            Some(((ks, kl), (vs, vl))) => {
                let (kn, kn_layout) = operand::<T>(cuda_storage(ks, "k")?, kl, "k")?;
                let (vn, vn_layout) = operand::<T>(cuda_storage(vs, "v")?, vl, "v")?;
                Some((TensorRef::new(kn, kn_layout), TensorRef::new(vn, vn_layout)))
            }
            None => None,
        };
        let seqlens_guard = self.cache_seqlens.storage_and_layout();
        let table_guard = self.block_table.as_ref().map(|t| t.storage_and_layout());
        let block_table = match (&table_guard, &self.block_table) {
            (Some(g), Some(t)) => Some(BlockTable {
                table: index_view(g, "block_table")?,
                max_pages: t.dims2()?.1,
            }),
            _ => None,
        };
        let mut cache = KvCache {
            k: TensorMut::new(k_cache.slice().slice_mut(k_l.start_offset()..), k_layout),
            v: TensorMut::new(v_cache.slice().slice_mut(v_l.start_offset()..), v_layout),
            seqlens: index_view(&seqlens_guard, "cache_seqlens")?,
            block_table,
        };
        let guards = self.policy.lock();
        let views = guards.views()?;
        let opts = views.options(&self.policy)?;
        let shape = q_l.shape().clone();
        let mut o = unsafe { dev.alloc::<T>(shape.elem_count())? };
        let [b, s, h, _] = q_layout.shape;
        let mut lse = dev.alloc_zeros::<f32>(b * s * h)?;
        let step = DecodeStep {
            q: &q,
            new_kv: new_views.as_ref().map(|(k, v)| (k, v)),
        };
        let out = Out {
            o: TensorMut::new(o.as_view_mut(), Layout::contiguous(q_layout.shape)),
            lse: Some(lse.as_view_mut()),
        };
        fa.decode_kvcache(&stream, step, &mut cache, out, &opts, None)
            .map_err(wrap)?;
        self.lse.put(tensor_of(lse, vec![b, h, s], dev));
        Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), shape))
    }
}

qkv_op!(KvDecode, "flash-attn-kvcache");

/// Decode (or a short chunk) against a KV cache, as FlashAttention's
/// `flash_attn_with_kvcache`; returns O (`q`'s shape) and the f32 LSE
/// `[batch, num_heads_q, seq_len_q]`.
///
/// `q` is `[batch, seq_len_q, num_heads_q, head_size]`. The caches are
/// `[batch, capacity, num_heads_kv, head_size]`, or with `block_table`
/// (`[batch, max_pages]`, u32 or i32) page pools `[num_pages, page_size,
/// num_heads_kv, head_size]`. `cache_seqlens` (`[batch]`, u32 or i32) counts
/// the tokens already cached. With `k_new` and `v_new` (`[batch, seq_new,
/// num_heads_kv, head_size]`), those are first written into the caches **in
/// place** at positions `cache_seqlens[b]..`, and attended to; as in
/// FlashAttention, `cache_seqlens` is not advanced. Device-side lengths and
/// page indices are clamped by the kernels (to the capacity and the pool).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    k_new: Option<&Tensor>,
    v_new: Option<&Tensor>,
    args: &AttnArgs,
) -> Result<(Tensor, Tensor)> {
    let new_kv = match (k_new, v_new) {
        (Some(k), Some(v)) => Some((k.clone(), v.clone())),
        (None, None) => None,
        _ => bail!("flash-attn: k_new and v_new come together"),
    };
    let op = KvDecode {
        policy: Policy::new(args),
        cache_seqlens: cache_seqlens.clone(),
        block_table: block_table.cloned(),
        new_kv,
        lse: Slot::default(),
    };
    // In the graph without a backward: a loss through it fails at
    // `backward()` (candle's `BackwardNotSupported`) instead of giving q no
    // gradient.
    let lse = op.lse.clone();
    let o = q.apply_op3(k_cache, v_cache, op)?;
    Ok((o, lse.get("LSE")?))
}

/// Merges two attention states over disjoint key sets (FlashInfer's
/// `merge_state`): O tensors `[batch, seq, heads, head_size]`, LSEs f32
/// `[batch, heads, seq]` as [`flash_attn_lse`] returns them. Returns the
/// merged O and LSE.
pub fn merge_states(
    o_a: &Tensor,
    lse_a: &Tensor,
    o_b: &Tensor,
    lse_b: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let op = Merge {
        lse_a: lse_a.clone(),
        lse_b: lse_b.clone(),
        lse: Slot::default(),
    };
    // No backward, as `flash_attn_with_kvcache`.
    let lse = op.lse.clone();
    let o = o_a.apply_op2(o_b, op)?;
    Ok((o, lse.get("LSE")?))
}

struct Merge {
    lse_a: Tensor,
    lse_b: Tensor,
    lse: Slot,
}

impl Merge {
    fn run<T: AttnElement + CudaDType>(
        &self,
        a: &CudaStorage,
        a_l: &CandleLayout,
        b: &CudaStorage,
        b_l: &CandleLayout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = a.device();
        let fa = kernels(dev)?;
        let stream = dev.cuda_stream();
        let (a_view, a_layout) = operand::<T>(a, a_l, "o_a")?;
        let (b_view, b_layout) = operand::<T>(b, b_l, "o_b")?;
        let (ga, gb) = (
            self.lse_a.storage_and_layout(),
            self.lse_b.storage_and_layout(),
        );
        let (lse_a, lse_b) = (f32_view(&ga, "lse_a")?, f32_view(&gb, "lse_b")?);
        let shape = a_l.shape().clone();
        let mut o = unsafe { dev.alloc::<T>(shape.elem_count())? };
        let [bs, s, h, _] = a_layout.shape;
        let mut lse = dev.alloc_zeros::<f32>(bs * s * h)?;
        fa.merge_states(
            &stream,
            State {
                o: &TensorRef::new(a_view, a_layout),
                lse: &lse_a,
            },
            State {
                o: &TensorRef::new(b_view, b_layout),
                lse: &lse_b,
            },
            Out::with_lse(
                TensorMut::new(o.as_view_mut(), Layout::contiguous(a_layout.shape)),
                lse.as_view_mut(),
            ),
        )
        .map_err(wrap)?;
        self.lse.put(tensor_of(lse, vec![bs, h, s], dev));
        Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), shape))
    }
}

impl CustomOp2 for Merge {
    fn name(&self) -> &'static str {
        "flash-attn-merge-states"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &CandleLayout,
        _: &CpuStorage,
        _: &CandleLayout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("flash-attn runs on CUDA tensors only (got CPU tensors)")
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        a_l: &CandleLayout,
        b: &CudaStorage,
        b_l: &CandleLayout,
    ) -> Result<(CudaStorage, Shape)> {
        match a.dtype() {
            DType::F16 => self.run::<f16>(a, a_l, b, b_l),
            DType::BF16 => self.run::<bf16>(a, a_l, b, b_l),
            dt => bail!("flash-attn merges f16 and bf16 tensors, got {dt:?}"),
        }
    }
}
