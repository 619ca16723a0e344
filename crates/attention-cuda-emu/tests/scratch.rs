//! Scratch reuse: a batch's plan allocates the split-KV scratch (partial outputs and their
//! log-sum-exps) once, on its first attention call, and every later layer reuses it, so a
//! layer's attention allocates only its output tensor. Checked by counting the allocations of
//! a device that wraps the emulated one. Likewise the split plan: chosen by the first layer
//! (asking the device for its wave once), taken as it is by the others. And the split merge
//! folded into the attention kernel (`CudaConfig::fuse_split_merge`): no `merge_states`
//! launch, its counters zeroed once per plan, the outputs bitwise those of the merge launch.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use attention::{AttentionParams, Backend, BatchMetadata, RequestKv};
use attention_cuda::{CudaBackend, CudaConfig, Device, KernelArg, LaunchConfig, Spec};
use attention_cuda_emu::{emu_or_skip, EmuDevice};
use kv_pool::{KvDtype, KvLayout, KvShape, Slot};

/// The emulated device, counting allocations and wave queries (it reports a wave of 6 blocks,
/// so the split plan fills waves in the emulation too) and recording the kernels launched.
struct Counting {
    inner: EmuDevice,
    allocs: AtomicUsize,
    wave_queries: AtomicUsize,
    launches: Mutex<Vec<String>>,
}

impl Device for Counting {
    type Buffer = <EmuDevice as Device>::Buffer;
    type Graph = std::convert::Infallible;

    fn name(&self) -> &str {
        "cuda-emu-counting"
    }

    fn alloc_zeroed(&self, bytes: usize) -> attention::Result<Self::Buffer> {
        self.allocs.fetch_add(1, Ordering::Relaxed);
        self.inner.alloc_zeroed(bytes)
    }

    fn write(&self, dst: &mut Self::Buffer, offset: usize, src: &[u8]) -> attention::Result<()> {
        self.inner.write(dst, offset, src)
    }

    fn read(&self, src: &Self::Buffer, offset: usize, dst: &mut [u8]) -> attention::Result<()> {
        self.inner.read(src, offset, dst)
    }

    fn len(&self, buf: &Self::Buffer) -> usize {
        self.inner.len(buf)
    }

    fn address(&self, buf: &Self::Buffer) -> usize {
        self.inner.address(buf)
    }

    fn wave_blocks(&self, _: &Spec, _: &str, _: u32) -> attention::Result<Option<usize>> {
        self.wave_queries.fetch_add(1, Ordering::Relaxed);
        Ok(Some(6))
    }

    fn launch(
        &self,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, Self::Buffer>],
    ) -> attention::Result<()> {
        self.launches.lock().unwrap().push(kernel.to_string());
        self.inner.launch(spec, kernel, cfg, args)
    }
}

/// What each of four layers of one plan did: (allocations, wave queries, kernels launched)
/// and its output, for a request whose KV range is split (one chunk per block).
type Layers = (Vec<(usize, usize, Vec<String>)>, Vec<Vec<f32>>);

fn run_layers(test: &str, fuse_split_merge: bool) -> Option<Layers> {
    let inner = emu_or_skip(test)?;
    let b = CudaBackend::new(
        Counting {
            inner,
            allocs: AtomicUsize::new(0),
            wave_queries: AtomicUsize::new(0),
            launches: Mutex::new(Vec::new()),
        },
        CudaConfig {
            split_kv_target_blocks: 1 << 20,
            fuse_split_merge,
            ..CudaConfig::default()
        },
    );
    let (heads, d, layers) = (2usize, 64usize, 4usize);
    let shape = KvShape::mha(
        heads as u32,
        d as u32,
        d as u32,
        layers as u32,
        KvDtype::F16,
    )
    .unwrap();
    let mut store = b
        .new_kv_store(KvLayout::new(shape, 16, 1024).unwrap())
        .unwrap();
    let slots: Vec<Slot> = (16..16 + 300).map(Slot).collect();
    let meta = BatchMetadata::new(
        16,
        &[RequestKv {
            slots: &slots,
            extend_len: 2,
        }],
    )
    .unwrap();
    let plan = b.plan(&meta).unwrap();
    let x: Vec<f32> = (0..2 * heads * d)
        .map(|i| (i % 7) as f32 * 0.1 - 0.3)
        .collect();
    let q = b.upload(&x, &[2, heads, d]).unwrap();
    let k = b.upload(&x, &[2, heads, d]).unwrap();
    let v = b.upload(&x, &[2, heads, d]).unwrap();
    let params = AttentionParams::dense(1.0 / (d as f32).sqrt());
    let mut outputs = Vec::new();
    let mut per_layer = Vec::new();
    for layer in 0..layers {
        let count = |c: &AtomicUsize| c.load(Ordering::Relaxed);
        let before = (count(&b.device().allocs), count(&b.device().wave_queries));
        b.device().launches.lock().unwrap().clear();
        let out = b
            .attention(layer, &plan, &mut store, &q, &k, &v, &params)
            .unwrap();
        per_layer.push((
            count(&b.device().allocs) - before.0,
            count(&b.device().wave_queries) - before.1,
            b.device().launches.lock().unwrap().clone(),
        ));
        outputs.push(b.download(&out).unwrap());
    }
    Some((per_layer, outputs))
}

#[test]
fn layers_reuse_the_plans_split_scratch() {
    let Some((per_layer, outputs)) = run_layers("layers_reuse_the_plans_split_scratch", false)
    else {
        return;
    };
    // The first layer allocates its output and the two scratch buffers and asks for the
    // wave; the others only allocate their output.
    let counts: Vec<(usize, usize)> = per_layer.iter().map(|(a, w, _)| (*a, *w)).collect();
    assert_eq!(counts, vec![(3, 1), (1, 0), (1, 0), (1, 0)]);
    // Same inputs in every layer (each layer has its own cache): the same outputs.
    for o in &outputs[1..] {
        assert_eq!(o, &outputs[0]);
    }
    for (_, _, launches) in &per_layer {
        assert_eq!(
            launches.last().map(String::as_str),
            Some("merge_states"),
            "{launches:?}"
        );
    }
}

/// The merge in the kernel: no `merge_states` launch; the counters allocated and zeroed on the
/// plan's first layer only (every launch leaves them at zero, or a later layer would not
/// merge and its output would stay the emulation's NaN poison); every layer's output bitwise
/// the merge launch's.
#[test]
fn the_merge_in_the_kernel_gives_the_merge_launchs_bits() {
    let test = "the_merge_in_the_kernel_gives_the_merge_launchs_bits";
    let (Some((fused, got)), Some((_, want))) = (run_layers(test, true), run_layers(test, false))
    else {
        return;
    };
    let counts: Vec<(usize, usize)> = fused.iter().map(|(a, w, _)| (*a, *w)).collect();
    assert_eq!(counts, vec![(4, 1), (1, 0), (1, 0), (1, 0)]);
    for (layer, (_, _, launches)) in fused.iter().enumerate() {
        assert!(
            !launches.iter().any(|k| k == "merge_states"),
            "{launches:?}"
        );
        let zeroed = launches.iter().filter(|k| *k == "zero_counters").count();
        assert_eq!(zeroed, usize::from(layer == 0), "{launches:?}");
    }
    for (layer, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "layer {layer}: the in-kernel merge differs from merge_states"
        );
    }
}
