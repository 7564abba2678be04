//! Compile-time loop unrolling. Fragment arrays must be indexed with constants
//! only, or they leave registers for local memory; LLVM's unroller gives up on
//! the nested fragment loops of a head-dim-128 tile, so unroll them explicitly.

/// Calls `f(0), f(1), …, f(N-1)` as straight-line code.
#[inline(always)]
pub fn unroll<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 32, "unroll supports at most 32 iterations") };
    macro_rules! calls {
        ($($i:literal)*) => { $( if $i < N { f($i) } )* };
    }
    calls!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
}
