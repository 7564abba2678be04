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
/// plus its lines in `attention_variants`.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

/// Head dimensions with compiled backward kernels (`bwd` lines of
/// `attention_variants`): all of [`SUPPORTED_HEAD_DIMS`].
pub const BWD_HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

/// Largest head dim of any kernel.
pub const MAX_HEAD_DIM: usize = 256;

/// 16-byte chunks in one shared-memory row of a head-dim-`d` tile: the row's
/// chunks rounded up to a whole swizzle group of [`SWIZZLE_ROWS`] chunks, so
/// the XOR swizzle stays a permutation of the row (D = 32 and 96 are padded;
/// the padding is never loaded or read).
pub const fn smem_row_chunks(head_dim: usize) -> usize {
    (head_dim / CHUNK_ELEMS).div_ceil(SWIZZLE_ROWS) * SWIZZLE_ROWS
}

/// Chunk lanes of a row-copy pass: the row's chunks rounded up to a power of
/// two, so a CTA's threads split into whole rows and each thread keeps one
/// chunk column; the lanes past the row's end issue no copy.
pub const fn copy_row_lanes(head_dim: usize) -> usize {
    (head_dim / CHUNK_ELEMS).next_power_of_two()
}

/// Minimum compute capability: `ldmatrix` and f16 `mma.sync` are sm_75
/// (Turing); `cp.async` and bf16 `mma.sync` are sm_80, so the `Sm75` module
/// copies through registers and has no bf16 kernels.
pub const MIN_COMPUTE_CAPABILITY: (u32, u32) = (7, 5);

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
    /// Head dimension D: elements per row of Q, K, V and O.
    pub head_dim: usize,
    /// Query rows per CTA (packed (token, head) rows in decode): `m_tiles` x
    /// [`MMA_M`] per warp for [`WarpSplit::Rows`], shared by all warps for `Keys`.
    pub block_m: usize,
    /// Keys per block streamed through the K/V ring.
    pub block_n: usize,
    /// Warps per CTA.
    pub warps: usize,
    /// How the warps divide the CTA's rows and each block's keys.
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
    /// Decode: the stages a launch uses when its grid has more CTAs than
    /// the GPU has SMs (2 <= busy_stages <= kv_stages; see `with_stages`).
    pub busy_stages: usize,
    /// CTAs that must fit on one SM (`.minnctapersm`): caps registers at
    /// 64K / (threads * this). Without it ptxas picks its own occupancy target
    /// and may spill to reach it.
    pub min_ctas_per_sm: usize,
}

/// Keys one warp of a [`WarpSplit::Keys`] tile takes from each block: one
/// k-step of P·V.
pub const WARP_KEYS: usize = MMA_K;

/// A PTX module of the build. Its tiles are sized for every GPU that loads
/// it, so the module bounds their shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PtxArch {
    /// `sm_75` (Turing: T4, RTX 20xx): f16 kernels only (Turing's tensor
    /// cores have no bf16), `mma.sync.m16n8k8`, global -> shared copies
    /// through registers (no `cp.async`), tiles within 64 KB per CTA.
    Sm75,
    /// `sm_80`: loaded on compute capability 8.x, and above 9 where the
    /// `Sm90` tiles do not fit (sm_120 has 99 KB per CTA).
    Sm80,
    /// `sm_90`: loaded on GPUs that give a CTA 227 KB (H100, H200, B200).
    Sm90,
    /// `sm_90a`: Hopper's architecture-specific instructions (`wgmma`,
    /// `setmaxnreg`), which run on compute capability 9.0 only. It holds only
    /// [`HOPPER_ENTRIES`]: the Hopper forward, which `FlashAttention` loads
    /// on such GPUs, and the primitive probes of `flash_attn::hopper::probes`.
    Sm90a,
}

impl PtxArch {
    /// Every module, in build order.
    pub const ALL: [PtxArch; 4] = [PtxArch::Sm75, PtxArch::Sm80, PtxArch::Sm90, PtxArch::Sm90a];
    /// The modules of the attention kernels ([`ENTRIES`], less the dtypes a
    /// module lacks: [`Self::has_dtype`]), whose tiles
    /// [`AttnTile::for_kernel`] sizes.
    pub const ATTENTION: [PtxArch; 3] = [PtxArch::Sm75, PtxArch::Sm80, PtxArch::Sm90];

    /// The module this code is being compiled into (device code; on the host
    /// it reads `Sm80` and means nothing).
    pub const TARGET: PtxArch = if cfg!(target_feature = "sm_90a") {
        PtxArch::Sm90a
    } else if cfg!(target_feature = "sm_90") {
        PtxArch::Sm90
    } else if cfg!(target_feature = "sm_80") {
        PtxArch::Sm80
    } else {
        PtxArch::Sm75
    };

    /// The `target-cpu` the module is compiled for.
    pub const fn target_cpu(self) -> &'static str {
        match self {
            PtxArch::Sm75 => "sm_75",
            PtxArch::Sm80 => "sm_80",
            PtxArch::Sm90 => "sm_90",
            PtxArch::Sm90a => "sm_90a",
        }
    }

    /// The PTX ISA the module needs beyond its target's default, as an LLVM
    /// target feature: sm_75 defaults to ISA 6.3, and `ldmatrix` and
    /// `mma.sync.m16n8k8` need 6.5 (7.0, sm_80's, is what CUDA 11.0 drivers load);
    /// sm_90 and sm_90a default to 7.8 and 8.0, and the backward's vector
    /// `red.global.add.v4.f32` needs 8.1 (CUDA 12.1 drivers).
    pub const fn ptx_isa_feature(self) -> Option<&'static str> {
        match self {
            PtxArch::Sm75 => Some("ptx70"),
            PtxArch::Sm90 | PtxArch::Sm90a => Some("ptx81"),
            _ => None,
        }
    }

    /// Largest dynamic shared memory of one CTA on every GPU that loads the
    /// module: sm_75 64 KB; sm_86/89 99 KB (sm_80 163 KB); sm_90 and sm_100 227 KB.
    pub const fn max_smem_bytes(self) -> usize {
        match self {
            PtxArch::Sm75 => 64 * 1024,
            PtxArch::Sm80 => 99 * 1024,
            PtxArch::Sm90 | PtxArch::Sm90a => 227 * 1024,
        }
    }

    /// The entry points the module defines.
    pub const fn entries(self) -> &'static [Entry] {
        match self {
            PtxArch::Sm75 => TURING_ENTRIES,
            PtxArch::Sm80 | PtxArch::Sm90 => ENTRIES,
            PtxArch::Sm90a => HOPPER_ENTRIES,
        }
    }

    /// Whether the module has kernels for `dtype`: sm_75's tensor cores
    /// have no bf16 `mma`.
    pub const fn has_dtype(self, dtype: Dtype) -> bool {
        !matches!((self, dtype), (PtxArch::Sm75, Dtype::Bf16))
    }

    /// Whether a GPU of compute capability `major.minor` runs the `Sm90a`
    /// module: architecture-specific PTX runs on that exact architecture only.
    pub const fn hopper_device(major: i32, minor: i32) -> bool {
        major == 9 && minor == 0
    }

    /// The module for a GPU of compute capability `major.minor` whose CTAs
    /// may opt in to `smem_optin` bytes of shared memory: the newest whose
    /// tiles fit, `None` below sm_75. PTX JIT-compiles forward, so later GPUs
    /// run it.
    pub const fn for_device(major: i32, minor: i32, smem_optin: usize) -> Option<PtxArch> {
        if major >= 9 && smem_optin >= PtxArch::Sm90.max_smem_bytes() {
            Some(PtxArch::Sm90)
        } else if major >= 8 {
            Some(PtxArch::Sm80)
        } else if major == 7 && minor >= 5 {
            Some(PtxArch::Sm75)
        } else {
            None
        }
    }
}

impl AttnTile {
    /// The tile of a kernel family for a head dimension, `None` when that head
    /// dimension is not compiled.
    pub const fn for_kernel(kind: KernelKind, head_dim: usize, arch: PtxArch) -> Option<AttnTile> {
        let (warps, split, m_tiles, q_in_regs, block_n, kv_stages, min_ctas_per_sm) =
            match (kind, head_dim, arch) {
                // Decode is memory-bound with few query rows: one m-tile shared by
                // all warps wastes the least MMA work, and the ring keeps blocks in
                // flight while one is consumed. Two 32 KB stages measured
                // faster than three (docs/perf-notes.md, v6).
                (KernelKind::Decode | KernelKind::Combine, 32 | 64, _) => {
                    (4, WarpSplit::Keys, 1, true, 64, 3, 2)
                }
                // sm_90: up to three 32 KB stages (see `busy_stages` below).
                (KernelKind::Decode | KernelKind::Combine, 96 | 128, PtxArch::Sm90) => {
                    (4, WarpSplit::Keys, 1, true, 64, 3, 2)
                }
                (KernelKind::Decode | KernelKind::Combine, 96 | 128, _) => {
                    (4, WarpSplit::Keys, 1, true, 64, 2, 2)
                }
                // Two warps (32-key blocks) keep two 32 KB stages and the f32
                // merge tile under the 99 KB of sm_86/89; at D = 256 Q's 64
                // fragment registers would crowd O's 128, so Q is re-read.
                // sm_90: up to three 24 KB stages (see `busy_stages` below).
                (KernelKind::Decode | KernelKind::Combine, 192, PtxArch::Sm90) => {
                    (2, WarpSplit::Keys, 1, true, 32, 3, 2)
                }
                (KernelKind::Decode | KernelKind::Combine, 192, _) => {
                    (2, WarpSplit::Keys, 1, true, 32, 2, 2)
                }
                // sm_75's 64 KB: one warp and 16-key blocks (Q 8 KB, two
                // 16 KB stages). Q in registers (two 32-key warps, 64 KB)
                // spilled 40-60 bytes per thread.
                (KernelKind::Decode | KernelKind::Combine, 256, PtxArch::Sm75) => {
                    (1, WarpSplit::Keys, 1, false, 16, 2, 2)
                }
                // sm_90: up to three 32 KB stages, as at D = 96/128.
                (KernelKind::Decode | KernelKind::Combine, 256, PtxArch::Sm90) => {
                    (2, WarpSplit::Keys, 1, false, 32, 3, 2)
                }
                (KernelKind::Decode | KernelKind::Combine, 256, _) => {
                    (2, WarpSplit::Keys, 1, false, 32, 2, 2)
                }
                (KernelKind::Forward, 32, _) => (4, WarpSplit::Rows, 2, true, 64, 2, 2),
                (KernelKind::Forward, 64, _) => (4, WarpSplit::Rows, 2, false, 64, 2, 2),
                // 2 x 16 rows of D=128 accumulators (128 registers) leave no room
                // for Q's 64 fragment registers, nor for S of 64-key blocks; the
                // two CTAs per SM get the full 255-register budget.
                // D = 96 has the registers for 64-key blocks (96 of O, 64 of
                // S): 9-18% faster than 32-key blocks on H100 (v10).
                // sm_75: 32-key blocks keep Q and two stages within 64 KB.
                (KernelKind::Forward, 96, PtxArch::Sm75) => {
                    (4, WarpSplit::Rows, 2, false, 32, 2, 2)
                }
                (KernelKind::Forward, 96, _) => (4, WarpSplit::Rows, 2, false, 64, 2, 2),
                (KernelKind::Forward, 128, _) => (4, WarpSplit::Rows, 2, false, 32, 2, 2),
                // One m-tile: 2 x 16 rows of D = 192/256 accumulators would take
                // 192-256 registers alone. 32-key blocks keep Q plus two stages
                // under the 99 KB of sm_86/89.
                // sm_75: 16-key blocks, Q plus two stages within 64 KB.
                (KernelKind::Forward, 192 | 256, PtxArch::Sm75) => {
                    (4, WarpSplit::Rows, 1, false, 16, 2, 2)
                }
                (KernelKind::Forward, 192 | 256, PtxArch::Sm80) => {
                    (4, WarpSplit::Rows, 1, false, 32, 2, 2)
                }
                // With 227 KB, eight warps share each K/V block (128 rows: half
                // the L2 -> shared traffic per FLOP) and 64-key blocks halve the
                // rescales and barriers: Q 64 KB + two 64 KB stages at D = 256.
                (KernelKind::Forward, 192 | 256, PtxArch::Sm90) => {
                    (8, WarpSplit::Rows, 1, false, 64, 2, 1)
                }
                _ => return None,
            };
        let block_m = match split {
            WarpSplit::Rows => warps * m_tiles * MMA_M,
            WarpSplit::Keys => m_tiles * MMA_M,
        };
        // The D = 96-256 decode ring of sm_90 runs three stages where the
        // host's ring rule says (few K/V streams or short CTAs: latency-bound,
        // 4-20% faster on H100) and two in fuller grids (1-2% faster at HBM
        // bandwidth); at D = 64 three stages won in both (docs/perf-notes.md,
        // v11; D = 256: v63b, and three stages in fuller grids lost 1-2 %,
        // v64c; the rule: v65; D = 192: v66).
        let busy_stages = match (kind, head_dim, arch) {
            (KernelKind::Decode | KernelKind::Combine, 96 | 128 | 192 | 256, PtxArch::Sm90) => 2,
            _ => kv_stages,
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
            busy_stages,
            min_ctas_per_sm,
        })
    }

    /// Whether any kernel is compiled for this head dimension.
    pub const fn supports(head_dim: usize) -> bool {
        Self::for_kernel(KernelKind::Forward, head_dim, PtxArch::Sm80).is_some()
    }

    /// [`Self::for_kernel`] for compile-time use, where an unsupported head
    /// dim is a build error.
    pub const fn of(kind: KernelKind, head_dim: usize, arch: PtxArch) -> AttnTile {
        match Self::for_kernel(kind, head_dim, arch) {
            Some(t) => t,
            None => panic!("unsupported head dim"),
        }
    }

    /// The tile of one table line: its head dim's ([`Self::of`]), except
    /// that the general forward kernel at D = 96 (`Modified` scores with
    /// `Ragged` sequences) keeps 32-key blocks: the registers its uniform
    /// branches keep live do not fit beside the S of 64-key blocks (ptxas
    /// spilled 4 bytes on sm_90).
    pub const fn of_variant(
        kind: KernelKind,
        head_dim: usize,
        p: Policies,
        arch: PtxArch,
    ) -> AttnTile {
        let mut t = Self::of(kind, head_dim, arch);
        if matches!(kind, KernelKind::Forward)
            && head_dim == 96
            && matches!(p.score, ScoreKind::Modified)
            && matches!(p.seq, SeqKind::Ragged)
        {
            t.block_n = 32;
        }
        t
    }

    /// The tile with a ring of `stages` stages, if that is `busy_stages` up
    /// to its own (a decode launch's choice, `AttnParams::kv_stages`); else
    /// itself.
    pub const fn with_stages(self, stages: usize) -> AttnTile {
        if stages < self.busy_stages || stages > self.kv_stages {
            self
        } else {
            AttnTile {
                kv_stages: stages,
                ..self
            }
        }
    }

    /// Rows of the CTA owned by one warp.
    pub const fn warp_rows(self) -> usize {
        self.m_tiles * MMA_M
    }

    /// Threads per CTA: `warps` x [`WARP_SIZE`].
    pub const fn threads(self) -> usize {
        self.warps * WARP_SIZE
    }
    /// 16-byte chunks in one row of Q, K, V or O.
    pub const fn row_chunks(self) -> usize {
        self.head_dim / CHUNK_ELEMS
    }
    /// Bytes of one (padded) row of a shared-memory tile.
    pub const fn smem_row_bytes(self) -> usize {
        smem_row_chunks(self.head_dim) * CHUNK_BYTES
    }
    /// Bytes of the Q tile: `block_m` padded rows.
    pub const fn q_smem_bytes(self) -> usize {
        self.block_m * self.smem_row_bytes()
    }
    /// Bytes of one K or V tile: `block_n` padded rows.
    pub const fn kv_smem_bytes(self) -> usize {
        self.block_n * self.smem_row_bytes()
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
    /// Byte offset of stage 0's K tile, the ring's start; stage `s` lies
    /// `s` x [`Self::stage_bytes`] further.
    pub const fn k_smem_offset(self) -> usize {
        self.ring_offset()
    }
    /// Byte offset of stage 0's V tile, right after its K tile.
    pub const fn v_smem_offset(self) -> usize {
        self.k_smem_offset() + self.kv_smem_bytes()
    }
    /// Row stride of the f32 `[warps][block_m][head_dim]` tile in which a
    /// [`WarpSplit::Keys`] CTA merges its warps' O; padded by one 16-byte chunk
    /// so the 8 rows an accumulator store touches fall on different banks.
    pub const fn merge_row_bytes(self) -> usize {
        self.head_dim * 4 + CHUNK_BYTES
    }
    /// The merge tile (at the start of the ring), then each warp's row maxima
    /// and sums: `[2][warps][block_m]` f32.
    pub const fn merge_bytes(self) -> usize {
        self.warps * self.block_m * self.merge_row_bytes()
    }
    /// Byte offset of the [`WarpSplit::Keys`] warps' row maxima and sums, right
    /// after the merge tile.
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

/// Threads of one split-KV combine CTA: eight row-wide groups at D = 128,
/// so 64 splits take one memory latency (`combine_shape`).
pub const COMBINE_THREADS: usize = 256;
/// Output elements each combine thread owns (one 8-byte store of f16/bf16).
pub const COMBINE_ELEMS_PER_THREAD: usize = 4;
/// Splits whose partials a combine thread loads together. One at a time, the
/// split loop waited a memory latency per split and pass: ~30 µs at 75 splits
/// on H100 (SmolLM-135M decode, B=1, 16k keys), more than the decode itself.
/// 16 spilled registers.
pub const COMBINE_SPLIT_GROUP: usize = 8;
/// Upper bound on KV splits; the combine kernel reads every split's LSE per row.
pub const MAX_SPLITS: usize = 128;
/// Threads of one KV-append CTA (one per 16-byte chunk).
pub const APPEND_THREADS: usize = 128;
/// Pages of a paged KV cache hold a multiple of this many tokens.
pub const PAGE_SIZE_MULTIPLE: usize = 16;

/// Thread groups of one combine CTA, each one row wide (a thread per
/// [`COMBINE_ELEMS_PER_THREAD`] columns); the threads past the last whole
/// group (D = 96, 192) idle.
pub const fn combine_groups(head_dim: usize) -> usize {
    COMBINE_THREADS / (head_dim / COMBINE_ELEMS_PER_THREAD)
}

/// How a combine launch spreads its CTAs' groups over rows and splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineShape {
    /// Groups that share one row, each merging every `split_groups`-th
    /// chunk of [`COMBINE_SPLIT_GROUP`] splits; their partial states meet in
    /// shared memory.
    pub split_groups: usize,
    /// Rows one CTA finishes.
    pub rows_per_cta: usize,
}

