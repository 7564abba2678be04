//! The Hopper (sm_90a) module's kernels: `wgmma` and TMA. For now the
//! primitive probes; the warp-specialised forward (docs/hopper-plan.md)
//! builds on them.

pub mod probe;
