//! The Hopper module (`PtxArch::Sm90a`): architecture-specific PTX that runs
//! on compute capability 9.0 only, and the TMA tensor maps its kernels read.
//! `FlashAttention::new` loads it on such GPUs for the Hopper forward (unless
//! [`FORCE_SM80_ENV`] is set); [`probes`] loads it for the primitive checks.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    self, CUfunction_attribute, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use flash_attn_kernels::config::{Dtype, Entry, PtxArch, HOPPER_ENTRIES, SW128_ROW_ELEMS};
use flash_attn_kernels::params::{
    AttnParams, BwdParams, HopperFwdMaps, ProbeGemmParams, ProbeTmaMaps, ProbeTmaParams, TensorMap,
};

use crate::attention::{load_module, ByValue, LoadedCode, ModuleChoice};
use crate::error::FlashAttnError;

// SAFETY: #[repr(C)] plain data that the probe entries take by value.
unsafe impl DeviceRepr for ByValue<ProbeGemmParams> {}
unsafe impl DeviceRepr for ByValue<ProbeTmaMaps> {}
unsafe impl DeviceRepr for ByValue<ProbeTmaParams> {}
// SAFETY: #[repr(C)] plain data, the Hopper forward's first parameter.
unsafe impl DeviceRepr for ByValue<HopperFwdMaps> {}

/// Set to `1`, [`crate::FlashAttention::new`] does not load the Hopper
/// module: every forward call runs on the `Sm90` module's `mma.sync`
/// kernels, as on GPUs other than compute capability 9.0.
/// [`crate::FlashAttention::set_hopper_forward`] switches one instance.
pub const FORCE_SM80_ENV: &str = "FLASH_ATTN_FORCE_SM80";

/// Whether [`FORCE_SM80_ENV`] asks for the `Sm90` forward.
pub(crate) fn forced_off() -> bool {
    std::env::var(FORCE_SM80_ENV).is_ok_and(|v| v == "1")
}

