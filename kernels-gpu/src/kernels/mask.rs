//! The attention mask on one S tile held in mma accumulator layout.
use super::block_info::BlockInfo;
use super::policy::Mask;
use crate::index::{KeySpan, MaskEdges};
use crate::unroll::unroll;

/// Masks the S tile of the lane's CTA rows `rows` (g and g + 8) to the keys
/// each of them sees, testing only the ends in `edges` (the left end only
/// for masks that have one).
#[inline(always)]
pub fn apply_rows<M: Mask, const ST: usize>(
    s: &mut [[f32; 4]; ST],
    key0: i32,
    info: &BlockInfo,
    rows: [u32; 2],
    edges: MaskEdges,
) {
    if M::LEFT && edges.left {
        let lo = rows.map(|r| info.key_floor(r));
        if edges.right {
            apply_range(s, key0, rows.map(|r| info.key_limit(r)), lo);
        } else {
            apply_left(s, key0, lo);
        }
    } else {
        apply(s, key0, rows.map(|r| info.key_limit(r)));
    }
}

/// [`apply_rows`] without telling the ends apart: each element is tested
/// against both by two signed compares, as before v53. The f32 `mma.sync`
/// entries keep it: with the end variants their D = 128 window entry spilled
/// on sm_90 (ptxas 13.0; docs/perf-notes.md, v53).
#[inline(always)]
pub fn apply_rows_both<M: Mask, const ST: usize>(
    s: &mut [[f32; 4]; ST],
    key0: i32,
    info: &BlockInfo,
    rows: [u32; 2],
) {
    let last = rows.map(|r| info.key_limit(r) - key0);
    let first = if M::LEFT {
        rows.map(|r| info.key_floor(r) - key0)
    } else {
        [0; 2]
    };
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            if offset(j, e) > last[e / 2] || (M::LEFT && offset(j, e) < first[e / 2]) {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}

/// The compile-time column offset (from `key0`) of element `e` of n-tile
/// `j` in the accumulator layout.
#[inline(always)]
const fn offset(j: usize, e: usize) -> i32 {
    (j * 8 + (e & 1)) as i32
}

/// Sets S to -inf where the key lies right of the row's last visible key.
/// `key0` is the key of this lane's first column (tile start + 2 * (lane %
/// 4)); `hi` are the largest visible keys of the lane's two rows (g and
/// g + 8). Each element is compared as `column offset > hi - key0`: one
/// run-time value per row against compile-time offsets, so the mask adds
/// almost no live registers.
#[inline(always)]
fn apply<const ST: usize>(s: &mut [[f32; 4]; ST], key0: i32, hi: [i32; 2]) {
    let last = hi.map(|h| h - key0);
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            if offset(j, e) > last[e / 2] {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}

/// [`apply`] for the left end: -inf where the key lies left of the row's
/// first visible key `lo`.
#[inline(always)]
fn apply_left<const ST: usize>(s: &mut [[f32; 4]; ST], key0: i32, lo: [i32; 2]) {
    let first = lo.map(|l| l - key0);
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            if offset(j, e) < first[e / 2] {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}

/// [`apply`] for both ends, `lo..=hi`, in one unsigned compare per element
/// ([`KeySpan`]): two signed tests became two selects per element.
#[inline(always)]
fn apply_range<const ST: usize>(s: &mut [[f32; 4]; ST], key0: i32, hi: [i32; 2], lo: [i32; 2]) {
    let span = [0, 1].map(|r| KeySpan::new(lo[r], hi[r], key0));
    unroll::<ST>(|j| {
        unroll::<4>(|e| {
            if span[e / 2].cuts(offset(j, e)) {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}
