//! Attention kernels, organised as in FlashAttention-2: block info (which rows
//! and keys a CTA owns), mask, online softmax, mainloop, epilogue, and the
//! split-KV combine. `entries` instantiates them as named PTX entry points.

mod append;
mod block_info;
mod combine;
mod decode;
mod element;
mod entries;
mod epilogue;
mod mainloop;
mod mask;
mod paging;
mod smem_tile;
mod softmax;
mod unroll;
