//! Decode attention's KV bandwidth on a CUDA GPU (issue #14): the KV bytes one batched decode
//! call reads per second, per KV dtype, page size and context length, against the device's
//! memory bandwidth (FlashInfer reaches about 88 % of an H100's at long contexts).
//!
//! ```sh
//! cargo run --release -p attention-cuda --features cuda-13 --example decode_bandwidth -- \
//!     [PEAK_GBPS] [MIN_GIB] [SPLIT_TARGET] [KERNEL] [MERGE] [TABLES]
//! ```
//!
//! Llama-3-8B-shaped attention (8 KV heads, 32 query heads, head dim 128), as many requests as
//! it takes to read at least `MIN_GIB` GiB of KV per call (default 2), so launch overhead does
//! not hide the bandwidth. Each row times the case twice (`attention::bandwidth`, after one
//! untimed call, which compiles the kernels): alone, the median of 20 calls each synchronised
//! (a call's latency: the host's launches and synchronisation included), and back to back,
//! the median of 20 samples of 8 calls and one synchronisation, per call (what the GPU
//! spends per call when calls follow each other, as a decode step's layers do and as GPU
//! kernel benchmarks time them; the bandwidth figure). `PEAK_GBPS` is the
//! device's memory bandwidth in GB/s (default 3350, H100 SXM; 4800 for an H200);
//! `SPLIT_TARGET` the backend's `split_kv_target_blocks` (default: `CudaConfig`'s); `KERNEL`
//! the paged-attention kernel, `chunked`, `pipelined` or `both` (the default: a row each, the
//! same case one after the other); `MERGE` where a split call's partial states are merged,
//! `launch` (a `merge_states` launch, the default `CudaConfig`), `kernel` (in the attention
//! kernel, `fuse_split_merge`) or `both` (the default: the pipelined kernel's rows once more
//! with the merge in the kernel, labelled `+merge`). KV dtypes f16, bf16 and fp8 e4m3. Then
//! absorbed MLA, DeepSeek-V3-shaped (latent rows of 512 + 64, 16 and 128 query heads; bf16 and
//! fp8; 32768 positions), on each kernel asked for, the pipelined one's rows once more in the
//! tensor-core form (`CudaConfig::mla_tensor_cores`, labelled `+mma`). `TABLES`: `mha`,
//! `mla` or `both` (the default); or `prefill`: Llama-3-8B-shaped prefill attention (prompts
//! of 512, 2048 and 8192 tokens, 8 requests of 512 after 1024 cached, and short extends after
//! long prefixes, 32 after 8192 and 4 × 64 after 4096, whose KV range `paged_prefill` splits;
//! bf16 and f16, pages of 16) by the pipelined kernel (a block per token) and `paged_prefill`
//! (`CudaConfig::prefill_tensor_cores`), split as the target chooses and unsplit, in TFLOP/s
//! of causal attention. Prints Markdown
//! tables; a case the device refuses (memory) is a row with the error.

