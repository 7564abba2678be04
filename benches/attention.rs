//! `cargo bench`: times the forward and decode kernels with CUDA events, prints a
//! table, and writes one JSON object per line to `target/flash-attn-bench.jsonl`
//! (or `--json PATH`).
//!
//! Two timing methods; each JSON line says which in `"timing"`:
//!
//! - `events` (the default): each sample is a batch of back-to-back launches
//!   between two events, divided by the batch size, so the GPU stays busy and
//!   host-side validation and launch overlap the previous launch (as in a real
//!   model); the reported time is the median of 50 samples (10 with `--quick`).
//! - `graph` (as servers run a decode step, with no host dispatch at all): `N`
//!   launches captured in one CUDA graph on a non-default stream, launch `i`
//!   reading rotated copy `i % copies`; `N` is enough for about 0.5 ms (from 3
//!   uncaptured launches) and at least the number of copies, within 16..=1024.
//!   After 2 warm-up replays, 20 replays (5 with `--quick`) run back to back
//!   with an event between consecutive ones; a sample is one replay's time / `N`,
//!   and the median sample is reported. Decode rows use a preallocated
//!   `DecodeWorkspace`, so nothing is allocated during capture.
//!   `scripts/compare-torch.py --timer graph` times PyTorch the same way.
//!
//! Inputs are rotated over enough copies to exceed 256 MiB, which defeats the
//! L2 cache (at most 64 copies for `events`, 1024 for `graph`; one for inputs
//! above 256 MiB). Inputs are uniform in [-1, 1): one random tile of up to 1M
//! values per buffer, repeated on the device, and the copies are device copies.
//!
//! The 16k-token sweep keeps hidden = heads * D at 2048 where D divides it
//! (heads = 2048 / D, rounded down: D=96 runs 21 heads, hidden 2016), the same
//! rule as `scripts/compare-torch.py`'s copy of the shape list.
//!
//! The `decode-graph` rows (issue 9: decode where it is launch-bound, timed as
//! servers run it) are timed with `graph` unless `--timing events` is given:
//! f16, causal (bottom-right, so new token `t` of `Sq` sees the cache up to
//! `L - Sq + t`), `Sq` = 1 and 4 new tokens, B in {1, 4, 8, 32}, cache length L
//! in {256, 1k, 4k, 16k, 64k}, heads GQA 32/8, MHA 32/32, Qwen 28/4 and SmolLM
//! 9/3 at D=128 (SmolLM: D=64) plus GQA 32/8 at D=256; the two MHA cells at
//! B=32, L=64k (34 GB of K/V) are left out. `--filter decode-graph` selects them.
//!
//! The `policy-*` rows (f16, ours only: no PyTorch baseline) time the mask,
//! score and sequence policies next to the plain kernel on the same shape:
//! `policy-window` (sliding windows), `policy-scores` (softcap, ALiBi, sinks),
//! `policy-varlen` (packed sequences of random lengths vs a fixed batch at the
//! mean length) and `policy-decode` (windowed and soft-capped decode). Their
//! FLOPs count only the visible (query, key) pairs, exactly, per sequence; the
//! last column compares each with its plain row (time full/window, overhead in
//! %, or varlen/fixed TFLOP/s). Their JSON lines carry `"policy"` (`"none"`
//! for the plain reference rows), `"origin"`, `"flops"` and the comparison,
//! and `scripts/compare-torch.py` skips every line with a `"policy"` key.
//!
//! Options: `--filter SUBSTR` (matches the printed shape label, which ends with
//! the policy name, e.g. `window4096`, `softcap50`, `alibi`, `sinks0.5`,
//! `varlen`; a policy row's plain reference row runs with it), `--timing
//! events|graph` (every selected row timed that way), `--quick` (fewer
//! repetitions), `--module cubin|ptx` (load the embedded cubin, the default,
//! or JIT the PTX; the first line says which was loaded and how long
//! `FlashAttention::new` took), `--splits N` (decode rows split their keys N ways, lowered
//! to what the cache allows, instead of the heuristic's count; every decode
//! JSON line records the count used as `"splits"` and the K/V ring depth as
//! `"ring_stages"`), `--json PATH`, `--list` (print the selected rows' labels,
//! FLOPs, bytes and timing and exit; needs no GPU). Without a GPU it says so
//! and exits 0. Every JSON line carries `"timing"` and `"origin"`.
use std::io::Write;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use flash_attn::{
    AlibiSlopes, AttnElement, AttnOptions, Dtype, FlashAttention, Layout, TensorMut, TensorRef,
    Varlen, Window,
};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Inputs are rotated over enough copies to exceed this many bytes, so that
/// repeated launches do not read them out of the L2 cache (50-60 MB on H100/H200).
const ROTATE_BYTES: usize = 256 << 20;
const MAX_ROTATIONS: usize = 64;
/// Values drawn on the host per input buffer; longer buffers repeat them
/// (device copies): drawing gigabytes on the host takes minutes, and the
/// kernels' speed does not depend on the values.
const RANDOM_TILE: usize = 1 << 20;
/// Launches per timed batch are chosen to fill about this much GPU time.
const BATCH_TARGET_MS: f64 = 0.5;
const MAX_BATCH: usize = 64;
/// Graph timing: launches per captured graph (enough for about
/// `BATCH_TARGET_MS` and for one launch per rotated copy, within these
/// bounds; graph rows rotate over up to `GRAPH_MAX_LAUNCHES` copies).
const GRAPH_MIN_LAUNCHES: usize = 16;
const GRAPH_MAX_LAUNCHES: usize = 1024;
/// Untimed replays before the timed ones.
const GRAPH_WARMUP: usize = 2;
/// The decode table of issue 9, timed with CUDA graphs by default: (heads,
/// KV heads, head dim) for GQA 32/8, MHA 32/32, Qwen 28/4, GQA 32/8 at D=256
/// and SmolLM 9/3, each at these new-token counts, batches and cache lengths.
const DECODE_GRAPH: &str = "decode-graph";
const DECODE_GRAPH_HEADS: [(usize, usize, usize); 5] = [
    (32, 8, 128),
    (32, 32, 128),
    (28, 4, 128),
    (32, 8, 256),
    (9, 3, 64),
];
const DECODE_GRAPH_SEQLEN_Q: [usize; 2] = [1, 4];
const DECODE_GRAPH_BATCHES: [usize; 4] = [1, 4, 8, 32];
const DECODE_GRAPH_CACHES: [usize; 5] = [256, 1024, 4096, 16384, 65536];
/// Cells whose K/V cache exceeds this are left out (caches this big have one
/// copy, not rotated): MHA at B=32, L=64k (34 GB).
const DECODE_GRAPH_MAX_BYTES: f64 = 20e9;
/// The varlen rows: this many sequences of random lengths in `VARLEN_LENS`.
const VARLEN_SEQS: usize = 16;
const VARLEN_LENS: std::ops::RangeInclusive<usize> = 64..=2048;