/// A row's chunks of splits go to as many groups as there are chunks, up to
/// the CTA's: the chunks a group merges one after the other each cost a
/// memory latency (about 2 µs on H100, v11), so a row of 32 splits at
/// D = 128 waits one latency instead of four, and with few splits a CTA
/// finishes several rows.
pub const fn combine_shape(head_dim: usize, splits: usize) -> CombineShape {
    let groups = combine_groups(head_dim);
    let chunks = if splits == 0 {
        1
    } else {
        splits.div_ceil(COMBINE_SPLIT_GROUP)
    };
    let split_groups = if chunks < groups { chunks } else { groups };
    CombineShape {
        split_groups,
        rows_per_cta: groups / split_groups,
    }
}

/// Dynamic shared memory of a combine CTA: each group's partial O row
/// (f32) and its (max, sum).
pub const fn combine_smem_bytes(head_dim: usize) -> usize {
    combine_groups(head_dim) * (head_dim + 2) * 4
}
/// Threads of one merge-states CTA (one per 16-byte chunk of a row).
pub const MERGE_THREADS: usize = 128;

/// Element type of Q, K, V and O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// f32 in memory, rounded to f16 where it is staged into shared memory
    /// (the tensor cores' operands); O is written from the f32 accumulators.
    F32,
}

impl Dtype {
    /// The dtype's word in entry names: `f16` or `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
        }
    }

    /// Bytes of one element in memory.
    pub const fn bytes(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// The kernel families.
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
    /// Merges two (O, LSE) attention states over disjoint key sets; any head
    /// dim (a multiple of 8).
    Merge,
    /// A check of one Hopper primitive (`hopper_entries`): the GPU suite runs
    /// it against a host computation before any kernel relies on it.
    Probe,
    /// The Hopper forward (`Sm90a` module): TMA loads, `wgmma`, a producer
    /// warpgroup and [`HopperTile`]'s `consumers` consumer warpgroups.
    WgmmaForward,
    /// The backward pass: one CTA per (key block, KV head, batch) accumulates
    /// dK and dV over the query blocks that see its keys, and adds its share
    /// of dQ to an f32 buffer ([`BwdTile`]).
    Backward,
    /// Before [`KernelKind::Backward`]: each query row's `delta = dO·O`; any
    /// head dim (a multiple of 8).
    BackwardPrep,
    /// After [`KernelKind::Backward`]: dQ = softmax_scale times the f32 dQ
    /// buffer, in the element type; any head dim (a multiple of 8).
    BackwardDq,
    /// After [`KernelKind::Backward`] with a KV head's query heads split
    /// across CTAs (`BwdParams::head_splits`): dK and dV, the sums of the
    /// parts' f32 rows in order; any head dim (a multiple of 8).
    BackwardDkv,
    /// After [`KernelKind::BackwardPrep`], where the sinks' gradients are
    /// asked for: one CTA per head sums its rows' shares; reads f32 rows
    /// only, so one entry serves every dtype and head dim.
    BackwardSinks,
    /// The backward's key-block kernel on `wgmma` (`Sm90a` module,
    /// [`HopperBwdTile`]); the same three launches as [`KernelKind::Backward`]
    /// around it.
    WgmmaBackward,
}

/// Which keys a query row sees (see `kernels::policy`). Ordered from the most
/// specialised: a kernel of a later kind serves every problem of an earlier one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MaskKind {
    /// Every key of the sequence.
    Full,
    /// Keys up to the bottom-right-aligned diagonal.
    Causal,
    /// A sliding window (left, right) read from the launch parameters; covers
    /// `Full` and `Causal` too.
    Local,
}

/// What is done to the scores besides the scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScoreKind {
    /// Nothing.
    Plain,
    /// Softcap, ALiBi and attention sinks, each switched on by its launch
    /// parameter (uniform branches).
    Modified,
}

/// Where a CTA's sequence lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SeqKind {
    /// [B, S, H, D] with per-batch strides.
    Dense,
    /// Packed sequences (`cu_seqlens`) when its launch parameter is set,
    /// K/V never paged (no page lookups compiled in); covers `Dense`.
    Packed,
    /// Packed sequences and/or K/V in a paged cache, each when its launch
    /// parameter is set; covers `Packed`.
    Ragged,
    /// Decode over a dense or paged cache whose KV heads are read in
    /// adjacent pairs, each pair as one head of twice the head dim (the
    /// entry's): a row's query fills its own head's half, the other half is
    /// zero (`index::fold_chunks`). Covers only itself: its rows would be
    /// wrong for an unfolded launch, and a run-time switch in the common
    /// entries made short unfolded decode steps 2-3 % slower (v68).
    Folded,
}

/// The policies of one attention entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Policies {
    /// Which keys a query row sees.
    pub mask: MaskKind,
    /// What is done to the scores besides the scale.
    pub score: ScoreKind,
    /// Where the sequences live: dense, or packed and/or paged.
    pub seq: SeqKind,
}

impl Policies {
    /// Full mask, plain scores, dense sequences: the least a kernel must cover,
    /// and the policies recorded for `Combine`, `Append` and `Merge` entries.
    pub const PLAIN: Policies = Policies {
        mask: MaskKind::Full,
        score: ScoreKind::Plain,
        seq: SeqKind::Dense,
    };

    /// Whether a kernel with these policies computes a problem that needs `need`.
    pub const fn covers(self, need: Policies) -> bool {
        let mask = match (self.mask, need.mask) {
            (MaskKind::Local, _) => true,
            (a, b) => a as u8 == b as u8,
        };
        let folded = matches!(self.seq, SeqKind::Folded);
        let seq = if folded || matches!(need.seq, SeqKind::Folded) {
            folded && matches!(need.seq, SeqKind::Folded)
        } else {
            self.seq as u8 >= need.seq as u8
        };
        mask && self.score as u8 >= need.score as u8 && seq
    }

    /// Whether a forward grid of one CTA per tile (`mma.sync`, or a Hopper
    /// line that is not persistent) starts its tiles in
    /// [`crate::index::balanced_tile`]'s order: causal masks over a fixed
    /// batch, whose query blocks differ in weight.
    pub const fn orders_grid(self) -> bool {
        matches!(self.mask, MaskKind::Causal) && matches!(self.seq, SeqKind::Dense)
    }
}

/// One compiled kernel entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    /// PTX entry-point name, e.g. `flash_fwd_f16_hd128_causal_plain_dense`.
    pub name: &'static str,
    /// Kernel family: which parameter struct and launch geometry it takes.
    pub kind: KernelKind,
    /// Element type it reads and writes; `Append` moves bytes and is listed as `F16`.
    pub dtype: Dtype,
    /// 0 for `Append` and `Merge`, which take any head dim.
    pub head_dim: usize,
    /// `Policies::PLAIN` for `Combine`, `Append` and `Merge`.
    pub policies: Policies,
    /// Query rows per CTA of a [`KernelKind::WgmmaForward`] entry (its
    /// table line's last word); 0 for every other kind, whose tile follows
    /// from the kind, head dim, policies and module ([`Self::tile`]).
    pub rows: usize,
    /// A [`KernelKind::WgmmaForward`] entry whose CTAs loop over tiles
    /// ([`HopperTile::persistent`]; the table line's `persistent` word).
    pub persistent: bool,
    /// Keys per K/V block of a [`KernelKind::WgmmaForward`] line that takes
    /// fewer than its head dim's (the table line's `n64` word); `None`: the
    /// head dim's ([`HopperTile::for_head_dim`]) and every other kind.
    pub keys: Option<usize>,
}

