//! The GEMM path choice (`attention_cuda::gemm`) through the backend, with a fake vendor BLAS
//! (no cuBLAS or hipBLAS here): the emulated device plus an SGEMM that computes on the host
//! exactly what the BLAS would for the arguments the backend passes. The dense conformance
//! suite passes on both paths; the fake counts which one each matmul took. Also: the tiled
//! kernel's batch invariance, the reason `--enable-deterministic-inference` selects it.

use std::sync::atomic::{AtomicUsize, Ordering};

use attention::conformance;
use attention::{Backend, Result, TensorDtype};
use attention_cuda::gemm::{gemm_host, GemmArgs, GemmInputs};
use attention_cuda::{CudaBackend, CudaConfig, Device, GemmPath, KernelArg, LaunchConfig, Spec};
use attention_cuda_emu::{emu_or_skip, EmuBuffer, EmuDevice};

/// The emulated device with a fake BLAS that is either loaded or absent.
struct FakeBlas {
    emu: EmuDevice,
    loaded: bool,
    blas_calls: AtomicUsize,
    /// Of `blas_calls`, those with bf16 inputs (a bf16 weight).
    bf16_calls: AtomicUsize,
    /// Launches of the f32 or bf16-weight matmul kernel (what a loaded BLAS takes).
    kernel_calls: AtomicUsize,
    /// Launches of the f16-weight matmul kernel (a batch of one row block or fewer).
    f16_kernel_calls: AtomicUsize,
    /// f16 weights widened to f32 for the BLAS (a larger batch).
    widen_calls: AtomicUsize,
}

impl FakeBlas {
    fn new(test: &str, loaded: bool) -> Option<FakeBlas> {
        emu_or_skip(test).map(|emu| FakeBlas {
            emu,
            loaded,
            blas_calls: AtomicUsize::new(0),
            bf16_calls: AtomicUsize::new(0),
            kernel_calls: AtomicUsize::new(0),
            f16_kernel_calls: AtomicUsize::new(0),
            widen_calls: AtomicUsize::new(0),
        })
    }

    /// The first `n` elements of `buf`, of the GEMM's input type, as f32.
    fn floats(&self, buf: &EmuBuffer, n: usize, inputs: GemmInputs) -> Result<Vec<f32>> {
        if inputs == GemmInputs::Bf16 {
            let mut v = vec![0u16; n];
            self.emu.read(buf, 0, bytemuck::cast_slice_mut(&mut v))?;
            return Ok(v
                .into_iter()
                .map(|b| f32::from_bits(u32::from(b) << 16))
                .collect());
        }
        let mut v = vec![0f32; n];
        self.emu.read(buf, 0, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }
}

impl Device for FakeBlas {
    type Buffer = EmuBuffer;
    type Graph = std::convert::Infallible;

