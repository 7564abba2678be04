//! Kernel configuration: the single definition of tile shapes, thread counts,
//! shared-memory budgets and entry-point names, used by the kernels, by the
//! host's dispatch and launch geometry, and by the PTX build.

/// Threads in a warp.
pub const WARP_SIZE: usize = 32;
/// Rows of the `mma.sync.m16n8k16` tile (A rows, C rows).
pub const MMA_M: usize = 16;
/// Columns of the `mma.sync.m16n8k16` tile (B and C columns).
pub const MMA_N: usize = 8;
/// Depth of the `mma.sync.m16n8k16` tile.
pub const MMA_K: usize = 16;
/// Bytes of one f16/bf16 element.
pub const ELEM_BYTES: usize = 2;
/// One `cp.async`/`ldmatrix` row segment: 16 bytes, the widest single copy.
pub const CHUNK_BYTES: usize = 16;
/// Elements in one 16-byte chunk.
pub const CHUNK_ELEMS: usize = CHUNK_BYTES / ELEM_BYTES;
/// The XOR swizzle permutes chunks within groups of this many rows; 8 rows of
/// 16 bytes cover all 32 banks once, so an 8-row `ldmatrix` phase is conflict-free.
pub const SWIZZLE_ROWS: usize = 8;
/// Alignment (bytes) required of every tensor base pointer and of every
/// batch/sequence/head stride, so each row chunk is one aligned 16-byte copy.
pub const REQUIRED_ALIGN_BYTES: usize = CHUNK_BYTES;

/// Head dimensions with compiled kernels. Adding one is a new [`AttnTile`] arm
/// plus one line per entry in the device entry-point table.
pub const SUPPORTED_HEAD_DIMS: [usize; 2] = [64, 128];

/// Minimum compute capability: `cp.async`, `ldmatrix` and bf16 `mma.sync` are sm_80.
pub const MIN_COMPUTE_CAPABILITY: (u32, u32) = (8, 0);

/// How the warps of a CTA share its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarpSplit {
    /// Each warp owns `m_tiles` x [`MMA_M`] consecutive query rows and sees
    /// every key of a block (prefill: many rows).
    Rows,
    /// All warps share the CTA's `m_tiles` x [`MMA_M`] rows and each takes
    /// `block_n / warps` keys of every block; the warps' softmax states are
    /// merged at the end (decode: a handful of rows, many keys).
    Keys,
}

/// Tile of one attention thread block (CTA): `block_m` query rows, K and V
/// streamed through shared memory in blocks of `block_n` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnTile {
    pub head_dim: usize,
    pub block_m: usize,
    pub block_n: usize,
    pub warps: usize,
    pub split: WarpSplit,
    /// 16-row MMA tiles per warp. Two halve the `ldmatrix` traffic per MMA (each
    /// K/V fragment feeds both) at the cost of twice the accumulators.
    pub m_tiles: usize,
    /// Keep Q's A fragments in registers for the whole CTA (else re-read them
    /// from shared memory at every key block, to leave registers to O).
    pub q_in_regs: bool,
    /// (K, V) stages of the shared-memory ring, at least 2: `kv_stages - 1`
    /// key blocks are in flight while one is consumed.
    pub kv_stages: usize,
    /// CTAs that must fit on one SM (`.minnctapersm`): caps registers at
    /// 64K / (threads * this). Without it ptxas picks its own occupancy target
    /// and may spill to reach it.
    pub min_ctas_per_sm: usize,
}

/// Keys one warp of a [`WarpSplit::Keys`] tile takes from each block: one
/// k-step of P·V.
pub const WARP_KEYS: usize = MMA_K;

/// Largest dynamic shared memory of one CTA on every supported GPU (sm_86/89
/// allow 99 KB; sm_80 163 KB, sm_90 227 KB).
pub const MAX_SMEM_BYTES: usize = 99 * 1024;

impl AttnTile {
    /// The tile of a kernel family for a head dimension, `None` when that head
    /// dimension is not compiled.
    pub const fn for_kernel(kind: KernelKind, head_dim: usize) -> Option<AttnTile> {
        let warps = 4;
        let (split, m_tiles, q_in_regs, block_n, kv_stages, min_ctas_per_sm) =
            match (kind, head_dim) {
                // Decode is memory-bound with few query rows: one m-tile shared by
                // all warps wastes the least MMA work, and the ring keeps blocks in
                // flight while one is consumed. Two 32 KB stages measured
                // faster than three (docs/perf-notes.md, v6).
                (KernelKind::Decode | KernelKind::Combine, 64) => {
                    (WarpSplit::Keys, 1, true, 64, 3, 2)
                }
                (KernelKind::Decode | KernelKind::Combine, 128) => {
                    (WarpSplit::Keys, 1, true, 64, 2, 2)
                }
                (KernelKind::Forward, 64) => (WarpSplit::Rows, 2, false, 64, 2, 2),
                // 2 x 16 rows of D=128 accumulators (128 registers) leave no room
                // for Q's 64 fragment registers, nor for S of 64-key blocks; the
                // two CTAs per SM get the full 255-register budget.
                (KernelKind::Forward, 128) => (WarpSplit::Rows, 2, false, 32, 2, 2),
                _ => return None,
            };
        let block_m = match split {
            WarpSplit::Rows => warps * m_tiles * MMA_M,
            WarpSplit::Keys => m_tiles * MMA_M,
        };
        Some(AttnTile {
            head_dim,
            block_m,
            block_n,
            warps,
            split,
            m_tiles,
            q_in_regs,
            kv_stages,
            min_ctas_per_sm,
        })
    }