/// The varlen rows' sequence lengths (fixed seed; about 16k tokens in all).
fn varlen_seqlens() -> Vec<usize> {
    let mut rng = StdRng::seed_from_u64(0x7a51e9);
    (0..VARLEN_SEQS)
        .map(|_| rng.random_range(VARLEN_LENS))
        .collect()
}

/// Visible (query, key) pairs of one sequence under `window` (already combined
/// with the causal flag by [`Window::effective`]), bottom-right aligned.
fn visible_pairs(seqlen_q: usize, seqlen_k: usize, window: Window) -> u64 {
    let (sq, sk) = (seqlen_q as i64, seqlen_k as i64);
    (0..sq)
        .map(|i| {
            let diag = i + sk - sq;
            let lo = window.left.map_or(0, |l| (diag - l as i64).max(0));
            let hi = window
                .right
                .map_or(sk - 1, |r| (diag + r as i64).min(sk - 1));
            (hi - lo + 1).max(0) as u64
        })
        .sum()
}

/// A mask, score or sequence policy on top of the plain kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Policy {
    /// The plain kernel.
    None,
    /// A sliding window (with `causal`, its right side is 0).
    Window(Window),
    /// Logit soft-capping at this value.
    Softcap(f32),
    /// Per-head ALiBi slopes 2^(-8(h+1)/H).
    Alibi,
    /// Per-head attention-sink logits, all this value.
    Sinks(f32),
    /// `batch` packed sequences of [`varlen_seqlens`] lengths; the shape's
    /// `seqlen_q`/`seqlen_k` hold their mean (its plain row's sequence length).
    Varlen,
}

