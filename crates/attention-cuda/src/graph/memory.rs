//! What the captured graphs hold in device memory ([`GraphMemory`], from
//! [`super::CudaGraphRunner::memory`]): the one pool every size shares, and per size what its
//! forward asks for and what its warmup added to the pool.

use std::fmt;

/// The graphs' device memory: the shared pool, and each captured size's part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphMemory {
    /// Bytes of the shared pool: all the device memory the graphs hold.
    pub pool_bytes: usize,
    /// Buffers in the shared pool.
    pub pool_buffers: usize,
    /// The captured sizes, largest (captured first) first.
    pub sizes: Vec<SizeMemory>,
}

/// One captured size's part of [`GraphMemory`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeMemory {
    /// The batch size.
    pub bs: usize,
    /// Launches its graph replays.
    pub launches: usize,
    /// Allocations and uploads of its forward (each served by one pool buffer).
    pub allocations: usize,
    /// Bytes its forward asks for, summed over its allocations: what a pool of its own held
    /// when each size had one (one buffer per allocation).
    pub requested_bytes: usize,
    /// Bytes of the buffers its warmup added to the shared pool.
    pub added_bytes: usize,
}

impl GraphMemory {
    /// What the graphs held when each size kept a pool of its own: every size's
    /// [`SizeMemory::requested_bytes`] summed.
    pub fn per_size_pools_bytes(&self) -> usize {
        self.sizes.iter().map(|s| s.requested_bytes).sum()
    }
}

/// `bytes` in the largest binary unit that keeps it at least 1 (`"1.50 GiB"`, `"512 B"`).
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if unit == "B" {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {unit}")
    }
}

impl fmt::Display for GraphMemory {
    /// The pool, the per-size pools it replaces, and a table of sizes → bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "graph memory: {} in one pool of {} buffers shared by {} sizes \
             (one pool per size: {})",
            human_bytes(self.pool_bytes),
            self.pool_buffers,
            self.sizes.len(),
            human_bytes(self.per_size_pools_bytes())
        )?;
        writeln!(
            f,
            "{:>5} {:>9} {:>12} {:>14} {:>14}",
            "bs", "launches", "allocations", "asks for", "adds to pool"
        )?;
        for s in &self.sizes {
            writeln!(
                f,
                "{:>5} {:>9} {:>12} {:>14} {:>14}",
                s.bs,
                s.launches,
                s.allocations,
                human_bytes(s.requested_bytes),
                human_bytes(s.added_bytes)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_in_binary_units() {
        let shown: Vec<String> = [0, 1023, 1024, 1536, 5 << 20, 3 << 30, 1 << 40]
            .into_iter()
            .map(human_bytes)
            .collect();
        assert_eq!(
            shown,
            ["0 B", "1023 B", "1.00 KiB", "1.50 KiB", "5.00 MiB", "3.00 GiB", "1.00 TiB"]
        );
    }
}
