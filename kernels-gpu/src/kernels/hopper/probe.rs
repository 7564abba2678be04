//! Checks of the Hopper primitives, run by the GPU suite against the host:
//! the `wgmma` descriptors, operand layouts and fences, and the TMA +
//! mbarrier ring. Each is the smallest kernel that uses the primitive the
//! way the Hopper forward does.
use crate::arch::{barrier, fence, global, mbarrier, smem, special, tma, wgmma};
use crate::config::{PROBE_THREADS, SW128_ROW_ELEMS, WGMMA_M};
use crate::index::{k_major_desc, mn_major_desc, sw128_offset, SW128_ATOM_BYTES, SW128_ROW_BYTES};
use crate::kernels::element::Element;
use crate::params::{ProbeGemmParams, ProbeTmaParams};
use crate::unroll::unroll;

/// Elements per 16-byte chunk.
const CHUNK: u32 = 8;

/// Tries of an mbarrier wait before the probe gives up and traps: a wrong
/// phase, count or transaction size then fails the launch instead of hanging
/// the GPU suite for good. How long a try suspends is the hardware's choice
/// (4x this many outlasted 60 s on H100), so this is far beyond any real wait.
const MAX_WAIT_TRIES: u32 = 1 << 20;

#[inline(always)]
fn wait_or_trap(bar: u32, parity: u32) {
    let mut tries = 0;
    while !mbarrier::try_wait_parity(bar, parity) {
        tries += 1;
        if tries == MAX_WAIT_TRIES {
            special::trap();
        }
    }
}

/// The dynamic shared memory's base rounded up to a swizzle atom.
#[inline(always)]
fn aligned_smem() -> u32 {
    let a = SW128_ATOM_BYTES;
    (smem::base() + a - 1) & !(a - 1)
}

/// Copies the row-major `rows` x `cols` 16-bit matrix at `src` into an SW128
/// tile at `tile`, all threads of the CTA.
#[inline(always)]
fn fill_sw128(tile: u32, src: u64, rows: u32, cols: u32) {
    let chunks = cols / CHUNK;
    let mut i = special::thread_idx_x();
    while i < rows * chunks {
        let (r, c) = (i / chunks, i % chunks);
        let v = global::ld_nc_v4_b32(src + 2 * (r * cols + c * CHUNK) as u64);
        smem::st_v4_b32(tile + sw128_offset(r, c, rows), v);
        i += PROBE_THREADS as u32;
    }
}

/// C [64, N] = A [64, K] · B with one warpgroup: `K / 16` `wgmma`s in one
/// group, in the form `p.mode` names (see [`ProbeGemmParams`]).
#[inline(always)]
pub unsafe fn wgmma_gemm<
    T: Element,
    const N: usize,
    const K: usize,
    const NT: usize,
    const KS: usize,
>(
    p: &ProbeGemmParams,
) {
    const M: u32 = WGMMA_M as u32;
    let (n, k) = (N as u32, K as u32);
    // The host admits SS only with K % 64 == 0 and RS only with N % 64 == 0:
    // SW128 tiles hold whole 64-column groups, so these are exact sizes.
    let a_tile = aligned_smem();
    let b_tile = a_tile + M * k * 2;
    let rs = p.mode == ProbeGemmParams::RS_MN_MAJOR;
    if rs {
        // A comes from registers.
        fill_sw128(b_tile, p.b, k, n);
    } else {
        fill_sw128(a_tile, p.a, M, k);
        fill_sw128(b_tile, p.b, n, k);
    }
    // The tiles were written by ordinary stores; wgmma reads them through
    // the async proxy.
    fence::proxy_async_shared();
    barrier::sync_cta();

    let tid = special::thread_idx_x();
    let (w, g, t) = (tid / 32, tid % 32 / 4, tid % 4);
    // Every register operand is in place before the fence: a write to one
    // between the `wgmma`s would make ptxas wait for the earlier ones.
    let mut a = [[0u32; 4]; KS];
    if rs {
        // The A fragment of rows 16w + g (+8), columns 16kk + 2t (+1, +8, +9).
        unroll::<KS>(|kk| {
            let at = |row: u32, col: u32| {
                let i = (16 * w + row) * k + 16 * kk as u32 + col;
                global::ld_nc_b32(p.a + 2 * i as u64)
            };
            a[kk] = [
                at(g, 2 * t),
                at(g + 8, 2 * t),
                at(g, 8 + 2 * t),
                at(g + 8, 8 + 2 * t),
            ];
        });
    }
    // NaN: the first k-step's scale_d = 0 must ignore D's old value, as the
    // forward's S = Q·Kᵀ relies on.
    let mut d = [[f32::NAN; 4]; NT];
    wgmma::fence_operands(&mut d);
    wgmma::fence_fragments(&mut a);
    // Each form is one straight run fence - wgmmas - commit - wait: a branch
    // or a join between them makes ptxas inject a fence (info C7519).
    if rs {
        wgmma::fence();
        unroll::<KS>(|kk| {
            let b = mn_major_desc(b_tile, k, kk as u32);
            wgmma::rs::<NT, 1>(T::BF16, &mut d, &a[kk], b, (kk > 0) as u32);
        });
        wgmma::commit_group();
        wgmma::wait_group::<0>();
    } else {
        wgmma::fence();
        unroll::<KS>(|kk| {
            let (a, b) = (
                k_major_desc(a_tile, M, kk as u32),
                k_major_desc(b_tile, n, kk as u32),
            );
            wgmma::ss::<NT, 0, 0>(T::BF16, &mut d, a, b, (kk > 0) as u32);
        });
        wgmma::commit_group();
        wgmma::wait_group::<0>();
    }
    // The A registers are read asynchronously too: they stay untouched
    // until the wait.
    wgmma::fence_operands(&mut d);
    wgmma::fence_fragments(&mut a);
    unroll::<NT>(|j| {
        unroll::<2>(|h| {
            let row = 16 * w + 8 * h as u32 + g;
            let col = 8 * j as u32 + 2 * t;
            let c = p.c + 4 * (row * n + col) as u64;
            global::st_v2_b32(c, d[j][2 * h].to_bits(), d[j][2 * h + 1].to_bits());
        })
    });
}

