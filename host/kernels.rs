//! The kernels embedded at build time (see build.rs): the PTX, built from
//! `kernels-gpu` when a kernel toolchain is present, otherwise the committed,
//! hash-checked copy; and the committed cubins assembled from that PTX
//! (`scripts/update-cubins.sh`), empty where they do not match it.
//!
//! Each is embedded as a zstd frame and unpacked only when its module is
//! loaded: a binary carries 8.8 MB of kernels instead of 113 MB, and
//! `FlashAttention::new` on an H200 host, which unpacks two cubins (14.2 MB,
//! one per thread), takes about 20 ms longer than with raw kernels
//! (docs/perf-notes.md, v69).

/// `"source"` when this build compiled the kernels, `"committed"` when it used
/// the PTX committed under `kernels-gpu/ptx/`.
pub const PTX_SOURCE: &str = env!("FLASH_ATTN_PTX_ORIGIN");

use flash_attn_kernels::config::PtxArch;

/// An embedded kernel image (PTX text or a cubin) as a zstd frame.
#[derive(Clone, Copy)]
pub struct KernelImage(&'static [u8]);

impl KernelImage {
    /// The image's bytes. build.rs embeds only frames that it wrote or
    /// unpacked and hash-checked itself, so a failure here is a broken build.
    pub fn unpack(self) -> Vec<u8> {
        const CHECKED: &str = "build.rs embeds only zstd frames it has checked";
        let mut frame = ruzstd::decoding::StreamingDecoder::new(self.0).expect(CHECKED);
        // One allocation of the size the header records (committed frames
        // record it, and build.rs checked it; a source build's raw-block
        // frames do not): growing the vector by doubling made unpacking 1.6x
        // slower.
        let mut out = Vec::with_capacity(frame.decoder.content_size() as usize);
        std::io::Read::read_to_end(&mut frame, &mut out).expect(CHECKED);
        out
    }

    /// The size of the frame as embedded.
    pub fn packed_len(self) -> usize {
        self.0.len()
    }
}

impl std::fmt::Debug for KernelImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KernelImage({} bytes of zstd)", self.0.len())
    }
}

macro_rules! embedded {
    ($file:literal) => {
        KernelImage(include_bytes!(concat!(env!("OUT_DIR"), "/", $file, ".zst")))
    };
}

const PTX_SM75: KernelImage = embedded!("flash_attn_sm75.ptx");
const PTX_SM80: KernelImage = embedded!("flash_attn_sm80.ptx");
const PTX_SM90: KernelImage = embedded!("flash_attn_sm90.ptx");
const PTX_SM90A: KernelImage = embedded!("flash_attn_sm90a.ptx");

/// The PTX text of a module, unpacked on each call; [`PtxArch::for_device`]
/// picks the module.
pub fn ptx_text(arch: PtxArch) -> String {
    let packed = match arch {
        PtxArch::Sm75 => PTX_SM75,
        PtxArch::Sm80 => PTX_SM80,
        PtxArch::Sm90 => PTX_SM90,
        PtxArch::Sm90a => PTX_SM90A,
    };
    String::from_utf8(packed.unpack()).expect("build.rs embeds PTX that is UTF-8")
}

const CUBIN_SM75: KernelImage = embedded!("flash_attn_sm75.cubin");
const CUBIN_SM80: KernelImage = embedded!("flash_attn_sm80.cubin");
const CUBIN_SM86: KernelImage = embedded!("flash_attn_sm86.cubin");
const CUBIN_SM89: KernelImage = embedded!("flash_attn_sm89.cubin");
const CUBIN_SM90: KernelImage = embedded!("flash_attn_sm90.cubin");
const CUBIN_SM90_CU13: KernelImage = embedded!("flash_attn_sm90.cu13.cubin");
const CUBIN_SM90A: KernelImage = embedded!("flash_attn_sm90a.cubin");
const CUBIN_SM90A_CU13: KernelImage = embedded!("flash_attn_sm90a.cu13.cubin");

/// Machine code of `arch`'s module for a GPU of compute capability
/// `major.minor` that this build carries, in the order to try: SASS runs on
/// its own major version at the same or a higher minor (sm_87 takes
/// sm_80's). sm_90 and sm_90a have a CUDA 13.0 cubin (drivers R580+; for
/// sm_90 2-3% faster) before the CUDA 12.4 one (R525+); every other cubin is
/// CUDA 12.4's. Empty: the caller loads the PTX, which the driver
/// JIT-compiles (the sm_75 module on a newer GPU, for one).
pub fn cubins_for(arch: PtxArch, major: i32, minor: i32) -> Vec<(&'static str, KernelImage)> {
    let candidates: &[(&'static str, KernelImage)] = match (arch, major, minor) {
        (PtxArch::Sm75, 7, 5) => &[("sm_75/ptxas-12.4", CUBIN_SM75)],
        (PtxArch::Sm80, 8, 0 | 7) => &[("sm_80/ptxas-12.4", CUBIN_SM80)],
        (PtxArch::Sm80, 8, 6) => &[("sm_86/ptxas-12.4", CUBIN_SM86)],
        (PtxArch::Sm80, 8, 9) => &[("sm_89/ptxas-12.4", CUBIN_SM89)],
        (PtxArch::Sm90, 9, 0) => &[
            ("sm_90/ptxas-13.0", CUBIN_SM90_CU13),
            ("sm_90/ptxas-12.4", CUBIN_SM90),
        ],
        (PtxArch::Sm90a, 9, 0) => &[
            ("sm_90a/ptxas-13.0", CUBIN_SM90A_CU13),
            ("sm_90a/ptxas-12.4", CUBIN_SM90A),
        ],
        _ => &[],
    };
    candidates
        .iter()
        .copied()
        .filter(|(_, cubin)| cubin.packed_len() > 0)
        .collect()
}
