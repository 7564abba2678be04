//! Dynamic shared memory and plain shared-memory loads/stores.
use core::arch::{asm, global_asm};

// The dynamic shared-memory window of every kernel in the module; its size is
// the launch's `shared_mem_bytes`.
global_asm!(".extern .shared .align 16 .b8 SMEM[];");

/// `mov.u32 %r, SMEM;` the `.shared` address of the dynamic shared memory.
#[inline(always)]
pub fn base() -> u32 {
    let r: u32;
    unsafe {
        asm!("mov.u32 {r}, SMEM;", r = out(reg32) r, options(pure, nomem, nostack));
    }
    r
}

/// `st.shared.b32 [addr], v;`
#[inline(always)]
pub fn st_b32(addr: u32, v: u32) {
    unsafe {
        asm!("st.shared.b32 [{a}], {v};", a = in(reg32) addr, v = in(reg32) v, options(nostack));
    }
}

/// `st.shared.v2.b32 [addr], {a,b};` 8 bytes, `addr` 8-byte aligned.
#[inline(always)]
pub fn st_v2_b32(addr: u32, a: u32, b: u32) {
    unsafe {
        asm!(
            "st.shared.v2.b32 [{p}], {{{a}, {b}}};",
            p = in(reg32) addr, a = in(reg32) a, b = in(reg32) b,
            options(nostack),
        );
    }
}

/// `st.shared.v4.b32 [addr], {a,b,c,d};` 16 bytes, `addr` 16-byte aligned.
#[inline(always)]
pub fn st_v4_b32(addr: u32, v: [u32; 4]) {
    unsafe {
        asm!(
            "st.shared.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack),
        );
    }
}

/// `ld.shared.b32 v, [addr];`
#[inline(always)]
pub fn ld_b32(addr: u32) -> u32 {
    let v: u32;
    unsafe {
        asm!("ld.shared.b32 {v}, [{a}];", v = out(reg32) v, a = in(reg32) addr, options(nostack, readonly));
    }
    v
}

/// `ld.shared.v2.b32 {x,y}, [addr];` 8 bytes, `addr` 8-byte aligned.
#[inline(always)]
pub fn ld_v2_b32(addr: u32) -> (u32, u32) {
    let (x, y): (u32, u32);
    unsafe {
        asm!(
            "ld.shared.v2.b32 {{{x}, {y}}}, [{a}];",
            x = out(reg32) x, y = out(reg32) y, a = in(reg32) addr,
            options(nostack, readonly),
        );
    }
    (x, y)
}

/// `ld.shared.v4.b32 {x,y,z,w}, [addr];` 16 bytes, `addr` 16-byte aligned.
#[inline(always)]
pub fn ld_v4_b32(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ld.shared.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) addr,
            options(nostack, readonly),
        );
    }
    [a, b, c, d]
}
