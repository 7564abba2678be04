//! Special-function and conversion instructions.
use core::arch::asm;

/// `ex2.approx.ftz.f32`: 2^x (MUFU); 2^-inf = +0.
#[inline(always)]
pub fn ex2(x: f32) -> f32 {
    let r: f32;
    unsafe {
        asm!("ex2.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack));
    }
    r
}

/// `lg2.approx.ftz.f32`: log2(x) (MUFU).
#[inline(always)]
pub fn lg2(x: f32) -> f32 {
    let r: f32;
    unsafe {
        asm!("lg2.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack));
    }
    r
}

/// `cvt.rn.f16x2.f32 d, hi, lo;` packs two f32 into f16x2, `lo` in bits 0..16.
/// That form is sm_80; sm_75 gets [`pack_f16_pair`], the same rounding.
#[inline(always)]
pub fn pack_f16x2(lo: f32, hi: f32) -> u32 {
    if !cfg!(target_feature = "sm_80") {
        return pack_f16_pair(lo, hi);
    }
    let r: u32;
    unsafe {
        asm!("cvt.rn.f16x2.f32 {r}, {h}, {l};", r = out(reg32) r, h = in(reg32) hi, l = in(reg32) lo, options(pure, nomem, nostack));
    }
    r
}

/// `cvt.rn.f16.f32` x2 + `mov.b32 d, {lo, hi}`: [`pack_f16x2`] for sm_75.
#[inline(always)]
pub fn pack_f16_pair(lo: f32, hi: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!(
            "{{ .reg .f16 l, h; cvt.rn.f16.f32 l, {lo}; cvt.rn.f16.f32 h, {hi}; mov.b32 {r}, {{l, h}}; }}",
            r = out(reg32) r, lo = in(reg32) lo, hi = in(reg32) hi,
            options(pure, nomem, nostack),
        );
    }
    r
}

/// `cvt.rn.bf16x2.f32 d, hi, lo;` packs two f32 into bf16x2, `lo` in bits 0..16.
#[inline(always)]
pub fn pack_bf16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {r}, {h}, {l};", r = out(reg32) r, h = in(reg32) hi, l = in(reg32) lo, options(pure, nomem, nostack));
    }
    r
}

/// `fma.rn.f32 d, a, b, c;` a*b + c with one rounding.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    let r: f32;
    unsafe {
        asm!("fma.rn.f32 {r}, {a}, {b}, {c};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, c = in(reg32) c, options(pure, nomem, nostack));
    }
    r
}

/// `rcp.approx.ftz.f32`: 1/x within 1 ulp (MUFU), no slow-path call.
#[inline(always)]
pub fn rcp(x: f32) -> f32 {
    let r: f32;
    unsafe {
        asm!("rcp.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack));
    }
    r
}

/// `tanh.approx.f32` (MUFU, sm_75+): max relative error about 2^-11.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let r: f32;
    unsafe {
        asm!("tanh.approx.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack));
    }
    r
}

/// `abs.f32`
#[inline(always)]
pub fn abs(x: f32) -> f32 {
    let r: f32;
    unsafe {
        asm!("abs.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack));
    }
    r
}

/// `mov.b32 {lo, hi}` + `cvt.f32.f16` x2: the two f16 of a packed pair
/// (`lo` in bits 0..16) as f32.
#[inline(always)]
pub fn unpack_f16x2(pair: u32) -> (f32, f32) {
    let (lo, hi): (f32, f32);
    unsafe {
        asm!(
            "{{ .reg .f16 l, h; mov.b32 {{l, h}}, {p}; cvt.f32.f16 {lo}, l; cvt.f32.f16 {hi}, h; }}",
            p = in(reg32) pair, lo = out(reg32) lo, hi = out(reg32) hi,
            options(pure, nomem, nostack),
        );
    }
    (lo, hi)
}