impl Entry {
    /// The attention tile of a forward or decode entry (not a
    /// [`KernelKind::WgmmaForward`] one: [`Self::hopper_tile`]) in `arch`'s module.
    pub const fn tile(&self, arch: PtxArch) -> AttnTile {
        AttnTile::of_variant(self.kind, self.head_dim, self.policies, arch)
    }
    /// Threads per CTA, the value the PTX build writes into `.maxntid`.
    pub const fn threads(&self, arch: PtxArch) -> usize {
        match self.kind {
            KernelKind::Combine => COMBINE_THREADS,
            KernelKind::Append => APPEND_THREADS,
            KernelKind::Merge => MERGE_THREADS,
            KernelKind::Probe => PROBE_THREADS,
            KernelKind::WgmmaForward => self.hopper_tile().threads(),
            KernelKind::WgmmaBackward => HopperBwdTile::of(self.head_dim).threads(),
            KernelKind::Backward => BwdTile::of(self.head_dim, arch).threads(),
            KernelKind::BackwardPrep
            | KernelKind::BackwardDq
            | KernelKind::BackwardDkv
            | KernelKind::BackwardSinks => BWD_THREADS,
            _ => self.tile(arch).threads(),
        }
    }
    /// Dynamic shared memory per CTA.
    pub const fn smem_bytes(&self, arch: PtxArch) -> usize {
        match self.kind {
            KernelKind::Combine => combine_smem_bytes(self.head_dim),
            KernelKind::Append | KernelKind::Merge => 0,
            KernelKind::Probe => PtxArch::Sm90a.max_smem_bytes(),
            KernelKind::WgmmaForward => self.hopper_tile().smem_bytes(),
            KernelKind::WgmmaBackward => HopperBwdTile::of(self.head_dim).smem_bytes(),
            KernelKind::Backward => BwdTile::of(self.head_dim, arch).smem_bytes(),
            KernelKind::BackwardPrep | KernelKind::BackwardDq | KernelKind::BackwardDkv => 0,
            // A word per warp: the warps' sums.
            KernelKind::BackwardSinks => BWD_THREADS / WARP_SIZE * 4,
            _ => self.tile(arch).smem_bytes(),
        }
    }
    /// Occupancy the PTX build requests with `.minnctapersm`, if any.
    pub const fn min_ctas_per_sm(&self, arch: PtxArch) -> Option<usize> {
        match self.kind {
            KernelKind::Combine | KernelKind::Append | KernelKind::Merge => None,
            KernelKind::BackwardPrep
            | KernelKind::BackwardDq
            | KernelKind::BackwardDkv
            | KernelKind::BackwardSinks => None,
            KernelKind::Backward => Some(BwdTile::of(self.head_dim, arch).ctas_per_sm),
            KernelKind::Probe => Some(1),
            KernelKind::WgmmaForward => Some(self.hopper_tile().ctas_per_sm),
            KernelKind::WgmmaBackward => Some(HopperBwdTile::of(self.head_dim).ctas_per_sm()),
            _ => Some(self.tile(arch).min_ctas_per_sm),
        }
    }
    /// The tile of a [`KernelKind::WgmmaForward`] entry.
    pub const fn hopper_tile(&self) -> HopperTile {
        HopperTile::of(
            self.head_dim,
            self.policies,
            self.rows,
            self.persistent,
            self.keys,
        )
    }
}

/// The one table of attention variants: each line is (kind, dtype, head dim,
/// mask, scores, sequence layout), named with the lowercase words of the
/// PTX entry `flash_{kind}_{dtype}_hd{D}_{mask}_{scores}_{seq}`. It calls
/// `$callback!` with every line; the config rows ([`ENTRIES`]), the device
/// entry points (`kernels::entries`) and so the host dispatch all come from it.
///
/// Per (dtype, head dim) and kind: the plain full and causal kernels that most
/// calls use, and one `local modified ragged` kernel that serves every other
/// combination through uniform branches (a kernel per combination would
/// multiply the PTX; docs/perf-notes.md measures what the branches cost).
/// The forward kernel also has `causal modified dense` (Gemma 2's softcap,
/// ALiBi and sinks on causal layers) and `local plain dense` (Mistral's
/// sliding window), which measured 4-6% faster than the general kernel on
/// H100 (v10). f32 has only the general line of each kind and head dim: its
/// copies stage through registers on every GPU, so the specialised lines'
/// few percent matter less than the PTX they would add. Lines are in order
/// of specialisation: dispatch takes the first line that covers a call.
macro_rules! attention_variants {
    ($callback:ident) => {
        $callback! {
            fwd f16 32 full plain dense;
            fwd f16 32 causal plain dense;
            fwd f16 32 causal modified dense;
            fwd f16 32 local plain dense;
            fwd f16 32 local modified ragged;
            fwd f16 64 full plain dense;
            fwd f16 64 causal plain dense;
            fwd f16 64 causal modified dense;
            fwd f16 64 local plain dense;
            fwd f16 64 local modified ragged;
            fwd f16 96 full plain dense;
            fwd f16 96 causal plain dense;
            fwd f16 96 causal modified dense;
            fwd f16 96 local plain dense;
            fwd f16 96 local modified ragged;
            fwd f16 128 full plain dense;
            fwd f16 128 causal plain dense;
            fwd f16 128 causal modified dense;
            fwd f16 128 local plain dense;
            fwd f16 128 local modified ragged;
            fwd f16 192 full plain dense;
            fwd f16 192 causal plain dense;
            fwd f16 192 causal modified dense;
            fwd f16 192 local plain dense;
            fwd f16 192 local modified ragged;
            fwd f16 256 full plain dense;
            fwd f16 256 causal plain dense;
            fwd f16 256 causal modified dense;
            fwd f16 256 local plain dense;
            fwd f16 256 local modified ragged;
            fwd bf16 32 full plain dense;
            fwd bf16 32 causal plain dense;
            fwd bf16 32 causal modified dense;
            fwd bf16 32 local plain dense;
            fwd bf16 32 local modified ragged;
            fwd bf16 64 full plain dense;
            fwd bf16 64 causal plain dense;
            fwd bf16 64 causal modified dense;
            fwd bf16 64 local plain dense;
            fwd bf16 64 local modified ragged;
            fwd bf16 96 full plain dense;
            fwd bf16 96 causal plain dense;
            fwd bf16 96 causal modified dense;
            fwd bf16 96 local plain dense;
            fwd bf16 96 local modified ragged;
            fwd bf16 128 full plain dense;
            fwd bf16 128 causal plain dense;
            fwd bf16 128 causal modified dense;
            fwd bf16 128 local plain dense;
            fwd bf16 128 local modified ragged;
            fwd bf16 192 full plain dense;
            fwd bf16 192 causal plain dense;
            fwd bf16 192 causal modified dense;
            fwd bf16 192 local plain dense;
            fwd bf16 192 local modified ragged;
            fwd bf16 256 full plain dense;
            fwd bf16 256 causal plain dense;
            fwd bf16 256 causal modified dense;
            fwd bf16 256 local plain dense;
            fwd bf16 256 local modified ragged;
            decode f16 32 full plain dense;
            decode f16 32 causal plain dense;
            decode f16 32 local modified dense;
            decode f16 64 full plain dense;
            decode f16 64 causal plain dense;
            decode f16 64 local modified dense;
            decode f16 96 full plain dense;
            decode f16 96 causal plain dense;
            decode f16 96 local modified dense;
            decode f16 128 full plain dense;
            decode f16 128 causal plain dense;
            decode f16 128 local modified dense;
            decode f16 192 full plain dense;
            decode f16 192 causal plain dense;
            decode f16 192 local modified dense;
            decode f16 256 full plain dense;
            decode f16 256 causal plain dense;
            decode f16 256 local modified dense;
            decode f16 64 full plain folded;
            decode f16 64 causal plain folded;
            decode f16 64 local modified folded;
            decode f16 128 full plain folded;
            decode f16 128 causal plain folded;
            decode f16 128 local modified folded;
            decode f16 192 full plain folded;
            decode f16 192 causal plain folded;
            decode f16 192 local modified folded;
            decode bf16 32 full plain dense;
            decode bf16 32 causal plain dense;
            decode bf16 32 local modified dense;
            decode bf16 64 full plain dense;
            decode bf16 64 causal plain dense;
            decode bf16 64 local modified dense;
            decode bf16 96 full plain dense;
            decode bf16 96 causal plain dense;
            decode bf16 96 local modified dense;
            decode bf16 128 full plain dense;
            decode bf16 128 causal plain dense;
            decode bf16 128 local modified dense;
            decode bf16 192 full plain dense;
            decode bf16 192 causal plain dense;
            decode bf16 192 local modified dense;
            decode bf16 256 full plain dense;
            decode bf16 256 causal plain dense;
            decode bf16 256 local modified dense;
            decode bf16 64 full plain folded;
            decode bf16 64 causal plain folded;
            decode bf16 64 local modified folded;
            decode bf16 128 full plain folded;
            decode bf16 128 causal plain folded;
            decode bf16 128 local modified folded;
            decode bf16 192 full plain folded;
            decode bf16 192 causal plain folded;
            decode bf16 192 local modified folded;
            combine f16 32 full plain dense;
            combine f16 64 full plain dense;
            combine f16 96 full plain dense;
            combine f16 128 full plain dense;
            combine f16 192 full plain dense;
            combine f16 256 full plain dense;
            combine bf16 32 full plain dense;
            combine bf16 64 full plain dense;
            combine bf16 96 full plain dense;
            combine bf16 128 full plain dense;
            combine bf16 192 full plain dense;
            combine bf16 256 full plain dense;
            fwd f32 32 local modified ragged;
            fwd f32 64 local modified ragged;
            fwd f32 96 local modified ragged;
            fwd f32 128 local modified ragged;
            fwd f32 192 local modified ragged;
            fwd f32 256 local modified ragged;
            decode f32 32 local modified dense;
            decode f32 64 local modified dense;
            decode f32 96 local modified dense;
            decode f32 128 local modified dense;
            decode f32 192 local modified dense;
            decode f32 256 local modified dense;
            combine f32 32 full plain dense;
            combine f32 64 full plain dense;
            combine f32 96 full plain dense;
            combine f32 128 full plain dense;
            combine f32 192 full plain dense;
            combine f32 256 full plain dense;
            bwd f16 32 local plain dense;
            bwd f16 64 local plain dense;
            bwd f16 96 local plain dense;
            bwd f16 128 local plain dense;
            bwd f16 192 local plain dense;
            bwd f16 256 local plain dense;
            bwd bf16 32 local plain dense;
            bwd bf16 64 local plain dense;
            bwd bf16 96 local plain dense;
            bwd bf16 128 local plain dense;
            bwd bf16 192 local plain dense;
            bwd bf16 256 local plain dense;
            bwd f16 32 local modified dense;
            bwd f16 64 local modified dense;
            bwd f16 96 local modified dense;
            bwd f16 128 local modified dense;
            bwd f16 192 local modified dense;
            bwd f16 256 local modified dense;
            bwd bf16 32 local modified dense;
            bwd bf16 64 local modified dense;
            bwd bf16 96 local modified dense;
            bwd bf16 128 local modified dense;
            bwd bf16 192 local modified dense;
            bwd bf16 256 local modified dense;
        }
    };
}
#[allow(unused_imports)] // used by the device crate's entries only
pub(crate) use attention_variants;

/// Maps the table's words to config values (also the device entries'
/// last word: `persistent` or `n64`).
macro_rules! table_word {
    (kind fwd) => {
        KernelKind::Forward
    };
    (kind decode) => {
        KernelKind::Decode
    };
    (kind combine) => {
        KernelKind::Combine
    };
    (kind bwd) => {
        KernelKind::Backward
    };
    (dtype f16) => {
        Dtype::F16
    };
    (dtype bf16) => {
        Dtype::Bf16
    };
    (dtype f32) => {
        Dtype::F32
    };
    (mask full) => {
        MaskKind::Full
    };
    (mask causal) => {
        MaskKind::Causal
    };
    (mask local) => {
        MaskKind::Local
    };
    (score plain) => {
        ScoreKind::Plain
    };
    (score modified) => {
        ScoreKind::Modified
    };
    (seq dense) => {
        SeqKind::Dense
    };
    (seq packed) => {
        SeqKind::Packed
    };
    (seq ragged) => {
        SeqKind::Ragged
    };
    (seq folded) => {
        SeqKind::Folded
    };
    (grid) => {
        false
    };
    (grid persistent) => {
        true
    };
    (grid n64) => {
        false
    };
    (grid n128) => {
        false
    };
    (keys) => {
        None
    };
    (keys persistent) => {
        None
    };
    (keys n64) => {
        Some(64)
    };
    (keys n128) => {
        Some(128)
    };
}

#[allow(unused_imports)] // used by the device crate's entries only
pub(crate) use table_word;

