//! The Hopper (sm_90a) module's kernels: the warp-specialised forward
//! (`wgmma` + TMA; docs/hopper-plan.md) and the probes that check its
//! primitives.

pub mod forward;
pub mod probe;
mod ring;