    /// Whether any kernel is compiled for this head dimension.
    pub const fn supports(head_dim: usize) -> bool {
        Self::for_kernel(KernelKind::Forward, head_dim).is_some()
    }

    /// [`Self::for_kernel`] for compile-time use, where an unsupported head
    /// dim is a build error.
    pub const fn of(kind: KernelKind, head_dim: usize) -> AttnTile {
        match Self::for_kernel(kind, head_dim) {
            Some(t) => t,
            None => panic!("unsupported head dim"),
        }
    }

    /// Rows of the CTA owned by one warp.
    pub const fn warp_rows(self) -> usize {
        self.m_tiles * MMA_M
    }

    pub const fn threads(self) -> usize {
        self.warps * WARP_SIZE
    }
    /// 16-byte chunks in one row of Q, K, V or O.
    pub const fn row_chunks(self) -> usize {
        self.head_dim / CHUNK_ELEMS
    }
    pub const fn q_smem_bytes(self) -> usize {
        self.block_m * self.head_dim * ELEM_BYTES
    }
    pub const fn kv_smem_bytes(self) -> usize {
        self.block_n * self.head_dim * ELEM_BYTES
    }
    /// One (K, V) stage of the ring.
    pub const fn stage_bytes(self) -> usize {
        2 * self.kv_smem_bytes()
    }
    /// Byte offset of the (K, V) ring: after Q, or at 0 when Q borrows the
    /// last stage (possible when Q's fragments live in registers: the last
    /// stage is first refilled after they are loaded).
    pub const fn ring_offset(self) -> usize {
        if self.q_shares_ring() {
            0
        } else {
            self.q_smem_bytes()
        }
    }
    const fn q_shares_ring(self) -> bool {
        self.kv_stages > 1 && self.q_in_regs
    }
    /// Byte offsets of the Q tile and of stage `s`'s K and V tiles in dynamic
    /// shared memory. The O tile of the forward epilogue reuses the Q region.
    pub const fn q_smem_offset(self) -> usize {
        if self.q_shares_ring() {
            self.ring_offset() + (self.kv_stages - 1) * self.stage_bytes()
        } else {
            0
        }
    }
    pub const fn k_smem_offset(self) -> usize {
        self.ring_offset()
    }
    pub const fn v_smem_offset(self) -> usize {
        self.k_smem_offset() + self.kv_smem_bytes()
    }
    /// Row stride of the f32 [warps][block_m][head_dim] tile in which a
    /// [`WarpSplit::Keys`] CTA merges its warps' O; padded by one 16-byte chunk
    /// so the 8 rows an accumulator store touches fall on different banks.
    pub const fn merge_row_bytes(self) -> usize {
        self.head_dim * 4 + CHUNK_BYTES
    }
    /// The merge tile (at the start of the ring), then each warp's row maxima
    /// and sums: [2][warps][block_m] f32.
    pub const fn merge_bytes(self) -> usize {
        self.warps * self.block_m * self.merge_row_bytes()
    }
    pub const fn merge_stats_offset(self) -> usize {
        self.ring_offset() + self.merge_bytes()
    }
    /// Dynamic shared memory of one CTA.
    pub const fn smem_bytes(self) -> usize {
        let ring = self.ring_offset() + self.kv_stages * self.stage_bytes();
        let merge = match self.split {
            WarpSplit::Rows => 0,
            WarpSplit::Keys => self.merge_stats_offset() + 2 * self.warps * self.block_m * 4,
        };
        if ring > merge {
            ring
        } else {
            merge
        }
    }
}

/// Threads of one split-KV combine CTA.
pub const COMBINE_THREADS: usize = 128;
/// Output elements each combine thread owns (one 8-byte store of f16/bf16).
pub const COMBINE_ELEMS_PER_THREAD: usize = 4;
/// Upper bound on KV splits; the combine kernel reads every split's LSE per row.
pub const MAX_SPLITS: usize = 128;
/// Threads of one KV-append CTA (one per 16-byte chunk).
pub const APPEND_THREADS: usize = 128;
/// Pages of a paged KV cache hold a multiple of this many tokens.
pub const PAGE_SIZE_MULTIPLE: usize = 16;

