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
//! (heads = 2048 / D, rounded down: D=96 runs 21 heads, hidden 2016).
//! `scripts/compare-torch.py` takes its shapes, origins and labels from the
//! JSON lines; it keeps no copy of this list.
//!
//! The `decode-graph` rows (issue 9: decode where it is launch-bound, timed as
//! servers run it) are timed with `graph` unless `--timing events` is given:
//! f16, causal (bottom-right, so new token `t` of `Sq` sees the cache up to
//! `L - Sq + t`), `Sq` = 1 and 4 new tokens, B in {1, 4, 8, 32}, cache length L
//! in {256, 1k, 4k, 16k, 64k}, heads GQA 32/8, MHA 32/32, Qwen 28/4 and SmolLM
//! 9/3 at D=128 (SmolLM: D=64) plus GQA 32/8 at D=256; the two MHA cells at
//! B=32, L=64k (34 GB of K/V) are left out. `--filter decode-graph` selects them.
//! The `decode-d192`, `decode-d96`, `decode-d64`, `decode-d64-gqa` and
//! `decode-d32` rows, timed the same way, decode one token at the head dims
//! and head counts the `decode-graph` rows lack: D = 192 (DeepSeek-V2-Lite
//! unabsorbed, 16/16 heads), D = 96 (Phi-3-mini, 32/32), D = 64 (32/32, and
//! Llama-3.2-1B's 32/8) and D = 32 (16/16); B 1, 8, 32; L 1k, 4k, 16k.
//! `--filter decode-d` selects them.
//!
//! The `model` rows are issue 11's prefill shapes: one 8k-token prompt,
//! causal, Llama-3-8B (GQA 32/8) and Qwen2.5-7B (28/4) at D=128, SmolLM
//! (9/3) at D=64 and Phi-3-mini (32/32) at D=96, f16 and bf16.
//!
//! The `seed-*` rows are the shapes of the seed reports (shared/seeds): L4,
//! RTX 3060 and A100 tables in f16, and the T4 report's SmolLM-135M (9
//! heads, D = 64, B = 1, causal) in f16 and f32: forward S = 64..1024,
//! decode cache lengths 1, 10, 50, 100, 256, 512, 1024 (and 2k, 4k in f16);
//! `--filter seed-SmolLM --timing graph` prints that report's columns (ms,
//! tokens/s, memory, max error). `scripts/compare-torch.py` skips f32 rows.
//!
//! The `small-grid` rows are batch-1 prompts on few heads (8 x 512, 4 x 2k,
//! 16 x 1k at D = 64, 128 and 256, causal and not): grids smaller than an
//! H100's SMs, which the Hopper dispatch serves with 64-row tiles. The
//! `grid-waves` rows are batch-1 causal prompts of 8k-16k keys whose grids
//! hold 4-12 waves of 128-row tiles on an H100 (8 to 24 heads at D = 128, 9
//! to 16 at D = 64): where the persistent lines' longest-first claims stop
//! paying against the non-persistent grid (`HOPPER_PERSISTENT_CAUSAL_FEW_WAVES`).
//!
//! The `tile-cost` rows (D = 64, 32 x 32 heads of 512 queries: 4096 tiles
//! of 128 rows) take 128 to 4k keys (512 is the sweep's row), so that the
//! time per tile splits into a fixed part and a part per key block (a line
//! through the rows' times).
//!
//! The `policy-*` rows (f16 unless said, ours only: no PyTorch baseline) time the mask,
//! score and sequence policies next to the plain kernel on the same shape:
//! `policy-window` (sliding windows), `policy-window-short` (windows of
//! 128-2048 keys over 8k-token prompts, Gemma 3's local layers among
//! them), `policy-gptoss` (gpt-oss-20b's D = 64 layers: 128-key window,
//! sinks), `policy-scores` (softcap, ALiBi, sinks;
//! plain and softcap also in bf16, whose capped softmax holds its max
//! fixed), `policy-gemma2` (Gemma 2 9B's and 27B's prefill, plain and
//! softcap 50, f16 and bf16),
//! `policy-varlen` (packed sequences of random lengths vs a fixed batch at the
//! mean length, D = 128, and D = 192 causal, MLA prefill's Q·K width;
//! causal also with K/V in shuffled pools of 16- and 256-token pages,
//! `forward_varlen_paged`), `policy-decode` (windowed and soft-capped decode)
//! and `policy-append` (decode steps that append their new tokens' K/V to the
//! cache first, `decode_kvcache` with `new_kv`, timed with graphs as the
//! `decode-graph` rows; the cache already holds those tokens, so the step's
//! output is the plain row's). Their
//! FLOPs count only the visible (query, key) pairs, exactly, per sequence; the
//! last column compares each with its plain row (time full/window, overhead in
//! %, or varlen/fixed TFLOP/s). Their JSON lines carry `"policy"` (`"none"`
//! for the plain reference rows), `"origin"`, `"flops"` and the comparison,
//! and `scripts/compare-torch.py` skips every line with a `"policy"` key.
//!
//! Columns besides the time (JSON keys in parentheses; every row has them):
//!
//! - `TFLOP/s` (`"tflops"`): matmul FLOPs (Q·Kᵀ and P·V, halved for causal
//!   forward, visible pairs only for policy rows) / time. `GB/s` (`"gbps"`):
//!   K and V once (decode) or Q, K, V and O once (forward) / time.
//! - `tokens/s` (`"tokens_per_s"`): query tokens / time, with query tokens =
//!   B × Sq (the varlen rows: the sum of their sequence lengths). For decode
//!   rows this is new tokens generated per second (one step of B sequences ×
//!   Sq new tokens each); for forward rows it is prefill tokens per second.
//! - `max_err` (`"max_abs_err"`): after timing, one more call on the first
//!   input copy with O poisoned with NaN; then up to 32 query rows (one head of
//!   one query token each) are copied back and compared with an f64 reference
//!   computed here, on the host, from the same (rounded) inputs: the host keeps
//!   each buffer's random tile, so it sees exactly what the device holds. The
//!   32 picks are spread evenly over the query tokens and, independently, over
//!   the heads, from (first token, head 0) to (last token, last head), a pick
//!   already taken moving on to the next (token, head) row, so the last row is
//!   always checked and no row twice; a row with fewer than 32 query rows
//!   checks all of them. The reference follows `flash_attn::reference` (bottom-right mask,
//!   windows, softcap, ALiBi, sinks, GQA, varlen sequence boundaries, the paged
//!   rows' block table); `--self-test` checks it against that module on small
//!   problems of every row kind. Every row kind is checked, none is skipped.
//!   The value is the largest |O - O_ref| over the checked elements; a
//!   non-finite element makes it `null`, with `"check_error"` naming the
//!   element, and prints `NaN!`. Also in the JSON: `"ref_max_abs"` (largest
//!   |O_ref| checked, the error's scale), `"abs_tol"` (the GPU tests' bound: 4
//!   units of the dtype's rounding, 2^-9 for f16 and 2^-6 for bf16) and
//!   `"checked_rows"`. A value above `abs_tol` prints with a `!`, and the run
//!   ends with a list of the failed rows; the exit status does not change.
//! - `mem_MB` (`"mem_bytes"`, printed in 10^6 bytes): the device memory one
//!   call of the row needs, computed from sizes: the bytes of every buffer the
//!   call reads or writes, i.e. Q, K, V and O (one copy, not the rotated
//!   ones), for decode rows the `DecodeWorkspace` as `decode_workspace`
//!   allocates it (f32 partial O and LSE of splits × B × H × Sq rows, also
//!   when splits = 1) and the cache lengths, the varlen rows' cu_seqlens, the
//!   paged rows' block table, the append rows' new K/V, and the ALiBi
//!   slopes or sink logits of those rows. No LSE: the bench asks for none
//!   (a caller asking for it adds B × H × Sq × 4 bytes). The CUDA context
//!   and the loaded module are not counted.
//! - `used_MB` (`"mem_used_delta_bytes"`): measured, not computed: the device
//!   memory in use (`cuMemGetInfo`, after a context synchronize) after the
//!   row's check call, minus the same before the row allocated anything. It
//!   includes every rotated input copy and the allocator's rounding and pool
//!   reserve, and it is a difference of two snapshots, not a peak: memory
//!   allocated and freed between them is missed. `null` (`?`) when the driver
//!   does not answer.
//!
//! Options: `--filter SUBSTR` (matches the printed shape label, which ends with
//! the policy name, e.g. `window4096`, `softcap50`, `alibi`, `sinks0.5`,
//! `varlen`; a policy row's plain reference row runs with it), `--timing
//! events|graph` (every selected row timed that way), `--quick` (fewer
//! repetitions), `--module cubin|ptx` (load the embedded cubin, the default,
//! or JIT the PTX; the first line says which was loaded and how long
//! `FlashAttention::new` took), `--forward-path auto|sm80` (on compute
//! capability 9.0, `sm80` runs every forward row on the `mma.sync` kernels
//! instead of the Hopper ones, to compare both; the first line says which),
//! `--hopper-rows 64|128|192` (forward rows on the Hopper kernels take
//! that many query rows per CTA where the head dim has such a line, instead
//! of the heuristic's choice), `--hopper-persistent on|off` (forward rows
//! on the Hopper kernels take their persistent line, where one covers them,
//! or a line of one CTA per tile, instead of the heuristic's choice),
//! `--hopper-keys 64|80|112|128` (forward rows on the Hopper kernels take
//! that many keys per block where the head dim has such a line, instead of
//! the heuristic's choice), `--tile-order dynamic|static` (persistent Hopper
//! lines claim their tiles from a counter, the default, or walk the static
//! order, to compare both), `--decode-launch programmatic|plain` (a
//! decode step's later kernels, the decode after an append and the split
//! decode's combine, as programmatic dependent launches, the default on
//! Hopper and newer, or plain ones, to compare both), `--kv-fold
//! auto|off|on` (decode rows fold pairs of adjacent KV heads where the rule
//! picks it, never, or wherever the call allows it: `KvFold`; every decode
//! JSON line records the fold used as `"kv_fold"`),
//! `--splits N` (decode rows split their keys N ways, lowered
//! to what the cache allows, instead of the heuristic's count; every decode
//! JSON line records the count used as `"splits"` and the K/V ring depth as
//! `"ring_stages"`), `--json PATH`, `--plot PATH.png` (after the run, draw
//! the JSON lines with `scripts/plot-bench.py`, which is built into the binary
//! and run as `python3 -`: TFLOP/s of the forward rows, GB/s and tokens/s of
//! the decode rows, and every row's max error; python3 with matplotlib is
//! checked before the run, and its absence exits 2 at once; a plot that fails
//! after the run exits 1, the JSON lines already written), `--list` (print the
//! selected rows' labels, FLOPs, bytes and timing and exit; needs no GPU),
//! `--self-test` (check the f64 check against `flash_attn::reference` and
//! exit; needs no GPU). Without a GPU it says so and exits 0 (no plot).
//! Every JSON line carries `"timing"`, `"origin"` and `"label"` (the printed
//! label that `--filter` matches); the paged rows are printed but not
//! written (the key set has no place for the page size).
use std::io::Write;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use flash_attn::{
    reference, AlibiSlopes, AttnElement, AttnOptions, BlockTable, DecodeStep, Dtype,
    FlashAttention, KvFold, Layout, Out, PagedVarlen, Qkv, TensorMut, TensorRef, Varlen, Window,
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
/// Decode at the head dims the `decode-graph` rows lack, timed with CUDA
/// graphs by default, one new token, at these batches and cache lengths:
/// (origin, heads, KV heads, head dim) for DeepSeek-V2-Lite's attention
/// unabsorbed (16 heads, each its own K/V of 128 + 64 columns, V padded to
/// them), Phi-3-mini, 32/32 heads and Llama-3.2-1B's 32/8 at D = 64, and
/// 16/16 heads at D = 32. The split model was fitted and checked on the
/// `decode-graph` rows (D = 64, 128, 256); these rows check it at the other
/// head dims (v67) and measure the KV-head fold (v68).
const DECODE_DIMS: [(&str, usize, usize, usize); 5] = [
    ("decode-d192", 16, 16, 192),
    ("decode-d96", 32, 32, 96),
    ("decode-d64", 32, 32, 64),
    ("decode-d64-gqa", 32, 8, 64),
    ("decode-d32", 16, 16, 32),
];
const DECODE_DIMS_BATCHES: [usize; 3] = [1, 8, 32];
const DECODE_DIMS_CACHES: [usize; 3] = [1024, 4096, 16384];
/// Decode steps with and without appending the new tokens first, timed with
/// CUDA graphs: (batch, heads, KV heads, head dim, new tokens, cache length).
const DECODE_APPEND: &str = "policy-append";
const DECODE_APPEND_SHAPES: [(usize, usize, usize, usize, usize, usize); 7] = [
    (1, 32, 8, 128, 1, 1024),
    (1, 32, 8, 128, 1, 4096),
    (1, 32, 8, 128, 1, 16384),
    (1, 32, 8, 128, 4, 1024),
    (1, 9, 3, 64, 1, 1024),
    (8, 32, 8, 128, 1, 4096),
    (32, 32, 8, 128, 1, 1024),
];
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
    /// [`Policy::Varlen`] with K/V in a page pool of pages of this many
    /// tokens (`forward_varlen_paged`: chunked prefill, here whole prompts),
    /// the pages shuffled.
    VarlenPaged(usize),
    /// A decode step that appends its `Sq` new tokens' K/V to the cache
    /// first (`decode_kvcache` with `new_kv`), as a server runs it: the
    /// append kernel, then decode (and combine). The new tokens are the
    /// cache's last `Sq` rows, so the step attends to the plain row's keys.
    Append,
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
            Policy::VarlenPaged(page) => format!("varlen-paged{page}"),
            Policy::Append => "append".into(),
        }
    }

    /// Packed sequences of [`varlen_seqlens`] lengths.
    fn is_varlen(&self) -> bool {
        matches!(self, Policy::Varlen | Policy::VarlenPaged(_))
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
    /// Graph for the `decode-graph`, `decode-d*` ([`DECODE_DIMS`]) and
    /// `policy-append` rows, else events, unless `--timing` says.
    fn timing(&self, forced: Option<Timing>) -> Timing {
        let graphed = [DECODE_GRAPH, DECODE_APPEND].contains(&self.origin)
            || DECODE_DIMS
                .iter()
                .any(|&(origin, ..)| origin == self.origin);
        forced.unwrap_or(if graphed {
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
        if self.policy.is_varlen() {
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
            let kv = 2 * k_tokens * self.kv_heads * self.head_dim * self.dtype.bytes();
            let qo = 2 * q_tokens * self.heads * self.head_dim * self.dtype.bytes();
            return match self.kind {
                Kind::Decode => kv as f64,
                Kind::Forward => (kv + qo) as f64,
            };
        }
        let kv =
            2 * self.batch * self.seqlen_k * self.kv_heads * self.head_dim * self.dtype.bytes();
        let qo = 2 * self.batch * self.seqlen_q * self.heads * self.head_dim * self.dtype.bytes();
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
    // The other compiled head dims (D = 32 runs on the Hopper lines of 64
    // with zero columns; D = 192 has its own), as the sweep.
    for head_dim in [32, 192] {
        for causal in [false, true] {
            for seqlen in [1024, 2048, 4096, 16384] {
                v.push(fwd(
                    Dtype::F16,
                    16384 / seqlen,
                    2048 / head_dim,
                    seqlen,
                    head_dim,
                    causal,
                    "head-dims",
                ));
            }
        }
    }
    // Model prefill (issue 11): Llama-3-8B (GQA 32/8) and Qwen2.5-7B (28/4)
    // at D=128, SmolLM (9/3) at D=64, Phi-3-mini (32/32) at D=96; one
    // 8k-token prompt, causal.
    for dtype in [Dtype::F16, Dtype::Bf16] {
        for (heads, kv_heads, head_dim) in [(32, 8, 128), (28, 4, 128), (9, 3, 64), (32, 32, 96)] {
            v.push(Shape {
                kv_heads,
                ..fwd(dtype, 1, heads, 8192, head_dim, true, "model")
            });
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
    // A tile's fixed cost against its per-block cost: D = 64 tiles of 512
    // queries (4096 tiles of 128 rows) over 128 to 4k keys (512: the
    // sweep's row); time per tile is about a + b * blocks.
    for seqlen_k in [128, 256, 1024, 2048, 4096] {
        v.push(Shape {
            seqlen_k,
            ..fwd(Dtype::F16, 32, 32, 512, 64, false, "tile-cost")
        });
    }
    // Batch-1 prompts on few heads: grids of at most an H100's SMs in 64-row
    // CTAs, which the Hopper dispatch gives 64-row tiles, and a larger one
    // (16 heads of 1k).
    for head_dim in [64, 128, 256] {
        for causal in [false, true] {
            for (h, s) in [(8, 512), (4, 2048), (16, 1024)] {
                v.push(fwd(Dtype::F16, 1, h, s, head_dim, causal, "small-grid"));
            }
        }
    }
    // D = 256 grids of one to three waves of 64-row CTAs (H100: 192, 256
    // and 384 of them), where the dispatch weighs split-key 64-row tiles
    // against 128-row ones.
    for causal in [false, true] {
        for (h, s) in [(12, 1024), (8, 2048), (32, 512), (24, 1024)] {
            v.push(fwd(Dtype::F16, 1, h, s, 256, causal, "small-grid"));
        }
    }
    // Causal prompts over a few waves of 128-row tiles (H100: 3.9 to 11.6).
    for (heads, seqlen, head_dim) in [
        (8, 8192, 128),
        (16, 8192, 128),
        (24, 8192, 128),
        (8, 16384, 128),
        (12, 8192, 64),
        (16, 8192, 64),
        (9, 16384, 64),
    ] {
        v.push(fwd(
            Dtype::F16,
            1,
            heads,
            seqlen,
            head_dim,
            true,
            "grid-waves",
        ));
    }
    // The T4 report (SmolLM-135M) ran f32: both dtypes.
    for dtype in [Dtype::F16, Dtype::F32] {
        for s in [64, 128, 256, 512, 1024] {
            v.push(fwd(dtype, 1, 9, s, 64, true, "seed-SmolLM"));
        }
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
    // The T4 report's cache lengths (1..1024), f16 and f32, and longer in f16.
    for dtype in [Dtype::F16, Dtype::F32] {
        for cache in [1, 10, 50, 100, 256, 512, 1024] {
            v.push(Shape {
                dtype,
                ..dec(1, 9, 9, cache, 64, "seed-SmolLM")
            });
        }
    }
    for cache in [2048, 4096] {
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
    for (origin, heads, kv_heads, head_dim) in DECODE_DIMS {
        for batch in DECODE_DIMS_BATCHES {
            for cache in DECODE_DIMS_CACHES {
                v.push(dec(batch, heads, kv_heads, cache, head_dim, origin));
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
    // gpt-oss-20b's prefill layers (64 heads over 8 KV heads, D = 64): a
    // 128-key window on alternate layers, sinks on all.
    let plain = Shape {
        kv_heads: 8,
        ..fwd(Dtype::F16, 1, 64, 4096, 64, true, "policy-gptoss")
    };
    v.extend([
        plain,
        with(plain, Policy::Window(Window::left(128))),
        with(plain, Policy::Sinks(0.5)),
    ]);
    // Short windows over 8k-token prompts: Gemma 3's local layers (1024
    // keys; 27B: 32 heads over 16 KV heads at D = 128, 12B: 16 over 8 at
    // D = 256) and a sweep of window widths at D = 32, 64, 96 (Phi-3's
    // head dim) and 128, where a tile's few key blocks make its fixed cost
    // count.
    for (heads, kv_heads, head_dim, windows) in [
        (32, 16, 128, &[1024][..]),
        (16, 8, 256, &[1024]),
        (32, 32, 32, &[128, 512, 2048]),
        (32, 32, 64, &[128, 512, 2048]),
        (32, 32, 96, &[128, 512, 2048]),
        (16, 16, 128, &[128, 512, 2048]),
    ] {
        let plain = Shape {
            kv_heads,
            ..fwd(
                Dtype::F16,
                1,
                heads,
                8192,
                head_dim,
                true,
                "policy-window-short",
            )
        };
        v.push(plain);
        v.extend(
            windows
                .iter()
                .map(|&w| with(plain, Policy::Window(Window::left(w)))),
        );
    }
    for causal in [true, false] {
        let plain = fwd(Dtype::F16, 4, 16, 4096, 128, causal, "policy-scores");
        v.push(plain);
        for policy in [Policy::Softcap(50.0), Policy::Alibi, Policy::Sinks(0.5)] {
            v.push(with(plain, policy));
        }
        // bf16: where the softcap's softmax runs without a row max (v51).
        let plain = fwd(Dtype::Bf16, 4, 16, 4096, 128, causal, "policy-scores");
        v.extend([plain, with(plain, Policy::Softcap(50.0))]);
    }
    // Gemma 2's own prefill shapes with its softcap 50: 9B (16 heads over
    // 8 KV heads, D = 256) and 27B (32 over 16, D = 128), causal.
    for (heads, kv_heads, head_dim) in [(16, 8, 256), (32, 16, 128)] {
        let plain = Shape {
            kv_heads,
            ..fwd(Dtype::F16, 2, heads, 4096, head_dim, true, "policy-gemma2")
        };
        v.extend([plain, with(plain, Policy::Softcap(50.0))]);
        let plain = Shape {
            dtype: Dtype::Bf16,
            ..plain
        };
        v.extend([plain, with(plain, Policy::Softcap(50.0))]);
    }
    let lens = varlen_seqlens();
    let mean = (lens.iter().sum::<usize>() + VARLEN_SEQS / 2) / VARLEN_SEQS;
    // D = 192 causal: the Q·K width of DeepSeek's MLA prefill.
    for (causal, head_dim) in [(true, 128), (false, 128), (true, 192)] {
        let plain = fwd(
            Dtype::F16,
            VARLEN_SEQS,
            16,
            mean,
            head_dim,
            causal,
            "policy-varlen",
        );
        v.extend([plain, with(plain, Policy::Varlen)]);
        if causal {
            // Chunked prefill's layout (vLLM's 16-token pages, and large ones).
            v.extend([16, 256].map(|page| with(plain, Policy::VarlenPaged(page))));
        }
    }
    let plain = dec(8, 32, 8, 16384, 128, "policy-decode");
    v.extend([
        plain,
        with(plain, Policy::Window(Window::left(4096))),
        with(plain, Policy::Softcap(50.0)),
    ]);
    for (batch, heads, kv_heads, head_dim, seqlen_q, cache) in DECODE_APPEND_SHAPES {
        let plain = Shape {
            seqlen_q,
            ..dec(batch, heads, kv_heads, cache, head_dim, DECODE_APPEND)
        };
        v.extend([plain, with(plain, Policy::Append)]);
    }
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
    /// `--hopper-rows N`: the forward rows' `hopper_rows`.
    hopper_rows: Option<usize>,
    /// `--hopper-persistent on|off`: the forward rows' `hopper_persistent`.
    hopper_persistent: Option<bool>,
    /// `--hopper-keys N`: the forward rows' `hopper_keys`.
    hopper_keys: Option<usize>,
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
/// the host, repeated on the device by doubling copies; with the host's view
/// of the buffer (the tile, widened exactly from `T`).
fn random_buffer<T: AttnElement>(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    n: usize,
) -> (CudaSlice<T>, Tiled) {
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
    (buf, Tiled(tile.into_iter().map(T::to_f64).collect()))
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
/// (the copies hold the same values at other addresses), with the host's view
/// of them.
fn random_sets<T: AttnElement>(
    b: &Bench,
    q_len: usize,
    kv_len: usize,
) -> (Vec<[CudaSlice<T>; 3]>, HostInputs) {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let set_bytes = (2 * q_len + 2 * kv_len) * size_of::<T>();
    let sets = ROTATE_BYTES.div_ceil(set_bytes).clamp(1, b.max_rotations());
    let [(q, q_host), (k, k_host), (v, v_host)] =
        [q_len, kv_len, kv_len].map(|n| random_buffer::<T>(&b.stream, &mut rng, n));
    let first = [q, k, v];
    let copies: Vec<_> = (1..sets)
        .map(|_| {
            first
                .each_ref()
                .map(|x| b.stream.clone_dtod(x).expect("copy"))
        })
        .collect();
    let host = HostInputs {
        q: q_host,
        k: k_host,
        v: v_host,
    };
    (std::iter::once(first).chain(copies).collect(), host)
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

/// Query rows (one head of one query token) of O each row checks against the
/// f64 reference: at most this many, spread over the tokens and heads.
const CHECK_ROWS: usize = 32;

/// The host's view of one input buffer: element `e` holds
/// `tile[e % tile.len()]`, as [`random_buffer`] fills the device buffer.
struct Tiled(Vec<f64>);

impl Tiled {
    /// Elements `start..start + out.len()`.
    fn read(&self, start: usize, out: &mut [f64]) {
        let (tile, mut filled) = (&self.0, 0);
        let mut e = start % tile.len();
        while filled < out.len() {
            let take = (tile.len() - e).min(out.len() - filled);
            out[filled..filled + take].copy_from_slice(&tile[e..e + take]);
            filled += take;
            e = 0;
        }
    }
}

/// The host's view of the first input copy.
struct HostInputs {
    q: Tiled,
    k: Tiled,
    v: Tiled,
}

/// One sequence of a checked problem: its queries are token rows
/// `q_start..q_start + sq` of Q and O, its keys rows `k_start..k_start + n`
/// of K and V (through the page table when paged).
#[derive(Clone, Copy, Debug)]
struct CheckSeq {
    q_start: usize,
    sq: usize,
    k_start: usize,
    n: usize,
}

/// A paged cache: key `j` of sequence `b` lives in token row
/// `table[b * max_pages + j / page] * page + j % page` of the pool.
struct CheckPaging {
    table: Vec<usize>,
    max_pages: usize,
    page: usize,
}

/// A row's problem as the f64 check sees it: the semantics of
/// `flash_attn::reference` (bottom-right aligned mask, softcap, then ALiBi,
/// sinks in the denominator, GQA head groups), one query row at a time.
struct CheckSpec {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
    /// The mask, `causal` folded in.
    mask: Window,
    softcap: Option<f64>,
    /// Per-head ALiBi slopes.
    alibi: Option<Vec<f64>>,
    /// Per-head sink logits.
    sinks: Option<Vec<f64>>,
    seqs: Vec<CheckSeq>,
    paging: Option<CheckPaging>,
}

/// The outcome of the f64 check of one row.
#[derive(Clone, Debug, Default)]
struct Check {
    /// Query rows checked.
    rows: usize,
    /// max |O - O_ref| over the checked elements; `None` when an element of
    /// O was not finite (unwritten or NaN).
    max_abs_err: Option<f64>,
    /// max |O_ref| over the checked elements (the error's scale).
    ref_max_abs: f64,
    /// The first non-finite element of O, described.
    nonfinite: Option<String>,
}

/// The largest |O - O_ref| the GPU tests accept (4 units of the dtype's
/// rounding at |O| <= 1; tests/gpu.rs).
fn abs_tol(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F16 => 4.0 / 2048.0,
        Dtype::Bf16 => 4.0 / 256.0,
        Dtype::F32 => 8.0 / 2048.0,
    }
}

impl CheckSpec {
    /// The problem of row `s` over `sequences` ((Sq, Skv) each, laid out one
    /// after another in Q/O and K/V, as the fixed, decode and packed layouts
    /// all are), with the row's policy and the default scale.
    fn new(s: &Shape, sequences: &[(usize, usize)]) -> CheckSpec {
        let (mut q_start, mut k_start) = (0, 0);
        let seqs = sequences
            .iter()
            .map(|&(sq, n)| {
                let seq = CheckSeq {
                    q_start,
                    sq,
                    k_start,
                    n,
                };
                q_start += sq;
                k_start += n;
                seq
            })
            .collect();
        CheckSpec {
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            scale: f64::from(1.0 / (s.head_dim as f32).sqrt()),
            mask: s.window().effective(s.causal),
            softcap: match s.policy {
                Policy::Softcap(c) => Some(f64::from(c)),
                _ => None,
            },
            alibi: (s.policy == Policy::Alibi)
                .then(|| alibi_slopes(s.heads).into_iter().map(f64::from).collect()),
            sinks: match s.policy {
                Policy::Sinks(x) => Some(vec![f64::from(x); s.heads]),
                _ => None,
            },
            seqs,
            paging: None,
        }
    }

    /// The checked rows as (sequence, query, head), in order: [`CHECK_ROWS`]
    /// (or every row, if fewer) spread evenly over the query tokens and,
    /// independently, over the heads, from (first token, head 0) to (last
    /// token, last head); a pick already taken moves to the next free row.
    fn sample_rows(&self) -> Vec<(usize, usize, usize)> {
        let tokens: usize = self.seqs.iter().map(|q| q.sq).sum();
        let all = tokens * self.heads;
        let n = all.min(CHECK_ROWS);
        let spread = |k: usize, len: usize| {
            if n > 1 {
                k * (len - 1) / (n - 1)
            } else {
                len - 1
            }
        };
        // Rows as token * heads + head.
        let mut picked: Vec<usize> = Vec::with_capacity(n);
        for k in 0..n {
            let mut r = spread(k, tokens) * self.heads + spread(k, self.heads);
            while picked.contains(&r) {
                r = (r + 1) % all;
            }
            picked.push(r);
        }
        picked.sort_unstable();
        picked
            .into_iter()
            .map(|r| {
                let mut t = r / self.heads;
                let seq = self
                    .seqs
                    .iter()
                    .position(|q| {
                        let inside = t < q.sq;
                        if !inside {
                            t -= q.sq;
                        }
                        inside
                    })
                    .expect("a token of some sequence");
                (seq, t, r % self.heads)
            })
            .collect()
    }

    /// Token row of K/V that holds key `j` of sequence `seq`.
    fn key_row(&self, seq: usize, j: usize) -> usize {
        match &self.paging {
            None => self.seqs[seq].k_start + j,
            Some(p) => p.table[seq * p.max_pages + j / p.page] * p.page + j % p.page,
        }
    }

    /// The f64 reference of O for query `i` of sequence `seq`, head `h`:
    /// `flash_attn::reference`'s row, with Q, K and V read from the host's
    /// view of the inputs on demand (a long cache is never widened whole).
    fn reference_row(&self, x: &HostInputs, seq: usize, i: usize, h: usize) -> Vec<f64> {
        let d = self.head_dim;
        let q_seq = self.seqs[seq];
        let kv_head = h / (self.heads / self.kv_heads);
        let kv_start = |j: usize| (self.key_row(seq, j) * self.kv_heads + kv_head) * d;
        let mut q = vec![0.0; d];
        x.q.read(((q_seq.q_start + i) * self.heads + h) * d, &mut q);
        let spec = reference::RowSpec {
            window: self.mask,
            scale: self.scale,
            softcap: self.softcap,
            alibi_slope: self.alibi.as_ref().map(|s| s[h]),
            sink: self.sinks.as_ref().map(|s| s[h]),
            query: i,
            seqlen_q: q_seq.sq,
            seqlen_k: q_seq.n,
        };
        let key = |j: usize, buf: &mut [f64]| x.k.read(kv_start(j), buf);
        let value = |j: usize, buf: &mut [f64]| x.v.read(kv_start(j), buf);
        reference::output_row(&spec, &q, key, value, d).0
    }

    /// Compares `got(token row, head)` (one row of O, D values) with the
    /// reference on the sampled rows (computed on every core: a row of a
    /// 64k-key cache at D=256 costs about 50 ms on one).
    fn check(&self, x: &HostInputs, mut got: impl FnMut(usize, usize) -> Vec<f64>) -> Check {
        let rows = self.sample_rows();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let want: Vec<Vec<f64>> = std::thread::scope(|scope| {
            let workers: Vec<_> = rows
                .chunks(rows.len().div_ceil(threads).max(1))
                .map(|chunk| {
                    scope.spawn(move || {
                        chunk
                            .iter()
                            .map(|&(seq, i, h)| self.reference_row(x, seq, i, h))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().expect("a reference thread"))
                .collect()
        });
        let mut c = Check {
            max_abs_err: Some(0.0),
            ..Check::default()
        };
        for (&(seq, i, h), want) in rows.iter().zip(&want) {
            let token = self.seqs[seq].q_start + i;
            let have = got(token, h);
            c.rows += 1;
            for (e, (&g, &w)) in have.iter().zip(want).enumerate() {
                c.ref_max_abs = c.ref_max_abs.max(w.abs());
                if !g.is_finite() {
                    c.max_abs_err = None;
                    c.nonfinite.get_or_insert_with(|| {
                        format!("O[token {token}, head {h}, {e}] = {g}, want {w:.4e}")
                    });
                } else if let Some(m) = c.max_abs_err.as_mut() {
                    *m = m.max((g - w).abs());
                }
            }
        }
        c
    }
}

/// Per-head ALiBi slopes 2^(-8(h+1)/H), as the `alibi` rows upload them.
fn alibi_slopes(heads: usize) -> Vec<f32> {
    (0..heads)
        .map(|h| (-8.0 * (h + 1) as f32 / heads as f32).exp2())
        .collect()
}

/// Free device memory after the queued work (and the frees it lets the
/// stream-ordered allocator return) has finished; `None` if the driver says
/// nothing.
fn free_device_memory(stream: &Arc<CudaStream>) -> Option<usize> {
    let ctx = stream.context();
    ctx.synchronize().ok()?;
    ctx.mem_get_info().ok().map(|(free, _)| free)
}

/// What one row measured.
struct Measured {
    /// Median milliseconds per launch.
    ms: f64,
    /// The f64 check of sampled rows of O from one launch.
    check: Check,
    /// Bytes of the device buffers one call reads or writes (module docs).
    mem_bytes: usize,
    /// Device memory in use (`cuMemGetInfo`) after the row's check launch,
    /// minus in use before the row allocated anything.
    mem_used_delta: Option<i64>,
}

impl Measured {
    fn new(
        b: &Bench,
        ms: f64,
        check: Check,
        mem_bytes: usize,
        free_before: Option<usize>,
    ) -> Measured {
        let free_after = free_device_memory(&b.stream);
        Measured {
            ms,
            check,
            mem_bytes,
            mem_used_delta: free_before
                .zip(free_after)
                .map(|(before, after)| before as i64 - after as i64),
        }
    }
}

/// Bytes of the decode workspace [`FlashAttention::decode_workspace`]
/// allocates for a decode row (f32 partial O and LSE per split and row).
fn workspace_bytes<T: AttnElement>(b: &Bench, s: &Shape) -> usize {
    let rows = b.fa.decode_splits::<T>(&decode_shape(s, b.splits)) * s.batch * s.heads * s.seqlen_q;
    ((rows * s.head_dim).max(1) + rows.max(1)) * 4
}

/// Poisons `o` with NaN, runs `launch` (one call on the first input copy,
/// writing `o`), and checks the sampled rows of `o` against the f64
/// reference of the host's view of the inputs.
fn check_output<T: AttnElement>(
    b: &Bench,
    spec: &CheckSpec,
    host: &HostInputs,
    o: &mut CudaSlice<T>,
    launch: impl FnOnce(&mut CudaSlice<T>),
) -> Check {
    let nan = vec![T::from_f64(f64::NAN); o.len()];
    b.stream.memcpy_htod(&nan, o).expect("poison O");
    launch(o);
    let d = spec.head_dim;
    spec.check(host, |row, h| {
        let start = (row * spec.heads + h) * d;
        b.stream
            .clone_dtoh(&o.slice(start..start + d))
            .expect("download O")
            .into_iter()
            .map(T::to_f64)
            .collect()
    })
}

fn run_shape<T: AttnElement>(b: &Bench, s: &Shape) -> Measured {
    let free_before = free_device_memory(&b.stream);
    let q_layout = Layout::contiguous([s.batch, s.seqlen_q, s.heads, s.head_dim]);
    let kv_layout = Layout::contiguous([s.batch, s.seqlen_k, s.kv_heads, s.head_dim]);
    let q_len = s.batch * s.seqlen_q * s.heads * s.head_dim;
    let kv_len = s.batch * s.seqlen_k * s.kv_heads * s.head_dim;
    // Policy parameters: ALiBi slopes and sink logits, per head.
    let slopes = b.stream.clone_htod(&alibi_slopes(s.heads)).expect("upload");
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
        // Only the forward takes it (decode refuses it).
        hopper_rows: if s.kind == Kind::Forward {
            b.hopper_rows
        } else {
            None
        },
        hopper_persistent: if s.kind == Kind::Forward {
            b.hopper_persistent
        } else {
            None
        },
        hopper_keys: if s.kind == Kind::Forward {
            b.hopper_keys
        } else {
            None
        },
    };
    // What a call reads besides Q, K, V and O: the policy's per-head array.
    let policy_bytes = match s.policy {
        Policy::Alibi | Policy::Sinks(_) => s.heads * 4,
        _ => 0,
    };
    if s.policy.is_varlen() {
        return run_varlen::<T>(b, s, &opts, policy_bytes, free_before);
    }
    let (inputs, host) = random_sets::<T>(b, q_len, kv_len);
    let sets = inputs.len();
    let mut o = b.stream.alloc_zeros::<T>(q_len).expect("alloc");
    let seqlens = b
        .stream
        .clone_htod(&vec![s.seqlen_k as i32; s.batch])
        .expect("upload");
    let mut workspace = None;
    let mut mem_bytes = (2 * q_len + 2 * kv_len) * size_of::<T>() + policy_bytes;
    if s.kind == Kind::Decode {
        workspace = Some(
            b.fa.decode_workspace::<T>(&b.stream, &decode_shape(s, b.splits))
                .expect("workspace"),
        );
        mem_bytes += workspace_bytes::<T>(b, s) + s.batch * 4;
    }
    if let Some(page) = s.page_size {
        return run_paged::<T>(
            b,
            s,
            page,
            (inputs, host),
            o,
            seqlens,
            workspace,
            (mem_bytes, free_before),
        );
    }
    if s.policy == Policy::Append {
        return run_append::<T>(b, s, (inputs, host), o, workspace, (mem_bytes, free_before));
    }
    // Decode rows pass a preallocated workspace: graph capture cannot allocate.
    let mut call = |[q, k, v]: &[CudaSlice<T>; 3], o: &mut CudaSlice<T>| {
        let q = TensorRef::new(q.as_view(), q_layout);
        let k = TensorRef::new(k.as_view(), kv_layout);
        let v = TensorRef::new(v.as_view(), kv_layout);
        let qkv = Qkv {
            q: &q,
            k: &k,
            v: &v,
        };
        let out = Out::new(TensorMut::new(o.as_view_mut(), q_layout));
        match s.kind {
            Kind::Forward => b.fa.forward(&b.stream, qkv, out, &opts),
            Kind::Decode => b.fa.decode(
                &b.stream,
                qkv,
                &seqlens.as_view(),
                out,
                &opts,
                workspace.as_mut(),
            ),
        }
        .expect("launch");
    };
    let ms = b.time(sets, |i| call(&inputs[i % sets], &mut o));
    let spec = CheckSpec::new(s, &s.sequences());
    let check = check_output(b, &spec, &host, &mut o, |o| call(&inputs[0], o));
    Measured::new(b, ms, check, mem_bytes, free_before)
}

/// Forward over [`varlen_seqlens`] packed as [total, H, D] (Q, K and V share
/// the sequence boundaries).
fn run_varlen<T: AttnElement>(
    b: &Bench,
    s: &Shape,
    opts: &AttnOptions,
    policy_bytes: usize,
    free_before: Option<usize>,
) -> Measured {
    let lens = varlen_seqlens();
    let total: usize = lens.iter().sum();
    let cu: Vec<i32> = std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &l| {
            *acc += l as i32;
            Some(*acc)
        }))
        .collect();
    let cu_bytes = cu.len() * 4;
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
    let (q_len, kv_len) = (
        total * s.heads * s.head_dim,
        total * s.kv_heads * s.head_dim,
    );
    let (inputs, host) = random_sets::<T>(b, q_len, kv_len);
    let sets = inputs.len();
    let mut o = b.stream.alloc_zeros::<T>(q_len).expect("alloc");
    if let Policy::VarlenPaged(page) = s.policy {
        let paged = PagedPools::new(b, &inputs[0], &lens, page, s.kv_heads * s.head_dim);
        let seqlens_k = b
            .stream
            .clone_htod(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>());
        let seqlens_k = seqlens_k.expect("upload");
        let (sk, table) = (seqlens_k.as_view(), paged.table.as_view());
        let block_table = BlockTable {
            table,
            max_pages: paged.max_pages,
        };
        let seqs = PagedVarlen {
            cu_seqlens_q: &cu,
            max_seqlen_q: max,
            seqlens_k: &sk,
            block_table: &block_table,
        };
        let pool = Layout::contiguous([paged.num_pages, page, s.kv_heads, s.head_dim]);
        let call = |q: &CudaSlice<T>, o: &mut CudaSlice<T>| {
            b.fa.forward_varlen_paged(
                &b.stream,
                Qkv {
                    q: &TensorRef::new(q.as_view(), q_layout),
                    k: &TensorRef::new(paged.k.as_view(), pool),
                    v: &TensorRef::new(paged.v.as_view(), pool),
                },
                Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
                &seqs,
                opts,
            )
            .expect("launch");
        };
        let ms = b.time(sets, |i| call(&inputs[i % sets][0], &mut o));
        let spec = CheckSpec::new(s, &s.sequences());
        let check = check_output(b, &spec, &host, &mut o, |o| call(&inputs[0][0], o));
        let pool_len = paged.num_pages * page * s.kv_heads * s.head_dim;
        let mem_bytes = (2 * q_len + 2 * pool_len) * size_of::<T>()
            + cu_bytes
            + paged.table.len() * 4
            + lens.len() * 4
            + policy_bytes;
        return Measured::new(b, ms, check, mem_bytes, free_before);
    }
    let call = |[q, k, v]: &[CudaSlice<T>; 3], o: &mut CudaSlice<T>| {
        b.fa.forward_varlen(
            &b.stream,
            Qkv {
                q: &TensorRef::new(q.as_view(), q_layout),
                k: &TensorRef::new(k.as_view(), kv_layout),
                v: &TensorRef::new(v.as_view(), kv_layout),
            },
            Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
            &seqlens,
            opts,
        )
        .expect("launch");
    };
    let ms = b.time(sets, |i| call(&inputs[i % sets], &mut o));
    let spec = CheckSpec::new(s, &s.sequences());
    let check = check_output(b, &spec, &host, &mut o, |o| call(&inputs[0], o));
    let mem_bytes = (2 * q_len + 2 * kv_len) * size_of::<T>() + cu_bytes + policy_bytes;
    Measured::new(b, ms, check, mem_bytes, free_before)
}

/// The K/V of packed sequences copied into page pools, each sequence's
/// pages a shuffled run of pool pages: its token `t` at row `t % page` of
/// page `table[b][t / page]`. The pools hold the same K/V rows as the
/// packed tensors, so the packed reference checks a paged call.
struct PagedPools<T> {
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    table: CudaSlice<i32>,
    max_pages: usize,
    num_pages: usize,
}

impl<T: AttnElement> PagedPools<T> {
    fn new(
        b: &Bench,
        [_, k, v]: &[CudaSlice<T>; 3],
        lens: &[usize],
        page: usize,
        row: usize,
    ) -> Self {
        let pages: Vec<usize> = lens.iter().map(|l| l.div_ceil(page)).collect();
        let max_pages = pages.iter().copied().max().unwrap_or(1).max(1);
        let num_pages = pages.iter().sum::<usize>().max(1);
        let mut order: Vec<i32> = (0..num_pages as i32).collect();
        let mut rng = StdRng::seed_from_u64(0x9a9e);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let mut table = vec![0i32; lens.len() * max_pages];
        let mut next = order.into_iter();
        for (seq, &n) in pages.iter().enumerate() {
            for p in 0..n {
                table[seq * max_pages + p] = next.next().expect("a page per slot");
            }
        }
        let copy = |src: &CudaSlice<T>| {
            let mut pool = b
                .stream
                .alloc_zeros::<T>(num_pages * page * row)
                .expect("alloc");
            let mut start = 0;
            for (seq, &len) in lens.iter().enumerate() {
                for p in 0..pages[seq] {
                    let slot = table[seq * max_pages + p] as usize;
                    let rows = (len - p * page).min(page);
                    let from = (start + p * page) * row;
                    let to = slot * page * row;
                    b.stream
                        .memcpy_dtod(
                            &src.slice(from..from + rows * row),
                            &mut pool.slice_mut(to..to + rows * row),
                        )
                        .expect("copy");
                }
                start += len;
            }
            pool
        };
        let (k, v) = (copy(k), copy(v));
        let table = b.stream.clone_htod(&table).expect("upload");
        PagedPools {
            k,
            v,
            table,
            max_pages,
            num_pages,
        }
    }
}

/// A decode step through [`FlashAttention::decode_kvcache`] that appends
/// the last `Sq` tokens of each cache (copied out of it beforehand) to the
/// cache whose lengths stop before them, then attends: what the step reads
/// and computes is the plain decode row's, plus the append.
fn run_append<T: AttnElement>(
    b: &Bench,
    s: &Shape,
    (mut inputs, host): (Vec<[CudaSlice<T>; 3]>, HostInputs),
    mut o: CudaSlice<T>,
    mut workspace: Option<flash_attn::DecodeWorkspace>,
    (mem_bytes, free_before): (usize, Option<usize>),
) -> Measured {
    let sets = inputs.len();
    let row = s.kv_heads * s.head_dim;
    let tail = s.seqlen_q * row;
    let new_kv: Vec<[CudaSlice<T>; 2]> = inputs
        .iter()
        .map(|[_, k, v]| {
            [k, v].map(|src| {
                let mut new = b.stream.alloc_zeros::<T>(s.batch * tail).expect("alloc");
                for seq in 0..s.batch {
                    let from = (seq * s.seqlen_k + s.seqlen_k - s.seqlen_q) * row;
                    b.stream
                        .memcpy_dtod(
                            &src.slice(from..from + tail),
                            &mut new.slice_mut(seq * tail..(seq + 1) * tail),
                        )
                        .expect("copy");
                }
                new
            })
        })
        .collect();
    let seqlens = b
        .stream
        .clone_htod(&vec![(s.seqlen_k - s.seqlen_q) as i32; s.batch])
        .expect("upload");
    let q_layout = Layout::contiguous([s.batch, s.seqlen_q, s.heads, s.head_dim]);
    let kv_layout = Layout::contiguous([s.batch, s.seqlen_k, s.kv_heads, s.head_dim]);
    let new_layout = Layout::contiguous([s.batch, s.seqlen_q, s.kv_heads, s.head_dim]);
    let opts = AttnOptions {
        causal: s.causal,
        softmax_scale: None,
        num_splits: b.splits,
        ..Default::default()
    };
    let mut call = |[q, k, v]: &mut [CudaSlice<T>; 3],
                    [k_new, v_new]: &[CudaSlice<T>; 2],
                    o: &mut CudaSlice<T>| {
        let mut cache = flash_attn::KvCache {
            k: TensorMut::new(k.as_view_mut(), kv_layout),
            v: TensorMut::new(v.as_view_mut(), kv_layout),
            seqlens: seqlens.as_view(),
            block_table: None,
        };
        b.fa.decode_kvcache(
            &b.stream,
            DecodeStep {
                q: &TensorRef::new(q.as_view(), q_layout),
                new_kv: Some((
                    &TensorRef::new(k_new.as_view(), new_layout),
                    &TensorRef::new(v_new.as_view(), new_layout),
                )),
            },
            &mut cache,
            Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
            &opts,
            workspace.as_mut(),
        )
        .expect("launch");
    };
    let ms = b.time(sets, |i| {
        call(&mut inputs[i % sets], &new_kv[i % sets], &mut o)
    });
    let spec = CheckSpec::new(s, &s.sequences());
    let check = check_output(b, &spec, &host, &mut o, |o| {
        call(&mut inputs[0], &new_kv[0], o)
    });
    let mem_bytes = mem_bytes + 2 * s.batch * tail * size_of::<T>();
    Measured::new(b, ms, check, mem_bytes, free_before)
}

/// Decode through [`FlashAttention::decode_kvcache`] from a page pool: the
/// inputs' K/V buffers are read as [B * L / page, page, Hkv, D] pools with a
/// shuffled block table. `mem` is the other buffers' bytes and the free
/// memory before the row.
#[allow(clippy::too_many_arguments)]
fn run_paged<T: AttnElement>(
    b: &Bench,
    s: &Shape,
    page: usize,
    (mut inputs, host): (Vec<[CudaSlice<T>; 3]>, HostInputs),
    mut o: CudaSlice<T>,
    seqlens: CudaSlice<i32>,
    mut workspace: Option<flash_attn::DecodeWorkspace>,
    (mem_bytes, free_before): (usize, Option<usize>),
) -> Measured {
    let sets = inputs.len();
    let max_pages = s.seqlen_k.div_ceil(page);
    let num_pages = s.batch * max_pages;
    let mut rng = StdRng::seed_from_u64(0x9a9e);
    let mut table: Vec<i32> = (0..num_pages as i32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.random_range(0..=i));
    }
    let mut spec = CheckSpec::new(s, &s.sequences());
    spec.paging = Some(CheckPaging {
        table: table.iter().map(|&p| p as usize).collect(),
        max_pages,
        page,
    });
    let table = b.stream.clone_htod(&table).expect("upload");
    let q_layout = Layout::contiguous([s.batch, s.seqlen_q, s.heads, s.head_dim]);
    let pool = Layout::contiguous([num_pages, page, s.kv_heads, s.head_dim]);
    let opts = AttnOptions {
        causal: s.causal,
        softmax_scale: None,
        num_splits: b.splits,
        ..Default::default()
    };
    let mut call = |[q, k, v]: &mut [CudaSlice<T>; 3], o: &mut CudaSlice<T>| {
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
            DecodeStep {
                q: &TensorRef::new(q.as_view(), q_layout),
                new_kv: None,
            },
            &mut cache,
            Out::new(TensorMut::new(o.as_view_mut(), q_layout)),
            &opts,
            workspace.as_mut(),
        )
        .expect("launch");
    };
    let ms = b.time(sets, |i| call(&mut inputs[i % sets], &mut o));
    let check = check_output(b, &spec, &host, &mut o, |o| call(&mut inputs[0], o));
    let mem_bytes = mem_bytes + num_pages * 4;
    Measured::new(b, ms, check, mem_bytes, free_before)
}

/// `--self-test` (no GPU): the f64 check's row helper against
/// `flash_attn::reference` on small problems of every row kind, its row
/// sampling, and its verdicts on a good and a poisoned output.
fn self_test() {
    use flash_attn::reference::Extras;
    use flash_attn::validate::{DecodeShape, ForwardShape, VarlenShape};
    // A tile shorter than the buffers and not a multiple of D, so that rows
    // wrap around it as they do on the device.
    const TILE: usize = 997;
    let base = Shape {
        kind: Kind::Forward,
        dtype: Dtype::F16,
        batch: 2,
        heads: 4,
        kv_heads: 2,
        seqlen_q: 9,
        seqlen_k: 9,
        head_dim: 32,
        causal: false,
        page_size: None,
        origin: "self-test",
        policy: Policy::None,
    };
    let decode = Shape {
        kind: Kind::Decode,
        seqlen_q: 4,
        seqlen_k: 40,
        causal: true,
        ..base
    };
    let with = |s: Shape, policy| Shape { policy, ..s };
    let cases = [
        base,
        Shape {
            causal: true,
            ..base
        },
        // More queries than keys: the first rows see nothing (O = 0).
        Shape {
            causal: true,
            seqlen_q: 12,
            seqlen_k: 5,
            ..base
        },
        Shape {
            seqlen_q: 5,
            seqlen_k: 11,
            ..base
        },
        with(
            base,
            Policy::Window(Window {
                left: Some(3),
                right: Some(2),
            }),
        ),
        with(
            Shape {
                causal: true,
                ..base
            },
            Policy::Window(Window::left(3)),
        ),
        with(base, Policy::Softcap(0.5)),
        with(
            Shape {
                causal: true,
                ..base
            },
            Policy::Alibi,
        ),
        with(base, Policy::Sinks(0.5)),
        with(
            Shape {
                causal: true,
                seqlen_q: 12,
                seqlen_k: 5,
                ..base
            },
            Policy::Sinks(0.5),
        ),
        with(
            Shape {
                causal: true,
                ..base
            },
            Policy::Varlen,
        ),
        with(base, Policy::Varlen),
        decode,
        Shape {
            seqlen_q: 1,
            heads: 8,
            ..decode
        },
        with(decode, Policy::Window(Window::left(7))),
        with(decode, Policy::Softcap(0.5)),
        Shape {
            page_size: Some(4),
            ..decode
        },
    ];
    let mut rng = StdRng::seed_from_u64(0x7e57);
    for s in cases {
        let what = format!("{} ({:?})", s.label(), s.kind);
        // Varlen: short sequences of other lengths (one empty) instead of the bench's.
        let sequences = if s.policy == Policy::Varlen {
            vec![(3, 3), (0, 0), (7, 7), (5, 5)]
        } else {
            s.sequences()
        };
        let mut spec = CheckSpec::new(&s, &sequences);
        let tokens: usize = sequences.iter().map(|q| q.0).sum();
        let keys: usize = sequences.iter().map(|q| q.1).sum();
        let mut tiled = |n: usize| {
            Tiled(
                (0..n.min(TILE))
                    .map(|_| f16::from_f64(rng.random_range(-1.0..1.0)).to_f64())
                    .collect(),
            )
        };
        let (q_len, kv_len) = (
            tokens * s.heads * s.head_dim,
            keys * s.kv_heads * s.head_dim,
        );
        let x = HostInputs {
            q: tiled(q_len),
            k: tiled(kv_len),
            v: tiled(kv_len),
        };
        let full = |t: &Tiled, n: usize| {
            let mut v = vec![0.0; n];
            t.read(0, &mut v);
            v
        };
        let (q, mut k, mut v) = (full(&x.q, q_len), full(&x.k, kv_len), full(&x.v, kv_len));
        if let Some(page) = s.page_size {
            // The pool holds the cache's keys in shuffled pages; the reference
            // reads the cache in order.
            let max_pages = s.seqlen_k.div_ceil(page);
            let mut table: Vec<usize> = (0..s.batch * max_pages).collect();
            for i in (1..table.len()).rev() {
                table.swap(i, rng.random_range(0..=i));
            }
            let (pool_k, pool_v) = (k.clone(), v.clone());
            let row = s.kv_heads * s.head_dim;
            for b in 0..s.batch {
                for j in 0..s.seqlen_k {
                    let at = table[b * max_pages + j / page] * page + j % page;
                    let logical = (b * s.seqlen_k + j) * row;
                    k[logical..logical + row].copy_from_slice(&pool_k[at * row..(at + 1) * row]);
                    v[logical..logical + row].copy_from_slice(&pool_v[at * row..(at + 1) * row]);
                }
            }
            spec.paging = Some(CheckPaging {
                table,
                max_pages,
                page,
            });
        }
        let slopes = spec.alibi.clone();
        let extras = Extras {
            alibi_slopes: slopes.as_deref(),
            sinks: spec.sinks.as_deref(),
        };
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let softcap = spec.softcap.map(|c| c as f32);
        let want = if s.policy == Policy::Varlen {
            let cu: Vec<i32> = std::iter::once(0)
                .chain(sequences.iter().scan(0, |acc, q| {
                    *acc += q.0 as i32;
                    Some(*acc)
                }))
                .collect();
            let shape = VarlenShape {
                batch: sequences.len(),
                total_q: tokens,
                total_k: keys,
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                causal: s.causal,
                softmax_scale: scale,
                window: s.window(),
                softcap,
                ..Default::default()
            };
            reference::varlen(&shape, &cu, &cu, &q, &k, &v, &extras)
        } else if s.kind == Kind::Decode {
            let shape = DecodeShape {
                cache_len: s.seqlen_k,
                ..decode_shape(&s, None)
            };
            let seqlens = vec![s.seqlen_k as i32; s.batch];
            reference::decode_ext(&shape, &q, &k, &v, &seqlens, &extras)
        } else {
            let shape = ForwardShape {
                batch: s.batch,
                seqlen_q: s.seqlen_q,
                seqlen_k: s.seqlen_k,
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                v_head_dim: 0,
                causal: s.causal,
                softmax_scale: scale,
                window: s.window(),
                softcap,
            };
            reference::attention_ext(&shape, &q, &k, &v, &extras)
        };
        // Every row of the problem: the helper agrees with the library's reference.
        let d = s.head_dim;
        let want_row = |token: usize, h: usize| {
            let at = (token * s.heads + h) * d;
            want.o[at..at + d].to_vec()
        };
        for (seq, q_seq) in spec.seqs.iter().enumerate() {
            for i in 0..q_seq.sq {
                for h in 0..s.heads {
                    let mine = spec.reference_row(&x, seq, i, h);
                    let theirs = want_row(q_seq.q_start + i, h);
                    let err = mine
                        .iter()
                        .zip(&theirs)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f64::max);
                    assert!(
                        err < 1e-12,
                        "{what}: row (seq {seq}, query {i}, head {h}) differs by {err:e}"
                    );
                }
            }
        }
        // The sample: distinct rows in order, at most CHECK_ROWS, the last row included.
        let rows = spec.sample_rows();
        assert!(
            !rows.is_empty() && rows.len() <= CHECK_ROWS,
            "{what}: {rows:?}"
        );
        assert!(rows.windows(2).all(|w| w[0] < w[1]), "{what}: {rows:?}");
        let last_seq = spec.seqs.iter().rposition(|q| q.sq > 0).expect("a query");
        assert_eq!(
            rows.last(),
            Some(&(last_seq, spec.seqs[last_seq].sq - 1, s.heads - 1)),
            "{what}"
        );
        // Verdicts: the reference rounded to f16 passes, a NaN is caught.
        let good = spec.check(&x, |token, h| {
            want_row(token, h)
                .into_iter()
                .map(|w| f16::from_f64(w).to_f64())
                .collect()
        });
        let err = good.max_abs_err.expect("finite");
        assert!(
            err <= 1.0 / 2048.0 && good.rows == rows.len(),
            "{what}: {good:?}"
        );
        let bad = spec.check(&x, |token, h| {
            let mut o = want_row(token, h);
            if token == tokens - 1 {
                o[d - 1] = f64::NAN;
            }
            o
        });
        assert!(
            bad.max_abs_err.is_none() && bad.nonfinite.is_some(),
            "{what}: {bad:?}"
        );
    }
    // Every bench row's sample: CHECK_ROWS rows (or all), its last row included.
    for s in shapes() {
        let spec = CheckSpec::new(&s, &s.sequences());
        let rows = spec.sample_rows();
        let last = spec.seqs.len() - 1;
        let all_rows = spec.seqs.iter().map(|q| q.sq).sum::<usize>() * s.heads;
        assert_eq!(rows.len(), all_rows.min(CHECK_ROWS), "{}", s.label());
        assert_eq!(
            rows.last(),
            Some(&(last, spec.seqs[last].sq - 1, s.heads - 1)),
            "{}",
            s.label()
        );
    }
    println!(
        "self-test passed: the f64 check agrees with flash_attn::reference on {} problems \
         (forward, causal, windows, softcap, ALiBi, sinks, varlen, decode, paged decode)",
        cases.len()
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    // A flag of two words: true for `default` (also when absent), false for `other`.
    let either = |flag: &str, default: &str, other: &str| match value_of(flag).as_deref() {
        None => true,
        Some(w) if w == default => true,
        Some(w) if w == other => false,
        Some(w) => {
            eprintln!("{flag} wants {default} or {other}, not {w:?}");
            std::process::exit(2);
        }
    };
    if args.iter().any(|a| a == "--self-test") {
        self_test();
        return;
    }
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
    let hopper_rows = value_of("--hopper-rows").map(|n| match n.parse::<usize>() {
        Ok(n @ (64 | 128 | 192)) => n,
        _ => {
            eprintln!("--hopper-rows wants 64, 128 or 192, not {n:?}");
            std::process::exit(2);
        }
    });
    let hopper_persistent = match value_of("--hopper-persistent").as_deref() {
        None => None,
        Some("on") => Some(true),
        Some("off") => Some(false),
        Some(other) => {
            eprintln!("--hopper-persistent wants on or off, not {other:?}");
            std::process::exit(2);
        }
    };
    let hopper_keys = value_of("--hopper-keys").map(|n| match n.parse::<usize>() {
        Ok(n @ (64 | 80 | 112 | 128)) => n,
        _ => {
            eprintln!("--hopper-keys wants 64, 80, 112 or 128, not {n:?}");
            std::process::exit(2);
        }
    });
    let hopper_forward = either("--forward-path", "auto", "sm80");
    let static_tiles = !either("--tile-order", "dynamic", "static");
    let programmatic_launch = either("--decode-launch", "programmatic", "plain");
    let kv_fold = match value_of("--kv-fold").as_deref() {
        None | Some("auto") => KvFold::Auto,
        Some("off") => KvFold::Off,
        Some("on") => KvFold::On,
        Some(w) => {
            eprintln!("--kv-fold wants auto, off or on, not {w:?}");
            std::process::exit(2);
        }
    };
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
    let plot_path = value_of("--plot");

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

    if plot_path.is_some() {
        // Before the run, not after it: a missing matplotlib should cost seconds.
        if let Err(e) = run_python(&["-c", "import matplotlib"], true) {
            eprintln!("--plot needs python3 with matplotlib (pip install matplotlib): {e}");
            std::process::exit(2);
        }
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
    fa.set_hopper_forward(hopper_forward);
    fa.set_static_tile_order(static_tiles);
    fa.set_programmatic_launch(programmatic_launch);
    fa.set_kv_fold(kv_fold);
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
            hopper_rows,
            hopper_persistent,
            hopper_keys,
        }
    };
    println!(
        "device: {} (sm_{}{}, {} SMs), PTX from {}, loaded {:?} in {load_ms:.0} ms, forward on {}, {} decode launches, KV heads folded: {:?}",
        ctx.name().unwrap_or_default(),
        fa.compute_capability().0,
        fa.compute_capability().1,
        fa.num_sms(),
        flash_attn::PTX_SOURCE,
        fa.loaded_code(),
        if fa.hopper_forward() {
            "the Hopper kernels where they cover the row (wgmma + TMA)"
        } else {
            "the mma.sync kernels"
        },
        if fa.programmatic_launch() {
            "programmatic"
        } else {
            "plain"
        },
        fa.kv_fold()
    );
    if let Some(dir) = std::path::Path::new(&json_path).parent() {
        std::fs::create_dir_all(dir).ok();
    }
    let mut json = std::fs::File::create(&json_path).expect("create the JSON-lines file");

    println!(
        "{:<8} {:<5} {:>3} {:>3} {:>4} {:>6} {:>6} {:>4} {:>6} {:>10} {:>6} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8}  origin",
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
        "GB/s",
        "tokens/s",
        "max_err",
        "mem_MB",
        "used_MB"
    );
    // Rows whose check failed: (label, what).
    let mut failed_checks: Vec<(String, String)> = Vec::new();
    let mut checked_rows = 0;
    // Plain reference rows of the policy rows measured so far: (shape, ms, TFLOP/s).
    let mut plain_rows: Vec<(Shape, f64, f64)> = Vec::new();
    for s in selected {
        let is_reference = s.is_policy_row() && s.policy == Policy::None;
        let timing = timing_of(&s);
        let bench = bench_for(timing);
        let m = match s.dtype {
            Dtype::F16 => run_shape::<f16>(&bench, &s),
            Dtype::Bf16 => run_shape::<bf16>(&bench, &s),
            Dtype::F32 => run_shape::<f32>(&bench, &s),
        };
        let ms = m.ms;
        let tflops = s.flops() / (ms * 1e-3) / 1e12;
        let gbps = s.bytes() / (ms * 1e-3) / 1e9;
        let tokens: usize = s.sequences().iter().map(|&(sq, _)| sq).sum();
        let tokens_per_s = tokens as f64 / (ms * 1e-3);
        let tol = abs_tol(s.dtype);
        checked_rows += m.check.rows;
        let check_text = match (m.check.max_abs_err, &m.check.nonfinite) {
            (Some(e), _) if e <= tol => format!("{e:.2e}"),
            (Some(e), _) => {
                failed_checks.push((s.label(), format!("max |O - O_ref| {e:.3e} > {tol:.1e}")));
                format!("{e:.2e}!")
            }
            (None, what) => {
                failed_checks.push((s.label(), what.clone().unwrap_or_default()));
                "NaN!".into()
            }
        };
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
                    Policy::Varlen | Policy::VarlenPaged(_) => {
                        ("varlen_over_fixed_tflops", tflops / plain_tflops)
                    }
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
            "{:<8} {:<5} {:>3} {:>3} {:>4} {:>6} {:>6} {:>4} {:>6} {:>10.4} {:>6} {:>8.1} {:>8.0} {:>10.3e} {:>9} {:>9.1} {:>8}  {}",
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
            tokens_per_s,
            check_text,
            m.mem_bytes as f64 / 1e6,
            m.mem_used_delta
                .map_or("?".into(), |b| format!("{:.0}", b as f64 / 1e6)),
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
            "label": s.label(),
            "tokens_per_s": tokens_per_s,
            "max_abs_err": m.check.max_abs_err,
            "ref_max_abs": m.check.ref_max_abs,
            "abs_tol": tol,
            "checked_rows": m.check.rows,
            "mem_bytes": m.mem_bytes,
            "mem_used_delta_bytes": m.mem_used_delta,
        });
        if let Some(what) = &m.check.nonfinite {
            let extra = line.as_object_mut().expect("a JSON object");
            extra.insert("check_error".into(), what.clone().into());
        }
        if s.kind == Kind::Decode {
            let shape = decode_shape(&s, splits);
            let used = match s.dtype {
                Dtype::F16 => fa.decode_splits::<f16>(&shape),
                Dtype::Bf16 => fa.decode_splits::<bf16>(&shape),
                Dtype::F32 => fa.decode_splits::<f32>(&shape),
            };
            let stages = match s.dtype {
                Dtype::F16 => fa.decode_ring_stages::<f16>(&shape),
                Dtype::Bf16 => fa.decode_ring_stages::<bf16>(&shape),
                Dtype::F32 => fa.decode_ring_stages::<f32>(&shape),
            };
            let fold = match s.dtype {
                Dtype::F16 => fa.decode_kv_fold::<f16>(&shape),
                Dtype::Bf16 => fa.decode_kv_fold::<bf16>(&shape),
                Dtype::F32 => fa.decode_kv_fold::<f32>(&shape),
            };
            let extra = line.as_object_mut().expect("a JSON object");
            extra.insert("splits".into(), used.into());
            extra.insert("ring_stages".into(), stages.into());
            extra.insert("kv_fold".into(), fold.into());
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
            if s.policy.is_varlen() {
                extra.insert("seqlens".into(), varlen_seqlens().into());
            }
            if let Policy::VarlenPaged(page) = s.policy {
                extra.insert("page_size".into(), page.into());
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
    if failed_checks.is_empty() {
        println!(
            "f64 check: {checked_rows} sampled query rows, all within the GPU tests' tolerance"
        );
    } else {
        println!(
            "f64 check FAILED on {} rows ({checked_rows} sampled query rows in all):",
            failed_checks.len()
        );
        for (label, what) in &failed_checks {
            println!("  {label}: {what}");
        }
    }
    if let Some(png) = plot_path {
        match run_python(&["-", &json_path, &png], false) {
            Ok(()) => println!("plot written to {png}"),
            Err(e) => {
                eprintln!("--plot: {e}");
                std::process::exit(1);
            }
        }
    }
}

/// scripts/plot-bench.py, embedded so that `--plot` also works from a GPU
/// bundle that has the bench binary and no source tree.
const PLOT_SCRIPT: &str = include_str!("../scripts/plot-bench.py");

/// Runs `python3 ARGS` (stderr dropped if `quiet`); a first argument `-`
/// feeds it [`PLOT_SCRIPT`] on stdin.
fn run_python(args: &[&str], quiet: bool) -> Result<(), String> {
    let mut child = std::process::Command::new("python3")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stderr(if quiet {
            std::process::Stdio::null()
        } else {
            std::process::Stdio::inherit()
        })
        .spawn()
        .map_err(|e| format!("cannot run python3 ({e})"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    if args.first() == Some(&"-") {
        stdin
            .write_all(PLOT_SCRIPT.as_bytes())
            .map_err(|e| format!("cannot feed python3 the plot script ({e})"))?;
    }
    drop(stdin);
    let status = child.wait().map_err(|e| format!("python3 failed ({e})"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`python3 {}` exited with {status}", args.join(" ")))
    }
}