thread_local! {
    /// Hopper forward and backward launches made by this thread (see
    /// [`launches_on_this_thread`]).
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Hopper forward and backward launches this thread has made: a dense
/// forward call falls back to the `mma.sync` kernels unseen when the driver
/// refuses a tensor map, and a backward call at a head dim without a Hopper
/// line runs them, so the GPU suite compares this count before and after
/// each call. Not part of the supported API.
#[doc(hidden)]
pub fn launches_on_this_thread() -> u64 {
    LAUNCHES.with(|n| n.get())
}

/// The most rows of one TMA box (the driver's limit per box dimension).
pub(crate) const TMA_MAX_BOX_ROWS: usize = 256;

/// The `Sm90a` module's functions.
pub(crate) struct HopperModule {
    functions: HashMap<&'static str, CudaFunction>,
    pub(crate) loaded: LoadedCode,
    pub(crate) counters: TileCounters,
}

/// The u32 tile counters of dynamically scheduled persistent launches
/// (`index::TileGrid::counter`). A counter is 0 between launches (each
/// launch takes exactly as many tickets as the counter wraps at), but two
/// launches that run at the same time must not share one: their tickets
/// would interleave and tiles go undone. So launches take them in turn
/// from a ring of [`Self::RING`] (a counter comes back after that many
/// launches of this instance, far more than can be queued at once), and a
/// launch captured into a CUDA graph takes one of its own for good, since
/// the graph runs it again whenever it is launched (a graph's launches run
/// in order; two executable graphs instantiated from one capture must not
/// run at the same time). Once those are used up, captured launches take
/// the static order ([`flash_attn_kernels::index::persistent_step`]).
pub(crate) struct TileCounters {
    /// [`Self::RING`] + [`Self::CAPTURED`] zeroed counters.
    _counters: CudaSlice<u32>,
    base: u64,
    /// (launches so far, counters given to captured launches).
    taken: Mutex<(u64, u32)>,
}

impl TileCounters {
    /// Counters the launches outside graph capture go round.
    pub(crate) const RING: u32 = 1 << 16;
    /// Counters for captured launches, one each.
    pub(crate) const CAPTURED: u32 = 1 << 14;

    fn new(ctx: &Arc<CudaContext>) -> Result<Self, FlashAttnError> {
        let stream = ctx.default_stream();
        let counters = stream.alloc_zeros::<u32>((Self::RING + Self::CAPTURED) as usize)?;
        let base = {
            let (ptr, _sync) = counters.device_ptr(&stream);
            ptr
        };
        stream.synchronize()?;
        Ok(TileCounters {
            _counters: counters,
            base,
            taken: Mutex::new((0, 0)),
        })
    }

    /// The address of the counter for a launch on `stream`, `None` when it
    /// should take the static order.
    pub(crate) fn for_launch(&self, stream: &CudaStream) -> Result<Option<u64>, FlashAttnError> {
        let captured =
            stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let slot = if captured {
            if taken.1 == Self::CAPTURED {
                return Ok(None);
            }
            taken.1 += 1;
            Self::RING + taken.1 - 1
        } else {
            taken.0 += 1;
            ((taken.0 - 1) % Self::RING as u64) as u32
        };
        Ok(Some(self.base + 4 * slot as u64))
    }
}

impl HopperModule {
    /// Loads the module (its cubin, or the PTX the driver JIT-compiles, as
    /// `choice` says) and raises every entry's dynamic shared-memory limit;
    /// `None` unless the device is compute capability 9.0.
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        choice: ModuleChoice,
    ) -> Result<Option<Self>, FlashAttnError> {
        let (major, minor) = ctx.compute_capability()?;
        if !PtxArch::hopper_device(major, minor) {
            return Ok(None);
        }
        let (module, loaded) = load_module(ctx, PtxArch::Sm90a, choice)?;
        let mut functions = HashMap::new();
        for entry in HOPPER_ENTRIES {
            let function = module
                .load_function(entry.name)
                .map_err(|_| FlashAttnError::MissingKernel(entry.name))?;
            function.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                entry.smem_bytes(PtxArch::Sm90a) as i32,
            )?;
            functions.insert(entry.name, function);
        }
        Ok(Some(HopperModule {
            functions,
            loaded,
            counters: TileCounters::new(ctx)?,
        }))
    }

    /// Launches the Hopper forward `entry` over Q, K and V (in `params`, whose
    /// strides and sizes validation checked; `maps` their tensor maps) on a
    /// grid of `grid` CTAs.
    pub(crate) fn launch_forward(
        &self,
        stream: &CudaStream,
        entry: &Entry,
        maps: HopperFwdMaps,
        params: AttnParams,
        grid: (u32, u32, u32),
    ) -> Result<(), FlashAttnError> {
        let (function, cfg) = self.function_and_config(entry, grid)?;
        let (maps, params) = (ByValue(maps), ByValue(params));
        let mut builder = stream.launch_builder(function);
        builder.arg(&maps).arg(&params);
        // SAFETY: the entry takes (HopperFwdMaps, AttnParams) by value; the
        // maps cover exactly the validated tensors, and validation bounded
        // every address the kernel derives from the parameters.
        unsafe { builder.launch(cfg) }?;
        LAUNCHES.with(|n| n.set(n.get() + 1));
        Ok(())
    }

    /// Launches the Hopper backward `entry` (`params` as validation checked
    /// them for the `mma.sync` kernel, which takes the same) on a grid of
    /// `grid` CTAs.
    pub(crate) fn launch_backward(
        &self,
        stream: &CudaStream,
        entry: &Entry,
        params: BwdParams,
        grid: (u32, u32, u32),
    ) -> Result<(), FlashAttnError> {
        let (function, cfg) = self.function_and_config(entry, grid)?;
        let params = ByValue(params);
        let mut builder = stream.launch_builder(function);
        builder.arg(&params);
        // SAFETY: the entry takes BwdParams by value, and validation bounded
        // every address the kernel derives from them.
        unsafe { builder.launch(cfg) }?;
        LAUNCHES.with(|n| n.set(n.get() + 1));
        Ok(())
    }

    /// `entry`'s function and its launch on a grid of `grid` CTAs.
    fn function_and_config(
        &self,
        entry: &Entry,
        grid: (u32, u32, u32),
    ) -> Result<(&CudaFunction, LaunchConfig), FlashAttnError> {
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (entry.threads(PtxArch::Sm90a) as u32, 1, 1),
            shared_mem_bytes: entry.smem_bytes(PtxArch::Sm90a) as u32,
        };
        Ok((self.function(entry.name)?, cfg))
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, FlashAttnError> {
        self.functions.get(name).ok_or(FlashAttnError::Unsupported {
            what: "this entry",
            entry: "the sm_90a module",
        })
    }
}

/// A 16-bit tensor {D, S, H, B} (innermost first) for TMA: `base` its device
/// address, `strides` the byte strides of S, H and B (multiples of 16), boxes
/// of {64, `box_rows`, 1, 1} with the 128-byte swizzle, out-of-range
/// elements read as zeros.
pub(crate) struct TiledTensor {
    pub base: u64,
    pub dtype: Dtype,
    pub dims: [u64; 4],
    pub strides: [u64; 3],
    pub box_rows: u32,
}