/// Query rows one combine CTA finishes for a head dimension.
pub const fn combine_rows_per_cta(head_dim: usize) -> usize {
    COMBINE_THREADS / (head_dim / COMBINE_ELEMS_PER_THREAD)
}

/// Element type of Q, K, V and O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F16,
    Bf16,
}

impl Dtype {
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// The three kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// Prefill / full attention: one CTA per (query block, head, batch).
    Forward,
    /// Decode against a KV cache: query heads of one KV head packed into the
    /// CTA's rows, the keys split across CTAs (flash-decoding).
    Decode,
    /// Merges the split-KV partial outputs of `Decode`.
    Combine,
    /// Copies new K/V tokens into the cache before a decode step; moves bytes,
    /// so one entry serves every dtype and head dim.
    Append,
}

/// One compiled kernel entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub name: &'static str,
    pub kind: KernelKind,
    pub dtype: Dtype,
    pub head_dim: usize,
    /// Meaningless for `Combine` and `Append`, which are always `false`.
    pub causal: bool,
}

impl Entry {
    /// Threads per CTA, the value the PTX build writes into `.maxntid`.
    pub const fn threads(&self) -> usize {
        match self.kind {
            KernelKind::Combine => COMBINE_THREADS,
            KernelKind::Append => APPEND_THREADS,
            kind => AttnTile::of(kind, self.head_dim).threads(),
        }
    }
    /// Dynamic shared memory per CTA.
    pub const fn smem_bytes(&self) -> usize {
        match self.kind {
            KernelKind::Combine | KernelKind::Append => 0,
            kind => AttnTile::of(kind, self.head_dim).smem_bytes(),
        }
    }
    /// Occupancy the PTX build requests with `.minnctapersm`, if any.
    pub const fn min_ctas_per_sm(&self) -> Option<usize> {
        match self.kind {
            KernelKind::Combine | KernelKind::Append => None,
            kind => Some(AttnTile::of(kind, self.head_dim).min_ctas_per_sm),
        }
    }
}

macro_rules! entry_table {
    ($( $name:literal => $kind:ident, $dtype:ident, $hd:literal, $causal:literal; )*) => {
        /// Every kernel entry point in the PTX. Names follow
        /// `flash_{fwd|decode|combine}_{dtype}_hd{D}[_{causal|full}]`, plus the
        /// byte-moving `flash_append_kv` (dtype and head dim 0: any).
        pub const ENTRIES: &[Entry] = &[
            $( Entry { name: $name, kind: KernelKind::$kind, dtype: Dtype::$dtype, head_dim: $hd, causal: $causal }, )*
        ];
    };
}

entry_table! {
    "flash_fwd_f16_hd64_full" => Forward, F16, 64, false;
    "flash_fwd_f16_hd64_causal" => Forward, F16, 64, true;
    "flash_fwd_f16_hd128_full" => Forward, F16, 128, false;
    "flash_fwd_f16_hd128_causal" => Forward, F16, 128, true;
    "flash_fwd_bf16_hd64_full" => Forward, Bf16, 64, false;
    "flash_fwd_bf16_hd64_causal" => Forward, Bf16, 64, true;
    "flash_fwd_bf16_hd128_full" => Forward, Bf16, 128, false;
    "flash_fwd_bf16_hd128_causal" => Forward, Bf16, 128, true;
    "flash_decode_f16_hd64_full" => Decode, F16, 64, false;
    "flash_decode_f16_hd64_causal" => Decode, F16, 64, true;
    "flash_decode_f16_hd128_full" => Decode, F16, 128, false;
    "flash_decode_f16_hd128_causal" => Decode, F16, 128, true;
    "flash_decode_bf16_hd64_full" => Decode, Bf16, 64, false;
    "flash_decode_bf16_hd64_causal" => Decode, Bf16, 64, true;
    "flash_decode_bf16_hd128_full" => Decode, Bf16, 128, false;
    "flash_decode_bf16_hd128_causal" => Decode, Bf16, 128, true;
    "flash_combine_f16_hd64" => Combine, F16, 64, false;
    "flash_combine_f16_hd128" => Combine, F16, 128, false;
    "flash_combine_bf16_hd64" => Combine, Bf16, 64, false;
    "flash_combine_bf16_hd128" => Combine, Bf16, 128, false;
    "flash_append_kv" => Append, F16, 0, false;
}

/// The entry point for a (kind, dtype, head dim, causal) combination.
pub fn find_entry(
    kind: KernelKind,
    dtype: Dtype,
    head_dim: usize,
    causal: bool,
) -> Option<&'static Entry> {
    let causal = causal && matches!(kind, KernelKind::Forward | KernelKind::Decode);
    ENTRIES.iter().find(|e| {
        e.kind == kind && e.dtype == dtype && e.head_dim == head_dim && e.causal == causal
    })
}

/// Compute architectures the PTX is built for (`target-cpu` values).
pub const PTX_ARCHS: [&str; 2] = ["sm_80", "sm_90"];
