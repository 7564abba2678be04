//! The attention mask on one S tile held in mma accumulator layout.
use super::unroll::unroll;

/// Sets S to -inf where the key lies past the row's limit. `key0` is the key of
/// this lane's first column (tile start + 2 * (lane % 4)); `limits` are the
/// largest visible keys of the lane's two rows (g and g + 8).
#[inline(always)]
pub fn apply<const ST: usize>(s: &mut [[f32; 4]; ST], key0: i32, limits: [i32; 2]) {
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            let key = key0 + (j * 8) as i32 + (e & 1) as i32;
            if key > limits[e / 2] {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}