impl Policy {
    fn name(&self) -> String {
        let bound = |b: Option<usize>| b.map_or("inf".to_string(), |b| b.to_string());
        match *self {
            Policy::None => "none".into(),
            Policy::Window(Window {
                left: Some(l),
                right: None,
            }) => format!("window{l}"),
            Policy::Window(w) => format!("window{}-{}", bound(w.left), bound(w.right)),
            Policy::Softcap(c) => format!("softcap{c}"),
            Policy::Alibi => "alibi".into(),
            Policy::Sinks(s) => format!("sinks{s}"),
            Policy::Varlen => "varlen".into(),
        }
    }
}

/// How a row is timed (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Timing {
    /// Batches of back-to-back launches between two events.
    Events,
    /// Replays of one CUDA graph of captured launches.
    Graph,
}

impl Timing {
    fn name(self) -> &'static str {
        match self {
            Timing::Events => "events",
            Timing::Graph => "graph",
        }
    }
    fn parse(text: &str) -> Option<Timing> {
        [Timing::Events, Timing::Graph]
            .into_iter()
            .find(|t| t.name() == text)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Forward,
    Decode,
}

#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// `Policy::None` except in the `policy-*` rows.
    policy: Policy,
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
        ) + &self.policy_suffix()
    }
    fn policy_suffix(&self) -> String {
        if self.policy == Policy::None {
            String::new()
        } else {
            format!(" {}", self.policy.name())
        }
    }
    /// Graph for the `decode-graph` rows, else events, unless `--timing` says.
    fn timing(&self, forced: Option<Timing>) -> Timing {
        forced.unwrap_or(if self.origin == DECODE_GRAPH {
            Timing::Graph
        } else {
            Timing::Events
        })
    }
    /// A `policy-*` row: exact visible-pair FLOPs, its own JSON keys.
    fn is_policy_row(&self) -> bool {
        self.origin.starts_with("policy-")
    }
    /// The plain row a policy row is compared with.
    fn plain(&self) -> Shape {
        Shape {
            policy: Policy::None,
            ..*self
        }
    }
    /// (seqlen_q, seqlen_k) of each sequence.
    fn sequences(&self) -> Vec<(usize, usize)> {
        if self.policy == Policy::Varlen {
            varlen_seqlens().into_iter().map(|l| (l, l)).collect()
        } else {
            vec![(self.seqlen_q, self.seqlen_k); self.batch]
        }
    }
    fn window(&self) -> Window {
        match self.policy {
            Policy::Window(w) => w,
            _ => Window::UNBOUNDED,
        }
    }
    /// Matmul FLOPs (Q·Kᵀ and P·V). A causal mask halves them; the policy
    /// rows count exactly the visible (query, key) pairs of each sequence.
    fn flops(&self) -> f64 {
        if self.is_policy_row() {
            let mask = self.window().effective(self.causal);
            let pairs: u64 = self
                .sequences()
                .into_iter()
                .map(|(sq, sk)| visible_pairs(sq, sk, mask))
                .sum();
            return 4.0 * (self.heads * self.head_dim) as f64 * pairs as f64;
        }
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
        if self.is_policy_row() {
            // Tokens of Q/O and keys of K/V the kernel must touch: a window
            // bounds the keys of a decode row to its last `left + Sq` keys.
            let mask = self.window().effective(self.causal);
            let (mut q_tokens, mut k_tokens) = (0, 0);
            for (sq, sk) in self.sequences() {
                q_tokens += sq;
                k_tokens += match (self.kind, mask.left) {
                    (Kind::Decode, Some(left)) => sk.min(left.saturating_add(sq)),
                    _ => sk,
                };
            }
            let kv = 2 * k_tokens * self.kv_heads * self.head_dim * 2;
            let qo = 2 * q_tokens * self.heads * self.head_dim * 2;
            return match self.kind {
                Kind::Decode => kv as f64,
                Kind::Forward => (kv + qo) as f64,
            };
        }
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
        policy: Policy::None,
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
        policy: Policy::None,
    };
    let mut v = vec![fwd(Dtype::F16, 4, 16, 4096, 128, false, "floor")];
    // Sweep at 16k tokens per batch, hidden 2048.
    for dtype in [Dtype::F16, Dtype::Bf16] {
        for head_dim in [64, 96, 128, 256] {
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
    for (heads, kv_heads, head_dim) in DECODE_GRAPH_HEADS {
        for seqlen_q in DECODE_GRAPH_SEQLEN_Q {
            for batch in DECODE_GRAPH_BATCHES {
                for cache in DECODE_GRAPH_CACHES {
                    let s = Shape {
                        seqlen_q,
                        ..dec(batch, heads, kv_heads, cache, head_dim, DECODE_GRAPH)
                    };
                    if s.bytes() <= DECODE_GRAPH_MAX_BYTES {
                        v.push(s);
                    }
                }
            }
        }
    }
    // Policies (f16, ours only), each right after its plain row.
    let with = |s: Shape, policy| Shape { policy, ..s };
    for (causal, window) in [
        (true, Window::left(4096)),
        (
            false,
            Window {
                left: Some(4096),
                right: Some(4096),
            },
        ),
    ] {
        let plain = fwd(Dtype::F16, 1, 16, 16384, 128, causal, "policy-window");
        v.extend([plain, with(plain, Policy::Window(window))]);
    }
    for causal in [true, false] {
        let plain = fwd(Dtype::F16, 4, 16, 4096, 128, causal, "policy-scores");
        v.push(plain);
        for policy in [Policy::Softcap(50.0), Policy::Alibi, Policy::Sinks(0.5)] {
            v.push(with(plain, policy));
        }
    }
    let lens = varlen_seqlens();
    let mean = (lens.iter().sum::<usize>() + VARLEN_SEQS / 2) / VARLEN_SEQS;
    for causal in [true, false] {
        let plain = fwd(
            Dtype::F16,
            VARLEN_SEQS,
            16,
            mean,
            128,
            causal,
            "policy-varlen",
        );
        v.extend([plain, with(plain, Policy::Varlen)]);
    }
    let plain = dec(8, 32, 8, 16384, 128, "policy-decode");
    v.extend([
        plain,
        with(plain, Policy::Window(Window::left(4096))),
        with(plain, Policy::Softcap(50.0)),
    ]);
    v
}

/// One row's timing method, with the stream it runs on (graph rows need a
/// stream that can be captured, not the legacy default stream).
struct Bench<'a> {
    stream: Arc<CudaStream>,
    fa: &'a FlashAttention,
    reps: usize,
    timing: Timing,
    /// `--splits N`: the decode rows' `num_splits`.
    splits: Option<usize>,
}