macro_rules! entry_rows {
    ($($kind:ident $dtype:ident $d:literal $mask:ident $score:ident $seq:ident;)*) => {
        /// Every kernel entry point in the PTX: `attention_variants`, then the
        /// byte-moving `flash_append_kv` and the per-dtype `flash_merge_*`.
        pub const ENTRIES: &[Entry] = &[
            $(Entry {
                name: concat!(
                    "flash_", stringify!($kind), "_", stringify!($dtype), "_hd", stringify!($d),
                    "_", stringify!($mask), "_", stringify!($score), "_", stringify!($seq)
                ),
                kind: table_word!(kind $kind),
                dtype: table_word!(dtype $dtype),
                head_dim: $d,
                policies: Policies {
                    mask: table_word!(mask $mask),
                    score: table_word!(score $score),
                    seq: table_word!(seq $seq),
                },
                rows: 0,
                persistent: false,
                keys: None,
            },)*
            Entry { name: "flash_append_kv", kind: KernelKind::Append, dtype: Dtype::F16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_merge_f16", kind: KernelKind::Merge, dtype: Dtype::F16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_merge_bf16", kind: KernelKind::Merge, dtype: Dtype::Bf16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_bwd_prep_f16", kind: KernelKind::BackwardPrep, dtype: Dtype::F16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_bwd_prep_bf16", kind: KernelKind::BackwardPrep, dtype: Dtype::Bf16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_bwd_dq_f16", kind: KernelKind::BackwardDq, dtype: Dtype::F16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_bwd_dq_bf16", kind: KernelKind::BackwardDq, dtype: Dtype::Bf16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_bwd_dkv_f16", kind: KernelKind::BackwardDkv, dtype: Dtype::F16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_bwd_dkv_bf16", kind: KernelKind::BackwardDkv, dtype: Dtype::Bf16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
            Entry { name: "flash_bwd_sinks", kind: KernelKind::BackwardSinks, dtype: Dtype::F16, head_dim: 0, policies: Policies::PLAIN, rows: 0, persistent: false, keys: None },
        ];
    };
}
attention_variants!(entry_rows);

/// [`ENTRIES`] of the dtypes the `Sm75` module has ([`PtxArch::has_dtype`]),
/// in the same order.
pub const TURING_ENTRIES: &[Entry] = &entries_of::<{ count_entries(PtxArch::Sm75) }>(PtxArch::Sm75);

const fn entries_of<const N: usize>(arch: PtxArch) -> [Entry; N] {
    let mut out = [ENTRIES[0]; N];
    let (mut i, mut n) = (0, 0);
    while i < ENTRIES.len() {
        if arch.has_dtype(ENTRIES[i].dtype) {
            out[n] = ENTRIES[i];
            n += 1;
        }
        i += 1;
    }
    assert!(n == N, "the entry count does not match the module's dtypes");
    out
}

const fn count_entries(arch: PtxArch) -> usize {
    let (mut i, mut n) = (0, 0);
    while i < ENTRIES.len() {
        if arch.has_dtype(ENTRIES[i].dtype) {
            n += 1;
        }
        i += 1;
    }
    n
}

/// Threads of the backward's helper kernels (`prep`, `dq`, `dkv`, `sinks`),
/// and of the key-block kernel up to D = 128 ([`BwdTile::threads`]).
pub const BWD_THREADS: usize = 4 * WARP_SIZE;
/// Padding after each shared-memory row of the backward tiles: a row is then
/// an odd number of 16-byte chunks (3 to 33), so the eight rows of an
/// `ldmatrix` phase, and the eight row groups of a fragment store, start in
/// distinct 16-byte bank groups.
pub const BWD_ROW_PAD_BYTES: usize = 16;

/// Warps that split dK's and dV's columns of the same keys when Pᵀ goes
/// through shared memory ([`BwdTile::shared_p`]).
pub const BWD_WIDE_COL_PARTS: usize = 4;

/// The backward CTA of the `mma.sync` kernel and its shared memory: the K
/// and V rows of its key block (read by every query block), `q_stages`
/// buffers of a query block's Q and dO rows and its LSE and `delta` (f32),
/// dSᵀ of the current block (keys x queries, for dQ = dS·K) and, with
/// `shared_p`, Pᵀ. With two stages the next block's copies run under the
/// current block's GEMMs.
///
/// Each warp computes Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for 16 keys ([`MMA_M`]
/// rows) and holds f32 accumulators of dK and dV for `dkv_keys()` keys and
/// `head_dim / col_parts()` columns. Up to D = 128 a warp holds the whole
/// dK and dV rows of its 16 keys (D registers per thread) and keeps Pᵀ and
/// dSᵀ in registers as the A fragments of dV += Pᵀ·dO and dK += dSᵀ·Q. At
/// D = 192 and 256 that would be 192-256 registers, so (`shared_p`) two
/// warps compute the Sᵀ of the same 16 keys, each over half of the block's
/// queries; all write Pᵀ and dSᵀ to shared memory, and each warp then
/// reads back whole rows of 32 keys for a quarter of dK's and dV's
/// columns, and dQ's tiles are 32 queries where the columns split evenly:
/// tiles of 32 rows read a B fragment once for two m16n8 tiles, a third
/// fewer `ldmatrix` per `mma` than 16-row tiles (FlashAttention-2's layout
/// at these head dims).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdTile {
    /// Q/K head dim.
    pub head_dim: usize,
    /// Keys per CTA.
    pub block_n: usize,
    /// Query rows per step: 64 up to D = 64; 32 at D = 96 and 128, which
    /// keeps Sᵀ and dPᵀ (2 x 16 registers) beside the dK and dV accumulators
    /// (2 x D / 2) in 255 registers. Above, the largest that fits shared
    /// memory ([`Self::of`]).
    pub block_m: usize,
    /// Query-block buffers: 2 where they fit the module's shared memory, else 1.
    pub q_stages: usize,
    /// CTAs per SM the PTX asks for (`.minnctapersm`), which caps the
    /// registers: 3 (168 registers) at D <= 64 in the sm_90 module, whose
    /// SMs hold three such tiles; 1 elsewhere (255 registers).
    pub ctas_per_sm: usize,
    /// Whether Pᵀ goes through shared memory and the dK/dV columns split
    /// across warps (D > 128).
    pub shared_p: bool,
}

impl BwdTile {
    /// The tile of head dim `head_dim` in `arch`'s module. Up to D = 128:
    /// 64 keys and two stages where they fit. Above, the first (keys, query
    /// rows, stages) of `WIDE` that fits the module's shared memory (else
    /// the last, which the kernel's compile-time check then refuses): the
    /// sm_90 module takes (64, 64, 2) at D = 192 and 256; sm_80's 99 KB
    /// (64, 32, 1) at 192 and (32, 32, 1) at 256; sm_75's 64 KB (32, 32, 1)
    /// at 192 and (32, 16, 1) at 256.
    pub const fn of(head_dim: usize, arch: PtxArch) -> BwdTile {
        let max = arch.max_smem_bytes();
        if head_dim <= 128 {
            let one = BwdTile {
                head_dim,
                block_n: 64,
                block_m: if head_dim <= 64 { 64 } else { 32 },
                q_stages: 1,
                ctas_per_sm: if head_dim <= 64 && matches!(arch, PtxArch::Sm90) {
                    3
                } else {
                    1
                },
                shared_p: false,
            };
            let two = BwdTile { q_stages: 2, ..one };
            return if two.smem_bytes() <= max { two } else { one };
        }
        const WIDE: [(usize, usize, usize); 4] =
            [(64, 64, 2), (64, 32, 1), (32, 32, 1), (32, 16, 1)];
        let mut i = 0;
        while i < WIDE.len() {
            let (block_n, block_m, q_stages) = WIDE[i];
            let t = BwdTile {
                head_dim,
                block_n,
                block_m,
                q_stages,
                ctas_per_sm: 1,
                shared_p: true,
            };
            if t.smem_bytes() <= max || i + 1 == WIDE.len() {
                return t;
            }
            i += 1;
        }
        panic!("unreachable: the last wide tile is returned")
    }
    /// Warps that compute the Sᵀ of the same 16 keys, each for a share of
    /// the query block.
    pub const fn s_parts(&self) -> usize {
        if self.shared_p {
            2
        } else {
            1
        }
    }
    /// Warps per CTA.
    pub const fn warps(&self) -> usize {
        self.block_n / MMA_M * self.s_parts()
    }
    /// Threads per CTA.
    pub const fn threads(&self) -> usize {
        self.warps() * WARP_SIZE
    }
    /// Warps that split the dK and dV columns of the same keys.
    pub const fn col_parts(&self) -> usize {
        if self.shared_p {
            BWD_WIDE_COL_PARTS
        } else {
            1
        }
    }
    /// Keys whose dK and dV (a column part of them) a warp accumulates.
    pub const fn dkv_keys(&self) -> usize {
        self.block_n * self.col_parts() / self.warps()
    }
    /// Query rows of a warp's dQ tile: 32 with `shared_p` where the warps
    /// then split D into whole pairs of n-tiles, else 16.
    pub const fn dq_rows(&self) -> usize {
        if self.shared_p && self.block_m >= 32 {
            let parts = self.warps() / (self.block_m / 32);
            if parts > 0 && self.head_dim.is_multiple_of(16 * parts) {
                return 32;
            }
        }
        MMA_M
    }
    /// Warps that share one dQ tile's rows (each takes `head_dim / dq_parts`
    /// columns): every warp works on every block.
    pub const fn dq_parts(&self) -> usize {
        self.warps() / (self.block_m / self.dq_rows())
    }
    /// Bytes of a padded row of `elems` 16-bit elements.
    pub const fn row_bytes(elems: usize) -> usize {
        elems * ELEM_BYTES + BWD_ROW_PAD_BYTES
    }
    /// Offset of V's tile (K's is 0).
    pub const fn v_offset(&self) -> usize {
        self.block_n * Self::row_bytes(self.head_dim)
    }
    /// Bytes of one query-block stage: Q, dO, then the LSE and `delta` rows.
    pub const fn stage_bytes(&self) -> usize {
        2 * self.block_m * Self::row_bytes(self.head_dim) + 2 * self.block_m * 4
    }
    /// Offset of Q's tile in stage `stage`; dO's follows it.
    pub const fn q_offset(&self, stage: usize) -> usize {
        2 * self.v_offset() + stage * self.stage_bytes()
    }
    /// Offset of stage `stage`'s LSE row (natural log, f32), then `delta`'s.
    pub const fn stats_offset(&self, stage: usize) -> usize {
        self.q_offset(stage) + 2 * self.block_m * Self::row_bytes(self.head_dim)
    }
    /// Offset of dSᵀ ([`Self::block_n`] rows of `block_m` elements).
    pub const fn ds_offset(&self) -> usize {
        self.q_offset(self.q_stages)
    }
    /// Offset of Pᵀ (as dSᵀ), used with `shared_p`.
    pub const fn p_offset(&self) -> usize {
        self.ds_offset() + self.block_n * Self::row_bytes(self.block_m)
    }
    /// Dynamic shared memory of the CTA.
    pub const fn smem_bytes(&self) -> usize {
        let score_tiles = if self.shared_p { 2 } else { 1 };
        self.ds_offset() + score_tiles * self.block_n * Self::row_bytes(self.block_m)
    }
}

/// Query rows per step of the Hopper backward: the M of dQ = dS·K.
pub const HOPPER_BWD_BLOCK_M: usize = WGMMA_M;
/// Head dims of the Hopper backward ([`HopperBwdTile`]); D = 32 stays on
/// the `mma.sync` kernel, which was faster there (docs/perf-notes.md v71).
pub const HOPPER_BWD_HEAD_DIMS: [usize; 3] = [64, 96, 128];

/// The Hopper backward CTA: `warpgroups` warpgroups of [`WGMMA_M`] keys
/// each, and its shared memory, every 16-bit tile in the SW128 layout
/// (`index::sw128_offset`: whole 64-column groups) that `wgmma`
/// descriptors read: K and V of the key block, two stages of a query
/// block's Q and dO and its LSE and `delta` rows (f32), and dSᵀ (keys x
/// queries). Offsets from the base rounded up to [`SWIZZLE_ATOM_BYTES`],
/// which the size includes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperBwdTile {
    /// Q/K head dim.
    pub head_dim: usize,
    /// Two where each warpgroup's half of dQ's columns (the N of its dQ
    /// `wgmma`, a slice of K's columns) lies within one 64-column group: a
    /// block of 128 keys, half the dQ atomics per key of one warpgroup's 64,
    /// one CTA per SM. Else (D = 96) one, two CTAs per SM.
    pub warpgroups: usize,
}

impl HopperBwdTile {
    /// Query-block stages: the next block's copies run under this one's GEMMs.
    pub const STAGES: usize = 2;
    /// The tile of head dim `head_dim`.
    pub const fn of(head_dim: usize) -> HopperBwdTile {
        let half = head_dim / 2;
        let split = head_dim <= SW128_ROW_ELEMS || half.is_multiple_of(SW128_ROW_ELEMS);
        HopperBwdTile {
            head_dim,
            warpgroups: if split { 2 } else { 1 },
        }
    }
    /// Keys per CTA.
    pub const fn block_n(&self) -> usize {
        self.warpgroups * WGMMA_M
    }
    /// Threads per CTA.
    pub const fn threads(&self) -> usize {
        self.warpgroups * WARPGROUP_THREADS
    }
    /// CTAs per SM the PTX asks for (`.minnctapersm`): as many as 255
    /// registers per thread allow.
    pub const fn ctas_per_sm(&self) -> usize {
        2 / self.warpgroups
    }
    /// Bytes of an SW128 tile of `rows` rows of the head dim.
    const fn tile_bytes(&self, rows: usize) -> usize {
        self.head_dim.div_ceil(SW128_ROW_ELEMS) * rows * SW128_ROW_BYTES
    }
    /// K's tile.
    pub const fn k_offset(&self) -> usize {
        0
    }
    /// V's tile.
    pub const fn v_offset(&self) -> usize {
        self.tile_bytes(self.block_n())
    }
    /// Q's tile of stage `stage`.
    pub const fn q_offset(&self, stage: usize) -> usize {
        2 * self.v_offset() + stage * 2 * self.tile_bytes(HOPPER_BWD_BLOCK_M)
    }
    /// dO's tile of stage `stage`.
    pub const fn do_offset(&self, stage: usize) -> usize {
        self.q_offset(stage) + self.tile_bytes(HOPPER_BWD_BLOCK_M)
    }
    /// Stage `stage`'s LSE row (natural log, f32), then `delta`'s.
    pub const fn stats_offset(&self, stage: usize) -> usize {
        self.q_offset(Self::STAGES) + stage * 2 * HOPPER_BWD_BLOCK_M * 4
    }
    /// dSᵀ: [`Self::block_n`] rows of [`HOPPER_BWD_BLOCK_M`] elements (one
    /// column group), after the stats, which end on an atom boundary.
    pub const fn ds_offset(&self) -> usize {
        self.stats_offset(Self::STAGES)
    }
    /// Dynamic shared memory of the CTA, with the alignment slack.
    pub const fn smem_bytes(&self) -> usize {
        self.ds_offset() + self.block_n() * HOPPER_BWD_BLOCK_M * ELEM_BYTES + SWIZZLE_ATOM_BYTES
    }
}

