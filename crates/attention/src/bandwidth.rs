//! Decode attention's KV bandwidth on any [`Backend`]: one batched decode attention call over a
//! paged store, timed, and the KV bytes it must read (every K and V row of every request once)
//! divided by its time. FlashInfer's and issue #14's figure of merit: a decode kernel that
//! reads the KV at the device's memory bandwidth cannot be made faster.
//!
//! [`DecodeCase`] is one shape (requests, context length, page size, heads, KV dtype);
//! [`measure_decode`] builds its store (zeroed, as [`Backend::new_kv_store`] gives it: the
//! values do not change the work), its page table (each request's positions on consecutive
//! pages after the reserved page 0) and its plan, runs one untimed call (which compiles
//! kernels where a backend compiles at first use), then times `iters` samples, each of
//! `calls` calls back to back ending with [`Backend::synchronize`] (so an asynchronous backend
//! has finished; the output stays on the device, as it does between layers: a download would
//! add a copy of `requests × q_heads × head_dim` floats, most of a short context's time), and
//! reports the median sample's time per call. One call a sample ([`measure_decode`]) is a
//! call's latency, the host's launch and synchronisation included; several
//! ([`measure_decode_back_to_back`]) are what a GPU spends per call when calls follow each
//! other (a decode step's layers), as GPU kernel benchmarks (FlashInfer's) time them. The GPU
//! benches run it per page size and context length; the tests run it on the CPU and emulated
//! backends with small shapes. [`PrefillCase`] and [`measure_prefill`] time an extend batch the
//! same way, in FLOP/s of causal attention (a prefill is bound by compute, not by its reads).

use std::time::Instant;

use kv_pool::{KvDtype, KvLayout, KvShape, Slot};

use crate::{AttentionParams, Backend, BatchMetadata, RequestKv, Result};

/// One decode attention shape: `requests` requests of `kv_len` cached positions each (the
/// last one written by the call itself), over an MHA/GQA store or, with `mla_rope_dim`, an
/// absorbed-MLA one ([`Backend::attention_mla`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeCase {
    /// Requests in the batch (one query token each).
    pub requests: usize,
    /// Cached positions per request, the new token's included.
    pub kv_len: usize,
    /// Tokens per page.
    pub page_size: u32,
    /// KV heads of the store.
    pub kv_heads: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// K and V head dim; for MLA the latent row (`kv_lora_rank` + rope dim).
    pub head_dim: usize,
    /// The store's KV dtype.
    pub dtype: KvDtype,
    /// `Some(rope dim)`: absorbed MLA, one latent row of `head_dim` elements per position
    /// (`kv_heads` 1), whose first `head_dim − rope dim` are the values.
    pub mla_rope_dim: Option<usize>,
}

impl DecodeCase {
    /// A Llama-3-8B-shaped case (8 KV heads, 32 query heads, head dim 128) with as many
    /// requests as it takes for the call to read at least `min_bytes` of KV (at least one).
    pub fn llama3_8b(page_size: u32, kv_len: usize, dtype: KvDtype, min_bytes: u64) -> Self {
        let one = DecodeCase {
            requests: 1,
            kv_len,
            page_size,
            kv_heads: 8,
            q_heads: 32,
            head_dim: 128,
            dtype,
            mla_rope_dim: None,
        };
        one.with_requests_for(min_bytes)
    }

    /// A DeepSeek-V3-shaped absorbed-MLA case (latent rows of 512 + 64, `q_heads` heads: 128,
    /// or 16 a GPU at tensor parallelism 8) with as many requests as it takes for the call to
    /// read at least `min_bytes` of KV (at least one).
    pub fn deepseek_v3(
        q_heads: usize,
        page_size: u32,
        kv_len: usize,
        dtype: KvDtype,
        min_bytes: u64,
    ) -> Self {
        let one = DecodeCase {
            requests: 1,
            kv_len,
            page_size,
            kv_heads: 1,
            q_heads,
            head_dim: 576,
            dtype,
            mla_rope_dim: Some(64),
        };
        one.with_requests_for(min_bytes)
    }

    fn with_requests_for(self, min_bytes: u64) -> Self {
        DecodeCase {
            requests: min_bytes.div_ceil(self.kv_bytes().max(1)).max(1) as usize,
            ..self
        }
    }

