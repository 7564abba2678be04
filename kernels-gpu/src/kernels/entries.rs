//! PTX entry points. Names must match `config::ENTRIES` (checked by the host's
//! tests against the built PTX).
use super::append::append_kv;
use super::combine::combine;
use super::element::{Bf16, F16};
use super::mainloop::attention;
use crate::config::{AttnTile, KernelKind};
use crate::params::{AppendParams, AttnParams, CombineParams};

macro_rules! attention_entries {
    ($($name:ident: $elem:ty, $d:literal, causal = $causal:literal, $kind:ident;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: AttnParams) {
            attention::<
                $elem,
                $d,
                { AttnTile::of(KernelKind::$kind, $d).m_tiles },
                { $d / 16 },
                { $d / 8 },
                { AttnTile::of(KernelKind::$kind, $d).block_n / 8 },
                $causal,
                { matches!(KernelKind::$kind, KernelKind::Decode) },
            >(&p)
        }
    )*};
}

attention_entries! {
    flash_fwd_f16_hd64_full: F16, 64, causal = false, Forward;
    flash_fwd_f16_hd64_causal: F16, 64, causal = true, Forward;
    flash_fwd_f16_hd128_full: F16, 128, causal = false, Forward;
    flash_fwd_f16_hd128_causal: F16, 128, causal = true, Forward;
    flash_fwd_bf16_hd64_full: Bf16, 64, causal = false, Forward;
    flash_fwd_bf16_hd64_causal: Bf16, 64, causal = true, Forward;
    flash_fwd_bf16_hd128_full: Bf16, 128, causal = false, Forward;
    flash_fwd_bf16_hd128_causal: Bf16, 128, causal = true, Forward;
    flash_decode_f16_hd64_full: F16, 64, causal = false, Decode;
    flash_decode_f16_hd64_causal: F16, 64, causal = true, Decode;
    flash_decode_f16_hd128_full: F16, 128, causal = false, Decode;
    flash_decode_f16_hd128_causal: F16, 128, causal = true, Decode;
    flash_decode_bf16_hd64_full: Bf16, 64, causal = false, Decode;
    flash_decode_bf16_hd64_causal: Bf16, 64, causal = true, Decode;
    flash_decode_bf16_hd128_full: Bf16, 128, causal = false, Decode;
    flash_decode_bf16_hd128_causal: Bf16, 128, causal = true, Decode;
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