/// Copies head `ctaid.x` of an [S, H, D] tensor in tiles of `p.rows` rows
/// through a two-stage TMA ring: thread 0 loads tile i + 1 while every
/// thread reads tile i out of shared memory into `p.copied` and thread 0
/// stores it back with a TMA store into the `store` map's tensor. `load_map`
/// and `store_map` are generic addresses of the tensor maps.
#[inline(always)]
pub unsafe fn tma_copy<const D: usize>(p: &ProbeTmaParams, load_map: u64, store_map: u64) {
    const STAGES: u32 = 2;
    let groups = (D / SW128_ROW_ELEMS) as u32;
    let rows = p.rows;
    let stage_bytes = rows * D as u32 * 2;
    let head = special::block_idx_x() as i32;
    let tid = special::thread_idx_x();
    let tiles = p.seqlen.div_ceil(rows);
    let base = aligned_smem();
    let stage = |s: u32| base + s * stage_bytes.next_multiple_of(SW128_ATOM_BYTES);
    let bars = stage(STAGES);
    let full = |s: u32| bars + 8 * s;
    let empty = |s: u32| bars + 8 * (STAGES + s);
    // Arrivals that free a stage: one per warp.
    let warps = PROBE_THREADS as u32 / 32;
    if tid == 0 {
        for s in 0..STAGES {
            mbarrier::init(full(s), 1);
            mbarrier::init(empty(s), warps);
        }
        mbarrier::fence_init();
        tma::prefetch_map(load_map);
        tma::prefetch_map(store_map);
    }
    barrier::sync_cta_divergent();

    let load = |i: u32| {
        let s = i % STAGES;
        // The producer's phase of `empty` starts at 1, which a fresh barrier
        // has already completed: the first STAGES loads do not wait.
        wait_or_trap(empty(s), (i / STAGES + 1) & 1);
        mbarrier::arrive_expect_tx(full(s), stage_bytes);
        for c in 0..groups {
            let coord = [
                (c as usize * SW128_ROW_ELEMS) as i32,
                (i * rows) as i32,
                head,
                0,
            ];
            tma::load_4d(
                stage(s) + c * rows * SW128_ROW_BYTES,
                load_map,
                coord,
                full(s),
            );
        }
    };
    if tid == 0 {
        load(0);
    }
    let chunks = D as u32 / CHUNK;
    for i in 0..tiles {
        let s = i % STAGES;
        if tid == 0 && i + 1 < tiles {
            load(i + 1);
        }
        wait_or_trap(full(s), (i / STAGES) & 1);
        let mut e = tid;
        while e < rows * chunks {
            let (r, c) = (e / chunks, e % chunks);
            let v = smem::ld_v4_b32(stage(s) + sw128_offset(r, c, rows));
            let row = (i * rows + r) as u64;
            let dst = p.copied
                + 2 * ((row * p.heads as u64 + head as u64) * D as u64 + (c * CHUNK) as u64);
            global::st_v4_b32(dst, v);
            e += PROBE_THREADS as u32;
        }
        if tid == 0 {
            for c in 0..groups {
                let coord = [
                    (c as usize * SW128_ROW_ELEMS) as i32,
                    (i * rows) as i32,
                    head,
                    0,
                ];
                tma::store_4d(store_map, coord, stage(s) + c * rows * SW128_ROW_BYTES);
            }
            tma::store_commit();
            tma::store_wait_read();
        }
        // Every lane's reads of the stage are done before its warp releases it.
        barrier::sync_warp();
        if tid % 32 == 0 {
            mbarrier::arrive(empty(s));
        }
    }
    if tid == 0 {
        tma::store_wait();
    }
}