impl Bench<'_> {
    /// Rotated input copies at most: a graph touches each in one replay.
    fn max_rotations(&self) -> usize {
        match self.timing {
            Timing::Events => MAX_ROTATIONS,
            Timing::Graph => GRAPH_MAX_LAUNCHES,
        }
    }
    /// Median milliseconds per launch; `launch(i)` reads copy `i % sets`.
    fn time(&self, sets: usize, launch: impl FnMut(usize)) -> f64 {
        match self.timing {
            Timing::Events => time_median(&self.stream, self.reps, launch),
            Timing::Graph => time_graph(&self.stream, self.reps, sets, launch),
        }
    }
}

/// `n` random values in [-1, 1): a tile of at most [`RANDOM_TILE`] drawn on
/// the host, repeated on the device by doubling copies.
fn random_buffer<T: AttnElement>(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    n: usize,
) -> CudaSlice<T> {
    let tile: Vec<T> = (0..n.min(RANDOM_TILE))
        .map(|_| T::from_f64(rng.random_range(-1.0..1.0)))
        .collect();
    let mut buf = stream.alloc_zeros::<T>(n).expect("alloc");
    stream
        .memcpy_htod(&tile, &mut buf.slice_mut(..tile.len()))
        .expect("upload");
    let mut filled = tile.len();
    while filled < n {
        let len = filled.min(n - filled);
        let (src, mut dst) = buf.split_at_mut(filled);
        stream
            .memcpy_dtod(&src.slice(..len), &mut dst.slice_mut(..len))
            .expect("copy");
        filled += len;
    }
    buf
}

