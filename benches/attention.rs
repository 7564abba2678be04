//! `cargo bench`: times the forward and decode kernels with CUDA events, prints a
//! table, and writes one JSON object per line to `target/flash-attn-bench.jsonl`
//! (or `--json PATH`).
//!
//! Each sample is a batch of back-to-back launches between two events, divided
//! by the batch size, so the GPU stays busy and host-side validation and launch
//! overlap the previous launch (as in a real model); the reported time is the
//! median sample. Inputs are rotated over enough copies to defeat the L2 cache.
//!
//! Options: `--filter SUBSTR` (matches the printed shape label), `--quick`
//! (fewer repetitions), `--json PATH`. Without a GPU it says so and exits 0.
use std::io::Write;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use flash_attn::{AttnElement, AttnOptions, Dtype, FlashAttention, Layout, TensorMut, TensorRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Inputs are rotated over enough copies to exceed this many bytes, so that
/// repeated launches do not read them out of the L2 cache (50-60 MB on H100/H200).
const ROTATE_BYTES: usize = 256 << 20;
const MAX_ROTATIONS: usize = 64;
/// Launches per timed batch are chosen to fill about this much GPU time.
const BATCH_TARGET_MS: f64 = 0.5;
const MAX_BATCH: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Forward,
    Decode,
}

#[derive(Clone, Copy, Debug)]
struct Shape {
    kind: Kind,
    dtype: Dtype,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
    /// Decode from a paged cache with pages of this many tokens (a shuffled
    /// page pool); these rows are printed but kept out of the JSON, whose key
    /// set has no place for the page size.
    page_size: Option<usize>,
    /// Where the shape comes from, for the table.
    origin: &'static str,
}

impl Shape {
    fn label(&self) -> String {
        let paged = self
            .page_size
            .map_or(String::new(), |p| format!(" paged{p}"));
        format!(
            "{} {} {} b{} h{}/{} q{} k{} d{}{}{paged}",
            self.origin,
            if self.kind == Kind::Forward {
                "forward"
            } else {
                "decode"
            },
            self.dtype.name(),
            self.batch,
            self.heads,
            self.kv_heads,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            if self.causal { " causal" } else { "" }
        )
    }
    /// Matmul FLOPs (Q·Kᵀ and P·V); a causal mask halves them.
    fn flops(&self) -> f64 {
        let f =
            4.0 * (self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim) as f64;
        if self.causal && self.kind == Kind::Forward {
            f / 2.0
        } else {
            f
        }
    }
    /// Bytes the kernel must move at least: K and V once (decode, reported as
    /// GB/s), or Q, K, V and O once (forward).
    fn bytes(&self) -> f64 {
        let kv = 2 * self.batch * self.seqlen_k * self.kv_heads * self.head_dim * 2;
        let qo = 2 * self.batch * self.seqlen_q * self.heads * self.head_dim * 2;
        match self.kind {
            Kind::Decode => kv as f64,
            Kind::Forward => (kv + qo) as f64,
        }
    }
}

