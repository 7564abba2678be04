//! Compile-time loop unrolling. Fragment arrays must be indexed with constants
//! only, or they leave registers for local memory; LLVM's unroller gives up on
//! the nested fragment loops of a head-dim-128 tile, so unroll them explicitly.

/// `if k < $n { let $i = k; $body }` for k = 0..32 as straight-line code.
macro_rules! unrolled {
    ($n:expr, |$i:ident| $body:expr) => {
        unrolled!(@ $n, $i, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@ $n:expr, $i:ident, $body:expr, $($k:literal)*) => {
        $( if $k < $n { let $i = $k; $body } )*
    };
}

/// Calls `f(0), f(1), …, f(N-1)` as straight-line code. Each call of the
/// closure is inlined at LLVM's discretion, which stops once a kernel holds
/// many copies of it: bodies that must stay inline go through
/// [`unroll_steps`].
#[inline(always)]
pub fn unroll<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 32, "unroll supports at most 32 iterations") };
    unrolled!(N, |i| f(i));
}

/// A loop body for [`unroll_steps`]. Implemented with `#[inline(always)]`,
/// every copy of `step` is inlined (a `wgmma` run left as calls is
/// serialised by ptxas: C7519).
pub trait Step {
    fn step(&mut self, i: usize);
}

/// Calls `body.step(0)`, …, `body.step(N-1)` as straight-line code.
#[inline(always)]
pub fn unroll_steps<const N: usize>(body: &mut impl Step) {
    const { assert!(N <= 32, "unroll_steps supports at most 32 iterations") };
    unrolled!(N, |i| body.step(i));
}