    fn name(&self) -> &str {
        "cuda-emu+fake-blas"
    }
    fn alloc_zeroed(&self, bytes: usize) -> Result<EmuBuffer> {
        self.emu.alloc_zeroed(bytes)
    }
    fn alloc_uninit(&self, bytes: usize) -> Result<EmuBuffer> {
        self.emu.alloc_uninit(bytes)
    }
    fn write(&self, dst: &mut EmuBuffer, offset: usize, src: &[u8]) -> Result<()> {
        self.emu.write(dst, offset, src)
    }
    fn read(&self, src: &EmuBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.emu.read(src, offset, dst)
    }
    fn len(&self, buf: &EmuBuffer) -> usize {
        self.emu.len(buf)
    }
    fn address(&self, buf: &EmuBuffer) -> usize {
        self.emu.address(buf)
    }
    fn launch(
        &self,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, EmuBuffer>],
    ) -> Result<()> {
        match kernel {
            "matmul" | "matmul_bf16" => self.kernel_calls.fetch_add(1, Ordering::Relaxed),
            "matmul_f16" => self.f16_kernel_calls.fetch_add(1, Ordering::Relaxed),
            "widen_f16" => self.widen_calls.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        self.emu.launch(spec, kernel, cfg, args)
    }
    fn blas(&self) -> std::result::Result<&str, String> {
        if self.loaded {
            Ok("fake BLAS")
        } else {
            Err("fake BLAS absent".into())
        }
    }
    fn blas_gemm(
        &self,
        args: &GemmArgs,
        inputs: GemmInputs,
        w: &EmuBuffer,
        x: &EmuBuffer,
        out: &mut EmuBuffer,
    ) -> Result<()> {
        assert!(self.loaded, "blas_gemm called with no BLAS loaded");
        self.blas_calls.fetch_add(1, Ordering::Relaxed);
        if inputs == GemmInputs::Bf16 {
            self.bf16_calls.fetch_add(1, Ordering::Relaxed);
        }
        args.check_bytes(inputs, self.len(w), self.len(x), self.len(out))
            .map_err(attention::AttentionError::Device)?;
        let (na, nb, nc) = args.elems();
        let (a, b) = (self.floats(w, na, inputs)?, self.floats(x, nb, inputs)?);
        let mut c = vec![f32::NAN; nc];
        gemm_host(args, &a, &b, &mut c);
        self.emu.write(out, 0, bytemuck::cast_slice(&c))
    }
}

fn config(enable_deterministic_inference: bool) -> CudaConfig {
    CudaConfig {
        enable_deterministic_inference,
        ..CudaConfig::default()
    }
}

/// Runs the dense suite on `dev` (f32, f16 and bf16 weights) and returns (BLAS calls, f32 and
/// bf16-weight kernel matmuls); asserts that small batches over f16 weights took the kernel,
/// and that bf16 weights (as bf16) and large batches over f16 ones (widened) reached the BLAS
/// exactly when it took GEMMs.
fn run(dev: FakeBlas, deterministic: bool, want: GemmPath) -> (usize, usize) {
    let b = CudaBackend::new(dev, config(deterministic));
    assert_eq!(b.gemm_choice().path, want, "{}", b.gemm_choice());
    let outcomes = conformance::run_dense_suite(&b).unwrap();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
    let d = b.device();
    assert!(d.f16_kernel_calls.load(Ordering::Relaxed) > 0);
    let bf16 = d.bf16_calls.load(Ordering::Relaxed);
    assert_eq!(bf16 > 0, want == GemmPath::Blas, "bf16 BLAS calls: {bf16}");
    let widened = d.widen_calls.load(Ordering::Relaxed);
    assert_eq!(
        widened > 0,
        want == GemmPath::Blas,
        "f16 weights widened: {widened}"
    );
    (
        d.blas_calls.load(Ordering::Relaxed),
        d.kernel_calls.load(Ordering::Relaxed),
    )
}

#[test]
fn a_loaded_blas_takes_every_gemm_by_default() {
    let Some(dev) = FakeBlas::new("a_loaded_blas_takes_every_gemm_by_default", true) else {
        return;
    };
    let (blas, kernel) = run(dev, false, GemmPath::Blas);
    assert!(blas > 0 && kernel == 0, "blas {blas}, kernel {kernel}");
}

#[test]
fn deterministic_inference_takes_the_kernel_even_with_a_blas() {
    let Some(dev) = FakeBlas::new("deterministic_inference_takes_the_kernel", true) else {
        return;
    };
    let (blas, kernel) = run(dev, true, GemmPath::Kernel);
    assert!(blas == 0 && kernel > 0, "blas {blas}, kernel {kernel}");
}

#[test]
fn no_blas_takes_the_kernel_and_says_why() {
    let Some(dev) = FakeBlas::new("no_blas_takes_the_kernel_and_says_why", false) else {
        return;
    };
    let b = CudaBackend::new(dev, config(false));
    assert_eq!(b.gemm_choice().to_string(), "own kernel (fake BLAS absent)");
    let (blas, kernel) = run(
        FakeBlas::new("no_blas_takes_the_kernel_and_says_why", false).unwrap(),
        false,
        GemmPath::Kernel,
    );
    assert!(blas == 0 && kernel > 0, "blas {blas}, kernel {kernel}");
}

/// A row's product is bitwise the same alone and inside batches of other rows: the kernel's sum
/// over k does not depend on m. For f32, bf16 and f16 weights, with k a multiple of the
/// kernel's 16-byte chunks (vector loads) and not, and batches spanning several blocks of rows.
#[test]
fn the_kernel_gemm_is_batch_invariant() {
    let Some(emu) = emu_or_skip("the_kernel_gemm_is_batch_invariant") else {
        return;
    };
    let b = CudaBackend::new(emu, config(true));
    let val = |i: usize| ((i * 2654435761) % 1000) as f32 / 997.0 - 0.5;
    let n = 70;
    for (k, dtype) in [
        (300, TensorDtype::F32),
        (301, TensorDtype::F32),
        (304, TensorDtype::Bf16),
        (300, TensorDtype::Bf16),
        (304, TensorDtype::F16),
    ] {
        let w: Vec<f32> = (0..n * k).map(|i| dtype.round(val(i + 7))).collect();
        let w = b.upload_weight(&w, &[n, k], dtype).unwrap();
        let row: Vec<f32> = (0..k).map(val).collect();
        let alone = b
            .download(&b.matmul(&b.upload(&row, &[1, k]).unwrap(), &w).unwrap())
            .unwrap();
        for (m, at) in [(5, 0), (33, 17), (64, 63), (130, 129)] {
            let mut x: Vec<f32> = (0..m * k).map(|i| val(i * 31 + 5)).collect();
            x[at * k..(at + 1) * k].copy_from_slice(&row);
            let out = b
                .download(&b.matmul(&b.upload(&x, &[m, k]).unwrap(), &w).unwrap())
                .unwrap();
            let got = &out[at * n..(at + 1) * n];
            assert!(
                got.iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype:?} k {k}: row {at} of a batch of {m} differs from the row alone"
            );
        }
    }
}