fn shapes() -> Vec<Shape> {
    let fwd = |dtype, batch, heads, seqlen: usize, head_dim, causal, origin| Shape {
        kind: Kind::Forward,
        dtype,
        batch,
        heads,
        kv_heads: heads,
        seqlen_q: seqlen,
        seqlen_k: seqlen,
        head_dim,
        causal,
        page_size: None,
        origin,
    };
    let dec = |batch, heads, kv_heads, cache: usize, head_dim, origin| Shape {
        kind: Kind::Decode,
        dtype: Dtype::F16,
        batch,
        heads,
        kv_heads,
        seqlen_q: 1,
        seqlen_k: cache,
        head_dim,
        causal: true,
        page_size: None,
        origin,
    };
    let mut v = vec![fwd(Dtype::F16, 4, 16, 4096, 128, false, "floor")];
    // Sweep at 16k tokens per batch, hidden 2048.
    for dtype in [Dtype::F16, Dtype::Bf16] {
        for head_dim in [64, 128] {
            for causal in [false, true] {
                for seqlen in [512, 1024, 2048, 4096, 8192, 16384] {
                    v.push(fwd(
                        dtype,
                        16384 / seqlen,
                        2048 / head_dim,
                        seqlen,
                        head_dim,
                        causal,
                        "sweep",
                    ));
                }
            }
        }
    }
    // Seed reports: L4 (fp16, D=64, causal), RTX 3060 (B=1 S=512 D=64; heads
    // unstated, 8 assumed), A100/H100 table (B=8 H=32 D=64), SmolLM-135M (9 heads D=64).
    for (b, h, s) in [
        (1, 1, 128),
        (4, 8, 128),
        (8, 8, 128),
        (8, 8, 256),
        (16, 8, 512),
    ] {
        v.push(fwd(Dtype::F16, b, h, s, 64, true, "seed-L4"));
    }
    v.push(fwd(Dtype::F16, 1, 8, 512, 64, false, "seed-3060"));
    for s in [512, 1024, 2048, 4096, 8192] {
        v.push(fwd(Dtype::F16, 8, 32, s, 64, false, "seed-A100"));
    }
    for s in [64, 128, 256, 512, 1024] {
        v.push(fwd(Dtype::F16, 1, 9, s, 64, true, "seed-SmolLM"));
    }
    // Decode: GQA 32/8 and MHA 32/32 at D=128, paged GQA, SmolLM-135M.
    for (kv_heads, origin) in [(8, "decode-gqa"), (32, "decode-mha")] {
        for batch in [1, 8, 32] {
            for cache in [1024, 4096, 16384, 65536] {
                v.push(dec(batch, 32, kv_heads, cache, 128, origin));
            }
        }
    }
    for page_size in [16, 64, 256] {
        for cache in [4096, 16384, 65536] {
            v.push(Shape {
                page_size: Some(page_size),
                ..dec(8, 32, 8, cache, 128, "decode-paged")
            });
        }
    }
    for cache in [256, 512, 1024, 2048, 4096] {
        v.push(dec(1, 9, 9, cache, 64, "seed-SmolLM"));
    }
    v
}

struct Bench {
    stream: Arc<CudaStream>,
    fa: FlashAttention,
    reps: usize,
}

fn random_buffer<T: AttnElement>(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    n: usize,
) -> CudaSlice<T> {
    let host: Vec<T> = (0..n)
        .map(|_| T::from_f64(rng.random_range(-1.0..1.0)))
        .collect();
    stream.clone_htod(&host).expect("upload")
}

/// Milliseconds per launch over one batch of `n` back-to-back launches.
fn time_batch(
    stream: &Arc<CudaStream>,
    n: usize,
    next: &mut usize,
    launch: &mut impl FnMut(usize),
) -> f64 {
    let ctx = stream.context();
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    let end = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    start.record(stream).expect("record");
    for _ in 0..n {
        launch(*next);
        *next += 1;
    }
    end.record(stream).expect("record");
    end.synchronize().expect("sync");
    start.elapsed_ms(&end).expect("elapsed") as f64 / n as f64
}