    /// The KV bytes one call reads: every K and V row of every request once (MLA: the one
    /// latent row a position).
    pub fn kv_bytes(&self) -> u64 {
        let rows = if self.mla_rope_dim.is_some() { 1 } else { 2 };
        (self.requests * self.kv_len * rows * self.kv_heads * self.head_dim) as u64
            * self.dtype.bytes() as u64
    }

    /// Pages of the store: each request's pages plus the reserved page 0.
    fn pages(&self) -> usize {
        self.requests * self.kv_len.div_ceil(self.page_size as usize) + 1
    }
}

/// What a measurement of a case (`C`) measured: the median sample's time per call and the calls
/// per sample. [`measure_decode`], [`measure_prefill`] and [`crate::gemm_throughput`]'s give
/// one, each with the figure of merit of its case.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing<C> {
    /// The case measured.
    pub case: C,
    /// The median sample's time per call, in seconds.
    pub seconds: f64,
    /// Calls per sample, back to back before one synchronisation.
    pub calls: usize,
}

/// What [`measure_decode`] measured.
pub type DecodeTiming = Timing<DecodeCase>;

/// What [`measure_prefill`] measured.
pub type PrefillTiming = Timing<PrefillCase>;

impl DecodeTiming {
    /// KV bytes read per second, in GB/s (10⁹ bytes).
    pub fn gbps(&self) -> f64 {
        self.case.kv_bytes() as f64 / self.seconds / 1e9
    }
}

/// Times decode attention of `case` on `b` (see the module documentation): the median of
/// `iters` calls (at least one), each synchronised, after one untimed call.
pub fn measure_decode<B: Backend>(b: &B, case: &DecodeCase, iters: usize) -> Result<DecodeTiming> {
    measure_decode_back_to_back(b, case, iters, 1)
}

/// Times decode attention of `case` on `b` (see the module documentation): the median of
/// `iters` samples (at least one) of `calls` calls back to back (at least one) and one
/// synchronisation, per call, after one untimed call.
pub fn measure_decode_back_to_back<B: Backend>(
    b: &B,
    case: &DecodeCase,
    iters: usize,
    calls: usize,
) -> Result<DecodeTiming> {
    Ok(DecodeTiming {
        case: *case,
        seconds: time_attention(b, case, 1, iters, calls)?,
        calls: calls.max(1),
    })
}

/// One prefill (extend) attention shape: `requests` requests of `extend_len` new tokens after
/// `prefix_len` cached positions each, over an MHA/GQA store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillCase {
    /// Requests in the batch.
    pub requests: usize,
    /// Cached positions per request before the new tokens.
    pub prefix_len: usize,
    /// New tokens per request (queries), written by the call itself.
    pub extend_len: usize,
    /// Tokens per page.
    pub page_size: u32,
    /// KV heads of the store.
    pub kv_heads: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// K and V head dim.
    pub head_dim: usize,
    /// The store's KV dtype.
    pub dtype: KvDtype,
}

impl PrefillCase {
    /// A Llama-3-8B-shaped prefill (8 KV heads, 32 query heads, head dim 128) of `requests`
    /// prompts of `extend_len` new tokens after `prefix_len` cached ones.
    pub fn llama3_8b(
        requests: usize,
        prefix_len: usize,
        extend_len: usize,
        page_size: u32,
        dtype: KvDtype,
    ) -> Self {
        PrefillCase {
            requests,
            prefix_len,
            extend_len,
            page_size,
            kv_heads: 8,
            q_heads: 32,
            head_dim: 128,
            dtype,
        }
    }

    /// FLOPs of causal attention: each query of each head against its prefix and the new
    /// tokens up to itself, a multiply and an add per element of the scores (`Q·Kᵀ`) and of
    /// the output (`P·V`).
    pub fn flops(&self) -> u64 {
        let e = self.extend_len as u64;
        let pairs = e * self.prefix_len as u64 + e * (e + 1) / 2;
        4 * self.requests as u64 * pairs * self.q_heads as u64 * self.head_dim as u64
    }