#[cfg(any(feature = "cuda-12", feature = "cuda-13"))]
fn main() -> std::process::ExitCode {
    use attention::bandwidth::{
        measure_decode, measure_decode_back_to_back, measure_prefill, DecodeCase, PrefillCase,
    };
    use attention_cuda::{AttentionKernel, CudaBackend, CudaConfig, CudarcDevice};
    use kv_pool::KvDtype;

    let mut args = std::env::args().skip(1);
    let peak: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(3350.0);
    let min_gib: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let mut config = CudaConfig::default();
    if let Some(target) = args.next().and_then(|a| a.parse().ok()) {
        config.split_kv_target_blocks = target;
    }
    let kernels: Vec<AttentionKernel> = match args.next().as_deref() {
        None | Some("both") => AttentionKernel::ALL.to_vec(),
        Some(k) => match k.parse() {
            Ok(k) => vec![k],
            Err(e) => {
                eprintln!("decode_bandwidth: {e}");
                return std::process::ExitCode::FAILURE;
            }
        },
    };
    let merges: Vec<bool> = match args.next().as_deref() {
        None | Some("both") => vec![false, true],
        Some("launch") => vec![false],
        Some("kernel") => vec![true],
        Some(m) => {
            eprintln!("decode_bandwidth: MERGE is launch, kernel or both, not {m}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let (mha_table, mla_table, prefill_table) = match args.next().as_deref() {
        None | Some("both") => (true, true, false),
        Some("mha") => (true, false, false),
        Some("mla") => (false, true, false),
        Some("prefill") => (false, false, true),
        Some(t) => {
            eprintln!("decode_bandwidth: TABLES is mha, mla, both or prefill, not {t}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // Each kernel with each merge, but the chunked kernel's only with the default one when
    // both are asked for.
    let variants: Vec<(AttentionKernel, bool)> = kernels
        .iter()
        .flat_map(|&k| merges.iter().map(move |&m| (k, m)))
        .filter(|&(k, m)| !(merges.len() > 1 && m && k == AttentionKernel::Chunked))
        .collect();
    let device = match CudarcDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("decode_bandwidth: no CUDA device: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!("device: {:?}", device.report());
    println!(
        "peak: {peak} GB/s; at least {min_gib} GiB of KV per call; split target {} blocks\n",
        config.split_kv_target_blocks
    );
    let b = CudaBackend::new(device, config);
    let min_bytes = (min_gib * (1u64 << 30) as f64) as u64;
    // One row: the case timed alone and back to back on `b`.
    let row = |b: &CudaBackend<CudarcDevice>, label: &str, case: &DecodeCase| {
        let lead = format!(
            "| {label} | {} | {} | {} | {} | {:.2} |",
            case.dtype,
            case.page_size,
            case.kv_len,
            case.requests,
            case.kv_bytes() as f64 / (1u64 << 30) as f64
        );
        let timings = measure_decode(b, case, 20)
            .and_then(|alone| Ok((alone, measure_decode_back_to_back(b, case, 20, 8)?)));
        match timings {
            Ok((alone, t)) => println!(
                "{lead} {:.3} | {:.1} % | {:.3} | {:.0} | {:.1} % |",
                alone.seconds * 1e3,
                100.0 * alone.gbps() / peak,
                t.seconds * 1e3,
                t.gbps(),
                100.0 * t.gbps() / peak
            ),
            Err(e) => println!("{lead} error: {e} | | | | |"),
        }
    };
    let header = |first: &str| {
        println!(
            "| {first} | KV dtype | page size | context | requests | KV read (GiB) | ms alone | \
             of peak alone | ms per call back to back | GB/s | of peak |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
    };
    if mha_table {
        header("kernel");
    }
    for dtype in [KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8E4m3]
        .into_iter()
        .filter(|_| mha_table)
    {
        for page in [1u32, 16, 64] {
            for context in [1024usize, 4096, 16384, 32768] {
                let case = DecodeCase::llama3_8b(page, context, dtype, min_bytes);
                for &(kernel, fuse) in &variants {
                    let b = b
                        .with_attention_kernel(kernel)
                        .with_split_merge_in_kernel(fuse);
                    row(
                        &b,
                        &format!("{kernel}{}", if fuse { "+merge" } else { "" }),
                        &case,
                    );
                }
            }
        }
    }
    // Absorbed MLA, DeepSeek-V3-shaped (latent rows of 512 + 64; 16 heads, a GPU's share at
    // tensor parallelism 8, and all 128): the chunked and pipelined kernels, the latter's
    // tensor-core form (`CudaConfig::mla_tensor_cores`) labelled `+mma`.
    if mla_table {
        println!();
        header("MLA heads, kernel");
    }
    for heads in [16usize, 128].into_iter().filter(|_| mla_table) {
        for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
            for page in [1u32, 64] {
                for context in [32768usize] {
                    let case = DecodeCase::deepseek_v3(heads, page, context, dtype, min_bytes);
                    for &kernel in &kernels {
                        let mma: &[bool] = match (kernel, dtype) {
                            (AttentionKernel::Pipelined, KvDtype::Bf16 | KvDtype::Fp8E4m3) => {
                                &[false, true]
                            }
                            _ => &[false],
                        };
                        for &on in mma {
                            let b = b.with_attention_kernel(kernel).with_mla_tensor_cores(on);
                            row(
                                &b,
                                &format!("{heads}, {kernel}{}", if on { "+mma" } else { "" }),
                                &case,
                            );
                        }
                    }
                }
            }
        }
    }
    if prefill_table {
        println!(
            "| prefill kernel | KV dtype | page size | requests | prefix | new tokens | ms per call \
             | TFLOP/s |"
        );
        println!("|---|---|---|---|---|---|---|---|");
    }
    // Fresh prompts, a batch after shared prefixes, and short extends after long prefixes (a
    // chat's next message: too few tiles to fill the GPU, so paged_prefill splits their KV).
    let prefills = [
        (1, 0, 512),
        (1, 0, 2048),
        (1, 0, 8192),
        (8, 1024, 512),
        (1, 8192, 32),
        (4, 4096, 64),
    ];
    for (requests, prefix, extend) in prefills.into_iter().filter(|_| prefill_table) {
        for dtype in [KvDtype::Bf16, KvDtype::F16] {
            let case = PrefillCase::llama3_8b(requests, prefix, extend, 16, dtype);
            for (label, b) in [
                (
                    "pipelined",
                    b.with_attention_kernel(AttentionKernel::Pipelined),
                ),
                ("paged_prefill", b.with_prefill_tensor_cores(true)),
                // Its KV range never split: what the split buys short extends.
                (
                    "paged_prefill unsplit",
                    b.with_config(CudaConfig {
                        prefill_tensor_cores: true,
                        split_kv_target_blocks: 1,
                        ..config
                    }),
                ),
            ] {
                let lead = format!("| {label} | {dtype} | 16 | {requests} | {prefix} | {extend} |");
                match measure_prefill(&b, &case, 5, 2) {
                    Ok(t) => println!("{lead} {:.3} | {:.1} |", t.seconds * 1e3, t.tflops()),
                    Err(e) => println!("{lead} error: {e} | |"),
                }
            }
        }
    }
    std::process::ExitCode::SUCCESS
}

#[cfg(not(any(feature = "cuda-12", feature = "cuda-13")))]
fn main() -> std::process::ExitCode {
    eprintln!("decode_bandwidth needs the CUDA bindings: build with --features cuda-12 or cuda-13");
    std::process::ExitCode::FAILURE
}
