//! PTX entry points, one per line of `config::attention_variants` (so the
//! names match `config::ENTRIES` by construction), plus the append and
//! merge kernels; in the `sm_90a` module instead one per line of
//! `config::hopper_entries` (`config::HOPPER_ENTRIES`).
/// Maps the table's words to the policy and element types.
macro_rules! ty {
    (f16) => {
        crate::kernels::element::F16
    };
    (bf16) => {
        crate::kernels::element::Bf16
    };
    (f32) => {
        crate::kernels::element::F32
    };
    (full) => {
        crate::kernels::policy::Full
    };
    (causal) => {
        crate::kernels::policy::Causal
    };
    (local) => {
        crate::kernels::policy::Local
    };
    (plain) => {
        crate::kernels::policy::Plain
    };
    (modified) => {
        crate::kernels::policy::Modified
    };
    (dense) => {
        crate::kernels::policy::Dense
    };
    (packed) => {
        crate::kernels::policy::Packed
    };
    (ragged) => {
        crate::kernels::policy::Ragged
    };
    (folded) => {
        crate::kernels::policy::Folded
    };
}

#[cfg(not(target_feature = "sm_90a"))]
mod sm80 {
    use super::super::append::append_kv;
    use super::super::backward::{self, backward};
    use super::super::combine::combine;
    use super::super::decode::decode;
    use super::super::element::F16;
    use super::super::mainloop::attention;
    use super::super::merge::merge;
    use super::super::policy::policies;
    use crate::config::{attention_variants, AttnTile, BwdTile, KernelKind, PtxArch};
    use crate::params::{AppendParams, AttnParams, BwdParams, CombineParams, MergeParams};

    /// The forward tile of a table line.
    macro_rules! forward_tile {
        ($d:literal, $mask:ident, $score:ident, $seq:ident) => {
            AttnTile::of_variant(
                KernelKind::Forward,
                $d,
                policies::<ty!($mask), ty!($score), ty!($seq)>(),
                PtxArch::TARGET,
            )
        };
    }

    /// The body of one entry of each kind.
    macro_rules! entry_body {
        (fwd, $p:ident, $t:ident, $d:literal, $mask:ident, $score:ident, $seq:ident) => {
            attention::<
                ty!($t),
                ty!($mask),
                ty!($score),
                ty!($seq),
                $d,
                { forward_tile!($d, $mask, $score, $seq).m_tiles },
                { $d / 16 },
                { $d / 8 },
                { forward_tile!($d, $mask, $score, $seq).block_n / 8 },
            >(&$p)
        };
        (decode, $p:ident, $t:ident, $d:literal, $mask:ident, $score:ident, $seq:ident) => {
            decode::<ty!($t), ty!($mask), ty!($score), ty!($seq), $d, { $d / 16 }, { $d / 8 }>(&$p)
        };
        (combine, $p:ident, $t:ident, $d:literal, $mask:ident, $score:ident, $seq:ident) => {
            combine::<ty!($t), $d>(&$p)
        };
        (bwd, $p:ident, $t:ident, $d:literal, $mask:ident, $score:ident, $seq:ident) => {
            backward::<
                ty!($t),
                ty!($score),
                $d,
                { BwdTile::of($d, PtxArch::TARGET).block_m },
                { $d / 16 },
                { $d / 8 / BwdTile::of($d, PtxArch::TARGET).col_parts() },
                {
                    BwdTile::of($d, PtxArch::TARGET).block_m
                        / 8
                        / BwdTile::of($d, PtxArch::TARGET).s_parts()
                },
                { $d / 8 / BwdTile::of($d, PtxArch::TARGET).dq_parts() },
                { BwdTile::of($d, PtxArch::TARGET).block_n / 16 },
                { BwdTile::of($d, PtxArch::TARGET).block_m / 16 },
                { BwdTile::of($d, PtxArch::TARGET).dkv_keys() / 16 },
                { BwdTile::of($d, PtxArch::TARGET).dq_rows() / 16 },
            >(&$p)
        };
    }

