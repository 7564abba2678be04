//! Global-memory loads, stores and the tile counter's atomic, with an explicit `.global` state space (the
//! pointers come from `u64` launch parameters, so the compiler cannot infer it).
use core::arch::asm;

/// `st.global.v4.b32 [p], {a,b,c,d};` 16 bytes, `p` 16-byte aligned.
#[inline(always)]
pub fn st_v4_b32(p: u64, v: [u32; 4]) {
    unsafe {
        asm!(
            "st.global.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack),
        );
    }
}

/// `st.global.v2.b32 [p], {a,b};` 8 bytes, `p` 8-byte aligned.
#[inline(always)]
pub fn st_v2_b32(p: u64, a: u32, b: u32) {
    unsafe {
        asm!("st.global.v2.b32 [{p}], {{{a}, {b}}};", p = in(reg64) p, a = in(reg32) a, b = in(reg32) b, options(nostack));
    }
}

/// `st.global.b32 [p], v;` 4 bytes (a pair of 16-bit elements), `p` 4-byte aligned.
#[inline(always)]
pub fn st_b32(p: u64, v: u32) {
    unsafe {
        asm!("st.global.b32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack));
    }
}

/// `red.global.add.f32 [p], v;` an atomic add (relaxed, GPU scope) that
/// returns nothing.
#[inline(always)]
pub fn red_add_f32(p: u64, v: f32) {
    unsafe {
        asm!("red.global.add.f32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack));
    }
}

/// `red.global.add.v4.f32 [p], {v0, v1, v2, v3};` four atomic adds to
/// consecutive f32s (relaxed, GPU scope) in one request: a lane covers half
/// of a 32-byte sector, where scalar `red`s cover 4 of its bytes each.
/// `p` 16-byte aligned; sm_90 and PTX ISA 8.1.
#[inline(always)]
pub fn red_add_v4_f32(p: u64, v: [f32; 4]) {
    unsafe {
        asm!(
            "red.global.add.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p,
            a = in(reg32) v[0],
            b = in(reg32) v[1],
            c = in(reg32) v[2],
            d = in(reg32) v[3],
            options(nostack),
        );
    }
}

/// `st.global.f32 [p], v;`
#[inline(always)]
pub fn st_f32(p: u64, v: f32) {
    unsafe {
        asm!("st.global.f32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack));
    }
}

/// `ld.global.nc.f32 d, [p];` read-only data (not written by this kernel).
#[inline(always)]
pub fn ld_nc_f32(p: u64) -> f32 {
    let r: f32;
    unsafe {
        asm!("ld.global.nc.f32 {r}, [{p}];", r = out(reg32) r, p = in(reg64) p, options(nostack, readonly, pure));
    }
    r
}

/// `ld.global.nc.b32 r, [p];` 4 bytes of read-only data (a pair of 16-bit elements).
#[inline(always)]
pub fn ld_nc_b32(p: u64) -> u32 {
    let r: u32;
    unsafe {
        asm!("ld.global.nc.b32 {r}, [{p}];", r = out(reg32) r, p = in(reg64) p, options(nostack, readonly, pure));
    }
    r
}

/// `ld.global.nc.v4.f32 {a,b,c,d}, [p];` 16 bytes of read-only data.
#[inline(always)]
pub fn ld_nc_v4_f32(p: u64) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    unsafe {
        asm!(
            "ld.global.nc.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) p,
            options(nostack, readonly, pure),
        );
    }
    [a, b, c, d]
}

/// `ld.global.nc.v4.b32 {a,b,c,d}, [p];` 16 bytes of read-only data.
#[inline(always)]
pub fn ld_nc_v4_b32(p: u64) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ld.global.nc.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) p,
            options(nostack, readonly, pure),
        );
    }
    [a, b, c, d]
}

/// `ld.global.nc.s32 d, [p];`
#[inline(always)]
pub fn ld_nc_s32(p: u64) -> i32 {
    let r: i32;
    unsafe {
        asm!("ld.global.nc.s32 {r}, [{p}];", r = out(reg32) r, p = in(reg64) p, options(nostack, readonly, pure));
    }
    r
}

/// `atom.global.inc.u32 d, [p], limit;` returns the old value `d` and stores
/// `d >= limit ? 0 : d + 1` (relaxed, GPU scope): a ticket counter that
/// wraps to 0 after `limit + 1` tickets.
#[inline(always)]
pub fn atom_inc_u32(p: u64, limit: u32) -> u32 {
    let d: u32;
    unsafe {
        asm!("atom.global.inc.u32 {d}, [{p}], {l};", d = out(reg32) d, p = in(reg64) p, l = in(reg32) limit, options(nostack));
    }
    d
}
