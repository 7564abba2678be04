//! Warpgroup matrix multiply-accumulate (sm_90a): `wgmma.mma_async`.
//!
//! A warpgroup (4 consecutive warps, the first a multiple of 4) computes
//! D (64 x N, f32) += A (64 x 16) · B (16 x N) per instruction, asynchronously:
//! `fence` before the first `wgmma` (and after any register write to its
//! operands), `commit_group` after a batch, `wait_group` before reading D.
//!
//! Accumulators, as `[[f32; 4]; N / 8]` per thread: with w = warp in the
//! group, g = lane / 4, t = lane % 4, `d[j][2h + e]` is
//! D[16w + 8h + g][8j + 2t + e] — per warp exactly the `mma.sync` m16n8 C
//! fragment of n-tile j, so the sm_80 softmax and masks apply unchanged.
//! A from registers (`rs_*`): four b32 of two elements, a0 = (16w + g,
//! 2t..2t+1), a1 = (16w + g + 8, 2t..), a2 = (16w + g, 8 + 2t..),
//! a3 = (16w + g + 8, 8 + 2t..): the m16n8k16 A fragment.
//! A and B from shared memory are 64-bit matrix descriptors
//! (`index::gmma_desc`). `scale_d` 0 ignores D's old value (D = A·B).
//!
//! No asm here is `pure` or `nomem`: these instructions read shared memory
//! asynchronously and must stay in order with the barriers around them.
use core::arch::asm;

/// `wgmma.fence.sync.aligned;` orders earlier register and shared-memory
/// accesses of the warpgroup before the `wgmma`s that follow.
#[inline(always)]
pub fn fence() {
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) };
}

/// `wgmma.commit_group.sync.aligned;` closes the group of `wgmma`s issued
/// since the last commit.
#[inline(always)]
pub fn commit_group() {
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}

/// `wgmma.wait_group.sync.aligned N;` waits until at most `N` committed
/// groups are pending. It does not name the accumulators: follow it with
/// [`fence_operands`] on those it released, so no read moves above it.
#[inline(always)]
pub fn wait_group<const N: u32>() {
    unsafe { asm!("wgmma.wait_group.sync.aligned {n};", n = const N, options(nostack)) };
}

/// An empty asm that claims to read and write every register of `d`: no
/// access to them is moved across it. Used right before [`fence`] (so no
/// write lands between the fence and the `wgmma`) and right after
/// [`wait_group`] (so no read is hoisted above the wait); ptxas otherwise
/// serialises the `wgmma`s (warning C7515) or the values are wrong.
#[inline(always)]
pub fn fence_operands<const R: usize>(d: &mut [[f32; 4]; R]) {
    crate::unroll::unroll::<R>(|j| unsafe {
        asm!(
            "// fence operands {0} {1} {2} {3}",
            inout(reg32) d[j][0], inout(reg32) d[j][1], inout(reg32) d[j][2], inout(reg32) d[j][3],
            options(nostack),
        )
    });
}

/// [`fence_operands`] for register A fragments.
#[inline(always)]
pub fn fence_fragments<const R: usize>(a: &mut [[u32; 4]; R]) {
    crate::unroll::unroll::<R>(|j| unsafe {
        asm!(
            "// fence operands {0} {1} {2} {3}",
            inout(reg32) a[j][0], inout(reg32) a[j][1], inout(reg32) a[j][2], inout(reg32) a[j][3],
            options(nostack),
        )
    });
}

/// ", {}, {}, {}, {}": the template of one more accumulator quad.
macro_rules! quad {
    ($j:literal) => {
        ", {}, {}, {}, {}"
    };
}

/// One `wgmma` function: `ss` (A descriptor) or `rs` (A registers), for an
/// element type and N, with the accumulator operands listed by quad index.
macro_rules! wgmma_fn {
    (ss, $name:ident, $ty:literal, $n:literal, $nt:literal, [$j0:literal $($j:literal)*]) => {
        #[doc = concat!(
            "`wgmma.mma_async.sync.aligned.m64n", stringify!($n), "k16.f32.", $ty, ".", $ty,
            " {d}, a_desc, b_desc, scale_d, 1, 1, TRANS_A, TRANS_B;` (A and B each K-major",
            " when its `TRANS_*` is 0, MN-major when 1)."
        )]
        #[inline(always)]
        pub fn $name<const TRANS_A: u32, const TRANS_B: u32>(
            d: &mut [[f32; 4]; $nt],
            a: u64,
            b: u64,
            scale_d: u32,
        ) {
            unsafe {
                asm!(
                    concat!(
                        "{{\n.reg .pred p;\nsetp.ne.b32 p, {sd}, 0;\n",
                        "wgmma.mma_async.sync.aligned.m64n", stringify!($n), "k16.f32.", $ty, ".", $ty,
                        " {{{}, {}, {}, {}", $(quad!($j),)* "}}, {a}, {b}, p, 1, 1, {ta}, {tb};\n}}"
                    ),
                    inout(reg32) d[$j0][0], inout(reg32) d[$j0][1], inout(reg32) d[$j0][2], inout(reg32) d[$j0][3],
                    $(inout(reg32) d[$j][0], inout(reg32) d[$j][1], inout(reg32) d[$j][2], inout(reg32) d[$j][3],)*
                    a = in(reg64) a, b = in(reg64) b, sd = in(reg32) scale_d,
                    ta = const TRANS_A, tb = const TRANS_B,
                    options(nostack),
                )
            }
        }
    };
    (rs, $name:ident, $ty:literal, $n:literal, $nt:literal, [$j0:literal $($j:literal)*]) => {
        #[doc = concat!(
            "`wgmma.mma_async.sync.aligned.m64n", stringify!($n), "k16.f32.", $ty, ".", $ty,
            " {d}, {a0, a1, a2, a3}, b_desc, scale_d, 1, 1, TRANS_B;` (B K-major when",
            " `TRANS_B` is 0, MN-major when 1)."
        )]
        #[inline(always)]
        pub fn $name<const TRANS_B: u32>(d: &mut [[f32; 4]; $nt], a: &[u32; 4], b: u64, scale_d: u32) {
            unsafe {
                asm!(
                    concat!(
                        "{{\n.reg .pred p;\nsetp.ne.b32 p, {sd}, 0;\n",
                        "wgmma.mma_async.sync.aligned.m64n", stringify!($n), "k16.f32.", $ty, ".", $ty,
                        " {{{}, {}, {}, {}", $(quad!($j),)* "}}, {{{a0}, {a1}, {a2}, {a3}}}, {b}, p, 1, 1, {tb};\n}}"
                    ),
                    inout(reg32) d[$j0][0], inout(reg32) d[$j0][1], inout(reg32) d[$j0][2], inout(reg32) d[$j0][3],
                    $(inout(reg32) d[$j][0], inout(reg32) d[$j][1], inout(reg32) d[$j][2], inout(reg32) d[$j][3],)*
                    a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                    b = in(reg64) b, sd = in(reg32) scale_d, tb = const TRANS_B,
                    options(nostack),
                )
            }
        }
    };
}

