//! Whether this process can use a GPU, asked without panicking.
use cudarc::driver::sys::cudaError_enum;
use cudarc::driver::{CudaContext, DriverError};

/// The CUDA devices this process can use: 0 when the driver library is not
/// installed (cudarc's run-time loading, the default, panics on the first
/// call without it), when it is the toolkit's link-time stub, or when it sees
/// no device. Any other driver error is returned: a driver that is present
/// but fails is not "no GPU".
pub fn cuda_device_count() -> Result<usize, DriverError> {
    if !driver_library_loads() {
        return Ok(0);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(e) => match e.0 {
            cudaError_enum::CUDA_ERROR_STUB_LIBRARY | cudaError_enum::CUDA_ERROR_NO_DEVICE => Ok(0),
            _ => Err(e),
        },
    }
}

/// Whether the loader finds libcuda under the names cudarc loads it by.
fn driver_library_loads() -> bool {
    const NAMES: &[&str] = if cfg!(windows) {
        &["nvcuda.dll"]
    } else {
        &["libcuda.so.1", "libcuda.so"]
    };
    NAMES.iter().any(|&name| {
        // SAFETY: the library is the driver cudarc itself loads (or, linked,
        // already has loaded); its initialisers are what any CUDA call runs.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}
