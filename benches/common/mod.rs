//! Timing and inputs shared by the backward and candle training benches.
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use flash_attn::AttnElement;

/// Median milliseconds per call over `reps` batches of back-to-back calls,
/// timed with CUDA events; a batch is as many calls (1 to `max_calls`) as
/// take about `batch_ms`, so that launch gaps and event overhead vanish.
pub fn time_median(
    stream: &Arc<CudaStream>,
    reps: usize,
    (batch_ms, max_calls): (f64, usize),
    mut call: impl FnMut(),
) -> f64 {
    let event = || {
        stream
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event")
    };
    let mut batch = |n: usize| {
        let (start, end) = (event(), event());
        start.record(stream).expect("record");
        for _ in 0..n {
            call();
        }
        end.record(stream).expect("record");
        end.synchronize().expect("sync");
        start.elapsed_ms(&end).expect("elapsed") as f64 / n as f64
    };
    let n = ((batch_ms / batch(2)).ceil() as usize).clamp(1, max_calls);
    let mut samples: Vec<f64> = (0..reps).map(|_| batch(n)).collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// `n` values in [-1, 1) from a xorshift of `seed`, on the device: the
/// values only need to be ordinary.
pub fn random<T: AttnElement>(stream: &Arc<CudaStream>, n: usize, seed: u64) -> CudaSlice<T> {
    let mut x = seed | 1;
    let host: Vec<T> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f64((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)
        })
        .collect();
    stream.clone_htod(&host).expect("upload")
}
