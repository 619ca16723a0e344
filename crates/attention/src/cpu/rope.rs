//! Rotary embedding on the CPU backend: the rotation, and the cos/sin table of a call's
//! positions kept for the next call with the same positions and frequencies (every layer's q
//! and k of one forward pass share them: 2 × layers calls, one table). The table is computed
//! exactly as without the cache, so results do not change.

use std::sync::{Arc, Mutex};

use super::dense::rows_per_job;
use super::pool::Pool;

use crate::rope::{RopeConfig, RopeStyle};

/// The last table: `cs[t · half + i]` = (cos, sin) of `positions[t] · inv[i]`.
#[derive(Debug)]
struct Table {
    positions: Vec<u32>,
    inv: Vec<f64>,
    half: usize,
    cs: Arc<Vec<(f32, f32)>>,
}

/// The backend's one-entry table cache (shared by clones of the backend: it only ever holds a
/// table that is a pure function of its key).
#[derive(Debug, Default)]
pub(crate) struct RopeCache {
    last: Mutex<Option<Table>>,
}

impl RopeCache {
    /// The table for `positions` and the inverse frequencies `inv`, `half` pairs per position.
    fn table(&self, positions: &[u32], inv: &[f64], half: usize) -> Arc<Vec<(f32, f32)>> {
        // A poisoned lock only means another call panicked mid-update: start afresh.
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = last.as_ref() {
            if t.half == half && t.positions == positions && t.inv == inv {
                return t.cs.clone();
            }
        }
        let mut cs = vec![(0.0f32, 0.0f32); positions.len() * half];
        for (row, &pos) in cs.chunks_exact_mut(half.max(1)).zip(positions) {
            for (c, &f) in row.iter_mut().zip(inv) {
                let (s, co) = (pos as f64 * f).sin_cos();
                *c = (co as f32, s as f32);
            }
        }
        let cs = Arc::new(cs);
        *last = Some(Table {
            positions: positions.to_vec(),
            inv: inv.to_vec(),
            half,
            cs: cs.clone(),
        });
        cs
    }

    /// Rotates every head of `x` (`[positions.len(), heads, cfg.head_dim]`, checked by the
    /// caller) at its token's position, with the inverse frequencies `inv`; split by tokens
    /// over `pool` when large (each head is rotated alone, so the split changes nothing).
    pub(crate) fn rotate(
        &self,
        pool: &Pool,
        x: &mut [f32],
        positions: &[u32],
        inv: &[f64],
        cfg: &RopeConfig,
    ) {
        let half = cfg.rotary_dim / 2;
        if half == 0 || positions.is_empty() {
            return;
        }
        let cs = self.table(positions, inv, half);
        let per_token = x.len() / positions.len();
        let tokens = rows_per_job(pool, x.len(), per_token);
        let items: Vec<_> = x
            .chunks_mut(tokens * per_token)
            .zip(cs.chunks(tokens * half))
            .collect();
        pool.for_each(items, |(x, cs)| {
            for (tok, cs) in x.chunks_exact_mut(per_token).zip(cs.chunks_exact(half)) {
                for head in tok.chunks_exact_mut(cfg.head_dim) {
                    rotate_head(head, cs, cfg.style);
                }
            }
        });
    }
}

/// Rotates one head by the (cos, sin) pairs `cs` (pair `i` of the head, as `style` pairs them).
fn rotate_head(head: &mut [f32], cs: &[(f32, f32)], style: RopeStyle) {
    let half = cs.len();
    for (i, &(cos, sin)) in cs.iter().enumerate() {
        let (a, b) = match style {
            RopeStyle::Neox => (i, i + half),
            RopeStyle::GptJ => (2 * i, 2 * i + 1),
        };
        let (xa, xb) = (head[a], head[b]);
        head[a] = xa * cos - xb * sin;
        head[b] = xb * cos + xa * sin;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rotation with its table computed from scratch, as the backend did before the cache.
    fn direct(x: &mut [f32], positions: &[u32], inv: &[f64], cfg: &RopeConfig) {
        let half = cfg.rotary_dim / 2;
        for (tok, &pos) in x.chunks_exact_mut(x.len() / positions.len()).zip(positions) {
            let cs: Vec<(f32, f32)> = inv[..half]
                .iter()
                .map(|&f| {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    (c as f32, s as f32)
                })
                .collect();
            for head in tok.chunks_exact_mut(cfg.head_dim) {
                rotate_head(head, &cs, cfg.style);
            }
        }
    }

    /// Calls that hit the cached table, miss it (other positions, other frequencies) and hit
    /// it again all give bitwise the direct computation.
    #[test]
    fn cached_table_gives_the_direct_result() {
        let cache = RopeCache::default();
        let pool = Pool::new(3).unwrap();
        for style in [RopeStyle::Neox, RopeStyle::GptJ] {
            let cfg = RopeConfig {
                style,
                ..RopeConfig::neox(16, 10_000.0)
            };
            let other = RopeConfig::neox(16, 500.0);
            let x: Vec<f32> = (0..3 * 2 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
            // Enough tokens for the pool to split them.
            let long: Vec<u32> = (0..2048).map(|p| p * 7 % 5000).collect();
            let x_long: Vec<f32> = (0..2048 * 2 * 16)
                .map(|i| (i as f32 * 0.11).cos())
                .collect();
            let (mut got, mut want) = (x_long.clone(), x_long);
            let inv = cfg.inv_freqs().unwrap();
            cache.rotate(&pool, &mut got, &long, &inv, &cfg);
            direct(&mut want, &long, &inv, &cfg);
            assert!(got == want, "split over the pool");
            for (positions, cfg) in [
                (&[0u32, 5, 9][..], &cfg),
                (&[0, 5, 9], &cfg),
                (&[1, 2, 3], &cfg),
                (&[1, 2, 3], &other),
                (&[0, 5, 9], &cfg),
            ] {
                let inv = cfg.inv_freqs().unwrap();
                let (mut got, mut want) = (x.clone(), x.clone());
                cache.rotate(&pool, &mut got, positions, &inv, cfg);
                direct(&mut want, positions, &inv, cfg);
                assert!(got == want, "{positions:?} {:?}", cfg.style);
            }
        }
    }
}
