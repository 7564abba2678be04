//! PTX entry points. Names must match `config::ENTRIES` (checked by the host's
//! tests against the built PTX).
use super::append::append_kv;
use super::combine::combine;
use super::decode::decode;
use super::element::{Bf16, F16};
use super::mainloop::attention;
use crate::config::{AttnTile, KernelKind};
use crate::params::{AppendParams, AttnParams, CombineParams};

macro_rules! forward_entries {
    ($($name:ident: $elem:ty, $d:literal, causal = $causal:literal;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: AttnParams) {
            attention::<
                $elem,
                $d,
                { AttnTile::of(KernelKind::Forward, $d).m_tiles },
                { $d / 16 },
                { $d / 8 },
                { AttnTile::of(KernelKind::Forward, $d).block_n / 8 },
                $causal,
            >(&p)
        }
    )*};
}

macro_rules! decode_entries {
    ($($name:ident: $elem:ty, $d:literal, causal = $causal:literal;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: AttnParams) {
            decode::<$elem, $d, { $d / 16 }, { $d / 8 }, $causal>(&p)
        }
    )*};
}

forward_entries! {
    flash_fwd_f16_hd64_full: F16, 64, causal = false;
    flash_fwd_f16_hd64_causal: F16, 64, causal = true;
    flash_fwd_f16_hd128_full: F16, 128, causal = false;
    flash_fwd_f16_hd128_causal: F16, 128, causal = true;
    flash_fwd_bf16_hd64_full: Bf16, 64, causal = false;
    flash_fwd_bf16_hd64_causal: Bf16, 64, causal = true;
    flash_fwd_bf16_hd128_full: Bf16, 128, causal = false;
    flash_fwd_bf16_hd128_causal: Bf16, 128, causal = true;
}

decode_entries! {
    flash_decode_f16_hd64_full: F16, 64, causal = false;
    flash_decode_f16_hd64_causal: F16, 64, causal = true;
    flash_decode_f16_hd128_full: F16, 128, causal = false;
    flash_decode_f16_hd128_causal: F16, 128, causal = true;
    flash_decode_bf16_hd64_full: Bf16, 64, causal = false;
    flash_decode_bf16_hd64_causal: Bf16, 64, causal = true;
    flash_decode_bf16_hd128_full: Bf16, 128, causal = false;
    flash_decode_bf16_hd128_causal: Bf16, 128, causal = true;
}

macro_rules! combine_entries {
    ($($name:ident: $elem:ty, $d:literal;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: CombineParams) {
            combine::<$elem, $d>(&p)
        }
    )*};
}

combine_entries! {
    flash_combine_f16_hd64: F16, 64;
    flash_combine_f16_hd128: F16, 128;
    flash_combine_bf16_hd64: Bf16, 64;
    flash_combine_bf16_hd128: Bf16, 128;
}

/// Dtype- and head-dim-agnostic: it moves 16-byte chunks.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_append_kv(p: AppendParams) {
    append_kv(&p)
}
