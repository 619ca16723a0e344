//! Pool sizing: how many KV slots fit on the device, and how many requests may run at once,
//! computed exactly as SGLang does (`profile_max_num_token` in `model_runner.py`, now
//! `kv_cache_configurator.py` / `pool_configurator.py`).
//!
//! SGLang measures the device twice: `total` (free memory after distributed init, before any
//! weights are loaded) and `free` (free memory after the weights are loaded). Then:
//!
//! ```text
//! reserved = total × (1 − mem_fraction_static)      // activations, CUDA graphs, req_to_token, …
//! rest     = free − reserved                        // the KV budget; may be ≤ 0
//! tokens   = floor(rest / cell_size)
//! tokens   = min(tokens, --max-total-tokens)        // when set
//! tokens   = floor(tokens / P) × P                  // whole pages
//! max_running_requests = min(clamp(floor(tokens / context_len × 512), 2048, 4096), tokens / 2)
//! ```
//!
//! `mem_fraction_static` is the fraction of the device that weights **plus** the KV pool may use.
//! Users often get its direction wrong (SGLang #322, #6027, #18262):
//! - an empty pool at start-up (this module's [`KvPoolError::PoolEmpty`]) needs a **larger** value;
//! - running out of memory later, during forward passes, needs a **smaller** value (it leaves
//!   more of the device for activations).

use std::fmt;

use crate::error::{KvPoolError, Result};
use crate::layout::{KvKind, KvLayout, KvShape};

/// Lower bound of SGLang's default request limit.
pub const DEFAULT_MAX_RUNNING_REQUESTS_MIN: usize = 2048;
/// Upper bound of SGLang's default request limit.
pub const DEFAULT_MAX_RUNNING_REQUESTS_MAX: usize = 4096;
/// Requests per full pool of `context_len` tokens in SGLang's default request limit.
pub const DEFAULT_REQUESTS_PER_CONTEXT: u64 = 512;
/// Extra positions per request row of the req_to_token table (`context_len + 4`).
pub const REQ_TO_TOKEN_EXTRA_POSITIONS: usize = 4;
/// Bytes per req_to_token entry (the table holds `int32` slot ids).
pub const REQ_TO_TOKEN_ENTRY_BYTES: u64 = 4;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// What the sizing needs to know: the two device measurements, the static fraction, the model's
/// KV shape and the serving limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryPlanInput {
    /// Device memory measured before loading weights (SGLang's `total_gpu_memory`), in bytes.
    pub total_device_bytes: u64,
    /// Device memory free after loading the weights (SGLang's `available_gpu_memory`), in bytes.
    /// At most `total_device_bytes`.
    pub free_after_weights_bytes: u64,
    /// `--mem-fraction-static`: the fraction of `total_device_bytes` that weights plus the KV pool
    /// may use, in `(0, 1]`. Larger means a larger KV pool and less room for activations.
    pub mem_fraction_static: f64,
    /// Per-token KV shape (after tensor-parallel sharding of KV heads).
    pub shape: KvShape,
    /// Page size `P` (1 for a token pool).
    pub page_size: u32,
    /// The model's context length (width of a req_to_token row, minus 4).
    pub context_len: usize,
    /// `--max-total-tokens`: a cap on the pool size, in tokens (at least one page).
    pub max_total_tokens: Option<usize>,
    /// `--max-running-requests`: a user request limit (at least 1). SGLang first divides a user
    /// value by the attention data-parallel size, which is 1 here, then caps it at `tokens / 2`.
    pub max_running_requests: Option<usize>,
}

/// Which rule decided the request limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestLimitRule {
    /// The default `floor(tokens / context_len × 512)`, inside `[2048, 4096]`.
    Proportional,
    /// The default, raised to its minimum 2048.
    DefaultMin,
    /// The default, lowered to its maximum 4096.
    DefaultMax,
    /// The user's `--max-running-requests`.
    User,
    /// Capped at `tokens / 2` (the default or the user value would exceed it).
    HalfPool,
}

/// The result of pool sizing: the KV pool size in tokens, the request limit, the req_to_token
/// table shape, and the figures that led to them. Built only by [`MemoryPlan::compute`], so
/// every plan describes a valid, non-empty pool.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    input: MemoryPlanInput,
    cell_size: u64,
    static_bytes: u64,
    rest_bytes: u64,
    profiled_tokens: u64,
    max_total_num_tokens: usize,
    max_total_tokens_applied: bool,
    default_max_running_requests: u64,
    max_running_requests: usize,
    max_running_requests_rule: RequestLimitRule,
    layout: KvLayout,
    req_to_token_width: usize,
    req_to_token_bytes: u64,
}

/// `floor(total × f)`, exactly, for a finite `f` in `(0, 1]` (no rounding of `1 − f` or of the
/// product: `f` is `mantissa × 2^exp` and the product is taken in 128-bit integers).
fn floor_mul_fraction(total: u64, f: f64) -> u64 {
    let bits = f.to_bits();
    let exp_bits = ((bits >> 52) & 0x7ff) as i32;
    let frac = bits & ((1u64 << 52) - 1);
    let (mantissa, exp) = if exp_bits == 0 {
        (frac, -1074)
    } else {
        (frac | (1u64 << 52), exp_bits - 1075)
    };
    // f ≤ 1 means exp ≤ −52, so the shift is at least 52 and the result at most `total`.
    let shift = (-exp) as u32;
    if shift >= 128 {
        return 0;
    }
    let product = u128::from(total) * u128::from(mantissa);
    u64::try_from(product >> shift).unwrap_or(total).min(total)
}