/// Threads of a probe CTA: one warpgroup.
pub const PROBE_THREADS: usize = WARPGROUP_THREADS;

/// Rows of one `wgmma` (`m64nNk16`): a warpgroup's share of a tile.
pub const WGMMA_M: usize = 64;

/// Elements of one row of a 128-byte-swizzled (SW128) tile: a TMA box's
/// inner size under `CU_TENSOR_MAP_SWIZZLE_128B`, and the column group in
/// which SW128 tiles store wider rows.
pub const SW128_ROW_ELEMS: usize = SW128_ROW_BYTES / ELEM_BYTES;
/// Bytes of one SW128 row: the swizzle's span.
pub const SW128_ROW_BYTES: usize = 128;

/// Bytes the Hopper kernels' dynamic shared memory is aligned to: an SW128
/// tile repeats every [`SWIZZLE_ROWS`] rows, and both `wgmma` descriptors
/// (base offset 0) and TMA's swizzle address it from that boundary. The
/// kernels round the window's base up, so a launch adds this much slack.
pub const SWIZZLE_ATOM_BYTES: usize = SW128_ROW_BYTES * SWIZZLE_ROWS;

/// Threads of a warpgroup: the unit that issues `wgmma` (4 consecutive
/// warps, the first a multiple of 4).
pub const WARPGROUP_THREADS: usize = 128;

/// The tile of one Hopper forward CTA (docs/hopper-plan.md §2): a producer
/// warpgroup whose one thread issues the TMA loads, and `consumers`
/// warpgroups that each own [`WGMMA_M`] query rows. Shared memory, from a
/// 1024-byte-aligned base: Q (`block_m` rows), `stages` K tiles, `v_stages` V
/// tiles (`block_n` rows each, every tile SW128 in 64-column groups, as TMA
/// writes it), then the mbarriers, a persistent CTA's tile slots and a
/// split-key tile's row states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperTile {
    /// Head dimension D.
    pub head_dim: usize,
    /// Consumer warpgroups per CTA.
    pub consumers: usize,
    /// Query rows per CTA: [`WGMMA_M`] per consumer warpgroup.
    pub block_m: usize,
    /// Keys per K/V block: the N of S = Q·Kᵀ and the K of O += P·V.
    pub block_n: usize,
    /// Stages of the K ring.
    pub stages: usize,
    /// Stages of the V ring: `stages`, but for [`Self::split_keys`].
    pub v_stages: usize,
    /// Both consumer warpgroups own the CTA's [`WGMMA_M`] query rows and
    /// take alternate 64-key blocks (consumer c the blocks c, c + 2, ...),
    /// each with an (m, l, O) of its own, merged through shared memory at
    /// the tile's end (docs/perf-notes.md v38): D = 256 in 64-row tiles,
    /// where one consumer's registers hold O and little else (v37). Q (32
    /// KiB), two K stages and four V stages (a V block stays in use one
    /// block longer than its K) fill 224 KiB. With an even number of
    /// stages in each ring a stage only ever holds one consumer's blocks,
    /// so each full barrier completes its phases for one waiter in turn (a
    /// parity wait on a barrier whose phases went to both consumers could
    /// pass on a phase still in flight). On the 16k-token sweep these tiles
    /// ran 0.75-0.87x the 128-row ones (v38), so the dispatch takes them
    /// only where 64-row CTAs do not outnumber the SMs ([`hopper_rows`]).
    pub split_keys: bool,
    /// Each consumer runs its blocks one GEMM at a time (cuDNN's D = 256
    /// tile: 128 rows, 128-key blocks): P(i-1)·V, its wait, then S(i), so
    /// that S (64 registers) and P (32) are never live together beside O
    /// (128). Without FlashAttention-3's intra-warpgroup overlap the other
    /// consumer's GEMMs (ping-pong, one turn per GEMM) cover the softmax.
    /// Its K and V rings hold half blocks ([`Self::stage_bytes`]). The
    /// dispatch takes it for short non-causal rows ([`hopper_keys`]).
    pub serial: bool,
    /// The consumer warpgroups take turns issuing their `wgmma`s
    /// (FlashAttention-3's ping-pong), so that one's softmax runs while the
    /// tensor cores work on the other's GEMMs.
    pub pingpong: bool,
    /// CTAs that share one SM (`.minnctapersm`): 2 for the one-consumer
    /// tiles, so that one CTA's prologue, first-block latency and epilogue
    /// run under the other's GEMMs, as the tile loop of a persistent CTA
    /// would hide them; 1 otherwise.
    pub ctas_per_sm: usize,
    /// The grid holds at most one CTA per SM and each CTA loops over tiles
    /// (`index::persistent_step`): the producer loads the next tile's Q into
    /// another buffer and its first K/V blocks while the consumers finish
    /// the current one, so a tile's prologue and load latency run under the
    /// previous tile's GEMMs. Short rows gain; on long rows the loop's state
    /// costs a few percent (docs/perf-notes.md v18, v23), so these are lines
    /// of their own.
    pub persistent: bool,
}

impl HopperTile {
    /// Registers per thread the producer keeps: it only runs the load loop.
    pub const PRODUCER_REGS: u32 = 24;
    /// The same for a persistent CTA, whose producer also walks the tile
    /// order (`index::persistent_step`) and each tile's key range: with 24
    /// the causal lines spilled 76 bytes, with 32 28 bytes (ptxas 13.0). The
    /// consumers keep 232.
    pub const PERSISTENT_PRODUCER_REGS: u32 = 40;
    /// Index of Q buffer 0's full barrier (see [`Self::barrier`]): Q full
    /// and Q empty per buffer, then the rings'.
    pub const Q_FULL: usize = 0;

    /// The tile of a head dimension with `rows` query rows per CTA; `None`
    /// when the Hopper path has none (smaller head dims run on the next
    /// tile, [`hopper_line_head_dim`]). SW128 tiles hold whole 64-column
    /// groups ([`Self::smem_cols`]), so D = 96 takes D = 128's shared memory
    /// but only its own `wgmma` work: six k-steps of Q·Kᵀ where the D = 128
    /// tile runs eight, and an O of n = 96. Per consumer thread, S takes
    /// block_n / 2 f32 registers, P block_n / 4 and O D / 2: D = 64, 96 and
    /// 128 take 128-key blocks (O 32-64, S 64, P 32); D = 192 takes 112 keys
    /// (O 96, S 56, P 28; with 128 keys two K and V stages would not fit in
    /// shared memory) and D = 256 80 keys as FlashAttention-3 does (O 128,
    /// S 40, P 20): Q plus two K and V stages then fill 217 and 225 of 227
    /// KiB (D = 128's paged lines take three: 224 KiB). Rows: 128 (two consumer warpgroups)
    /// for every head dim; 192 (three, as FlashAttention-3 at D = 64) for
    /// D = 64, whose S, P and O fit the 160 registers three consumers leave
    /// each, so a CTA's fixed cost (prologue, the first K block's latency,
    /// epilogue) and its K/V traffic spread over 1.5x the rows; 64 (one
    /// consumer with 232 registers, two CTAs per SM) for D = 64, 96 and 128,
    /// so that on short rows one CTA's fixed cost runs under the other's
    /// GEMMs (D = 96 and 128 then take 64-key blocks: two CTAs fit 2 x 82
    /// KiB); at
    /// D = 256, 64 rows are a [`Self::split_keys`] tile of two consumers
    /// and 64-key blocks, one CTA per SM.
    ///
    /// `keys`, where given, is a line's own keys per block: any multiple of
    /// 16 up to its head dim's, since fewer keys only shrink the K and V
    /// tiles and S (D = 256 causal at 64: docs/perf-notes.md v27).
    pub const fn for_head_dim(
        head_dim: usize,
        policies: Policies,
        rows: usize,
        persistent: bool,
        keys: Option<usize>,
    ) -> Option<HopperTile> {
        let split_keys = matches!((head_dim, rows), (256, 64));
        let most_keys = match (head_dim, rows) {
            // One 64-key block per consumer in flight at a time.
            (256, 64) => 64,
            // Two CTAs of Q plus two K and V stages of 128 keys would take
            // 2 x 145 KiB.
            (96 | 128, 64) => 64,
            (64 | 96 | 128, _) => 128,
            (192, _) => 112,
            (256, _) => 80,
            _ => return None,
        };
        let serial = head_dim == 256 && rows == 128 && !persistent && matches!(keys, Some(128));
        let block_n = match keys {
            None => most_keys,
            Some(n) if n % 16 == 0 && n > 0 && n <= most_keys => n,
            Some(_) if serial => 128,
            Some(_) => return None,
        };
        let local_modified = matches!(
            (policies.mask, policies.score),
            (MaskKind::Local, ScoreKind::Modified)
        );
        match (rows, head_dim) {
            (128, _) | (192, 64) | (64, 64 | 96 | 128) => {}
            (64, 256) if !persistent => {}
            _ => return None,
        }
        // Three Q buffers fit beside two K/V stages at D = 128 with 128
        // rows (224 of 227 KiB; at D = 64 four beside four stages, 192
        // KiB); the loop serves dense sequences.
        if persistent
            && (rows != HOPPER_PERSISTENT_ROWS
                || head_dim > 128
                || !matches!(policies.seq, SeqKind::Dense))
        {
            return None;
        }
        let consumers = if split_keys { 2 } else { rows / WGMMA_M };
        // A third K/V stage fits D = 128's 128-row tiles (224 of 227
        // KiB). Measured (docs/perf-notes.md, v22): it makes paged loads
        // of 16-token pages 1.06x faster (each block is 16 small boxes
        // per tensor, so the ring needs more depth to hide them) and the
        // dense lines 1-2 % slower, so only the paged lines take it.
        // D = 64's persistent lines serve short rows, whose K/V blocks
        // come from DRAM more often (few query tiles share a head):
        // there 4 stages were fastest (v28; causal since its tiles run
        // as one pipeline, v29: 1.004-1.016x over 3), and 3-4 stages
        // cost the long-row lines 1-3 %.
        let stages = match (head_dim, rows, policies.seq) {
            _ if serial => Self::SERIAL_K_HALVES,
            (96 | 128, 128, SeqKind::Ragged) => 3,
            (64, _, _) if persistent => 4,
            _ => 2,
        };
        Some(HopperTile {
            head_dim,
            consumers,
            block_m: rows,
            block_n,
            stages,
            v_stages: if split_keys {
                4
            } else if serial {
                Self::SERIAL_V_HALVES
            } else {
                stages
            },
            split_keys,
            serial,
            // Measured per head dim (docs/perf-notes.md, v16; v24: the
            // D = 64 persistent lines lose 2-6 % with it; D = 192 as 256,
            // not measured); the turn barriers pair two warpgroups.
            // The D = 256 window/modifier line spills with them.
            pingpong: match head_dim {
                _ if consumers != 2 || split_keys => false,
                64 => false,
                96 | 128 => true,
                _ => !local_modified,
            },
            ctas_per_sm: if consumers == 1 { 2 } else { 1 },
            persistent,
        })
    }

    /// [`Self::for_head_dim`] where a missing tile is a build error.
    pub const fn of(
        head_dim: usize,
        policies: Policies,
        rows: usize,
        persistent: bool,
        keys: Option<usize>,
    ) -> HopperTile {
        match Self::for_head_dim(head_dim, policies, rows, persistent, keys) {
            Some(t) => t,
            None => panic!("no Hopper tile for this head dim and rows"),
        }
    }

