//! Warp-wide shared-memory matrix loads (sm_75) and stores (sm_90).
//!
//! Each of the four 8x8 b16 matrices is addressed by eight lanes (lanes 8i..8i+7
//! give the rows of matrix i, 16 bytes each). Lane `l` receives, in register i,
//! the pair of elements (row l/4, columns 2(l%4), 2(l%4)+1) of matrix i, which is
//! the `mma.m16n8k16` A/B fragment layout.
use core::arch::asm;

/// `ldmatrix.sync.aligned.m8n8.x4.shared.b16`
#[inline(always)]
pub fn x4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) addr,
            options(nostack, readonly),
        );
    }
    [a, b, c, d]
}

/// `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`: as [`x4`] but each matrix
/// transposed, so lane `l` receives (rows 2(l%4), 2(l%4)+1; column l/4). Reads a
/// row-major [key][dim] V tile as the column-major B operand of P·V.
#[inline(always)]
pub fn x4_trans(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) addr,
            options(nostack, readonly),
        );
    }
    [a, b, c, d]
}

/// `stmatrix.sync.aligned.m8n8.x4.shared.b16 [addr], {r0, r1, r2, r3};`
/// (sm_90): the inverse of [`x4`]. Lanes 8i..8i+7 give the rows of matrix i
/// (16 bytes each); lane `l`'s register i holds (row l/4, columns 2(l%4),
/// 2(l%4)+1) of matrix i, so a packed `mma`/`wgmma` C fragment stores as it is.
#[inline(always)]
pub fn store_x4(addr: u32, r: [u32; 4]) {
    unsafe {
        asm!(
            "stmatrix.sync.aligned.m8n8.x4.shared.b16 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg32) addr,
            a = in(reg32) r[0], b = in(reg32) r[1], c = in(reg32) r[2], d = in(reg32) r[3],
            options(nostack),
        );
    }
}
