//! The attention mask on one S tile held in mma accumulator layout.
use super::block_info::BlockInfo;
use super::policy::Mask;
use crate::unroll::unroll;

/// Masks the S tile of the lane's CTA rows `rows` (g and g + 8) to the keys
/// each of them sees; the left bound is compiled in only for masks that
/// have one.
#[inline(always)]
pub fn apply_rows<M: Mask, const ST: usize>(
    s: &mut [[f32; 4]; ST],
    key0: i32,
    info: &BlockInfo,
    rows: [u32; 2],
) {
    let hi = rows.map(|r| info.key_limit(r));
    if M::LEFT {
        apply::<ST, true>(s, key0, hi, rows.map(|r| info.key_floor(r)));
    } else {
        apply::<ST, false>(s, key0, hi, [0; 2]);
    }
}

/// Sets S to -inf where the key lies outside the row's visible range. `key0`
/// is the key of this lane's first column (tile start + 2 * (lane % 4));
/// `hi` are the largest and `lo` (with `LEFT`) the smallest visible keys of
/// the lane's two rows (g and g + 8). Each element is compared as `column
/// offset > hi - key0`: one run-time value per row against compile-time
/// offsets, so the mask adds almost no live registers.
#[inline(always)]
pub fn apply<const ST: usize, const LEFT: bool>(
    s: &mut [[f32; 4]; ST],
    key0: i32,
    hi: [i32; 2],
    lo: [i32; 2],
) {
    let last = [hi[0] - key0, hi[1] - key0];
    let first = [lo[0] - key0, lo[1] - key0];
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            let offset = (j * 8 + (e & 1)) as i32;
            if offset > last[e / 2] || (LEFT && offset < first[e / 2]) {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}
