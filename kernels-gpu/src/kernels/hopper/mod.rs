//! The Hopper (sm_90a) module's kernels: the warp-specialised forward
//! (`wgmma` + TMA; docs/hopper-plan.md), the backward's key-block kernel on
//! `wgmma`, and the probes that check their primitives.

pub mod backward;
pub mod forward;
pub mod probe;
mod ring;