    /// Consumer warpgroup c's first query row in the tile: its own
    /// [`WGMMA_M`] rows, or 0 where the consumers share them
    /// ([`Self::split_keys`]).
    pub const fn first_row(self, c: u32) -> u32 {
        if self.split_keys {
            0
        } else {
            c * WGMMA_M as u32
        }
    }
    /// Threads per CTA: the producer warpgroup and the consumers.
    pub const fn threads(self) -> usize {
        (1 + self.consumers) * WARPGROUP_THREADS
    }
    /// Registers per producer thread ([`Self::PRODUCER_REGS`],
    /// [`Self::PERSISTENT_PRODUCER_REGS`]).
    pub const fn producer_regs(self) -> u32 {
        if self.persistent {
            Self::PERSISTENT_PRODUCER_REGS
        } else {
            Self::PRODUCER_REGS
        }
    }
    /// Registers per consumer thread: what the producer leaves of the CTA's
    /// share of the 64K, rounded down to `setmaxnreg`'s multiple of 8 (one
    /// consumer, two CTAs per SM: 232; two consumers: 240; three: 160).
    pub const fn consumer_regs(self) -> u32 {
        let left = 65536 / self.ctas_per_sm - WARPGROUP_THREADS * self.producer_regs() as usize;
        (left / (self.consumers * WARPGROUP_THREADS)) as u32 & !7
    }
    /// Columns of a row in shared memory: the head dim in whole 64-column
    /// SW128 groups, as TMA writes them (D = 96: a second group of which
    /// TMA zero-fills the last 32 columns, which no `wgmma` reads).
    pub const fn smem_cols(self) -> usize {
        // Plain arithmetic: with `next_multiple_of` or `div_ceil` the PTX
        // of 18-22 entries whose tiles it does not change changed
        // (docs/perf-notes.md v56).
        #[allow(clippy::manual_div_ceil)]
        let cols = (self.head_dim + SW128_ROW_ELEMS - 1) / SW128_ROW_ELEMS * SW128_ROW_ELEMS;
        cols
    }
    /// Bytes of the Q tile.
    pub const fn q_bytes(self) -> usize {
        self.block_m * self.smem_cols() * ELEM_BYTES
    }
    /// Bytes of one K or V tile.
    pub const fn kv_bytes(self) -> usize {
        self.block_n * self.smem_cols() * ELEM_BYTES
    }
    /// Stages of a serial tile's K ring, each half a block (two of its four
    /// 64-column groups, half of S's k-steps), so that a stage frees, and
    /// the next half loads, while the other half is still read; with
    /// [`Self::SERIAL_V_HALVES`] 160 KiB beside Q's 64. H100, 512 keys,
    /// against whole 64 KiB blocks in one K and one V stage: 1.01x; 3 K and
    /// 2 V halves 0.3-0.8 % faster than 2 and 3 (docs/perf-notes.md, v44).
    pub const SERIAL_K_HALVES: usize = 3;
    /// Stages of a serial tile's V ring, each half a block (half of O's
    /// columns).
    pub const SERIAL_V_HALVES: usize = 2;
    /// Bytes of one ring stage: a block's K or V tile, or half of it on a
    /// serial tile.
    pub const fn stage_bytes(self) -> usize {
        if self.serial {
            self.kv_bytes() / 2
        } else {
            self.kv_bytes()
        }
    }
    /// Q buffers: three or four in a persistent CTA, else one. A buffer
    /// frees after the next tile's first softmax (once the TMA store of the
    /// O it held has read it), so with two the next Q could only start
    /// loading then, and a causal light tile (one key block) ends before it
    /// lands: the third buffer gives its load a whole tile (docs/perf-notes.md,
    /// v24). A line without ping-pong runs its tiles as one pipeline, which
    /// needs the next tile's Q before the current one's epilogue, and frees a
    /// buffer a tile later: a fourth buffer restores that tile (v29).
    pub const fn q_buffers(self) -> usize {
        match (self.persistent, self.pingpong) {
            (true, false) => 4,
            (true, true) => 3,
            (false, _) => 1,
        }
    }
    /// Offset of Q buffer `b`.
    pub const fn q_offset(self, b: usize) -> usize {
        b * self.q_bytes()
    }
    /// Offset of stage `s`'s K tile.
    pub const fn k_offset(self, s: usize) -> usize {
        self.q_offset(self.q_buffers()) + s * self.stage_bytes()
    }
    /// Offset of stage `s`'s V tile.
    pub const fn v_offset(self, s: usize) -> usize {
        self.k_offset(self.stages) + s * self.stage_bytes()
    }
    /// Barriers: Q full per Q buffer, Q empty per buffer of a persistent
    /// CTA (its consumers release a buffer once the tile's epilogue has read
    /// it; one Q is loaded once), then K full and K empty per K stage, V
    /// full and V empty per V stage.
    pub const fn barriers(self) -> usize {
        self.v_ring() + 2 * self.v_stages
    }
    /// Index of the V ring's first (full) barrier; its empty barriers
    /// follow its full ones, as the K ring's do.
    pub const fn v_ring(self) -> usize {
        self.k_ring() + 2 * self.stages
    }
    /// Index of Q buffer `b`'s empty barrier (persistent CTAs only).
    pub const fn q_empty(self, b: usize) -> usize {
        self.q_buffers() + b
    }
    /// Index of the K ring's first (full) barrier.
    pub const fn k_ring(self) -> usize {
        self.q_buffers() * (1 + self.persistent as usize)
    }
    /// Offset of barrier `i` (8 bytes each).
    pub const fn barrier(self, i: usize) -> usize {
        self.v_offset(self.v_stages) + 8 * i
    }
    /// Offset of Q buffer `b`'s tile slot in a persistent CTA: the
    /// producer writes the tile it loads there (query block, pair; 8 bytes)
    /// before the buffer's full barrier completes, and the consumers read
    /// it after their wait on that barrier.
    pub const fn tile_slot(self, b: usize) -> usize {
        self.barrier(self.barriers()) + 8 * b
    }
    /// Whether a persistent line of this tile under `mask` claims its tiles
    /// from a counter when the launch gives one (`index::TileGrid::counter`):
    /// the causal lines, whose tiles differ in key blocks, and the lines
    /// without ping-pong. The other persistent lines walk the static order,
    /// as before the counters: on their non-causal D = 96 and 128 rows at
    /// 512 keys the counter's code cost 2-3 % in every order (H100,
    /// docs/perf-notes.md v35).
    pub const fn claims_tiles(self, mask: MaskKind) -> bool {
        self.persistent && (!self.pingpong || matches!(mask, MaskKind::Causal))
    }
    /// Dynamic shared memory of one CTA, with the slack that lets the kernel
    /// round its base up to [`SWIZZLE_ATOM_BYTES`].
    pub const fn smem_bytes(self) -> usize {
        SWIZZLE_ATOM_BYTES + self.merge_rows_offset() + self.merge_rows_bytes()
    }
    /// Offset of a [`Self::split_keys`] tile's row states: each consumer's
    /// (m, l) of every row, 8 bytes each, exchanged at the tile's end (its
    /// O goes through the tile's Q buffer); past the tile slots.
    pub const fn merge_rows_offset(self) -> usize {
        let slots = if self.persistent { self.q_buffers() } else { 0 };
        self.tile_slot(slots)
    }
    const fn merge_rows_bytes(self) -> usize {
        if self.split_keys {
            2 * self.block_m * 8
        } else {
            0
        }
    }
}

/// The one table of the `Sm90a` module's entries, in three groups:
///
/// - `fwd dtype D mask scores seq rows`: the Hopper forward
///   ([`KernelKind::WgmmaForward`]) with `rows` query rows per CTA (64 per
///   consumer warpgroup), named `flash_wgmma_fwd_...` with the words of
///   `attention_variants` and `_m{rows}`; dispatch takes the first line that
///   covers a call and has the rows [`hopper_rows`] picks for it, else the
///   first that covers it, and calls no line covers stay on the `Sm90`
///   module. Per head dim: plain full and causal (the hot cases), causal
///   with score modifiers (softcap, ALiBi, sinks: Gemma 2, Bloom, gpt-oss),
///   and `local modified` for every other dense call (windows, non-causal
///   modifiers); the same three per head dim for packed sequences (128
///   rows), and causal plus `local modified` for packed queries against a
///   paged cache (chunked prefill; boxes of `index::paged_box_rows` rows
///   per page). D = 64 has 192-row lines besides the
///   128-row ones (not `local modified`, which spills with 192); 64-row
///   lines (one consumer, two CTAs per SM) serve every D = 64 call and
///   plain full and causal calls at D = 96 and 128 (D = 96's lines are
///   D = 128's, line for line); at D = 256 the 64-row plain
///   full and causal lines give each tile two consumers that take
///   alternate key blocks ([`HopperTile::split_keys`]). A line ending in `persistent`
///   ([`HopperTile::persistent`]; `_persistent` in its name: plain full and
///   causal at D = 64, 96 and 128, windows: `local modified` at D = 64,
///   `local plain` at D = 96 and 128, whose `local modified` spills with the persistent
///   producer's registers) is taken before the others where
///   [`hopper_persistent`] says so. A line ending in `n64` takes 64-key
///   blocks, fewer than its head dim's (`_n64` in its name: plain causal at
///   D = 256), and is taken only where [`hopper_keys`] says so. A head dim
///   without lines runs on the next one's ([`hopper_line_head_dim`]).
/// - `wgmma dtype N K`: a primitive probe that multiplies a 64 x K by a
///   K x N tile (`m64nNk16`, K/16 steps) both with A and B in shared memory
///   (B K-major, as Kᵀ in Q·Kᵀ; needs K % 64 == 0) and with A in registers
///   and B MN-major (as V in P·V; needs N % 64 == 0).
/// - `tma D`: a probe that copies [S, H, D] tiles through a two-stage TMA +
///   mbarrier ring and back out with a TMA store.
///
/// The probe shapes are those of the forward: Q·Kᵀ at D = 128 (176 keys),
/// 192 (112 keys) and 256 (80 and 64 keys), P·V at the same, and the
/// 128 x 128 causal tile; TMA boxes of every line head dim.
macro_rules! hopper_entries {
    ($callback:ident) => {
        $callback! {
            fwd f16 64 full plain dense 128 persistent;
            fwd f16 64 causal plain dense 128 persistent;
            fwd f16 128 full plain dense 128 persistent;
            fwd f16 96 full plain dense 128 persistent;
            fwd f16 128 causal plain dense 128 persistent;
            fwd f16 96 causal plain dense 128 persistent;
            fwd f16 64 local modified dense 128 persistent;
            fwd f16 128 local plain dense 128 persistent;
            fwd f16 96 local plain dense 128 persistent;
            fwd f16 64 full plain dense 192;
            fwd f16 64 causal plain dense 192;
            fwd f16 64 causal modified dense 192;
            fwd f16 64 full plain dense 128;
            fwd f16 64 causal plain dense 128;
            fwd f16 64 causal modified dense 128;
            fwd f16 64 local modified dense 128;
            fwd f16 64 full plain dense 64;
            fwd f16 64 causal plain dense 64;
            fwd f16 64 causal modified dense 64;
            fwd f16 64 local modified dense 64;
            fwd f16 128 full plain dense 128;
            fwd f16 96 full plain dense 128;
            fwd f16 128 causal plain dense 128;
            fwd f16 96 causal plain dense 128;
            fwd f16 128 causal modified dense 128;
            fwd f16 96 causal modified dense 128;
            fwd f16 128 local modified dense 128;
            fwd f16 96 local modified dense 128;
            fwd f16 128 full plain dense 64;
            fwd f16 96 full plain dense 64;
            fwd f16 128 causal plain dense 64;
            fwd f16 96 causal plain dense 64;
            fwd f16 192 full plain dense 128;
            fwd f16 192 causal plain dense 128;
            fwd f16 192 causal modified dense 128;
            fwd f16 192 local modified dense 128;
            fwd f16 256 full plain dense 128;
            fwd f16 256 causal plain dense 128;
            fwd f16 256 causal plain dense 128 n64;
            fwd f16 256 full plain dense 128 n128;
            fwd f16 256 causal modified dense 128;
            fwd f16 256 local modified dense 128;
            fwd f16 256 full plain dense 64;
            fwd f16 256 causal plain dense 64;
            fwd f16 64 full plain packed 128;
            fwd f16 64 causal plain packed 128;
            fwd f16 64 local modified packed 128;
            fwd f16 128 full plain packed 128;
            fwd f16 96 full plain packed 128;
            fwd f16 128 causal plain packed 128;
            fwd f16 96 causal plain packed 128;
            fwd f16 128 local modified packed 128;
            fwd f16 96 local modified packed 128;
            fwd f16 192 full plain packed 128;
            fwd f16 192 causal plain packed 128;
            fwd f16 192 local modified packed 128;
            fwd f16 256 full plain packed 128;
            fwd f16 256 causal plain packed 128;
            fwd f16 256 local modified packed 128;
            fwd f16 64 causal plain ragged 128;
            fwd f16 64 local modified ragged 128;
            fwd f16 128 causal plain ragged 128;
            fwd f16 96 causal plain ragged 128;
            fwd f16 128 local modified ragged 128;
            fwd f16 96 local modified ragged 128;
            fwd f16 192 causal plain ragged 128;
            fwd f16 192 local modified ragged 128;
            fwd f16 256 causal plain ragged 128;
            fwd f16 256 local modified ragged 128;
            fwd bf16 64 full plain dense 128 persistent;
            fwd bf16 64 causal plain dense 128 persistent;
            fwd bf16 128 full plain dense 128 persistent;
            fwd bf16 96 full plain dense 128 persistent;
            fwd bf16 128 causal plain dense 128 persistent;
            fwd bf16 96 causal plain dense 128 persistent;
            fwd bf16 64 local modified dense 128 persistent;
            fwd bf16 128 local plain dense 128 persistent;
            fwd bf16 96 local plain dense 128 persistent;
            fwd bf16 64 full plain dense 192;
            fwd bf16 64 causal plain dense 192;
            fwd bf16 64 causal modified dense 192;
            fwd bf16 64 full plain dense 128;
            fwd bf16 64 causal plain dense 128;
            fwd bf16 64 causal modified dense 128;
            fwd bf16 64 local modified dense 128;
            fwd bf16 64 full plain dense 64;
            fwd bf16 64 causal plain dense 64;
            fwd bf16 64 causal modified dense 64;
            fwd bf16 64 local modified dense 64;
            fwd bf16 128 full plain dense 128;
            fwd bf16 96 full plain dense 128;
            fwd bf16 128 causal plain dense 128;
            fwd bf16 96 causal plain dense 128;
            fwd bf16 128 causal modified dense 128;
            fwd bf16 96 causal modified dense 128;
            fwd bf16 128 local modified dense 128;
            fwd bf16 96 local modified dense 128;
            fwd bf16 128 full plain dense 64;
            fwd bf16 96 full plain dense 64;
            fwd bf16 128 causal plain dense 64;
            fwd bf16 96 causal plain dense 64;
            fwd bf16 192 full plain dense 128;
            fwd bf16 192 causal plain dense 128;
            fwd bf16 192 causal modified dense 128;
            fwd bf16 192 local modified dense 128;
            fwd bf16 256 full plain dense 128;
            fwd bf16 256 causal plain dense 128;
            fwd bf16 256 causal plain dense 128 n64;
            fwd bf16 256 full plain dense 128 n128;
            fwd bf16 256 causal modified dense 128;
            fwd bf16 256 local modified dense 128;
            fwd bf16 256 full plain dense 64;
            fwd bf16 256 causal plain dense 64;
            fwd bf16 64 full plain packed 128;
            fwd bf16 64 causal plain packed 128;
            fwd bf16 64 local modified packed 128;
            fwd bf16 128 full plain packed 128;
            fwd bf16 96 full plain packed 128;
            fwd bf16 128 causal plain packed 128;
            fwd bf16 96 causal plain packed 128;
            fwd bf16 128 local modified packed 128;
            fwd bf16 96 local modified packed 128;
            fwd bf16 192 full plain packed 128;
            fwd bf16 192 causal plain packed 128;
            fwd bf16 192 local modified packed 128;
            fwd bf16 256 full plain packed 128;
            fwd bf16 256 causal plain packed 128;
            fwd bf16 256 local modified packed 128;
            fwd bf16 64 causal plain ragged 128;
            fwd bf16 64 local modified ragged 128;
            fwd bf16 128 causal plain ragged 128;
            fwd bf16 96 causal plain ragged 128;
            fwd bf16 128 local modified ragged 128;
            fwd bf16 96 local modified ragged 128;
            fwd bf16 192 causal plain ragged 128;
            fwd bf16 192 local modified ragged 128;
            fwd bf16 256 causal plain ragged 128;
            fwd bf16 256 local modified ragged 128;
            bwd f16 64 local plain dense;
            bwd f16 96 local plain dense;
            bwd f16 128 local plain dense;
            bwd bf16 64 local plain dense;
            bwd bf16 96 local plain dense;
            bwd bf16 128 local plain dense;
            bwd f16 64 local modified dense;
            bwd f16 96 local modified dense;
            bwd f16 128 local modified dense;
            bwd bf16 64 local modified dense;
            bwd bf16 96 local modified dense;
            bwd bf16 128 local modified dense;
            wgmma f16 64 64;
            wgmma f16 128 128;
            wgmma f16 176 128;
            wgmma f16 128 176;
            wgmma f16 112 192;
            wgmma f16 192 112;
            wgmma f16 80 256;
            wgmma f16 256 80;
            wgmma f16 64 256;
            wgmma f16 256 64;
            wgmma bf16 64 64;
            wgmma bf16 128 128;
            wgmma bf16 176 128;
            wgmma bf16 128 176;
            wgmma bf16 112 192;
            wgmma bf16 192 112;
            wgmma bf16 80 256;
            wgmma bf16 256 80;
            wgmma bf16 64 256;
            wgmma bf16 256 64;
            tma 64;
            tma 128;
            tma 192;
            tma 256;
        }
    };
}
#[allow(unused_imports)] // used by the device crate's entries only
pub(crate) use hopper_entries;