fn timing_event(stream: &Arc<CudaStream>) -> CudaEvent {
    stream
        .context()
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event")
}

/// The upper median, as every timing here reports it.
fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Milliseconds per launch over one batch of `n` back-to-back launches.
fn time_batch(
    stream: &Arc<CudaStream>,
    n: usize,
    next: &mut usize,
    launch: &mut impl FnMut(usize),
) -> f64 {
    let (start, end) = (timing_event(stream), timing_event(stream));
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
    median(
        (0..reps)
            .map(|_| time_batch(stream, batch, &mut next, &mut launch))
            .collect(),
    )
}

/// Median milliseconds per launch as servers run a decode step: `n` launches
/// captured in one CUDA graph (launch `i` reads copy `i % sets`; `n` covers
/// every copy and about `BATCH_TARGET_MS`), [`GRAPH_WARMUP`] replays, then
/// `reps` replays back to back with an event between consecutive ones, each
/// sample divided by `n`. The launches must not allocate or synchronize.
fn time_graph(
    stream: &Arc<CudaStream>,
    reps: usize,
    sets: usize,
    mut launch: impl FnMut(usize),
) -> f64 {
    let estimate = time_batch(stream, 3, &mut 0, &mut launch);
    let n = ((BATCH_TARGET_MS / estimate).ceil() as usize)
        .max(sets)
        .clamp(GRAPH_MIN_LAUNCHES, GRAPH_MAX_LAUNCHES);
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    (0..n).for_each(&mut launch);
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("end capture")
        .expect("a captured graph");
    for _ in 0..GRAPH_WARMUP {
        graph.launch().expect("replay");
    }
    // Queued behind the warm-up, so no replay waits for the host.
    let events: Vec<CudaEvent> = (0..=reps).map(|_| timing_event(stream)).collect();
    events[0].record(stream).expect("record");
    for event in &events[1..] {
        graph.launch().expect("replay");
        event.record(stream).expect("record");
    }
    events[reps].synchronize().expect("sync");
    median(
        events
            .windows(2)
            .map(|w| w[0].elapsed_ms(&w[1]).expect("elapsed") as f64 / n as f64)
            .collect(),
    )
}

/// Random Q, K, V and enough device copies of them to defeat the L2 cache
/// (the copies hold the same values at other addresses).
fn random_sets<T: AttnElement>(b: &Bench, q_len: usize, kv_len: usize) -> Vec<[CudaSlice<T>; 3]> {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let set_bytes = (2 * q_len + 2 * kv_len) * 2;
    let sets = ROTATE_BYTES.div_ceil(set_bytes).clamp(1, b.max_rotations());
    let first = [q_len, kv_len, kv_len].map(|n| random_buffer::<T>(&b.stream, &mut rng, n));
    let copies: Vec<_> = (1..sets)
        .map(|_| {
            first
                .each_ref()
                .map(|x| b.stream.clone_dtod(x).expect("copy"))
        })
        .collect();
    std::iter::once(first).chain(copies).collect()
}

/// The validated decode problem of a decode row, as the library sees it.
fn decode_shape(s: &Shape, num_splits: Option<usize>) -> flash_attn::DecodeShape {
    flash_attn::DecodeShape {
        batch: s.batch,
        seqlen_q: s.seqlen_q,
        cache_len: s.seqlen_k,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        causal: s.causal,
        softmax_scale: 1.0 / (s.head_dim as f32).sqrt(),
        window: s.window(),
        softcap: match s.policy {
            Policy::Softcap(c) => Some(c),
            _ => None,
        },
        num_splits,
    }
}

