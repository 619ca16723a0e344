//! A mixture-of-experts layer's throughput on a CUDA GPU (issue #14): `fused_moe` per model
//! shape and batch size, in the lanes' form (`moe_matmul`, FMAs over tiles of 16 rows) and the
//! tensor-core form (`moe_matmul_mma`, `CudaConfig::moe_tensor_cores`, labelled `mma`).
//!
//! ```sh
//! cargo run --release -p attention-cuda --features cuda-13 --example moe_throughput -- \
//!     [PEAK_GBPS] [TOKENS]
//! ```
//!
//! Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top 8) and DeepSeek-V2-Lite's
//! routed experts (2048, 64 of 1408, top 6), bf16 experts, over `TOKENS` tokens (a
//! comma-separated list; default 1,16,256,4096,16384: decode batches to a long prefill chunk).
//! Each row is `attention::moe_throughput::measure_moe`: after one untimed call, the median of
//! 5 samples of 3 calls back to back and one synchronisation, per call (routing, both expert
//! matmuls, the combine and the activations' conversions included). It reports the expert
//! matmuls' TFLOP/s (the prefill figure; an H100's dense bf16 tensor-core peak is about 990)
//! and the touched experts' weight bytes per second against `PEAK_GBPS` (the decode figure;
//! default 3350, H100 SXM; 4800 for an H200). Prints a Markdown table; a case the device
//! refuses (memory) is a row with the error.

#[cfg(any(feature = "cuda-12", feature = "cuda-13"))]
fn main() -> std::process::ExitCode {
    use attention::moe_throughput::{measure_moe, moe_experts, MoeCase};
    use attention_cuda::{CudaBackend, CudaConfig, CudarcDevice, Device};

    let mut args = std::env::args().skip(1);
    let peak: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(3350.0);
    let tokens: Vec<usize> = match args.next() {
        None => vec![1, 16, 256, 4096, 16384],
        Some(list) => match list.split(',').map(str::parse).collect() {
            Ok(t) => t,
            Err(e) => {
                eprintln!("moe_throughput: TOKENS is a comma-separated list of counts: {e}");
                return std::process::ExitCode::FAILURE;
            }
        },
    };
    let device = match CudarcDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("moe_throughput: no CUDA device: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!("device: {:?}", device.report());
    if !device.tensor_cores() {
        println!("this GPU has no tensor-core form (sm_80 or later): the mma rows run the lanes'");
    }
    println!("peak: {peak} GB/s\n");
    let lanes = CudaBackend::new(device, CudaConfig::default());
    let forms = [
        ("lanes", lanes.clone()),
        ("mma", lanes.with_moe_tensor_cores(true)),
    ];
    println!("| layer | tokens | form | ms per call | TFLOP/s | weight GB/s | of peak |");
    println!("|---|---|---|---|---|---|---|");
    for (name, shape) in [
        ("Qwen3-30B-A3B", MoeCase::qwen3_30b_a3b(0)),
        ("DeepSeek-V2-Lite", MoeCase::deepseek_v2_lite(0)),
    ] {
        // Both forms read the same experts (the backends share the device).
        let experts = match moe_experts(&lanes, &shape) {
            Ok(e) => e,
            Err(e) => {
                println!("| {name} | | | error: {e} | | | |");
                continue;
            }
        };
        for &n in &tokens {
            let case = MoeCase { tokens: n, ..shape };
            for (form, b) in &forms {
                match measure_moe(b, &case, &experts, 5, 3) {
                    Ok(t) => println!(
                        "| {name} | {n} | {form} | {:.3} | {:.1} | {:.0} | {:.1} % |",
                        t.seconds * 1e3,
                        t.tflops(),
                        t.weight_gbps(),
                        100.0 * t.weight_gbps() / peak
                    ),
                    Err(e) => println!("| {name} | {n} | {form} | error: {e} | | | |"),
                }
            }
        }
    }
    std::process::ExitCode::SUCCESS
}

#[cfg(not(any(feature = "cuda-12", feature = "cuda-13")))]
fn main() -> std::process::ExitCode {
    eprintln!("moe_throughput needs the CUDA bindings: build with --features cuda-12 or cuda-13");
    std::process::ExitCode::FAILURE
}
