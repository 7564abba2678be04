//! Attention kernels, organised as in FlashAttention-2: block info (which rows
//! and keys a CTA owns), policies (mask, score modifiers, sequence layout),
//! the K/V ring, online softmax, the forward mainloop and the decode
//! schedule, epilogues, the split-KV combine and state merging. `entries`
//! instantiates them as named PTX entry points.

mod append;
mod block_info;
mod combine;
mod decode;
mod element;
mod entries;
mod epilogue;
mod kv_ring;
mod lane;
mod mainloop;
mod mask;
mod merge;
mod paging;
mod policy;
mod smem_tile;
mod softmax;
mod unroll;
