//! GEMM throughput on a CUDA GPU (issue #14), per form: dense matmuls over bf16 weights
//! through cuBLAS (`cublas`, what eager calls take where it is loaded), the crate's own kernel
//! (`own`: `matmul`, a warp's FMAs per output; what decode batches under CUDA graphs take) and
//! its tensor-core form (`own+mma`: `matmul_mma`, `CudaConfig::gemm_tensor_cores`); then
//! mixture-of-experts layers in the lanes' form (`moe_matmul`, FMAs over tiles of 16 rows) and
//! the tensor-core form (`moe_matmul_mma`, `CudaConfig::moe_tensor_cores`, labelled `mma`).
//!
//! ```sh
//! cargo run --release -p attention-cuda --features cuda-13 --example gemm_throughput -- \
//!     [PEAK_GBPS] [TOKENS]
//! ```
//!
//! Dense: Llama-3-8B's projections (QKV 4096 → 6144, gate/up 4096 → 28672, down 14336 →
//! 4096). MLA: DeepSeek-V2-Lite's query and output paths, folded (one matmul each, 4× the
//! weights) against SGLang's projection plus `bmm` by `w_kc` / `w_vc` (the model's form). MoE: Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top 8) and
//! DeepSeek-V2-Lite's routed experts (2048, 64 of 1408, top 6), bf16 experts. Each over
//! `TOKENS` rows (a comma-separated list; default 1,16,64,256,4096: decode batches to a
//! prefill chunk). Each row is `attention::gemm_throughput`'s measurement: after one untimed
//! call, the median of 5 samples of 3 calls back to back and one synchronisation, per call
//! (the activations' conversions included; for MoE, routing and the combine too). It reports
//! TFLOP/s (the prefill figure; an H100's dense bf16 tensor-core peak is about 990) and the
//! weight bytes read per second against `PEAK_GBPS` (the decode figure; default 3350, H100
//! SXM; 4800 for an H200). Prints Markdown tables; a case the device refuses (memory) is a
//! row with the error.

#[cfg(any(feature = "cuda-12", feature = "cuda-13"))]
fn main() -> std::process::ExitCode {
    use attention::gemm_throughput::{
        measure_matmul, measure_moe, moe_experts, MatmulCase, MoeCase,
    };
    use attention::TensorDtype;
    use attention_cuda::{CudaBackend, CudaConfig, CudarcDevice, Device};

    let mut args = std::env::args().skip(1);
    let peak: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(3350.0);
    let tokens: Vec<usize> = match args.next() {
        None => vec![1, 16, 64, 256, 4096],
        Some(list) => match list.split(',').map(str::parse).collect() {
            Ok(t) => t,
            Err(e) => {
                eprintln!("gemm_throughput: TOKENS is a comma-separated list of counts: {e}");
                return std::process::ExitCode::FAILURE;
            }
        },
    };
    let device = match CudarcDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gemm_throughput: no CUDA device: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!("device: {:?}", device.report());
    if !device.tensor_cores() {
        println!("this GPU has no tensor-core forms (sm_80 or later): their rows run FMAs");
    }
    println!("peak: {peak} GB/s\n");
    let b = CudaBackend::new(device, CudaConfig::default());
    println!("GEMM path of the eager rows: {}\n", b.gemm_choice());
    let row = |name: &str, n: usize, form: &str, t: attention::Result<(f64, f64, f64)>| match t {
        Ok((seconds, tflops, gbps)) => println!(
            "| {name} | {n} | {form} | {:.3} | {tflops:.1} | {gbps:.0} | {:.1} % |",
            seconds * 1e3,
            100.0 * gbps / peak
        ),
        Err(e) => println!("| {name} | {n} | {form} | error: {e} | | | |"),
    };
    let header = |first: &str| {
        println!("| {first} | tokens | form | ms per call | TFLOP/s | weight GB/s | of peak |");
        println!("|---|---|---|---|---|---|---|");
    };

    header("Llama-3-8B matmul");
    let own = b.without_blas();
    let dense_forms = [
        ("cublas", b.clone()),
        ("own", own.clone()),
        ("own+mma", own.with_gemm_tensor_cores(true)),
    ];
    for (name, k, n) in [
        ("QKV", 4096, 6144),
        ("gate/up", 4096, 28672),
        ("down", 14336, 4096),
    ] {
        for &m in &tokens {
            let case = MatmulCase::dense(m, k, n, TensorDtype::Bf16);
            for (form, b) in &dense_forms {
                let t = measure_matmul(b, &case, 5, 3)
                    .map(|t| (t.seconds, t.tflops(), t.weight_gbps()));
                row(name, m, form, t);
            }
        }
    }

    println!();
    header("DeepSeek-V2-Lite MLA");
    // The query and output paths of one layer: folded at load (what the model did first, one
    // matmul each) against SGLang's form (the projection, and `bmm` per head by w_kc / w_vc,
    // kept in f32). The `bmm` rows have one form, the own kernel.
    let bf16 = |k, n| MatmulCase::dense(0, k, n, TensorDtype::Bf16);
    let per_head = |k, n| MatmulCase {
        heads: 16,
        ..MatmulCase::dense(0, k, n, TensorDtype::F32)
    };
    let mla = [
        ("q folded 2048→16×512", bf16(2048, 16 * 512)),
        ("q_nope 2048→16×128", bf16(2048, 16 * 128)),
        ("bmm w_kc 16×(128→512)", per_head(128, 512)),
        ("o folded 16×512→2048", bf16(16 * 512, 2048)),
        ("bmm w_vc 16×(512→128)", per_head(512, 128)),
        ("o_proj 16×128→2048", bf16(16 * 128, 2048)),
    ];
    for (name, shape) in mla {
        for &m in &tokens {
            let case = MatmulCase { m, ..shape };
            let forms = if case.heads > 1 {
                &dense_forms[1..2]
            } else {
                &dense_forms[..]
            };
            for (form, b) in forms {
                let t = measure_matmul(b, &case, 5, 3)
                    .map(|t| (t.seconds, t.tflops(), t.weight_gbps()));
                row(name, m, form, t);
            }
        }
    }

    println!();
    header("MoE layer");
    let moe_forms = [("lanes", b.clone()), ("mma", b.with_moe_tensor_cores(true))];
    for (name, shape) in [
        ("Qwen3-30B-A3B", MoeCase::qwen3_30b_a3b(0)),
        ("DeepSeek-V2-Lite", MoeCase::deepseek_v2_lite(0)),
    ] {
        // Both forms read the same experts (the backends share the device).
        let experts = match moe_experts(&b, &shape) {
            Ok(e) => e,
            Err(e) => {
                println!("| {name} | | | error: {e} | | | |");
                continue;
            }
        };
        for &n in &tokens {
            let case = MoeCase { tokens: n, ..shape };
            for (form, b) in &moe_forms {
                let t = measure_moe(b, &case, &experts, 5, 3)
                    .map(|t| (t.seconds, t.tflops(), t.weight_gbps()));
                row(name, n, form, t);
            }
        }
    }
    std::process::ExitCode::SUCCESS
}

#[cfg(not(any(feature = "cuda-12", feature = "cuda-13")))]
fn main() -> std::process::ExitCode {
    eprintln!("gemm_throughput needs the CUDA bindings: build with --features cuda-12 or cuda-13");
    std::process::ExitCode::FAILURE
}
