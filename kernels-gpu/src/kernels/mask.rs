//! The attention mask on one S tile held in mma accumulator layout.
use super::unroll::unroll;

/// Sets S to -inf where the key lies past the row's limit. `key0` is the key of
/// this lane's first column (tile start + 2 * (lane % 4)); `limits` are the
/// largest visible keys of the lane's two rows (g and g + 8). Each element is
/// compared as `column offset > limit - key0`: one run-time value per row
/// against compile-time offsets, so the mask adds almost no live registers.
#[inline(always)]
pub fn apply<const ST: usize>(s: &mut [[f32; 4]; ST], key0: i32, limits: [i32; 2]) {
    let visible = [limits[0] - key0, limits[1] - key0];
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            let offset = (j * 8 + (e & 1)) as i32;
            if offset > visible[e / 2] {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}