    /// The same store as a [`DecodeCase`] of its whole length (what [`time_attention`] lays
    /// out).
    fn as_store(&self) -> DecodeCase {
        DecodeCase {
            requests: self.requests,
            kv_len: self.prefix_len + self.extend_len,
            page_size: self.page_size,
            kv_heads: self.kv_heads,
            q_heads: self.q_heads,
            head_dim: self.head_dim,
            dtype: self.dtype,
            mla_rope_dim: None,
        }
    }
}

impl PrefillTiming {
    /// [`PrefillCase::flops`] per second, in TFLOP/s (10¹²).
    pub fn tflops(&self) -> f64 {
        self.case.flops() as f64 / self.seconds / 1e12
    }
}

/// Times extend attention of `case` on `b` (a store laid out as the module documentation
/// says, the new tokens' K and V written by each call): the median of `iters` samples (at
/// least one) of `calls` calls back to back (at least one) and one synchronisation, per call,
/// after one untimed call.
pub fn measure_prefill<B: Backend>(
    b: &B,
    case: &PrefillCase,
    iters: usize,
    calls: usize,
) -> Result<PrefillTiming> {
    Ok(PrefillTiming {
        case: *case,
        seconds: time_attention(b, &case.as_store(), case.extend_len.max(1), iters, calls)?,
        calls: calls.max(1),
    })
}

/// Seconds per attention call over `c`'s store with the last `extend_len` positions of each
/// request new (1: a decode batch), timed by [`median_seconds_per_call`].
fn time_attention<B: Backend>(
    b: &B,
    c: &DecodeCase,
    extend_len: usize,
    iters: usize,
    calls: usize,
) -> Result<f64> {
    let shape = match c.mla_rope_dim {
        Some(rope) => {
            if c.kv_heads != 1 || rope >= c.head_dim {
                return Err(crate::AttentionError::InvalidConfig {
                    field: "mla_rope_dim",
                    reason: format!(
                        "an MLA decode case has one KV head and a latent row longer than its \
                         rope dim, not {} heads of {} with rope {rope}",
                        c.kv_heads, c.head_dim
                    ),
                });
            }
            KvShape::mla((c.head_dim - rope) as u32, rope as u32, 1, c.dtype)?
        }
        None => KvShape::mha(
            c.kv_heads as u32,
            c.head_dim as u32,
            c.head_dim as u32,
            1,
            c.dtype,
        )?,
    };
    let layout = KvLayout::new(shape, c.page_size, c.pages() * c.page_size as usize)?;
    let mut store = b.new_kv_store(layout)?;
    let page = c.page_size as usize;
    let per_request = c.kv_len.div_ceil(page);
    let slots: Vec<Vec<Slot>> = (0..c.requests)
        .map(|r| {
            (0..c.kv_len)
                .map(|p| Slot(((1 + r * per_request + p / page) * page + p % page) as u32))
                .collect()
        })
        .collect();
    let requests: Vec<RequestKv<'_>> = slots
        .iter()
        .map(|s| RequestKv {
            slots: s,
            extend_len,
        })
        .collect();
    let meta = if extend_len == 1 {
        BatchMetadata::new_decode(c.page_size, &requests)?
    } else {
        BatchMetadata::new(c.page_size, &requests)?
    };
    let plan = b.plan(&meta)?;
    let tokens = c.requests * extend_len;
    let row = |heads: usize| -> Vec<f32> {
        (0..tokens * heads * c.head_dim)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 1000.0)
            .collect()
    };
    let q = b.upload(&row(c.q_heads), &[tokens, c.q_heads, c.head_dim])?;
    let kv = if c.mla_rope_dim.is_some() {
        b.upload(&row(1), &[tokens, c.head_dim])? // the new latent rows
    } else {
        b.upload(&row(c.kv_heads), &[tokens, c.kv_heads, c.head_dim])?
    };
    let params = AttentionParams::dense(1.0 / (c.head_dim as f32).sqrt());
    median_seconds_per_call(b, iters, calls, || {
        if c.mla_rope_dim.is_some() {
            b.attention_mla(0, &plan, &mut store, &q, &kv, &params)
                .map(drop)
        } else {
            b.attention(0, &plan, &mut store, &q, &kv, &kv, &params)
                .map(drop)
        }
    })
}

