//! [`HostLayout`]: the memory order of the host pool (SGLang's `--hicache-mem-layout`) and its
//! byte math.
//!
//! Per buffer `b` of the shape (K, V, labels; MLA only the latent), `L` layers, `R = size + P`
//! rows (the padding page included), rows of `row_bytes(b)` bytes. Every layout keeps each
//! buffer in one block (SGLang's leading `2` of the MHA tensors); the blocks lie back to back in
//! canonical buffer order. Within a block (SGLang's tensor shapes, `H × D` = one row):
//!
//! | layout | block shape | row `(layer l, slot s)` at |
//! |---|---|---|
//! | `layer_first` | `[L, R, row]` | `(l·R + s)·rb` |
//! | `page_first` | `[R, L, row]` | `(s·L + l)·rb` |
//! | `page_first_direct` | `[R/P, L, P, row]` | `((s/P·L + l)·P + s mod P)·rb` |

use std::fmt;
use std::str::FromStr;

use crate::error::{KvPoolError, Result};

/// The host pool's memory order (SGLang's `--hicache-mem-layout`; `page_first` is SGLang's
/// default). See the [module docs](self) for the byte math.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HostLayout {
    /// `layer_first`: per buffer `[layers, rows, row]`, the device store's order, so a run of
    /// consecutive slots is one copy per (layer, buffer) whatever its length.
    LayerFirst,
    /// `page_first`: per buffer `[rows, layers, row]`: one token's layers back to back (a run
    /// is one copy per row).
    #[default]
    PageFirst,
    /// `page_first_direct`: per buffer `[pages, layers, P, row]`: one page of one layer is `P`
    /// rows back to back (a run is one copy per page, layer and buffer).
    PageFirstDirect,
}

impl HostLayout {
    /// Every layout, in a stable order.
    pub const ALL: [HostLayout; 3] = [
        HostLayout::LayerFirst,
        HostLayout::PageFirst,
        HostLayout::PageFirstDirect,
    ];

    /// SGLang's name (`layer_first`, `page_first`, `page_first_direct`).
    pub const fn name(self) -> &'static str {
        match self {
            HostLayout::LayerFirst => "layer_first",
            HostLayout::PageFirst => "page_first",
            HostLayout::PageFirstDirect => "page_first_direct",
        }
    }

    /// Byte offset, within its buffer's block, of row `slot` of `layer` (no bounds check:
    /// `layer < layers`, `slot < rows` is the caller's).
    #[inline]
    pub(crate) fn offset_in_block(
        self,
        layers: usize,
        rows: usize,
        page_size: usize,
        row_bytes: usize,
        layer: usize,
        slot: usize,
    ) -> usize {
        let row = match self {
            HostLayout::LayerFirst => layer * rows + slot,
            HostLayout::PageFirst => slot * layers + layer,
            HostLayout::PageFirstDirect => {
                (slot / page_size * layers + layer) * page_size + slot % page_size
            }
        };
        row * row_bytes
    }

    /// Rows from `slot` on that lie back to back in every (layer, buffer) of this layout
    /// (`rows − slot`, `1`, or the rest of the slot's page), for a pool of `rows` rows.
    #[inline]
    pub(crate) fn contiguous_rows(self, rows: usize, page_size: usize, slot: usize) -> usize {
        match self {
            HostLayout::LayerFirst => rows.saturating_sub(slot),
            HostLayout::PageFirst => 1,
            HostLayout::PageFirstDirect => page_size - slot % page_size,
        }
    }
}

impl fmt::Display for HostLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HostLayout {
    type Err = KvPoolError;

    fn from_str(s: &str) -> Result<Self> {
        HostLayout::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| KvPoolError::InvalidConfig {
                field: "hicache-mem-layout",
                reason: format!(
                    "unknown host layout {s:?}; expected one of layer_first, page_first, \
                     page_first_direct"
                ),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_is_an_error() {
        for l in HostLayout::ALL {
            assert_eq!(l.to_string().parse::<HostLayout>().unwrap(), l);
        }
        assert_eq!(HostLayout::default(), HostLayout::PageFirst);
        assert!(matches!(
            "page_head".parse::<HostLayout>(),
            Err(KvPoolError::InvalidConfig {
                field: "hicache-mem-layout",
                ..
            })
        ));
    }

    #[test]
    fn every_row_has_its_own_bytes() {
        // 2 layers, P = 4, 12 rows, 3-byte rows: the offsets of all rows tile the block.
        let (layers, rows, p, rb) = (2, 12, 4, 3);
        for l in HostLayout::ALL {
            let mut offs: Vec<usize> = (0..layers)
                .flat_map(|layer| (0..rows).map(move |s| (layer, s)))
                .map(|(layer, s)| l.offset_in_block(layers, rows, p, rb, layer, s))
                .collect();
            offs.sort_unstable();
            assert_eq!(offs, (0..layers * rows).map(|i| i * rb).collect::<Vec<_>>());
            for s in 0..rows {
                let n = l.contiguous_rows(rows, p, s);
                for layer in 0..layers {
                    let first = l.offset_in_block(layers, rows, p, rb, layer, s);
                    for k in 0..n {
                        assert_eq!(
                            l.offset_in_block(layers, rows, p, rb, layer, s + k),
                            first + k * rb,
                            "{l} slot {s} + {k}"
                        );
                    }
                }
            }
        }
    }
}