/// Median milliseconds per launch over `reps` batches, after warm-up.
fn time_median(stream: &Arc<CudaStream>, reps: usize, mut launch: impl FnMut(usize)) -> f64 {
    let mut next = 0;
    let estimate = time_batch(stream, 3, &mut next, &mut launch);
    let batch = ((BATCH_TARGET_MS / estimate).ceil() as usize).clamp(1, MAX_BATCH);
    let mut samples: Vec<f64> = (0..reps)
        .map(|_| time_batch(stream, batch, &mut next, &mut launch))
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn run_shape<T: AttnElement>(b: &Bench, s: &Shape) -> f64 {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let q_layout = Layout::contiguous([s.batch, s.seqlen_q, s.heads, s.head_dim]);
    let kv_layout = Layout::contiguous([s.batch, s.seqlen_k, s.kv_heads, s.head_dim]);
    let q_len = s.batch * s.seqlen_q * s.heads * s.head_dim;
    let kv_len = s.batch * s.seqlen_k * s.kv_heads * s.head_dim;
    let set_bytes = (2 * q_len + 2 * kv_len) * 2;
    let sets = ROTATE_BYTES.div_ceil(set_bytes).clamp(1, MAX_ROTATIONS);
    let inputs: Vec<[CudaSlice<T>; 3]> = (0..sets)
        .map(|_| {
            [
                random_buffer::<T>(&b.stream, &mut rng, q_len),
                random_buffer::<T>(&b.stream, &mut rng, kv_len),
                random_buffer::<T>(&b.stream, &mut rng, kv_len),
            ]
        })
        .collect();
    let mut o = b.stream.alloc_zeros::<T>(q_len).expect("alloc");
    let opts = AttnOptions {
        causal: s.causal,
        softmax_scale: None,
        ..Default::default()
    };
    let seqlens = b
        .stream
        .clone_htod(&vec![s.seqlen_k as i32; s.batch])
        .expect("upload");
    let mut workspace = None;
    if s.kind == Kind::Decode {
        let shape = flash_attn::DecodeShape {
            batch: s.batch,
            seqlen_q: s.seqlen_q,
            cache_len: s.seqlen_k,
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            causal: s.causal,
            softmax_scale: 1.0 / (s.head_dim as f32).sqrt(),
            ..Default::default()
        };
        workspace = Some(
            b.fa.decode_workspace::<T>(&b.stream, &shape)
                .expect("workspace"),
        );
    }
    if let Some(page) = s.page_size {
        return run_paged::<T>(b, s, page, inputs, o, seqlens, workspace, sets);
    }
    let reps = b.reps;
    time_median(&b.stream, reps, |i| {
        let [q, k, v] = &inputs[i % sets];
        let q = TensorRef::new(q.as_view(), q_layout);
        let k = TensorRef::new(k.as_view(), kv_layout);
        let v = TensorRef::new(v.as_view(), kv_layout);
        let mut out = TensorMut::new(o.as_view_mut(), q_layout);
        match s.kind {
            Kind::Forward => b.fa.forward(&b.stream, &q, &k, &v, &mut out, None, &opts),
            Kind::Decode => b.fa.decode(
                &b.stream,
                &q,
                &k,
                &v,
                &seqlens.as_view(),
                &mut out,
                None,
                &opts,
                workspace.as_mut(),
            ),
        }
        .expect("launch");
    })
}

/// Decode through [`FlashAttention::decode_kvcache`] from a page pool: the
/// inputs' K/V buffers are read as [B * L / page, page, Hkv, D] pools with a
/// shuffled block table.
#[allow(clippy::too_many_arguments)]
fn run_paged<T: AttnElement>(
    b: &Bench,
    s: &Shape,
    page: usize,
    mut inputs: Vec<[CudaSlice<T>; 3]>,
    mut o: CudaSlice<T>,
    seqlens: CudaSlice<i32>,
    mut workspace: Option<flash_attn::DecodeWorkspace>,
    sets: usize,
) -> f64 {
    let max_pages = s.seqlen_k.div_ceil(page);
    let num_pages = s.batch * max_pages;
    let mut rng = StdRng::seed_from_u64(0x9a9e);
    let mut table: Vec<i32> = (0..num_pages as i32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.random_range(0..=i));
    }
    let table = b.stream.clone_htod(&table).expect("upload");
    let q_layout = Layout::contiguous([s.batch, s.seqlen_q, s.heads, s.head_dim]);
    let pool = Layout::contiguous([num_pages, page, s.kv_heads, s.head_dim]);
    let opts = AttnOptions {
        causal: s.causal,
        softmax_scale: None,
        ..Default::default()
    };
    time_median(&b.stream, b.reps, |i| {
        let [q, k, v] = &mut inputs[i % sets];
        let mut cache = flash_attn::KvCache {
            k: TensorMut::new(k.as_view_mut(), pool),
            v: TensorMut::new(v.as_view_mut(), pool),
            seqlens: seqlens.as_view(),
            block_table: Some(flash_attn::BlockTable {
                table: table.as_view(),
                max_pages,
            }),
        };
        b.fa.decode_kvcache(
            &b.stream,
            &TensorRef::new(q.as_view(), q_layout),
            &mut cache,
            None,
            &mut TensorMut::new(o.as_view_mut(), q_layout),
            None,
            &opts,
            workspace.as_mut(),
        )
        .expect("launch");
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
    let quick = args.iter().any(|a| a == "--quick");
    let json_path = value_of("--json").unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        format!("{dir}/flash-attn-bench.jsonl")
    });

    // SAFETY: only probes whether the driver library can be loaded.
    let have_driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !have_driver || CudaContext::device_count().map_or(true, |n| n < 1) {
        println!("no CUDA device found: skipping the flash-attn benchmarks");
        return;
    }
    let ctx = CudaContext::new(0).expect("CUDA context");
    let fa = FlashAttention::new(&ctx).expect("load flash-attn kernels");
    let bench = Bench {
        stream: ctx.default_stream(),
        fa,
        reps: if quick { 10 } else { 50 },
    };
    println!(
        "device: {} (sm_{}{}, {} SMs), PTX from {}",
        ctx.name().unwrap_or_default(),
        bench.fa.compute_capability().0,
        bench.fa.compute_capability().1,
        bench.fa.num_sms(),
        flash_attn::PTX_SOURCE
    );
    if let Some(dir) = std::path::Path::new(&json_path).parent() {
        std::fs::create_dir_all(dir).ok();
    }
    let mut json = std::fs::File::create(&json_path).expect("create the JSON-lines file");

    println!(
        "{:<8} {:<5} {:>3} {:>3} {:>4} {:>6} {:>6} {:>4} {:>6} {:>10} {:>8} {:>8}  origin",
        "kernel",
        "dtype",
        "B",
        "H",
        "Hkv",
        "Sq",
        "Skv",
        "D",
        "causal",
        "median_ms",
        "TFLOP/s",
        "GB/s"
    );
    for s in shapes() {
        if filter.as_deref().is_some_and(|f| !s.label().contains(f)) {
            continue;
        }
        let ms = match s.dtype {
            Dtype::F16 => run_shape::<f16>(&bench, &s),
            Dtype::Bf16 => run_shape::<bf16>(&bench, &s),
        };
        let tflops = s.flops() / (ms * 1e-3) / 1e12;
        let gbps = s.bytes() / (ms * 1e-3) / 1e9;
        let kernel = if s.kind == Kind::Forward {
            "forward"
        } else {
            "decode"
        };
        println!(
            "{:<8} {:<5} {:>3} {:>3} {:>4} {:>6} {:>6} {:>4} {:>6} {:>10.4} {:>8.1} {:>8.0}  {}",
            kernel,
            s.dtype.name(),
            s.batch,
            s.heads,
            s.kv_heads,
            s.seqlen_q,
            s.seqlen_k,
            s.head_dim,
            s.causal,
            ms,
            tflops,
            gbps,
            s.page_size
                .map_or(s.origin.to_string(), |p| format!("{} page {p}", s.origin))
        );
        let line = serde_json::json!({
            "kernel": kernel,
            "dtype": s.dtype.name(),
            "batch": s.batch,
            "heads": s.heads,
            "kv_heads": s.kv_heads,
            "seqlen_q": s.seqlen_q,
            "seqlen_k": s.seqlen_k,
            "head_dim": s.head_dim,
            "causal": s.causal,
            "median_ms": ms,
            "tflops": tflops,
            "gbps": gbps,
        });
        if s.page_size.is_none() {
            writeln!(json, "{line}").expect("write JSON line");
        }
    }
    println!("JSON lines written to {json_path}");
}
