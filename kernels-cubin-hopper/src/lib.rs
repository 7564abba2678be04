//! The committed Hopper cubins of flash-attn's kernels (sm_90 and sm_90a,
//! each from two pinned ptxas) and their manifest, in [`CUBIN_DIR`].
//! flash-attn's build script embeds those that were assembled from the PTX
//! it embeds (`flash_attn_kernels::artifacts::matching_cubins`). A package
//! of its own, apart from `flash-attn-cubins` (Turing to Ada), so that each
//! crate stays under crates.io's size limit.
#![no_std]

/// The directory holding the cubins and `manifest.json`.
pub const CUBIN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/cubin");