/// `cuTensorMapEncodeTiled` of `t`; the driver checks the geometry (16-byte
/// strides and base, box sizes) and refuses what TMA cannot read.
pub(crate) fn encode_tensor_map(t: &TiledTensor) -> Result<TensorMap, FlashAttnError> {
    // cudarc declares the type with the alignment the driver writes it at.
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let data_type = match t.dtype {
        Dtype::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        Dtype::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        // No Hopper entry takes f32 (find_hopper_entry finds none first).
        Dtype::F32 => {
            return Err(FlashAttnError::UnsupportedDtype {
                dtype: Dtype::F32,
                arch: "sm_90a",
                call: "the Hopper forward",
            })
        }
    };
    // The widest inner box the 128-byte swizzle allows.
    let boxes = [SW128_ROW_ELEMS as u32, t.box_rows, 1, 1];
    let element_strides = [1u32; 4];
    // SAFETY: every pointer is to a live local of the length the rank (4)
    // implies; the driver only writes `map`.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            4,
            t.base as *mut std::ffi::c_void,
            t.dims.as_ptr(),
            t.strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
    }
    Ok(TensorMap(map.opaque))
}

#[doc(hidden)]
pub mod probes {
    //! Checks of the Hopper primitives (`config::hopper_probes`) for the
    //! GPU suite: not part of the supported API.
    use super::*;
    use crate::tensor::AttnElement;
    use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
    use flash_attn_kernels::config::{ELEM_BYTES, PROBE_THREADS, SWIZZLE_ATOM_BYTES, WGMMA_M};

    /// The Hopper module of one context.
    pub struct Probes {
        module: HopperModule,
    }

    fn length(what: &'static str, expected: usize, got: usize) -> Result<(), FlashAttnError> {
        if expected == got {
            Ok(())
        } else {
            Err(FlashAttnError::ShapeMismatch {
                tensor: what,
                dim: "elements",
                expected,
                got,
            })
        }
    }

    impl Probes {
        /// `None` unless the context's device is compute capability 9.0.
        pub fn new(ctx: &Arc<CudaContext>) -> Result<Option<Self>, FlashAttnError> {
            Ok(HopperModule::load(ctx, ModuleChoice::PreferCubin)?.map(|module| Probes { module }))
        }

