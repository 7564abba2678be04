//! A thread's coordinates in the `mma` fragment layouts.
use crate::arch::special;
use crate::config::{AttnTile, MMA_M, WARP_SIZE};

/// Per-lane fragment coordinates.
#[derive(Clone, Copy)]
pub struct Lane {
    pub tid: u32,
    pub warp: u32,
    pub lane: u32,
}

impl Lane {
    #[inline(always)]
    pub fn current() -> Lane {
        let tid = special::thread_idx_x();
        Lane {
            tid,
            warp: tid / WARP_SIZE as u32,
            lane: tid % WARP_SIZE as u32,
        }
    }
    /// Accumulator row group g (rows g and g + 8 of an m-tile).
    #[inline(always)]
    pub fn group(self) -> u32 {
        self.lane / 4
    }
    /// Accumulator column pair t (columns 2t, 2t + 1).
    #[inline(always)]
    pub fn pair(self) -> u32 {
        self.lane % 4
    }
    /// First CTA row of m-tile `mt` of this warp (a warp owns consecutive rows).
    #[inline(always)]
    pub fn tile_row(self, tile: AttnTile, mt: usize) -> u32 {
        (self.warp as usize * tile.warp_rows() + mt * MMA_M) as u32
    }
    /// CTA row of accumulator half `r` (0: row g, 1: row g + 8) of m-tile `mt`.
    #[inline(always)]
    pub fn acc_row(self, tile: AttnTile, mt: usize, r: usize) -> u32 {
        self.tile_row(tile, mt) + self.group() + 8 * r as u32
    }
}