    macro_rules! entry_params {
        (fwd) => {
            AttnParams
        };
        (decode) => {
            AttnParams
        };
        (combine) => {
            CombineParams
        };
        (bwd) => {
            BwdParams
        };
    }

    /// The items of a table line, or none where the module lacks its dtype
    /// (`PtxArch::has_dtype`: bf16 on sm_75).
    macro_rules! for_dtype {
        (bf16, $($item:item)*) => {$(
            #[cfg(target_feature = "sm_80")]
            $item
        )*};
        ($dtype:ident, $($item:item)*) => {$($item)*};
    }

    macro_rules! device_entries {
    ($($kind:ident $dtype:ident $d:literal $mask:ident $score:ident $seq:ident;)*) => {$(
        for_dtype! { $dtype,
        const _: () = {
            #[export_name = concat!(
                "flash_", stringify!($kind), "_", stringify!($dtype), "_hd", stringify!($d),
                "_", stringify!($mask), "_", stringify!($score), "_", stringify!($seq)
            )]
            pub unsafe extern "ptx-kernel" fn entry(p: entry_params!($kind)) {
                entry_body!($kind, p, $dtype, $d, $mask, $score, $seq)
            }
        };
        }
    )*};
}

    attention_variants!(device_entries);

    /// Dtype- and head-dim-agnostic: it moves 16-byte chunks.
    #[no_mangle]
    pub unsafe extern "ptx-kernel" fn flash_append_kv(p: AppendParams) {
        append_kv(&p)
    }

    #[no_mangle]
    pub unsafe extern "ptx-kernel" fn flash_merge_f16(p: MergeParams) {
        merge::<F16>(&p)
    }

    #[no_mangle]
    pub unsafe extern "ptx-kernel" fn flash_bwd_prep_f16(p: BwdParams) {
        backward::prep::<F16>(&p)
    }

    #[no_mangle]
    pub unsafe extern "ptx-kernel" fn flash_bwd_dq_f16(p: BwdParams) {
        backward::dq::<F16>(&p)
    }

    #[no_mangle]
    pub unsafe extern "ptx-kernel" fn flash_bwd_dkv_f16(p: BwdParams) {
        backward::dkv::<F16>(&p)
    }

    /// Dtype- and head-dim-agnostic: it reads the f32 LSE and `delta` rows.
    #[no_mangle]
    pub unsafe extern "ptx-kernel" fn flash_bwd_sinks(p: BwdParams) {
        backward::sinks(&p)
    }

    for_dtype! { bf16,
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn flash_merge_bf16(p: MergeParams) {
            merge::<super::super::element::Bf16>(&p)
        }

        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn flash_bwd_prep_bf16(p: BwdParams) {
            backward::prep::<super::super::element::Bf16>(&p)
        }

        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn flash_bwd_dq_bf16(p: BwdParams) {
            backward::dq::<super::super::element::Bf16>(&p)
        }

        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn flash_bwd_dkv_bf16(p: BwdParams) {
            backward::dkv::<super::super::element::Bf16>(&p)
        }
    }
}

#[cfg(target_feature = "sm_90a")]
mod sm90a {
    use super::super::hopper::backward::backward;
    use super::super::hopper::forward::forward;
    use super::super::hopper::probe::{tma_copy, wgmma_gemm};
    use super::super::policy::policies;
    use crate::arch::tma::param0_address;
    use crate::config::{hopper_entries, table_word, HopperBwdTile, HopperTile};
    use crate::params::{
        AttnParams, BwdParams, HopperFwdMaps, ProbeGemmParams, ProbeTmaMaps, ProbeTmaParams,
    };

    macro_rules! fwd_name {
        ($dtype:ident $d:literal $mask:ident $score:ident $seq:ident $rows:literal $($grid:ident)?) => {
            concat!(
                "flash_wgmma_fwd_",
                stringify!($dtype),
                "_hd",
                stringify!($d),
                "_",
                stringify!($mask),
                "_",
                stringify!($score),
                "_",
                stringify!($seq),
                "_m",
                stringify!($rows)
                $(, "_", stringify!($grid))?
            )
        };
    }