macro_rules! hopper_rows {
    (
        $(fwd $fdtype:ident $fd:literal $mask:ident $score:ident $seq:ident $rows:literal $($grid:ident)?;)*
        $(bwd $bdtype:ident $bd:literal $bmask:ident $bscore:ident $bseq:ident;)*
        $(wgmma $dtype:ident $n:literal $k:literal;)*
        $(tma $d:literal;)*
    ) => {
        /// Every entry point of the `Sm90a` module (`hopper_entries`).
        pub const HOPPER_ENTRIES: &[Entry] = &[
            $(Entry {
                name: concat!(
                    "flash_wgmma_fwd_", stringify!($fdtype), "_hd", stringify!($fd),
                    "_", stringify!($mask), "_", stringify!($score), "_", stringify!($seq),
                    "_m", stringify!($rows) $(, "_", stringify!($grid))?
                ),
                kind: KernelKind::WgmmaForward,
                dtype: table_word!(dtype $fdtype),
                head_dim: $fd,
                policies: Policies {
                    mask: table_word!(mask $mask),
                    score: table_word!(score $score),
                    seq: table_word!(seq $seq),
                },
                rows: $rows,
                persistent: table_word!(grid $($grid)?),
                keys: table_word!(keys $($grid)?),
            },)*
            $(Entry {
                name: concat!(
                    "flash_wgmma_bwd_", stringify!($bdtype), "_hd", stringify!($bd),
                    "_", stringify!($bmask), "_", stringify!($bscore), "_", stringify!($bseq)
                ),
                kind: KernelKind::WgmmaBackward,
                dtype: table_word!(dtype $bdtype),
                head_dim: $bd,
                policies: Policies {
                    mask: table_word!(mask $bmask),
                    score: table_word!(score $bscore),
                    seq: table_word!(seq $bseq),
                },
                rows: 0,
                persistent: false,
                keys: None,
            },)*
            $(Entry {
                name: concat!("flash_probe_wgmma_", stringify!($dtype), "_n", stringify!($n), "_k", stringify!($k)),
                kind: KernelKind::Probe,
                dtype: table_word!(dtype $dtype),
                head_dim: $n,
                policies: Policies::PLAIN,
                rows: 0,
                persistent: false,
                keys: None,
            },)*
            $(Entry {
                name: concat!("flash_probe_tma_hd", stringify!($d)),
                kind: KernelKind::Probe,
                dtype: Dtype::F16,
                head_dim: $d,
                policies: Policies::PLAIN,
                rows: 0,
                persistent: false,
                keys: None,
            },)*
        ];
    };
}
hopper_entries!(hopper_rows);

/// A forward call as the Hopper dispatch sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperCall {
    /// Element type of Q, K, V and O.
    pub dtype: Dtype,
    /// Head dimension D.
    pub head_dim: usize,
    /// The policies the call needs.
    pub need: Policies,
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Query rows per sequence.
    pub seqlen_q: usize,
    /// Keys per sequence.
    pub seqlen_k: usize,
    /// Keys one query row sees at most under a sliding window bounded on
    /// both sides (left + right + 1); `None` without one.
    pub window_keys: Option<usize>,
    /// The device's streaming multiprocessors.
    pub num_sms: usize,
}

/// Keys per query row from which a causal call takes 192-row tiles:
/// a 192-row tile's diagonal crosses one more 128-key block than a 128-row
/// tile's, which short rows cannot amortise (H100, D = 64 causal: 0.92x at
/// 512 and 1k keys, 1.06x at 2k, 1.18x at 16k; docs/perf-notes.md v17).
pub const HOPPER_WIDE_CAUSAL_MIN_KEYS: usize = 2048;

/// Keys per query row up to which a call on the D = 64 lines takes the
/// 64-row tiles (two CTAs per SM), non-causal and causal: there a CTA's
/// fixed cost is a large part of its time, and the other CTA's GEMMs hide
/// it (H100, over the 192-row tile: non-causal 1.04-1.05x at 512 and 1k
/// keys, 0.92x at 2k; causal over the 128/192-row tiles 1.13-1.16x at 512
/// and 1k, 1.02-1.03x at 2k, 0.99-1.01x at 4k; docs/perf-notes.md v19).
pub const HOPPER_NARROW_MAX_KEYS_D64: [usize; 2] = [1024, 2048];

/// The same for the D = 128 lines, whose 64-row tiles take 64-key blocks:
/// only causal calls over 512 keys gain (1.03-1.05x; non-causal 0.95x at
/// 512, causal 0.96x at 1k).
pub const HOPPER_NARROW_MAX_KEYS_D128: [usize; 2] = [0, 512];

/// Query rows per CTA for a Hopper forward call:
/// - 64 (one consumer, two CTAs per SM; at D = 256 two consumers that
///   take alternate key blocks, `HopperTile::split_keys`) on the lines of
///   D = 64 and 128 over few keys ([`HOPPER_NARROW_MAX_KEYS_D64`], [`HOPPER_NARROW_MAX_KEYS_D128`];
///   a window bounded on both sides counts its width, as non-causal rows),
///   or where 64-row CTAs do not outnumber the SMs: each then has an SM to
///   itself, twice as many SMs as 128-row tiles would use (H100, D = 64, 8
///   or 9 heads of 512-1k rows: 1.19-1.31x);
/// - 192 where the call fills at least one wave of such CTAs (fewer,
///   shorter CTAs finish sooner on an idle GPU) and is not causal over short
///   rows;
/// - 128 otherwise.
///
/// A call whose line has no tile of the rows chosen takes its 128-row one
/// ([`find_hopper_entry`]).
pub const fn hopper_rows(call: &HopperCall) -> usize {
    const WIDE: usize = 3 * WGMMA_M;
    let causal = matches!(call.need.mask, MaskKind::Causal);
    let narrow_max = match hopper_line_head_dim(call.head_dim) {
        Some(64) => HOPPER_NARROW_MAX_KEYS_D64,
        Some(96 | 128) => HOPPER_NARROW_MAX_KEYS_D128,
        _ => [0, 0],
    };
    // A window bounded on both sides: every row sees about as many keys as
    // a non-causal row of that length.
    let few_keys = match (call.need.mask, call.window_keys) {
        (MaskKind::Local, Some(w)) => w <= narrow_max[0] || call.seqlen_k <= narrow_max[0],
        _ => call.seqlen_k <= narrow_max[causal as usize],
    };
    let narrow_ctas = call.batch * call.heads * call.seqlen_q.div_ceil(WGMMA_M);
    if few_keys || narrow_ctas <= call.num_sms {
        return WGMMA_M;
    }
    let ctas = call.batch * call.heads * call.seqlen_q.div_ceil(WIDE);
    let short_causal = causal && call.seqlen_k < HOPPER_WIDE_CAUSAL_MIN_KEYS;
    if ctas >= call.num_sms && !short_causal {
        WIDE
    } else {
        2 * WGMMA_M
    }
}

/// Keys per query row up to which a call whose line has a persistent twin
/// (`HopperTile::persistent`: D = 64, 96 and 128, plain full and causal;
/// D = 32 on D = 64's, padded) takes it, non-causal and causal. H100, over
/// the lines `hopper_rows` picks (docs/perf-notes.md v23): at 512 keys
/// 1.10-1.14x non-causal, 1.04-1.11x causal; at 1k 1.02-1.04x and
/// 1.03-1.06x; non-causal at 2k 0.90-0.94x (D = 64), 1.01-1.02x (D = 128;
/// v25). Causal since the dynamic tile order (v35), three leases (v36):
/// at 4k D = 64 1.05-1.08x, D = 96 1.00-1.04x, D = 128 1.00-1.04x; at 2k
/// D = 96 0.96-1.16x (rounds spread 5-14 %; median 1.08x); at 8k 0.97-0.98x
/// on D = 64's sweep rows, at 16k 0.94x.
pub const HOPPER_PERSISTENT_MAX_KEYS: [usize; 2] = [1024, 4096];

/// Keys per row (a window's width: `left + right + 1`) up to which a
/// call with a window bounded on both sides takes its persistent line
/// where one covers it: on the D = 64 lines (`.0`) and the D = 128 lines
/// (`.1`). H200, 8k-token causal prompts, against the 64-row (D = 64, up
/// to 1k keys) and 128-row lines (docs/perf-notes.md v52): D = 64 at 129,
/// 513 and 2049 keys 1.25x, 1.11x, 1.10x; D = 128 at 129 and 513 keys
/// 1.31x and 1.10x, at 1025 0.99x, at 2049 0.87x. D = 32 and 96 on those
/// lines (v53): at 129, 513 and 2049 keys 1.25x, 1.13x, 1.09x (D = 32) and
/// 1.32x, 1.11x, 0.96x (D = 96, forced at 2049).
pub const HOPPER_PERSISTENT_MAX_WINDOW_KEYS: [usize; 2] = [2049, 513];

/// Causal calls of at most this many waves of 128-row tiles (`.0`) take
/// the persistent line up to `.1` keys per row, past
/// [`HOPPER_PERSISTENT_MAX_KEYS`]: the tiles of a few-wave causal grid
/// differ in length by up to the whole row, and the counter's
/// longest-first claims even out the SMs' finish, which a grid of CTAs
/// launched heaviest first does less well. H100 (docs/perf-notes.md v36),
/// against the non-persistent lines at 8k keys: SmolLM's 9 heads (4.4
/// waves) 1.14-1.16x, 8-16 heads of D = 128 (3.9-7.8 waves) 1.05-1.08x,
/// 12-16 heads of D = 64 1.08-1.12x; 11.6 waves 1.00x. At 16k keys the
/// persistent lines lose at any grid (0.94-0.97x; 8 heads of D = 128,
/// 7.8 waves: 0.95x).
pub const HOPPER_PERSISTENT_CAUSAL_FEW_WAVES: (usize, usize) = (8, 8192);

