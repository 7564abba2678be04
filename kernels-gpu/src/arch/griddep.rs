//! Programmatic dependent launch (sm_90+, PTX ISA 7.8): `griddepcontrol`.
//! A grid launched with the `PROGRAMMATIC_STREAM_SERIALIZATION` attribute
//! may start while the grid before it on the stream still runs; these two
//! instructions say where that overlap ends (`wait`) and when the next grid
//! may start (`launch_dependents`). In a grid launched without the
//! attribute both return at once. The `sm_75` and `sm_80` modules, whose
//! targets lack the instruction, compile both to nothing: the host launches
//! their grids without the attribute.
#[cfg(target_feature = "sm_90")]
use core::arch::asm;

/// `griddepcontrol.wait;` blocks the thread until every grid this one
/// depends on has completed and its memory operations are visible. Every
/// thread runs it before its first global-memory access, so nothing of the
/// previous grid's output is read early. Not `nomem`: the compiler must not
/// move memory accesses above it.
#[inline(always)]
pub fn wait() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack))
    };
}

/// `griddepcontrol.launch_dependents;` lets the next grid on the stream
/// (launched with the attribute) be scheduled once every CTA of this grid
/// has run it or exited. Repeated calls in a CTA have no further effect; it
/// says nothing about memory, which the dependent's [`wait`] covers.
#[inline(always)]
pub fn launch_dependents() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.launch_dependents;", options(nostack))
    };
}