/// After one untimed `call`, the median over `iters` samples (at least one) of `calls` calls
/// (at least one) back to back and one [`Backend::synchronize`], in seconds per call.
pub(crate) fn median_seconds_per_call<B: Backend>(
    b: &B,
    iters: usize,
    calls: usize,
    mut call: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let mut sample = |calls: usize| -> Result<f64> {
        let t = Instant::now();
        for _ in 0..calls.max(1) {
            call()?;
        }
        b.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / calls.max(1) as f64)
    };
    sample(1)?;
    let mut times = (0..iters.max(1))
        .map(|_| sample(calls))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_8b_cases_read_at_least_what_was_asked() {
        let c = DecodeCase::llama3_8b(16, 1024, KvDtype::F16, 1 << 30);
        // 1024 positions x K and V x 8 heads x 128 dims x 2 bytes = 4 MiB per request.
        assert_eq!(c.kv_bytes() / c.requests as u64, 4 << 20);
        assert_eq!(c.requests, 256);
        assert_eq!(DecodeCase::llama3_8b(1, 32768, KvDtype::F16, 1).requests, 1);
    }

    #[test]
    fn deepseek_v3_cases_read_one_latent_row_a_position() {
        let c = DecodeCase::deepseek_v3(16, 64, 1024, KvDtype::Bf16, 1 << 30);
        // 1024 positions x one row of 576 elements x 2 bytes per request.
        assert_eq!(c.kv_bytes() / c.requests as u64, 1024 * 576 * 2);
        assert_eq!(c.requests, (1u64 << 30).div_ceil(1024 * 576 * 2) as usize);
    }

    #[test]
    fn a_prefill_is_measured_on_the_cpu_backend() {
        let case = PrefillCase {
            requests: 2,
            prefix_len: 5,
            extend_len: 7,
            page_size: 4,
            kv_heads: 2,
            q_heads: 4,
            head_dim: 16,
            dtype: KvDtype::Bf16,
        };
        // 7 queries a request against 5 + 1, 5 + 2, … 5 + 7 positions: 63 pairs.
        assert_eq!(case.flops(), 4 * 2 * 63 * 4 * 16);
        let t = measure_prefill(&crate::CpuBackend::default(), &case, 2, 2).unwrap();
        assert!(t.seconds > 0.0 && t.tflops() > 0.0, "{t:?}");
        assert_eq!((t.case, t.calls), (case, 2));
    }

    #[test]
    fn the_cpu_backend_is_measured_over_an_mla_store_and_bad_mla_cases_are_refused() {
        let b = crate::CpuBackend::default();
        let case = DecodeCase {
            requests: 2,
            kv_len: 50,
            page_size: 16,
            kv_heads: 1,
            q_heads: 4,
            head_dim: 48,
            dtype: KvDtype::Bf16,
            mla_rope_dim: Some(16),
        };
        let t = measure_decode(&b, &case, 2).unwrap();
        assert!(t.seconds > 0.0 && t.gbps().is_finite(), "{t:?}");
        assert_eq!(t.case.kv_bytes(), 2 * 50 * 48 * 2);
        for bad in [
            DecodeCase {
                kv_heads: 2,
                ..case
            },
            DecodeCase {
                mla_rope_dim: Some(48),
                ..case
            },
        ] {
            let err = measure_decode(&b, &bad, 1).unwrap_err();
            assert!(
                matches!(
                    err,
                    crate::AttentionError::InvalidConfig {
                        field: "mla_rope_dim",
                        ..
                    }
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn the_cpu_backend_is_measured_over_every_page_size() {
        let b = crate::CpuBackend::default();
        for page_size in [1, 16, 64] {
            let case = DecodeCase {
                requests: 3,
                kv_len: 100,
                page_size,
                kv_heads: 2,
                q_heads: 4,
                head_dim: 64,
                dtype: KvDtype::F16,
                mla_rope_dim: None,
            };
            let t = measure_decode(&b, &case, 3).unwrap();
            assert!(t.seconds > 0.0 && t.gbps().is_finite(), "{t:?}");
            assert_eq!((t.case.kv_bytes(), t.calls), (3 * 100 * 2 * 2 * 64 * 2, 1));
            let t = measure_decode_back_to_back(&b, &case, 2, 3).unwrap();
            assert!(t.seconds > 0.0 && t.gbps().is_finite(), "{t:?}");
            assert_eq!(t.calls, 3);
        }
    }
}
