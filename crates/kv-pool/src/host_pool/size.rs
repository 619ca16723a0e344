//! [`HostPoolSize`]: how many host slots the host tier gets (SGLang's `HostKVCache.__init__`,
//! `mem_cache/memory_pool_host.py`).
//!
//! Tokens = `hicache_size × 1e9 / bytes_per_token` when `--hicache-size` (GB) is > 0, else
//! `device_slots × hicache_ratio`; then rounded to pages as SGLang does (`size / P + 1` pages).
//! A pool that would leave less than a reserve (SGLang: 10 GiB) of the host's available memory
//! is refused, naming the numbers and the flags to change; one not larger than the device pool
//! is allowed with a warning flag (SGLang logs a warning).

use std::fmt;

use crate::error::{KvPoolError, Result};
use crate::layout::checked_pool_pages;

/// Host memory SGLang leaves to everything else (10 GiB): a host pool that would leave less of
/// the available memory is refused.
pub const HOST_MEMORY_RESERVE_BYTES: u64 = 10 << 30;

/// What [`HostPoolSize::compute`] sizes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostPoolSizeInput {
    /// Allocatable device slots (the device pool's `size`).
    pub device_slots: usize,
    /// Page size `P`.
    pub page_size: u32,
    /// Bytes of one token on the host (all layers and buffers: `KvShape::slot_bytes`).
    pub bytes_per_token: usize,
    /// `--hicache-ratio`: host slots per device slot (SGLang's default 2.0).
    pub hicache_ratio: f64,
    /// `--hicache-size`: host pool size in GB (10⁹ bytes); 0 uses the ratio.
    pub hicache_size_gb: f64,
    /// Host memory available now (the caller's `MemAvailable`), in bytes.
    pub mem_available_bytes: u64,
    /// Memory to leave to everything else ([`HOST_MEMORY_RESERVE_BYTES`] as SGLang).
    pub reserve_bytes: u64,
}

/// The host pool's size: pass `slots` to `HostKvPool::new` and to the host page allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPoolSize {
    /// Allocatable host slots (a multiple of `P`).
    pub slots: usize,
    /// Bytes they take (`slots × bytes_per_token`; the pool adds one padding page).
    pub bytes: u64,
    /// Whether the size came from `--hicache-size` (otherwise from the ratio).
    pub from_size: bool,
    /// The pool is not larger than the device pool: allowed, but worth a warning (a host tier
    /// no larger than the device holds little the device does not).
    pub warn_not_larger_than_device: bool,
}

impl HostPoolSize {
    /// Sizes the host pool as SGLang (module docs). A ratio or size that is negative, not
    /// finite, or both zero is [`KvPoolError::InvalidConfig`] naming the flag; a pool that
    /// leaves less than `reserve_bytes` of `mem_available_bytes` is
    /// [`KvPoolError::HostPoolTooLarge`]; one past the slot id range is the layout's error.
    pub fn compute(input: HostPoolSizeInput) -> Result<Self> {
        let HostPoolSizeInput {
            device_slots,
            page_size,
            bytes_per_token,
            hicache_ratio,
            hicache_size_gb,
            mem_available_bytes,
            reserve_bytes,
        } = input;
        let bad =
            |field: &'static str, reason: String| KvPoolError::InvalidConfig { field, reason };
        if page_size == 0 {
            return Err(bad("page_size", "must be at least 1".into()));
        }
        if bytes_per_token == 0 {
            return Err(bad("bytes_per_token", "must be at least 1".into()));
        }
        if !(hicache_size_gb.is_finite() && hicache_size_gb >= 0.0) {
            return Err(bad(
                "hicache-size",
                format!("must be a finite number of GB ≥ 0, got {hicache_size_gb}"),
            ));
        }
        let from_size = hicache_size_gb > 0.0;
        let tokens = if from_size {
            (hicache_size_gb * 1e9 / bytes_per_token as f64).floor()
        } else {
            if !(hicache_ratio.is_finite() && hicache_ratio > 0.0) {
                return Err(bad(
                    "hicache-ratio",
                    format!(
                        "must be a finite number > 0 (or set --hicache-size), got {hicache_ratio}"
                    ),
                ));
            }
            (device_slots as f64 * hicache_ratio).floor()
        };
        let p = page_size as usize;
        if tokens >= (u32::MAX as f64) {
            return Err(bad(
                if from_size {
                    "hicache-size"
                } else {
                    "hicache-ratio"
                },
                format!("{tokens} host tokens exceed the u32 slot id range"),
            ));
        }
        // SGLang: `page_num = size // page_size + 1; size = page_num * page_size`.
        let slots = (tokens as usize / p + 1) * p;
        checked_pool_pages(slots, page_size)?;
        let bytes = (slots as u64)
            .checked_mul(bytes_per_token as u64)
            .ok_or(KvPoolError::Overflow("host pool bytes"))?;
        let usable = mem_available_bytes.saturating_sub(reserve_bytes);
        if bytes > usable {
            return Err(KvPoolError::HostPoolTooLarge {
                slots,
                bytes,
                mem_available_bytes,
                reserve_bytes,
            });
        }
        Ok(HostPoolSize {
            slots,
            bytes,
            from_size,
            warn_not_larger_than_device: slots <= device_slots,
        })
    }
}

impl fmt::Display for HostPoolSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "host pool: {} slots, {:.2} GB (from {})",
            self.slots,
            self.bytes as f64 / 1e9,
            if self.from_size {
                "--hicache-size"
            } else {
                "--hicache-ratio"
            }
        )?;
        if self.warn_not_larger_than_device {
            f.write_str("; warning: not larger than the device pool")?;
        }
        Ok(())
    }
}
