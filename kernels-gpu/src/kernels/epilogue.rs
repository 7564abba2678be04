//! Writing the forward kernel's O (and the LSE): normalised 16-bit output
//! through shared memory for 16-byte coalesced stores; f32 output straight
//! from the accumulators.
use super::block_info::BlockInfo;
use super::element::Element;
use super::lane::Lane;
use super::smem_tile::SmemTile;
use crate::arch::{barrier, global, smem};
use crate::config::AttnTile;
use crate::params::AttnParams;
use crate::unroll::unroll;

/// Final O = acc / l in the output dtype, plus the LSE when requested.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn write_output<T: Element, const D: usize, const MT: usize, const OT: usize>(
    p: &AttnParams,
    info: &BlockInfo,
    tile: AttnTile,
    stage: SmemTile<D>,
    lane: Lane,
    o: &[[[f32; 4]; OT]; MT],
    inv_l: [[f32; 2]; MT],
    lse: [[f32; 2]; MT],
) {
    // The LSE goes out first, so its values die before the O staging.
    if p.lse != 0 && lane.pair() == 0 {
        unroll::<MT>(|mt| {
            unroll::<2>(|r| {
                let row = lane.acc_row(tile, mt, r);
                if let Some(token) = info.token(row) {
                    global::st_f32(p.lse + info.lse_index(row, token) * 4, lse[mt][r]);
                }
            });
        });
    }

    if T::BYTES == 4 {
        // f32 O straight from the accumulators: each lane's pairs are 8-byte
        // stores, four lanes a full 32-byte sector of a row.
        let stored = p.v_chunks(D);
        unroll::<MT>(|mt| {
            unroll::<2>(|r| {
                let row = lane.acc_row(tile, mt, r);
                if let Some(dst) = info.q_row_ptr(p.o, &p.o_strides, row) {
                    unroll::<OT>(|dd| {
                        if dd as u32 >= stored {
                            return;
                        }
                        let col = dd as u32 * 8 + 2 * lane.pair();
                        global::st_v2_b32(
                            dst + (col * T::BYTES) as u64,
                            (o[mt][dd][2 * r] * inv_l[mt][r]).to_bits(),
                            (o[mt][dd][2 * r + 1] * inv_l[mt][r]).to_bits(),
                        );
                    });
                }
            });
        });
        return;
    }

    // Every warp has finished reading Q (and K/V) before the O tile reuses the space.
    barrier::sync_cta();
    unroll::<MT>(|mt| {
        unroll::<2>(|r| {
            let row = lane.acc_row(tile, mt, r);
            unroll::<OT>(|dd| {
                let col = dd as u32 * 8 + 2 * lane.pair();
                let v = T::pack(
                    o[mt][dd][2 * r] * inv_l[mt][r],
                    o[mt][dd][2 * r + 1] * inv_l[mt][r],
                );
                smem::st_b32(stage.pair_addr(row, col), v);
            });
        });
    });
    barrier::sync_cta();

    let chunks = tile.row_chunks() as u32;
    let stored = p.v_chunks(D);
    let per_thread = tile.block_m * tile.row_chunks() / tile.threads();
    for i in 0..per_thread {
        let idx = lane.tid + (i * tile.threads()) as u32;
        let (row, chunk) = (idx / chunks, idx % chunks);
        if chunk >= stored {
            continue;
        }
        if let Some(dst) = info.q_row_ptr(p.o, &p.o_strides, row) {
            global::st_v4_b32(
                dst + chunk as u64 * 16,
                smem::ld_v4_b32(stage.chunk_addr(row, chunk)),
            );
        }
    }
}