    macro_rules! hopper_device_entries {
    (
        $(fwd $fdtype:ident $fd:literal $mask:ident $score:ident $seq:ident $rows:literal $($grid:ident)?;)*
        $(bwd $bdtype:ident $bd:literal $bmask:ident $bscore:ident $bseq:ident;)*
        $(wgmma $dtype:ident $n:literal $k:literal;)*
        $(tma $d:literal;)*
    ) => {
        $(const _: () = {
            const LOOP: bool = table_word!(grid $($grid)?);
            const TILE: HopperTile = HopperTile::of(
                $fd,
                policies::<ty!($mask), ty!($score), ty!($seq)>(),
                $rows,
                LOOP,
                table_word!(keys $($grid)?),
            );
            #[export_name = fwd_name!($fdtype $fd $mask $score $seq $rows $($grid)?)]
            // Tensor maps come first, as in every sm_90a entry that takes
            // them: the PTX build aligns that parameter to 128 bytes
            // (`artifacts::align_tensor_map_params`).
            pub unsafe extern "ptx-kernel" fn entry(_maps: HopperFwdMaps, p: AttnParams) {
                // The maps are read where the driver put them (param space);
                // reading `_maps` in Rust would copy it to local memory.
                let maps = param0_address!(fwd_name!($fdtype $fd $mask $score $seq $rows $($grid)?));
                forward::<
                    ty!($fdtype),
                    ty!($mask),
                    ty!($score),
                    ty!($seq),
                    $fd,
                    $rows,
                    LOOP,
                    { TILE.block_n / 8 },
                    { $fd / 8 },
                    { $fd / 16 },
                    { TILE.block_n / 16 },
                    { TILE.stages as u32 },
                    { TILE.v_stages as u32 },
                    { TILE.q_buffers() as u32 },
                    { TILE.consumer_regs() },
                >(&p, maps)
            }
        };)*
        $(const _: () = {
            #[export_name = concat!(
                "flash_wgmma_bwd_", stringify!($bdtype), "_hd", stringify!($bd),
                "_", stringify!($bmask), "_", stringify!($bscore), "_", stringify!($bseq)
            )]
            pub unsafe extern "ptx-kernel" fn entry(p: BwdParams) {
                backward::<
                    ty!($bdtype),
                    ty!($bscore),
                    $bd,
                    { HopperBwdTile::of($bd).warpgroups },
                    { $bd / 8 },
                    { $bd / 16 },
                    { $bd / 8 / HopperBwdTile::of($bd).warpgroups },
                    { HopperBwdTile::of($bd).block_n() / 16 },
                >(&p)
            }
        };)*
        $(const _: () = {
            #[export_name = concat!(
                "flash_probe_wgmma_", stringify!($dtype), "_n", stringify!($n), "_k", stringify!($k)
            )]
            pub unsafe extern "ptx-kernel" fn entry(p: ProbeGemmParams) {
                wgmma_gemm::<ty!($dtype), $n, $k, { $n / 8 }, { $k / 16 }>(&p)
            }
        };)*
        $(const _: () = {
            #[export_name = concat!("flash_probe_tma_hd", stringify!($d))]
            pub unsafe extern "ptx-kernel" fn entry(_maps: ProbeTmaMaps, p: ProbeTmaParams) {
                let maps_at = match p.map_source {
                    ProbeTmaParams::MAPS_GLOBAL => p.maps_global,
                    _ => param0_address!(concat!("flash_probe_tma_hd", stringify!($d))),
                };
                let load = maps_at + core::mem::offset_of!(ProbeTmaMaps, load) as u64;
                let store = maps_at + core::mem::offset_of!(ProbeTmaMaps, store) as u64;
                tma_copy::<$d>(&p, load, store)
            }
        };)*
    };
}

    hopper_entries!(hopper_device_entries);
}