/// The four functions of one N, and the arms of the N-generic [`ss`] and
/// [`rs`] that pick them.
macro_rules! wgmma_shapes {
    ($( $n:literal => $nt:literal: $ss16:ident $ssb:ident $rs16:ident $rsb:ident [$($j:literal)*]; )*) => {
        $(
            wgmma_fn!(ss, $ss16, "f16", $n, $nt, [$($j)*]);
            wgmma_fn!(ss, $ssb, "bf16", $n, $nt, [$($j)*]);
            wgmma_fn!(rs, $rs16, "f16", $n, $nt, [$($j)*]);
            wgmma_fn!(rs, $rsb, "bf16", $n, $nt, [$($j)*]);
        )*

        /// `m64nNk16` with A and B from shared memory, N = 8 * NT (one of
        /// the generated shapes; any other fails the build, where the match
        /// alone would leave a kernel that traps), bf16 or f16 inputs.
        #[inline(always)]
        pub fn ss<const NT: usize, const TRANS_A: u32, const TRANS_B: u32>(
            bf16: bool,
            d: &mut [[f32; 4]; NT],
            a: u64,
            b: u64,
            scale_d: u32,
        ) {
            const { assert!(matches!(NT, $($nt)|*), "no wgmma shape of this N") };
            let d = d as *mut [[f32; 4]; NT];
            match NT {
                $($nt => {
                    // SAFETY: NT == $nt, so this is the same array type.
                    let d = unsafe { &mut *d.cast::<[[f32; 4]; $nt]>() };
                    if bf16 {
                        $ssb::<TRANS_A, TRANS_B>(d, a, b, scale_d)
                    } else {
                        $ss16::<TRANS_A, TRANS_B>(d, a, b, scale_d)
                    }
                })*
                _ => crate::arch::special::trap(),
            }
        }

        /// `m64nNk16` with A from registers, B from shared memory; as [`ss`].
        #[inline(always)]
        pub fn rs<const NT: usize, const TRANS_B: u32>(
            bf16: bool,
            d: &mut [[f32; 4]; NT],
            a: &[u32; 4],
            b: u64,
            scale_d: u32,
        ) {
            const { assert!(matches!(NT, $($nt)|*), "no wgmma shape of this N") };
            let d = d as *mut [[f32; 4]; NT];
            match NT {
                $($nt => {
                    // SAFETY: NT == $nt, so this is the same array type.
                    let d = unsafe { &mut *d.cast::<[[f32; 4]; $nt]>() };
                    if bf16 { $rsb::<TRANS_B>(d, a, b, scale_d) } else { $rs16::<TRANS_B>(d, a, b, scale_d) }
                })*
                _ => crate::arch::special::trap(),
            }
        }
    };
}

wgmma_shapes! {
    32 => 4: ss_f16_n32 ss_bf16_n32 rs_f16_n32 rs_bf16_n32 [0 1 2 3];
    64 => 8: ss_f16_n64 ss_bf16_n64 rs_f16_n64 rs_bf16_n64 [0 1 2 3 4 5 6 7];
    80 => 10: ss_f16_n80 ss_bf16_n80 rs_f16_n80 rs_bf16_n80 [0 1 2 3 4 5 6 7 8 9];
    96 => 12: ss_f16_n96 ss_bf16_n96 rs_f16_n96 rs_bf16_n96 [0 1 2 3 4 5 6 7 8 9 10 11];
    112 => 14: ss_f16_n112 ss_bf16_n112 rs_f16_n112 rs_bf16_n112
        [0 1 2 3 4 5 6 7 8 9 10 11 12 13];
    128 => 16: ss_f16_n128 ss_bf16_n128 rs_f16_n128 rs_bf16_n128
        [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15];
    176 => 22: ss_f16_n176 ss_bf16_n176 rs_f16_n176 rs_bf16_n176
        [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21];
    192 => 24: ss_f16_n192 ss_bf16_n192 rs_f16_n192 rs_bf16_n192
        [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23];
    256 => 32: ss_f16_n256 ss_bf16_n256 rs_f16_n256 rs_bf16_n256
        [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31];
}
