//! Warp-level tensor-core matrix multiply-accumulate: m16n8k16 (sm_80),
//! m16n8k8 f16 (sm_75).
//!
//! `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`, D = A·B + C.
//! Lane `l`, with g = l/4 and t = l%4, holds:
//! - A (16x16, row-major), four b32 regs of two elements: a0 = (g, 2t..2t+1),
//!   a1 = (g+8, 2t..), a2 = (g, 8+2t..), a3 = (g+8, 8+2t..);
//! - B (16x8, "col": k-major per column), two b32 regs: b0 = (k 2t..2t+1, n g),
//!   b1 = (k 8+2t.., n g);
//! - C/D (16x8 f32): c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1).
//!
//! m16n8k8 holds the first half of each: A a0 = (g, 2t..), a1 = (g+8, 2t..);
//! B b0 = (k 2t.., n g); C/D as above. So an m16n8k16 is the m16n8k8 of
//! (a0, a1, b0) followed by that of (a2, a3, b1).
use core::arch::asm;

/// `mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32` (sm_75)
#[inline(always)]
pub fn m16n8k8_f16(c: &mut [f32; 4], a0: u32, a1: u32, b0: u32) {
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}}}, {{{b0}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) c[0], d1 = inout(reg32) c[1], d2 = inout(reg32) c[2], d3 = inout(reg32) c[3],
            a0 = in(reg32) a0, a1 = in(reg32) a1, b0 = in(reg32) b0,
            options(pure, nomem, nostack),
        );
    }
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`
#[inline(always)]
pub fn m16n8k16_f16(c: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) c[0], d1 = inout(reg32) c[1], d2 = inout(reg32) c[2], d3 = inout(reg32) c[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b0, b1 = in(reg32) b1,
            options(pure, nomem, nostack),
        );
    }
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`
#[inline(always)]
pub fn m16n8k16_bf16(c: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) c[0], d1 = inout(reg32) c[1], d2 = inout(reg32) c[2], d3 = inout(reg32) c[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b0, b1 = in(reg32) b1,
            options(pure, nomem, nostack),
        );
    }
}