        /// C [64, n] (f32) = A [64, k] · B through `flash_probe_wgmma_*`:
        /// `mode` [`ProbeGemmParams::SS_K_MAJOR`] takes B as [n, k],
        /// [`ProbeGemmParams::RS_MN_MAJOR`] as [k, n], both row-major.
        #[allow(clippy::too_many_arguments)]
        pub fn wgmma_gemm<T: AttnElement>(
            &self,
            stream: &Arc<CudaStream>,
            n: usize,
            k: usize,
            mode: u32,
            a: &CudaSlice<T>,
            b: &CudaSlice<T>,
            c: &mut CudaSlice<f32>,
        ) -> Result<(), FlashAttnError> {
            let name = format!("flash_probe_wgmma_{}_n{n}_k{k}", T::DTYPE.name());
            let function = self.module.function(&name)?;
            // SW128 tiles hold whole 64-column groups: the kernel's shared
            // memory holds A [64, k] and B exactly only for these.
            let form_fits = match mode {
                ProbeGemmParams::SS_K_MAJOR => k.is_multiple_of(SW128_ROW_ELEMS),
                ProbeGemmParams::RS_MN_MAJOR => n.is_multiple_of(SW128_ROW_ELEMS),
                _ => false,
            };
            if !form_fits {
                return Err(FlashAttnError::Unsupported {
                    what: "this wgmma form (SS needs K % 64 == 0, RS N % 64 == 0)",
                    entry: "flash_probe_wgmma_*",
                });
            }
            length("a", 64 * k, a.len())?;
            length("b", n * k, b.len())?;
            length("c", 64 * n, c.len())?;
            let smem = SWIZZLE_ATOM_BYTES + ELEM_BYTES * (WGMMA_M + n) * k;
            let (a_ptr, _a) = a.device_ptr(stream);
            let (b_ptr, _b) = b.device_ptr(stream);
            let (c_ptr, _c) = c.device_ptr_mut(stream);
            let params = ByValue(ProbeGemmParams {
                a: a_ptr,
                b: b_ptr,
                c: c_ptr,
                mode,
            });
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (PROBE_THREADS as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let mut builder = stream.launch_builder(function);
            builder.arg(&params);
            // SAFETY: the buffers hold the sizes the kernel reads and writes.
            unsafe { builder.launch(cfg) }?;
            Ok(())
        }

        /// Copies the [seqlen, heads, d] tensor `src` through the two-stage
        /// TMA ring of `flash_probe_tma_hd{d}` in tiles of `rows` rows: into
        /// `copied` ([ceil(seqlen / rows) * rows, heads, d], as the threads
        /// read the tiles, zero-filled rows included) and `stored` (by TMA
        /// stores). `map_source`: where the kernel reads the maps, one of
        /// `ProbeTmaParams::MAPS_*`.
        #[allow(clippy::too_many_arguments)]
        pub fn tma_copy<T: AttnElement>(
            &self,
            stream: &Arc<CudaStream>,
            d: usize,
            rows: usize,
            seqlen: usize,
            heads: usize,
            map_source: u32,
            src: &CudaSlice<T>,
            copied: &mut CudaSlice<T>,
            stored: &mut CudaSlice<T>,
        ) -> Result<(), FlashAttnError> {
            let function = self.module.function(&format!("flash_probe_tma_hd{d}"))?;
            // Whole 8-row swizzle atoms, at most one box.
            if rows == 0 || !rows.is_multiple_of(8) || rows > TMA_MAX_BOX_ROWS {
                return Err(FlashAttnError::Unsupported {
                    what: "rows (a multiple of 8 up to 256)",
                    entry: "flash_probe_tma_*",
                });
            }
            let too_large = FlashAttnError::TooLarge {
                what: "seqlen x heads",
                value: seqlen.saturating_mul(heads),
                limit: i32::MAX as usize / d,
            };
            if seqlen.saturating_mul(heads) > i32::MAX as usize / d {
                return Err(too_large);
            }
            length("src", seqlen * heads * d, src.len())?;
            length("stored", seqlen * heads * d, stored.len())?;
            length(
                "copied",
                seqlen.div_ceil(rows) * rows * heads * d,
                copied.len(),
            )?;
            // Two stages, then the four 8-byte mbarriers (the kernel's layout).
            let stage = (ELEM_BYTES * rows * d).next_multiple_of(SWIZZLE_ATOM_BYTES);
            let smem = SWIZZLE_ATOM_BYTES + 2 * stage + 4 * 8;
            if smem > PtxArch::Sm90a.max_smem_bytes() {
                return Err(FlashAttnError::TooLarge {
                    what: "shared memory of 2 stages of rows x d",
                    value: smem,
                    limit: PtxArch::Sm90a.max_smem_bytes(),
                });
            }
            let (src_ptr, _s) = src.device_ptr(stream);
            let (stored_ptr, _t) = stored.device_ptr_mut(stream);
            let map = |base| {
                encode_tensor_map(&TiledTensor {
                    base,
                    dtype: T::DTYPE,
                    dims: [d as u64, seqlen as u64, heads as u64, 1],
                    strides: [
                        (2 * heads * d) as u64,
                        (2 * d) as u64,
                        (2 * seqlen * heads * d) as u64,
                    ],
                    box_rows: rows as u32,
                })
            };
            let maps = ProbeTmaMaps {
                load: map(src_ptr)?,
                store: map(stored_ptr)?,
            };
            let mut global_maps = [0u64; 32];
            global_maps[..16].copy_from_slice(&maps.load.0);
            global_maps[16..].copy_from_slice(&maps.store.0);
            let global_maps = stream.clone_htod(&global_maps)?;
            let (copied_ptr, _c) = copied.device_ptr_mut(stream);
            let (maps_ptr, _m) = global_maps.device_ptr(stream);
            let params = ProbeTmaParams {
                maps_global: maps_ptr,
                copied: copied_ptr,
                seqlen: seqlen as u32,
                heads: heads as u32,
                rows: rows as u32,
                map_source,
            };
            let cfg = LaunchConfig {
                grid_dim: (heads as u32, 1, 1),
                block_dim: (PROBE_THREADS as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let (maps, params) = (ByValue(maps), ByValue(params));
            let mut builder = stream.launch_builder(function);
            builder.arg(&maps).arg(&params);
            // SAFETY: the maps and buffers cover what the kernel reads and writes.
            unsafe { builder.launch(cfg) }?;
            // `global_maps` is freed in stream order, after the kernel.
            Ok(())
        }
    }
}
