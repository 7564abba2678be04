//! Attention kernels, organised as in FlashAttention-2: block info (which rows
//! and keys a CTA owns), policies (mask, score modifiers, sequence layout),
//! the K/V ring, online softmax, the forward mainloop and the decode
//! schedule, epilogues, the split-KV combine, state merging and the
//! backward pass. `entries`
//! instantiates them as named PTX entry points.
//! The `sm_90a` module (`PtxArch::Sm90a`) compiles `hopper` and the pieces
//! it shares with the sm_80 kernels (block info, policies, mask, online
//! softmax, page lookup, the backward's row helpers); the rest make the `sm_75`, `sm_80` and `sm_90` modules (sm_75
//! through `copy` and the m16n8k8 form of `element::F16::mma`).

#[cfg(not(target_feature = "sm_90a"))]
mod append;
// The sm_90a module's backward takes its row helpers from here.
#[cfg_attr(target_feature = "sm_90a", allow(dead_code))]
mod backward;
mod block_info;
#[cfg(not(target_feature = "sm_90a"))]
mod combine;
mod copy;
#[cfg(not(target_feature = "sm_90a"))]
mod decode;
mod element;
mod entries;
#[cfg(not(target_feature = "sm_90a"))]
mod epilogue;
#[cfg(target_feature = "sm_90a")]
mod hopper;
#[cfg(not(target_feature = "sm_90a"))]
mod kv_ring;
#[cfg(not(target_feature = "sm_90a"))]
mod lane;
#[cfg(not(target_feature = "sm_90a"))]
mod mainloop;
mod mask;
#[cfg(not(target_feature = "sm_90a"))]
mod merge;
mod paging;
mod policy;
#[cfg(not(target_feature = "sm_90a"))]
mod smem_tile;
mod softmax;