/// Waves of the grid's tiles in the tail of a causal launch's dynamic
/// order (`index::dynamic_tile`: heaviest first across the tail's pairs).
/// A longer tail evens out the SMs' finish more, and spreads more pairs'
/// K/V over the same time in L2: H100, 512 keys, D = 128 causal, against a
/// 3-wave tail: 2 waves 1.01x, 6 waves 0.87x (docs/perf-notes.md v35).
pub const HOPPER_TAIL_WAVES: usize = 2;

/// Short non-causal rows against long keys on the D = 64 lines: up to
/// this many queries per sequence and keys per row, a call takes its
/// persistent line past [`HOPPER_PERSISTENT_MAX_KEYS`]. The 192-row tiles
/// it would take otherwise pad 512 queries to 576 rows, and the persistent
/// line runs its tiles as one pipeline (H100, v29, 512 queries: 1.07x at 2k
/// keys, 1.02x at 4k; at 2k queries and keys 0.98x, so the longer rows stay
/// off it).
pub const HOPPER_PERSISTENT_SHORT_QUERIES_D64: (usize, usize) = (512, 4096);

/// Query rows of a persistent line's tile (two consumer warpgroups): the
/// only rows [`HopperTile::for_head_dim`] gives a persistent line.
pub const HOPPER_PERSISTENT_ROWS: usize = 2 * WGMMA_M;

/// Whether a Hopper forward call takes its persistent line (where one
/// covers it), in place of the lines [`hopper_rows`] chooses among: short
/// rows, whose CTAs' fixed cost the loop hides
/// ([`HOPPER_PERSISTENT_MAX_KEYS`], [`HOPPER_PERSISTENT_SHORT_QUERIES_D64`]),
/// windows bounded on both sides up to [`HOPPER_PERSISTENT_MAX_WINDOW_KEYS`]
/// keys per row (one-sided ones were not timed there), and causal grids of
/// few waves ([`HOPPER_PERSISTENT_CAUSAL_FEW_WAVES`]), in a grid of more
/// 128-row tiles than SMs; never a full or causal call with score
/// modifiers, which only the window line would cover. With at most one tile per
/// SM there is no next tile to hide anything under, and the other lines
/// are faster (H100, D = 64, 8-16 heads of 512-1k rows: 1.10-1.41x; D =
/// 128, 16 heads of 1k rows: 1.02-1.03x; docs/perf-notes.md v25).
pub const fn hopper_persistent(call: &HopperCall) -> bool {
    let tiles = call.batch * call.heads * call.seqlen_q.div_ceil(HOPPER_PERSISTENT_ROWS);
    if tiles <= call.num_sms {
        return false;
    }
    match (call.need.mask, call.need.score, call.window_keys) {
        // A window bounded on both sides: its rows see at most its width.
        (MaskKind::Local, _, Some(w)) => {
            let max = match hopper_line_head_dim(call.head_dim) {
                Some(64) => HOPPER_PERSISTENT_MAX_WINDOW_KEYS[0],
                _ => HOPPER_PERSISTENT_MAX_WINDOW_KEYS[1],
            };
            return w <= max || call.seqlen_k <= max;
        }
        // Not measured on the window lines: they stay off them.
        (MaskKind::Local, _, None) => return false,
        // Full and causal modified calls have no persistent line of their
        // own, and the window line is slower for them (H200, gpt-oss's
        // causal sinks at 4k: 0.963x; docs/perf-notes.md v52).
        (_, ScoreKind::Modified, _) => return false,
        _ => {}
    }
    let causal = matches!(call.need.mask, MaskKind::Causal);
    let (waves, few_waves_keys) = HOPPER_PERSISTENT_CAUSAL_FEW_WAVES;
    let few_waves = causal && tiles <= waves * call.num_sms && call.seqlen_k <= few_waves_keys;
    let (short_q, short_q_keys) = HOPPER_PERSISTENT_SHORT_QUERIES_D64;
    let short_queries = matches!(call.need.mask, MaskKind::Full)
        && call.head_dim == 64
        && call.seqlen_q <= short_q
        && call.seqlen_k <= short_q_keys;
    call.seqlen_k <= HOPPER_PERSISTENT_MAX_KEYS[causal as usize] || short_queries || few_waves
}

/// The head dim of the Hopper forward lines that serve `head_dim`: the
/// smallest line head dim at least as large. A smaller head dim runs on its
/// tile with zero columns: the TMA boxes read the columns past the tensors'
/// head dim as zeros, which add nothing to Q·Kᵀ and give O columns the
/// epilogue does not store (`AttnParams::head_dim`). So D = 32 runs on the
/// D = 64 lines, at 2x the FLOPs.
/// `None` past the widest line.
pub const fn hopper_line_head_dim(head_dim: usize) -> Option<usize> {
    let mut best: Option<usize> = None;
    let mut i = 0;
    while i < HOPPER_ENTRIES.len() {
        let e = &HOPPER_ENTRIES[i];
        if matches!(e.kind, KernelKind::WgmmaForward) && e.head_dim >= head_dim {
            best = match best {
                Some(b) if b <= e.head_dim => Some(b),
                _ => Some(e.head_dim),
            };
        }
        i += 1;
    }
    best
}

/// Keys per query row from which a head dim that runs on a Hopper line of
/// at least twice its width (D = 32 on the D = 64 lines) takes that line:
/// with fewer, the `mma.sync` kernels, which do no padded work, are faster
/// (H100, D = 32 f16 at 1k keys: 1.07x non-causal, 1.24x causal; at 4k the
/// Hopper line is 1.16x and 1.05x; docs/perf-notes.md v18).
pub const HOPPER_PADDED_MIN_KEYS: usize = 4096;

/// Whether the dispatch's own choice keeps a call off the Hopper lines
/// although one covers it: a head dim padded to at least twice its width,
/// over fewer than [`HOPPER_PADDED_MIN_KEYS`] keys.
pub const fn hopper_padded_short(head_dim: usize, seqlen_k: usize) -> bool {
    match hopper_line_head_dim(head_dim) {
        Some(line) => line >= 2 * head_dim && seqlen_k < HOPPER_PADDED_MIN_KEYS,
        None => false,
    }
}

/// Causal calls at D = 256 over at most this many keys per query row take
/// the 64-key line ([`hopper_keys`]). H100, against the 80-key blocks
/// (docs/perf-notes.md v27): causal 1.04-1.05x at 512 and 1k keys, 1.01x
/// at 2k, 1.00-1.01x at 4k, 0.98x from 8k; non-causal 1.00-1.01x at 512
/// and 0.96-0.97x from 1k. 64 keys waste fewer masked columns on the
/// diagonal and past the last key (512 keys: 8 full blocks, not 7 of
/// which the last holds 32 keys), but each block's fixed cost is spread
/// over fewer keys.
pub const HOPPER_SHORT_CAUSAL_MAX_KEYS_D256: usize = 2048;

/// Non-causal calls at D = 256 over at most this many keys per query row
/// take the serial 128-key line ([`hopper_keys`], `HopperTile::serial`),
/// where their 128-row tiles outnumber the SMs. H100, against the 80-key
/// line (docs/perf-notes.md v44, five calls): 512 keys 1.013-1.025x (f16)
/// and 1.014-1.023x (bf16); 1k 0.94-1.00x, 2k-16k 0.86-0.95x. Four 128-key
/// blocks cover 512 keys where seven of 80 compute 560 columns, and each
/// consumer issues fewer instructions per key; over more blocks its GEMMs
/// without intra-warpgroup overlap lose.
pub const HOPPER_SERIAL_MAX_KEYS_D256: usize = 512;

/// Keys per block for a Hopper forward call where its head dim has lines
/// of other keys than its own (`n64`, `n128`): plain causal calls at D =
/// 256 over few keys ([`HOPPER_SHORT_CAUSAL_MAX_KEYS_D256`]) 64, plain
/// full ones over fewer ([`HOPPER_SERIAL_MAX_KEYS_D256`]) 128 where
/// [`hopper_rows`] keeps 128-row tiles (a small grid's split-key tiles
/// are faster: H100, 8 heads of 512 rows, 1.46x); `None` for the head
/// dim's own. A call no such line covers (modified, packed) takes the
/// head dim's own ([`find_hopper_entry`]).
pub const fn hopper_keys(call: &HopperCall) -> Option<usize> {
    let short_causal = matches!(call.need.mask, MaskKind::Causal)
        && call.seqlen_k <= HOPPER_SHORT_CAUSAL_MAX_KEYS_D256;
    let short_full = matches!(call.need.mask, MaskKind::Full)
        && call.seqlen_k <= HOPPER_SERIAL_MAX_KEYS_D256
        && hopper_rows(call) != WGMMA_M;
    match hopper_line_head_dim(call.head_dim) {
        Some(256) if short_causal => Some(64),
        Some(256) if short_full => Some(128),
        _ => None,
    }
}

/// A caller's choice among a call's Hopper lines (`AttnOptions`'s
/// `hopper_*` fields; tuning and tests); `None` leaves each to the
/// heuristic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HopperPick {
    /// Query rows per CTA ([`hopper_rows`]).
    pub rows: Option<usize>,
    /// The persistent line ([`hopper_persistent`]).
    pub persistent: Option<bool>,
    /// Keys per block ([`hopper_keys`]).
    pub keys: Option<usize>,
}

/// The Hopper forward entry for a call: among the lines of
/// [`hopper_line_head_dim`] whose policies cover it, its persistent line
/// where [`hopper_persistent`] (or the caller) says so, else among those of
/// the keys per block [`hopper_keys`] (or the caller) asks for, where some
/// line has them, else among those of the head dim's own, the first whose
/// rows are the caller's or [`hopper_rows`]'s, else the first 128-row one,
/// else the first; `None` sends the call to the `Sm90` module's kernels.
/// Without a caller's `rows`, a [`hopper_padded_short`] call gets `None`;
/// with them it takes its line (tuning and tests).
pub fn find_hopper_entry(call: &HopperCall, pick: HopperPick) -> Option<&'static Entry> {
    if pick.rows.is_none() && hopper_padded_short(call.head_dim, call.seqlen_k) {
        return None;
    }
    let head_dim = hopper_line_head_dim(call.head_dim)?;
    let lines = move |persistent: bool| {
        HOPPER_ENTRIES.iter().filter(move |e| {
            e.kind == KernelKind::WgmmaForward
                && e.persistent == persistent
                && e.dtype == call.dtype
                && e.head_dim == head_dim
                && e.policies.covers(call.need)
        })
    };
    // A caller's rows other than the persistent lines' exclude them; the
    // heuristic's rows do not (they would have been a fallback).
    if pick.persistent.unwrap_or(hopper_persistent(call))
        && pick.rows.is_none_or(|r| r == HOPPER_PERSISTENT_ROWS)
    {
        if let Some(line) = lines(true).next() {
            return Some(line);
        }
    }
    let rows = pick.rows.unwrap_or(hopper_rows(call));
    if let Some(keys) = pick.keys.or(hopper_keys(call)) {
        let keyed = lines(false).filter(move |e| e.hopper_tile().block_n == keys);
        if let Some(line) = line_of_rows(keyed, rows) {
            return Some(line);
        }
    }
    line_of_rows(lines(false).filter(|e| e.keys.is_none()), rows)
}

/// The first of `lines` with `rows` query rows, else the first 128-row
/// one, else the first.
fn line_of_rows<'a>(
    mut lines: impl Iterator<Item = &'a Entry> + Clone,
    rows: usize,
) -> Option<&'a Entry> {
    let first = lines.clone().next();
    let two_consumers = lines.clone().find(|e| e.rows == 2 * WGMMA_M);
    lines.find(|e| e.rows == rows).or(two_consumers).or(first)
}

/// The Hopper backward line of `dtype` and `head_dim` that covers `need`.
pub fn find_hopper_backward(
    dtype: Dtype,
    head_dim: usize,
    need: Policies,
) -> Option<&'static Entry> {
    HOPPER_ENTRIES.iter().find(|e| {
        e.kind == KernelKind::WgmmaBackward
            && e.dtype == dtype
            && e.head_dim == head_dim
            && e.policies.covers(need)
    })
}

/// The first (most specialised) entry of `kind` for `dtype` and `head_dim`
/// whose policies cover `need`.
pub fn find_entry(
    kind: KernelKind,
    dtype: Dtype,
    head_dim: usize,
    need: Policies,
) -> Option<&'static Entry> {
    ENTRIES.iter().find(|e| {
        e.kind == kind
            && (e.dtype == dtype || matches!(kind, KernelKind::Append | KernelKind::BackwardSinks))
            && (e.head_dim == head_dim
                || matches!(
                    kind,
                    KernelKind::Append
                        | KernelKind::Merge
                        | KernelKind::BackwardPrep
                        | KernelKind::BackwardDq
                        | KernelKind::BackwardDkv
                        | KernelKind::BackwardSinks
                ))
            && e.policies.covers(need)
    })
}