/// The smallest `mem_fraction_static`, to 0.001, whose static budget `floor(total × f)` is at
/// least `needed_static`; `None` if even 1 is not enough.
fn smallest_fraction(total: u64, needed_static: u128) -> Option<f64> {
    let total128 = u128::from(total);
    if needed_static > total128 {
        return None;
    }
    let mut k = (needed_static * 1000).div_ceil(total128).max(1);
    while k < 1000 {
        let f = k as f64 / 1000.0;
        if u128::from(floor_mul_fraction(total, f)) >= needed_static {
            return Some(f);
        }
        k += 1;
    }
    Some(1.0)
}

/// Human-readable bytes: GiB, MiB or KiB with two decimals, or plain bytes.
fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= GIB {
        format!("{:.2} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.2} MiB", b / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.2} KiB", b / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

/// [`human`] with a sign, for budgets that may be negative.
fn human_signed(bytes: i128) -> String {
    let magnitude = human(u64::try_from(bytes.unsigned_abs()).unwrap_or(u64::MAX));
    if bytes < 0 {
        format!("-{magnitude}")
    } else {
        magnitude
    }
}

fn invalid(field: &'static str, reason: String) -> KvPoolError {
    KvPoolError::InvalidConfig { field, reason }
}

impl MemoryPlan {
    /// Sizes the KV pool and the request limit by SGLang's rules (see the module docs).
    ///
    /// Errors:
    /// - [`KvPoolError::InvalidConfig`] naming the field, for `mem_fraction_static` not a finite
    ///   number in `(0, 1]`, `total_device_bytes == 0`, `free_after_weights_bytes > total`,
    ///   `page_size == 0`, `context_len == 0`, `max_total_tokens < page_size`,
    ///   `max_running_requests == 0`, an invalid `shape`, or a pool too large for `u32` slot ids;
    /// - [`KvPoolError::PoolEmpty`] when the budget holds less than the smallest usable pool
    ///   (one page, and at least 2 tokens so that `tokens / 2 ≥ 1` request can run). The message
    ///   says to **raise** `--mem-fraction-static` and gives the smallest value (to 0.001) that
    ///   fits one page and one full context, or says that the device is too small even at 1;
    /// - [`KvPoolError::Overflow`] when the req_to_token table or the pool's byte size does not
    ///   fit in 64 bits.
    pub fn compute(input: MemoryPlanInput) -> Result<MemoryPlan> {
        let f = input.mem_fraction_static;
        if !f.is_finite() || f <= 0.0 || f > 1.0 {
            return Err(invalid(
                "mem_fraction_static",
                format!("--mem-fraction-static must be a finite number in (0, 1], got {f}"),
            ));
        }
        let total = input.total_device_bytes;
        if total == 0 {
            return Err(invalid(
                "total_device_bytes",
                "device memory must be at least 1 byte, got 0".into(),
            ));
        }
        let free = input.free_after_weights_bytes;
        if free > total {
            return Err(invalid(
                "free_after_weights_bytes",
                format!(
                    "free memory after weights ({free} B) must be in 0..={total} \
                     (at most the device memory measured before loading them)"
                ),
            ));
        }
        if input.page_size == 0 {
            return Err(invalid(
                "page_size",
                "--page-size must be at least 1, got 0".into(),
            ));
        }
        let page = u64::from(input.page_size);
        if input.context_len == 0 {
            return Err(invalid(
                "context_len",
                "context length must be at least 1, got 0".into(),
            ));
        }
        if let Some(cap) = input.max_total_tokens {
            if (cap as u64) < page {
                return Err(invalid(
                    "max_total_tokens",
                    format!(
                        "--max-total-tokens must be at least one page ({page} tokens), got {cap}"
                    ),
                ));
            }
        }
        if input.max_running_requests == Some(0) {
            return Err(invalid(
                "max_running_requests",
                "--max-running-requests must be at least 1, got 0".into(),
            ));
        }
        // The shape's fields are public: re-validate so that cell_size cannot be 0 or overflow.
        let shape = KvShape::new(input.shape.kind, input.shape.layers, input.shape.dtype)?;
        let cell_size = shape.cell_size() as u64;

        let static_bytes = floor_mul_fraction(total, f);
        let reserved = total - static_bytes;
        let rest = i128::from(free) - i128::from(reserved);
        let profiled_tokens = if rest > 0 { rest as u64 / cell_size } else { 0 };

        // The smallest usable pool: one page, and at least 2 tokens so tokens / 2 ≥ 1.
        let min_tokens = page.max(2);
        let mut tokens = profiled_tokens;
        let mut max_total_tokens_applied = false;
        if let Some(cap) = input.max_total_tokens {
            let cap = cap as u64;
            if cap < tokens {
                tokens = cap;
                max_total_tokens_applied = true;
            }
        }
        tokens = tokens / page * page;

        if tokens < min_tokens {
            return Err(KvPoolError::PoolEmpty(Self::empty_message(
                &input,
                &shape,
                static_bytes,
                rest,
                profiled_tokens,
                tokens,
                min_tokens,
                max_total_tokens_applied,
            )));
        }

        let max_slots = (u64::from(u32::MAX) - page) / page * page;
        if tokens > max_slots {
            return Err(invalid(
                "max_total_tokens",
                format!(
                    "the KV budget of {} holds {tokens} tokens, more than the {max_slots} slots \
                     that u32 slot ids can address; set --max-total-tokens to at most {max_slots}",
                    human(rest as u64)
                ),
            ));
        }

        let half = tokens / 2;
        let default_max_running_requests = u64::try_from(
            u128::from(tokens) * u128::from(DEFAULT_REQUESTS_PER_CONTEXT)
                / input.context_len as u128,
        )
        .unwrap_or(u64::MAX);
        let (wanted, wanted_rule) = match input.max_running_requests {
            Some(user) => (user as u64, RequestLimitRule::User),
            None => {
                let lo = DEFAULT_MAX_RUNNING_REQUESTS_MIN as u64;
                let hi = DEFAULT_MAX_RUNNING_REQUESTS_MAX as u64;
                if default_max_running_requests < lo {
                    (lo, RequestLimitRule::DefaultMin)
                } else if default_max_running_requests > hi {
                    (hi, RequestLimitRule::DefaultMax)
                } else {
                    (default_max_running_requests, RequestLimitRule::Proportional)
                }
            }
        };
        let (max_running, rule) = if wanted > half {
            (half, RequestLimitRule::HalfPool)
        } else {
            (wanted, wanted_rule)
        };
        // tokens fits in u32, so both casts are lossless.
        let max_running_requests = max_running as usize;
        let max_total_num_tokens = tokens as usize;

        let layout = KvLayout::new(shape, input.page_size, max_total_num_tokens)?;
        let req_to_token_width = input
            .context_len
            .checked_add(REQ_TO_TOKEN_EXTRA_POSITIONS)
            .ok_or(KvPoolError::Overflow(
                "req_to_token width (context_len + 4)",
            ))?;
        let req_to_token_bytes = u64::try_from(
            (max_running as u128 + 1)
                * req_to_token_width as u128
                * u128::from(REQ_TO_TOKEN_ENTRY_BYTES),
        )
        .map_err(|_| KvPoolError::Overflow("req_to_token bytes"))?;
        u64::try_from(layout.total_bytes()).map_err(|_| KvPoolError::Overflow("pool bytes"))?;

        Ok(MemoryPlan {
            input: MemoryPlanInput { shape, ..input },
            cell_size,
            static_bytes,
            rest_bytes: rest as u64,
            profiled_tokens,
            max_total_num_tokens,
            max_total_tokens_applied,
            default_max_running_requests,
            max_running_requests,
            max_running_requests_rule: rule,
            layout,
            req_to_token_width,
            req_to_token_bytes,
        })
    }

    /// The message of [`KvPoolError::PoolEmpty`].
    #[allow(clippy::too_many_arguments)]
    fn empty_message(
        input: &MemoryPlanInput,
        shape: &KvShape,
        static_bytes: u64,
        rest: i128,
        profiled_tokens: u64,
        tokens: u64,
        min_tokens: u64,
        cap_applied: bool,
    ) -> String {
        let total = input.total_device_bytes;
        let free = input.free_after_weights_bytes;
        let f = input.mem_fraction_static;
        let page = u64::from(input.page_size);
        let cell = shape.cell_size() as u64;
        let reserved = total - static_bytes;
        if cap_applied && profiled_tokens >= min_tokens {
            // Only possible with page size 1 and --max-total-tokens 1.
            return format!(
                "no room for a request: --max-total-tokens {} leaves a pool of {tokens} token(s), \
                 and max_running_requests (capped at tokens / 2) would be 0; \
                 raise --max-total-tokens to at least {min_tokens}",
                input.max_total_tokens.unwrap_or(0)
            );
        }
        let what = if page >= 2 {
            format!("one page of {page} tokens")
        } else {
            format!("{min_tokens} tokens, so that tokens / 2 ≥ 1 request can run")
        };
        let mut msg = format!(
            "no room for the KV cache pool: --mem-fraction-static {f} reserves {} ({reserved} B \
             = total {} × (1 − {f})) for activations and other run-time memory, leaving a KV \
             budget of {} ({rest} B = {} free after weights − reserved); at {cell} B per token \
             ({shape}) that is {tokens} tokens, but the pool needs at least {what}. ",
            human(reserved),
            human(total),
            human_signed(rest),
            human(free),
        );
        // free − total × (1 − f) ≥ need  ⇔  floor(total × f) ≥ total − free + need.
        let needed_static = |need_tokens: u64| {
            u128::from(total - free) + u128::from(need_tokens) * u128::from(cell)
        };
        match smallest_fraction(total, needed_static(min_tokens)) {
            None => {
                let dtype_hint = if shape.dtype.bytes() > 1 {
                    "a smaller --kv-cache-dtype (e.g. fp8_e4m3), "
                } else {
                    ""
                };
                // MLA's latent row is not sharded by tensor parallelism; KV heads are.
                let tp_hint = if matches!(shape.kind, KvKind::Mla { .. }) {
                    ""
                } else {
                    "more tensor parallelism (fewer KV heads per device), "
                };
                msg.push_str(&format!(
                    "The device is too small for this model's KV cache at {}: even \
                     --mem-fraction-static 1 leaves only {} after the weights, less than \
                     {min_tokens} tokens × {cell} B = {}. Use {dtype_hint}a smaller page size \
                     (fewer tokens per page), {tp_hint}or a device with more memory.",
                    shape.dtype,
                    human(free),
                    human(min_tokens.saturating_mul(cell)),
                ));
            }
            Some(f_min) => {
                msg.push_str(&format!(
                    "raise --mem-fraction-static (a LARGER value gives more of the device to \
                     weights + KV cache): at least {f_min:.3} fits {what}"
                ));
                let full = (input.context_len as u64)
                    .div_ceil(page)
                    .saturating_mul(page);
                if full > min_tokens {
                    match smallest_fraction(total, needed_static(full)) {
                        Some(f_full) => msg.push_str(&format!(
                            ", and {f_full:.3} fits one full context of {} tokens",
                            input.context_len
                        )),
                        None => msg.push_str(&format!(
                            ", but even 1 cannot fit one full context of {} tokens",
                            input.context_len
                        )),
                    }
                }
                msg.push_str(
                    ". (Out-of-memory errors during forward passes at run time are the opposite \
                     case: they need a SMALLER value.)",
                );
            }
        }
        msg
    }

    /// The layout of the sized pool: `KvLayout::new(shape, page_size, max_total_num_tokens)`.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The input the plan was computed from.
    pub fn input(&self) -> &MemoryPlanInput {
        &self.input
    }

    /// SGLang's `cell_size`: bytes per token used for sizing ([`KvShape::cell_size`]).
    pub fn cell_size(&self) -> u64 {
        self.cell_size
    }

    /// `floor(total × mem_fraction_static)`: what weights plus the KV pool may use, in bytes.
    pub fn static_bytes(&self) -> u64 {
        self.static_bytes
    }

    /// `total − static_bytes`, i.e. `total × (1 − mem_fraction_static)` rounded up to a whole
    /// byte: memory kept back for activations, CUDA graphs, the req_to_token table and the like.
    pub fn reserved_bytes(&self) -> u64 {
        self.input.total_device_bytes - self.static_bytes
    }

    /// The KV budget `rest = free_after_weights − reserved`, in bytes (positive in every plan).
    pub fn rest_bytes(&self) -> u64 {
        self.rest_bytes
    }

    /// `floor(rest / cell_size)`: tokens the budget holds, before `--max-total-tokens` and the
    /// page floor.
    pub fn profiled_tokens(&self) -> u64 {
        self.profiled_tokens
    }

    /// The pool size in tokens (SGLang's `max_total_num_tokens`): a positive multiple of the page
    /// size.
    pub fn max_total_num_tokens(&self) -> usize {
        self.max_total_num_tokens
    }

    /// Whether `--max-total-tokens` lowered the pool size (it was below the profiled tokens).
    pub fn max_total_tokens_applied(&self) -> bool {
        self.max_total_tokens_applied
    }

    /// SGLang's default formula before clamping: `floor(tokens / context_len × 512)`, with
    /// `tokens` the final pool size (computed even when the user gave a limit).
    pub fn default_max_running_requests_unclamped(&self) -> u64 {
        self.default_max_running_requests
    }

    /// The request limit (at least 1, at most `tokens / 2`).
    pub fn max_running_requests(&self) -> usize {
        self.max_running_requests
    }

    /// Which rule decided [`max_running_requests`](Self::max_running_requests).
    pub fn max_running_requests_rule(&self) -> RequestLimitRule {
        self.max_running_requests_rule
    }

    /// Whether the request limit was capped at `tokens / 2` (the default or the user value was
    /// larger).
    pub fn max_running_requests_capped(&self) -> bool {
        self.max_running_requests_rule == RequestLimitRule::HalfPool
    }

    /// Rows of the req_to_token table: `max_running_requests + 1` (row 0 is padding).
    pub fn req_to_token_rows(&self) -> usize {
        self.max_running_requests + 1
    }

    /// Positions per req_to_token row: `context_len + 4`.
    pub fn req_to_token_width(&self) -> usize {
        self.req_to_token_width
    }

    /// Bytes of the req_to_token table (`int32` entries).
    pub fn req_to_token_bytes(&self) -> u64 {
        self.req_to_token_bytes
    }

    /// Bytes of the KV pool ([`KvLayout::total_bytes`]): includes the padding page and, for
    /// DoubleSparse, the label buffers, which SGLang's `cell_size` does not count, so it may
    /// exceed [`rest_bytes`](Self::rest_bytes) slightly.
    pub fn pool_bytes(&self) -> u64 {
        self.layout.total_bytes() as u64
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.input;
        let total = i.total_device_bytes;
        let free = i.free_after_weights_bytes;
        let frac = i.mem_fraction_static;
        let page = i.page_size;
        let tokens = self.max_total_num_tokens;
        writeln!(f, "KV memory plan (SGLang pool sizing)")?;
        writeln!(
            f,
            "  device memory         {} ({total} B), measured before loading weights",
            human(total)
        )?;
        writeln!(
            f,
            "  free after weights    {} ({free} B); weights and runtime took {}",
            human(free),
            human(total - free)
        )?;
        writeln!(
            f,
            "  mem_fraction_static   {frac}: weights + KV may use {} ({} B) = floor(total × {frac})",
            human(self.static_bytes),
            self.static_bytes
        )?;
        writeln!(
            f,
            "  reserved              {} ({} B) = total − that, kept for activations etc.",
            human(self.reserved_bytes()),
            self.reserved_bytes()
        )?;
        writeln!(
            f,
            "  KV budget (rest)      {} ({} B) = free after weights − reserved",
            human(self.rest_bytes),
            self.rest_bytes
        )?;
        writeln!(
            f,
            "  cell_size             {} ({} B) per token: {}",
            human(self.cell_size),
            self.cell_size,
            i.shape
        )?;
        let mut rule = if self.max_total_tokens_applied {
            format!(
                "--max-total-tokens {} (below floor(rest / cell_size) = {})",
                i.max_total_tokens.unwrap_or(0),
                self.profiled_tokens
            )
        } else {
            format!("floor(rest / cell_size) = {}", self.profiled_tokens)
        };
        let before_floor = if self.max_total_tokens_applied {
            i.max_total_tokens.unwrap_or(0) as u64
        } else {
            self.profiled_tokens
        };
        if before_floor != tokens as u64 {
            rule.push_str(&format!(", floored to a multiple of page_size {page}"));
        } else if page > 1 {
            rule.push_str(&format!(", already a multiple of page_size {page}"));
        }
        if let (Some(cap), false) = (i.max_total_tokens, self.max_total_tokens_applied) {
            rule.push_str(&format!("; --max-total-tokens {cap} does not bind"));
        }
        writeln!(f, "  pool tokens           {tokens} = {rule}")?;
        writeln!(
            f,
            "  pool                  {} pages of {page}; {} ({} B) with the padding page",
            self.layout.pages(),
            human(self.pool_bytes()),
            self.pool_bytes()
        )?;
        let default = format!(
            "floor({tokens} / {} × {DEFAULT_REQUESTS_PER_CONTEXT}) = {}",
            i.context_len, self.default_max_running_requests
        );
        let half = tokens / 2;
        let running_rule = match self.max_running_requests_rule {
            RequestLimitRule::Proportional => {
                format!("default {default}, within [{DEFAULT_MAX_RUNNING_REQUESTS_MIN}, {DEFAULT_MAX_RUNNING_REQUESTS_MAX}]")
            }
            RequestLimitRule::DefaultMin => {
                format!(
                    "default {default}, raised to the minimum {DEFAULT_MAX_RUNNING_REQUESTS_MIN}"
                )
            }
            RequestLimitRule::DefaultMax => {
                format!(
                    "default {default}, lowered to the maximum {DEFAULT_MAX_RUNNING_REQUESTS_MAX}"
                )
            }
            RequestLimitRule::User => format!(
                "--max-running-requests {} (÷ attention-DP size 1)",
                i.max_running_requests.unwrap_or(0)
            ),
            RequestLimitRule::HalfPool => match i.max_running_requests {
                Some(user) => format!("tokens / 2 = {half}, capping --max-running-requests {user}"),
                None => format!(
                    "tokens / 2 = {half}, capping the default (clamp({default}, \
                     {DEFAULT_MAX_RUNNING_REQUESTS_MIN}, {DEFAULT_MAX_RUNNING_REQUESTS_MAX}))"
                ),
            },
        };
        let below_half = if self.max_running_requests_capped() {
            String::new()
        } else {
            format!("; below tokens / 2 = {half}")
        };
        writeln!(
            f,
            "  max_running_requests  {} = {running_rule}{below_half}",
            self.max_running_requests
        )?;
        writeln!(
            f,
            "  req_to_token          {} rows × {} positions × {REQ_TO_TOKEN_ENTRY_BYTES} B = {} ({} B)",
            self.req_to_token_rows(),
            self.req_to_token_width,
            human(self.req_to_token_bytes),
            self.req_to_token_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvDtype;

    const GIB: u64 = 1 << 30;

    fn llama3_8b() -> KvShape {
        KvShape::mha(8, 128, 128, 32, KvDtype::Bf16).unwrap()
    }

    /// Llama-3-8B bf16 on an 80 GiB H100: 16 GiB of weights plus 0.5 GiB of runtime, so 63.5 GiB
    /// free after weights.
    fn llama3_8b_h100(page_size: u32) -> MemoryPlanInput {
        MemoryPlanInput {
            total_device_bytes: 80 * GIB,
            free_after_weights_bytes: 63 * GIB + GIB / 2,
            mem_fraction_static: 0.88,
            shape: llama3_8b(),
            page_size,
            context_len: 8192,
            max_total_tokens: None,
            max_running_requests: None,
        }
    }

    fn err(input: MemoryPlanInput) -> KvPoolError {
        MemoryPlan::compute(input).unwrap_err()
    }

    fn invalid_field(e: &KvPoolError) -> &'static str {
        match e {
            KvPoolError::InvalidConfig { field, .. } => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn llama3_8b_on_h100() {
        // cell_size = 8 kv heads × (128 + 128) × 32 layers × 2 B = 131072 B = 128 KiB.
        // total = 80 GiB = 85_899_345_920 B; free = 63.5 GiB = 68_182_605_824 B.
        // static = floor(85_899_345_920 × 0.88) = floor(75_591_424_409.6 + ~4e-7) = 75_591_424_409
        //   (f64 0.88 is 0.88000000000000000444…).
        // reserved = 85_899_345_920 − 75_591_424_409 = 10_307_921_511 (≈ 9.6 GiB).
        // rest = 68_182_605_824 − 10_307_921_511 = 57_874_684_313 (≈ 53.9 GiB).
        // tokens = floor(57_874_684_313 / 131_072) = floor(441_548.79…) = 441_548.
        // P = 1: 441_548; P = 16: 441_548 − 441_548 mod 16 (= 12) = 441_536.
        // max_running: floor(441_548 / 8192 × 512) = floor(27_596.75) = 27_596 → clamp → 4096;
        //   min(4096, 441_548 / 2 = 220_774) = 4096 (P = 16: 27_596 → 4096, half 220_768).
        // req_to_token (P = 16): 4097 rows × 8196 × 4 B = 134_316_048 B.
        let p1 = MemoryPlan::compute(llama3_8b_h100(1)).unwrap();
        assert_eq!(p1.cell_size(), 131_072);
        assert_eq!(p1.static_bytes(), 75_591_424_409);
        assert_eq!(p1.reserved_bytes(), 10_307_921_511);
        assert_eq!(p1.rest_bytes(), 57_874_684_313);
        assert_eq!(p1.profiled_tokens(), 441_548);
        assert_eq!(p1.max_total_num_tokens(), 441_548);
        assert_eq!(p1.default_max_running_requests_unclamped(), 27_596);
        assert_eq!(p1.max_running_requests(), 4096);
        assert_eq!(p1.max_running_requests_rule(), RequestLimitRule::DefaultMax);
        assert!(!p1.max_total_tokens_applied());
        assert!(!p1.max_running_requests_capped());
        assert_eq!(p1.layout().size, 441_548);
        assert_eq!(p1.pool_bytes(), (441_548 + 1) * 131_072);

        let p16 = MemoryPlan::compute(llama3_8b_h100(16)).unwrap();
        assert_eq!(p16.rest_bytes(), 57_874_684_313);
        assert_eq!(p16.profiled_tokens(), 441_548);
        assert_eq!(p16.max_total_num_tokens(), 441_536);
        assert_eq!(p16.max_running_requests(), 4096);
        assert_eq!(p16.req_to_token_rows(), 4097);
        assert_eq!(p16.req_to_token_width(), 8196);
        assert_eq!(p16.req_to_token_bytes(), 134_316_048);
        let layout = p16.layout();
        assert_eq!(layout, KvLayout::new(llama3_8b(), 16, 441_536).unwrap());
        assert_eq!(layout.pages(), 27_596);
        assert_eq!(p16.pool_bytes(), (441_536 + 16) * 131_072);
        assert_eq!(p16.input(), &llama3_8b_h100(16));
    }

    #[test]
    fn llama3_70b_tp4_long_context() {
        // Llama-3.1-70B bf16, TP 4: 8 kv heads / 4 = 2 per device, 80 layers.
        // cell_size = 2 × (128 + 128) × 80 × 2 B = 81_920 B = 80 KiB.
        // total 80 GiB, ~33.5 GiB of weights and runtime → free 46.5 GiB = 49_928_994_816 B.
        // f = 0.85 (f64 0.84999999999999997779…, just below 0.85): total × f is 1.9e-6 below
        //   68 GiB, so static = 68 GiB − 1 B = 73_014_444_031 and reserved = 12 GiB + 1 B
        //   = 12_884_901_889.
        // rest = 49_928_994_816 − 12_884_901_889 = 37_044_092_927 (34.5 GiB − 1 B).
        // tokens = floor(37_044_092_927 / 81_920) = floor(452_198.39…) = 452_198 (P = 1).
        // context 131_072: floor(452_198 / 131_072 × 512) = floor(1_766.4) = 1_766 → raised to
        //   2048; min(2048, 226_099) = 2048.
        let input = MemoryPlanInput {
            total_device_bytes: 80 * GIB,
            free_after_weights_bytes: 46 * GIB + GIB / 2,
            mem_fraction_static: 0.85,
            shape: KvShape::mha(2, 128, 128, 80, KvDtype::Bf16).unwrap(),
            page_size: 1,
            context_len: 131_072,
            max_total_tokens: None,
            max_running_requests: None,
        };
        let p = MemoryPlan::compute(input).unwrap();
        assert_eq!(p.cell_size(), 81_920);
        assert_eq!(p.static_bytes(), 73_014_444_031);
        assert_eq!(p.reserved_bytes(), 12_884_901_889);
        assert_eq!(p.rest_bytes(), 37_044_092_927);
        assert_eq!(p.max_total_num_tokens(), 452_198);
        assert_eq!(p.default_max_running_requests_unclamped(), 1_766);
        assert_eq!(p.max_running_requests(), 2048);
        assert_eq!(p.max_running_requests_rule(), RequestLimitRule::DefaultMin);
        assert_eq!(p.req_to_token_width(), 131_076);
        assert_eq!(p.req_to_token_bytes(), 2049 * 131_076 * 4);
    }

    #[test]
    fn deepseek_v3_mla() {
        // DeepSeek-V3 MLA on a 140 GiB device (TP 8, fp8 weights ≈ 80 GiB per device; MLA's
        // latent is not sharded): cell_size = 61 × (512 + 64) × 2 B = 70_272 B.
        // f = 0.9 (f64 0.90000000000000002220…): static = floor(140 GiB × 0.9 + ~3e-6)
        //   = 126 GiB = 135_291_469_824; reserved = 14 GiB = 15_032_385_536.
        // free = 60 GiB → rest = 46 GiB = 49_392_123_904.
        // tokens = floor(49_392_123_904 / 70_272) = floor(702_870.6…) = 702_870; P = 64:
        //   702_870 − 702_870 mod 64 (= 22) = 702_848 (10_982 pages).
        // context 163_840: floor(702_848 / 163_840 × 512) = floor(2_196.4) = 2_196, inside
        //   [2048, 4096] and below 351_424: 2_196.
        let input = MemoryPlanInput {
            total_device_bytes: 140 * GIB,
            free_after_weights_bytes: 60 * GIB,
            mem_fraction_static: 0.9,
            shape: KvShape::mla(512, 64, 61, KvDtype::Bf16).unwrap(),
            page_size: 64,
            context_len: 163_840,
            max_total_tokens: None,
            max_running_requests: None,
        };
        let p = MemoryPlan::compute(input).unwrap();
        assert_eq!(p.cell_size(), 70_272);
        assert_eq!(p.reserved_bytes(), 14 * GIB);
        assert_eq!(p.rest_bytes(), 46 * GIB);
        assert_eq!(p.profiled_tokens(), 702_870);
        assert_eq!(p.max_total_num_tokens(), 702_848);
        assert_eq!(p.layout().pages(), 10_982);
        assert_eq!(p.max_running_requests(), 2_196);
        assert_eq!(
            p.max_running_requests_rule(),
            RequestLimitRule::Proportional
        );
    }

    #[test]
    fn max_total_tokens_caps_then_page_floor() {
        // cap 1000 < 441_548, then floor to P = 16: 992. Default 4096 (floor(992/8192×512) = 62
        // raised to 2048) is capped at 992 / 2 = 496.
        let p = MemoryPlan::compute(MemoryPlanInput {
            max_total_tokens: Some(1000),
            ..llama3_8b_h100(16)
        })
        .unwrap();
        assert_eq!(p.profiled_tokens(), 441_548);
        assert_eq!(p.max_total_num_tokens(), 992);
        assert!(p.max_total_tokens_applied());
        assert_eq!(p.max_running_requests(), 496);
        assert!(p.max_running_requests_capped());
        assert_eq!(p.layout().size, 992);

        // A cap above the profiled size does not bind.
        let p = MemoryPlan::compute(MemoryPlanInput {
            max_total_tokens: Some(10_000_000),
            ..llama3_8b_h100(16)
        })
        .unwrap();
        assert_eq!(p.max_total_num_tokens(), 441_536);
        assert!(!p.max_total_tokens_applied());
        assert!(p
            .to_string()
            .contains("--max-total-tokens 10000000 does not bind"));
    }

    #[test]
    fn user_max_running_requests_capped_at_half_pool() {
        let p = MemoryPlan::compute(MemoryPlanInput {
            max_running_requests: Some(5000),
            ..llama3_8b_h100(16)
        })
        .unwrap();
        assert_eq!(p.max_running_requests(), 5000);
        assert_eq!(p.max_running_requests_rule(), RequestLimitRule::User);
        assert_eq!(p.req_to_token_rows(), 5001);

        let p = MemoryPlan::compute(MemoryPlanInput {
            max_total_tokens: Some(1000),
            max_running_requests: Some(600),
            ..llama3_8b_h100(16)
        })
        .unwrap();
        assert_eq!(p.max_running_requests(), 496);
        assert!(p.max_running_requests_capped());
        assert!(p.to_string().contains("capping --max-running-requests 600"));

        let p = MemoryPlan::compute(MemoryPlanInput {
            max_total_tokens: Some(1000),
            max_running_requests: Some(496),
            ..llama3_8b_h100(16)
        })
        .unwrap();
        assert_eq!(p.max_running_requests(), 496);
        assert!(!p.max_running_requests_capped());
    }

    #[test]
    fn validation_errors_name_the_field() {
        let base = llama3_8b_h100(16);
        for bad in [
            0.0,
            -0.5,
            1.0000001,
            2.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            let e = err(MemoryPlanInput {
                mem_fraction_static: bad,
                ..base
            });
            assert_eq!(invalid_field(&e), "mem_fraction_static", "{bad}");
            assert!(e.to_string().contains("(0, 1]"), "{e}");
        }
        let e = err(MemoryPlanInput {
            total_device_bytes: 0,
            free_after_weights_bytes: 0,
            ..base
        });
        assert_eq!(invalid_field(&e), "total_device_bytes");
        let e = err(MemoryPlanInput {
            free_after_weights_bytes: 80 * GIB + 1,
            ..base
        });
        assert_eq!(invalid_field(&e), "free_after_weights_bytes");
        assert!(e.to_string().contains("0..=85899345920"), "{e}");
        let e = err(MemoryPlanInput {
            page_size: 0,
            ..base
        });
        assert_eq!(invalid_field(&e), "page_size");
        let e = err(MemoryPlanInput {
            context_len: 0,
            ..base
        });
        assert_eq!(invalid_field(&e), "context_len");
        let e = err(MemoryPlanInput {
            max_total_tokens: Some(15),
            ..base
        });
        assert_eq!(invalid_field(&e), "max_total_tokens");
        assert!(
            e.to_string().contains("at least one page (16 tokens)"),
            "{e}"
        );
        let e = err(MemoryPlanInput {
            max_total_tokens: Some(0),
            page_size: 1,
            ..base
        });
        assert_eq!(invalid_field(&e), "max_total_tokens");
        let e = err(MemoryPlanInput {
            max_running_requests: Some(0),
            ..base
        });
        assert_eq!(invalid_field(&e), "max_running_requests");
        // A shape built by hand, bypassing KvShape::new, is re-validated.
        let mut shape = llama3_8b();
        shape.layers = 0;
        let e = err(MemoryPlanInput { shape, ..base });
        assert_eq!(invalid_field(&e), "layers");
        // Boundaries that are valid.
        assert!(MemoryPlan::compute(MemoryPlanInput {
            mem_fraction_static: 1.0,
            ..base
        })
        .is_ok());
        assert!(MemoryPlan::compute(MemoryPlanInput {
            max_total_tokens: Some(16),
            ..base
        })
        .is_ok());
    }

    #[test]
    fn empty_pool_says_raise_with_the_smallest_value() {
        // f = 0.2: static = 16 GiB (f64 0.2 is just above 0.2), reserved = 64 GiB, rest =
        // 63.5 − 64 = −0.5 GiB.
        // One page (16 × 128 KiB = 2 MiB): f ≥ (80 GiB − 63.5 GiB + 2 MiB) / 80 GiB
        //   = 16_898 / 81_920 = 0.20627… → 0.207.
        // One full context (8192 × 128 KiB = 1 GiB): f ≥ 17.5 / 80 = 0.21875 → 0.219.
        let input = MemoryPlanInput {
            mem_fraction_static: 0.2,
            ..llama3_8b_h100(16)
        };
        let e = err(input);
        let KvPoolError::PoolEmpty(msg) = &e else {
            panic!("expected PoolEmpty, got {e:?}")
        };
        assert!(msg.contains("raise --mem-fraction-static"), "{msg}");
        assert!(msg.contains("LARGER"), "{msg}");
        assert!(
            msg.contains("at least 0.207 fits one page of 16 tokens"),
            "{msg}"
        );
        assert!(
            msg.contains("0.219 fits one full context of 8192 tokens"),
            "{msg}"
        );
        assert!(msg.contains("-512.00 MiB"), "{msg}");
        assert!(msg.contains("SMALLER"), "{msg}");
        // The suggested values really work, and 0.001 less does not.
        for (f, tokens) in [(0.207, 16), (0.219, 8192)] {
            let p = MemoryPlan::compute(MemoryPlanInput {
                mem_fraction_static: f,
                ..input
            })
            .unwrap();
            assert!(p.max_total_num_tokens() >= tokens);
            let below = MemoryPlanInput {
                mem_fraction_static: f - 0.001,
                ..input
            };
            assert!(MemoryPlan::compute(below).map_or(true, |p| p.max_total_num_tokens() < tokens));
        }

        // A positive budget smaller than one page is also empty.
        let e = err(MemoryPlanInput {
            mem_fraction_static: 0.20626,
            ..input
        });
        assert!(
            matches!(&e, KvPoolError::PoolEmpty(m) if m.contains("at least 0.207")),
            "{e}"
        );
    }

    #[test]
    fn empty_pool_on_too_small_device() {
        // 1 MiB free after weights: even f = 1 leaves 1 MiB < one page of 2 MiB.
        let input = MemoryPlanInput {
            total_device_bytes: 16 * GIB,
            free_after_weights_bytes: 1 << 20,
            mem_fraction_static: 1.0,
            ..llama3_8b_h100(16)
        };
        let e = err(input);
        let KvPoolError::PoolEmpty(msg) = &e else {
            panic!("expected PoolEmpty, got {e:?}")
        };
        assert!(
            msg.contains("too small for this model's KV cache at bfloat16"),
            "{msg}"
        );
        assert!(msg.contains("--kv-cache-dtype"), "{msg}");
        assert!(!msg.contains("raise --mem-fraction-static"), "{msg}");

        // One page fits at f = 1, one full context does not.
        let input = MemoryPlanInput {
            free_after_weights_bytes: 100 << 20,
            mem_fraction_static: 0.5,
            ..input
        };
        let KvPoolError::PoolEmpty(msg) = err(input) else {
            panic!()
        };
        assert!(msg.contains("raise --mem-fraction-static"), "{msg}");
        assert!(
            msg.contains("even 1 cannot fit one full context of 8192 tokens"),
            "{msg}"
        );
    }

    #[test]
    fn page_size_one_needs_two_tokens() {
        // One token of budget with P = 1: tokens / 2 = 0 requests.
        let input = MemoryPlanInput {
            total_device_bytes: GIB,
            free_after_weights_bytes: 131_072 + 5,
            mem_fraction_static: 1.0,
            ..llama3_8b_h100(1)
        };
        let KvPoolError::PoolEmpty(msg) = err(input) else {
            panic!()
        };
        assert!(msg.contains("too small"), "{msg}");
        let ok = MemoryPlanInput {
            free_after_weights_bytes: 2 * 131_072,
            ..input
        };
        let p = MemoryPlan::compute(ok).unwrap();
        assert_eq!(p.max_total_num_tokens(), 2);
        assert_eq!(p.max_running_requests(), 1);
        // --max-total-tokens 1 with P = 1: the cap is at fault, not the fraction.
        let KvPoolError::PoolEmpty(msg) = err(MemoryPlanInput {
            max_total_tokens: Some(1),
            ..llama3_8b_h100(1)
        }) else {
            panic!()
        };
        assert!(
            msg.contains("raise --max-total-tokens to at least 2"),
            "{msg}"
        );
    }

    #[test]
    fn absurd_inputs_do_not_panic() {
        let tiny = KvShape::mha(1, 1, 1, 1, KvDtype::Fp8E4m3).unwrap();
        let huge = KvShape::mha(u32::MAX, 1, 1, u32::MAX, KvDtype::F32);
        assert!(huge.is_err());
        // u64::MAX bytes with a 2-byte cell: far more tokens than u32 slot ids allow.
        let input = MemoryPlanInput {
            total_device_bytes: u64::MAX,
            free_after_weights_bytes: u64::MAX,
            mem_fraction_static: 1.0,
            shape: tiny,
            page_size: u32::MAX,
            context_len: usize::MAX,
            max_total_tokens: None,
            max_running_requests: Some(usize::MAX),
        };
        assert!(MemoryPlan::compute(input).is_err());
        let e = err(MemoryPlanInput {
            page_size: 1,
            ..input
        });
        assert_eq!(invalid_field(&e), "max_total_tokens");
        // With a cap the pool fits, but context_len + 4 overflows.
        let e = err(MemoryPlanInput {
            page_size: 1,
            max_total_tokens: Some(1 << 20),
            ..input
        });
        assert!(matches!(e, KvPoolError::Overflow(_)), "{e:?}");
        // Tiny fractions (subnormal included) and a full-size u64 device.
        for f in [f64::MIN_POSITIVE, 5e-324, 1e-300, f64::EPSILON] {
            let e = err(MemoryPlanInput {
                mem_fraction_static: f,
                free_after_weights_bytes: 0,
                ..input
            });
            assert!(matches!(e, KvPoolError::PoolEmpty(_)), "{e:?}");
        }
        let ok = MemoryPlan::compute(MemoryPlanInput {
            page_size: 1,
            context_len: 8192,
            max_total_tokens: Some(usize::MAX),
            max_running_requests: None,
            free_after_weights_bytes: GIB,
            total_device_bytes: u64::MAX,
            mem_fraction_static: 1.0,
            ..input
        })
        .unwrap();
        assert_eq!(ok.max_total_num_tokens(), (GIB / 2) as usize);
    }

    #[test]
    fn floor_mul_fraction_is_exact() {
        assert_eq!(floor_mul_fraction(80 * GIB, 1.0), 80 * GIB);
        assert_eq!(floor_mul_fraction(80 * GIB, 0.5), 40 * GIB);
        assert_eq!(floor_mul_fraction(u64::MAX, 1.0), u64::MAX);
        assert_eq!(floor_mul_fraction(u64::MAX, 0.5), u64::MAX / 2);
        assert_eq!(floor_mul_fraction(u64::MAX, 5e-324), 0);
        assert_eq!(floor_mul_fraction(3, 1.0 / 3.0), 0); // 1/3 in f64 is just below 1/3
        assert_eq!(floor_mul_fraction(100, 0.88), 88);
    }

    #[test]
    fn display_summary_llama3_8b() {
        let p = MemoryPlan::compute(llama3_8b_h100(16)).unwrap();
        insta::assert_snapshot!(p.to_string());
    }
}