fn run_shape<T: AttnElement>(b: &Bench, s: &Shape) -> f64 {
    let q_layout = Layout::contiguous([s.batch, s.seqlen_q, s.heads, s.head_dim]);
    let kv_layout = Layout::contiguous([s.batch, s.seqlen_k, s.kv_heads, s.head_dim]);
    let q_len = s.batch * s.seqlen_q * s.heads * s.head_dim;
    let kv_len = s.batch * s.seqlen_k * s.kv_heads * s.head_dim;
    // Policy parameters: ALiBi slopes 2^(-8(h+1)/H) and sink logits, per head.
    let slopes: Vec<f32> = (0..s.heads)
        .map(|h| (-8.0 * (h + 1) as f32 / s.heads as f32).exp2())
        .collect();
    let slopes = b.stream.clone_htod(&slopes).expect("upload");
    let slopes = slopes.as_view();
    let sink = match s.policy {
        Policy::Sinks(x) => x,
        _ => 0.0,
    };
    let sinks = b.stream.clone_htod(&vec![sink; s.heads]).expect("upload");
    let sinks = sinks.as_view();
    let opts = AttnOptions {
        causal: s.causal,
        softmax_scale: None,
        window: s.window(),
        softcap: match s.policy {
            Policy::Softcap(c) => Some(c),
            _ => None,
        },
        alibi_slopes: (s.policy == Policy::Alibi).then_some(AlibiSlopes::PerHead(&slopes)),
        sinks: matches!(s.policy, Policy::Sinks(_)).then_some(&sinks),
        num_splits: if s.kind == Kind::Decode {
            b.splits
        } else {
            None
        },
    };
    if s.policy == Policy::Varlen {
        return run_varlen::<T>(b, s, &opts);
    }
    let inputs = random_sets::<T>(b, q_len, kv_len);
    let sets = inputs.len();
    let mut o = b.stream.alloc_zeros::<T>(q_len).expect("alloc");
    let seqlens = b
        .stream
        .clone_htod(&vec![s.seqlen_k as i32; s.batch])
        .expect("upload");
    let mut workspace = None;
    if s.kind == Kind::Decode {
        workspace = Some(
            b.fa.decode_workspace::<T>(&b.stream, &decode_shape(s, b.splits))
                .expect("workspace"),
        );
    }
    if let Some(page) = s.page_size {
        return run_paged::<T>(b, s, page, inputs, o, seqlens, workspace, sets);
    }
    // Decode rows pass a preallocated workspace: graph capture cannot allocate.
    b.time(sets, |i| {
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

/// Forward over [`varlen_seqlens`] packed as [total, H, D] (Q, K and V share
/// the sequence boundaries).
fn run_varlen<T: AttnElement>(b: &Bench, s: &Shape, opts: &AttnOptions) -> f64 {
    let lens = varlen_seqlens();
    let total: usize = lens.iter().sum();
    let cu: Vec<i32> = std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &l| {
            *acc += l as i32;
            Some(*acc)
        }))
        .collect();
    let cu = b.stream.clone_htod(&cu).expect("upload");
    let cu = cu.as_view();
    let max = lens.iter().copied().max().unwrap_or(0);
    let seqlens = Varlen {
        cu_seqlens_q: &cu,
        cu_seqlens_k: &cu,
        max_seqlen_q: max,
        max_seqlen_k: max,
    };
    let q_layout = Layout::packed([total, s.heads, s.head_dim]);
    let kv_layout = Layout::packed([total, s.kv_heads, s.head_dim]);
    let inputs = random_sets::<T>(
        b,
        total * s.heads * s.head_dim,
        total * s.kv_heads * s.head_dim,
    );
    let sets = inputs.len();
    let mut o = b
        .stream
        .alloc_zeros::<T>(total * s.heads * s.head_dim)
        .expect("alloc");
    b.time(sets, |i| {
        let [q, k, v] = &inputs[i % sets];
        b.fa.forward_varlen(
            &b.stream,
            &TensorRef::new(q.as_view(), q_layout),
            &TensorRef::new(k.as_view(), kv_layout),
            &TensorRef::new(v.as_view(), kv_layout),
            &mut TensorMut::new(o.as_view_mut(), q_layout),
            None,
            &seqlens,
            opts,
        )
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
        num_splits: b.splits,
        ..Default::default()
    };
    b.time(sets, |i| {
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
    let module_choice = match value_of("--module").as_deref() {
        None | Some("cubin") => flash_attn::ModuleChoice::PreferCubin,
        Some("ptx") => flash_attn::ModuleChoice::Ptx,
        Some(other) => {
            eprintln!("--module wants cubin or ptx, not {other:?}");
            std::process::exit(2);
        }
    };
    let splits = value_of("--splits").map(|n| match n.parse::<usize>() {
        Ok(n) if n > 0 => n,
        _ => {
            eprintln!("--splits wants a positive count, not {n:?}");
            std::process::exit(2);
        }
    });
    let forced_timing = value_of("--timing").map(|t| {
        Timing::parse(&t).unwrap_or_else(|| {
            eprintln!("--timing wants events or graph, not {t:?}");
            std::process::exit(2)
        })
    });
    let timing_of = |s: &Shape| s.timing(forced_timing);
    let json_path = value_of("--json").unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        format!("{dir}/flash-attn-bench.jsonl")
    });

    let all = shapes();
    let matches = |s: &Shape| filter.as_deref().is_none_or(|f| s.label().contains(f));
    // A policy row's plain row runs whenever one of its policy rows does.
    let selected: Vec<Shape> = all
        .iter()
        .copied()
        .filter(|&s| {
            matches(&s)
                || (s.is_policy_row()
                    && s.policy == Policy::None
                    && all
                        .iter()
                        .any(|t| t.policy != Policy::None && t.plain() == s && matches(t)))
        })
        .collect();
    if args.iter().any(|a| a == "--list") {
        for s in &selected {
            println!(
                "{:<70} {:>12.3} GFLOP {:>10.1} MB  {}",
                s.label(),
                s.flops() / 1e9,
                s.bytes() / 1e6,
                timing_of(s).name()
            );
        }
        println!("{} rows", selected.len());
        return;
    }

    if flash_attn::cuda_device_count().expect("the CUDA driver is present but fails") < 1 {
        println!("no CUDA device found: skipping the flash-attn benchmarks");
        return;
    }
    let ctx = CudaContext::new(0).expect("CUDA context");
    // SAFETY: every buffer is used only on the stream that allocated it (its
    // row's), so no cross-stream events are needed; stream capture would
    // reject waits on events recorded outside it.
    unsafe { ctx.disable_event_tracking() };
    let load_start = std::time::Instant::now();
    let fa = FlashAttention::new_with(&ctx, module_choice).expect("load flash-attn kernels");
    let load_ms = load_start.elapsed().as_secs_f64() * 1e3;
    // Events rows keep the legacy default stream; capture needs another one.
    let (default_stream, graph_stream) =
        (ctx.default_stream(), ctx.new_stream().expect("CUDA stream"));
    let bench_for = |timing| {
        let (stream, reps) = match timing {
            Timing::Events => (&default_stream, if quick { 10 } else { 50 }),
            Timing::Graph => (&graph_stream, if quick { 5 } else { 20 }),
        };
        Bench {
            stream: stream.clone(),
            fa: &fa,
            reps,
            timing,
            splits,
        }
    };
    println!(
        "device: {} (sm_{}{}, {} SMs), PTX from {}, loaded {:?} in {load_ms:.0} ms",
        ctx.name().unwrap_or_default(),
        fa.compute_capability().0,
        fa.compute_capability().1,
        fa.num_sms(),
        flash_attn::PTX_SOURCE,
        fa.loaded_code()
    );
    if let Some(dir) = std::path::Path::new(&json_path).parent() {
        std::fs::create_dir_all(dir).ok();
    }
    let mut json = std::fs::File::create(&json_path).expect("create the JSON-lines file");

    println!(
        "{:<8} {:<5} {:>3} {:>3} {:>4} {:>6} {:>6} {:>4} {:>6} {:>10} {:>6} {:>8} {:>8}  origin",
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
        "timing",
        "TFLOP/s",
        "GB/s"
    );
    // Plain reference rows of the policy rows measured so far: (shape, ms, TFLOP/s).
    let mut plain_rows: Vec<(Shape, f64, f64)> = Vec::new();
    for s in selected {
        let is_reference = s.is_policy_row() && s.policy == Policy::None;
        let timing = timing_of(&s);
        let bench = bench_for(timing);
        let ms = match s.dtype {
            Dtype::F16 => run_shape::<f16>(&bench, &s),
            Dtype::Bf16 => run_shape::<bf16>(&bench, &s),
        };
        let tflops = s.flops() / (ms * 1e-3) / 1e12;
        let gbps = s.bytes() / (ms * 1e-3) / 1e9;
        if is_reference {
            plain_rows.push((s, ms, tflops));
        }
        // How a policy row compares with its plain row.
        let versus = plain_rows
            .iter()
            .rev()
            .find(|(p, _, _)| s.policy != Policy::None && *p == s.plain())
            .map(|&(_, plain_ms, plain_tflops)| {
                let (key, value) = match s.policy {
                    Policy::Window(_) => ("full_over_window_time", plain_ms / ms),
                    Policy::Varlen => ("varlen_over_fixed_tflops", tflops / plain_tflops),
                    _ => ("overhead_pct", (ms / plain_ms - 1.0) * 100.0),
                };
                (key, value, plain_ms)
            });
        let versus_text = match versus {
            Some(("full_over_window_time", x, _)) => format!(", full/window time {x:.2}x"),
            Some(("varlen_over_fixed_tflops", x, _)) => format!(", varlen/fixed TFLOP/s {x:.2}"),
            Some((_, x, _)) => format!(", overhead {x:+.1}%"),
            None => String::new(),
        };
        let kernel = if s.kind == Kind::Forward {
            "forward"
        } else {
            "decode"
        };
        println!(
            "{:<8} {:<5} {:>3} {:>3} {:>4} {:>6} {:>6} {:>4} {:>6} {:>10.4} {:>6} {:>8.1} {:>8.0}  {}",
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
            timing.name(),
            tflops,
            gbps,
            s.page_size
                .map_or(s.origin.to_string(), |p| format!("{} page {p}", s.origin))
                + &s.policy_suffix()
                + &versus_text
        );
        let mut line = serde_json::json!({
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
            "timing": timing.name(),
            "origin": s.origin,
        });
        if s.kind == Kind::Decode {
            let shape = decode_shape(&s, splits);
            let used = match s.dtype {
                Dtype::F16 => fa.decode_splits::<f16>(&shape),
                Dtype::Bf16 => fa.decode_splits::<bf16>(&shape),
            };
            let stages = match s.dtype {
                Dtype::F16 => fa.decode_ring_stages::<f16>(&shape),
                Dtype::Bf16 => fa.decode_ring_stages::<bf16>(&shape),
            };
            let extra = line.as_object_mut().expect("a JSON object");
            extra.insert("splits".into(), used.into());
            extra.insert("ring_stages".into(), stages.into());
        }
        if s.is_policy_row() {
            // compare-torch.py skips lines with a "policy" key (no baseline).
            let extra = line.as_object_mut().expect("a JSON object");
            extra.insert("policy".into(), s.policy.name().into());
            extra.insert("flops".into(), s.flops().into());
            if let Some((key, value, plain_ms)) = versus {
                extra.insert(key.into(), value.into());
                extra.insert("plain_ms".into(), plain_ms.into());
            }
            if s.policy == Policy::Varlen {
                extra.insert("seqlens".into(), varlen_seqlens().into());
            }
            if let Policy::Window(w) = s.policy {
                extra.insert("window_left".into(), w.left.into());
                extra.insert("window_right".into(), w.right.into());
            }
        }
        if s.page_size.is_none() {
            writeln!(json, "{line}").expect("write JSON line");
        }
    }
    println!("JSON lines written to {json_path}");
}
