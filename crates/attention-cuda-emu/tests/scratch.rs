//! Scratch reuse: a batch's plan allocates the split-KV scratch (partial outputs and their
//! log-sum-exps) once, on its first attention call, and every later layer reuses it, so a
//! layer's attention allocates only its output tensor. Checked by counting the allocations of
//! a device that wraps the emulated one. Likewise the split plan: chosen by the first layer
//! (asking the device for its wave once), taken as it is by the others.

use std::sync::atomic::{AtomicUsize, Ordering};

use attention::{AttentionParams, Backend, BatchMetadata, RequestKv};
use attention_cuda::{CudaBackend, CudaConfig, Device, KernelArg, LaunchConfig, Spec};
use attention_cuda_emu::{emu_or_skip, EmuDevice};
use kv_pool::{KvDtype, KvLayout, KvShape, Slot};

/// The emulated device, counting allocations and wave queries (it reports a wave of 6 blocks,
/// so the split plan fills waves in the emulation too).
struct Counting {
    inner: EmuDevice,
    allocs: AtomicUsize,
    wave_queries: AtomicUsize,
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
        self.inner.launch(spec, kernel, cfg, args)
    }
}

#[test]
fn layers_reuse_the_plans_split_scratch() {
    let Some(inner) = emu_or_skip("layers_reuse_the_plans_split_scratch") else {
        return;
    };
    // Split the KV range (one chunk per block), so the scratch holds several splits.
    let b = CudaBackend::new(
        Counting {
            inner,
            allocs: AtomicUsize::new(0),
            wave_queries: AtomicUsize::new(0),
        },
        CudaConfig {
            split_kv_target_blocks: 1 << 20,
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
        let out = b
            .attention(layer, &plan, &mut store, &q, &k, &v, &params)
            .unwrap();
        per_layer.push((
            count(&b.device().allocs) - before.0,
            count(&b.device().wave_queries) - before.1,
        ));
        outputs.push(b.download(&out).unwrap());
    }
    // The first layer allocates its output and the two scratch buffers and asks for the
    // wave; the others only allocate their output.
    assert_eq!(per_layer, vec![(3, 1), (1, 0), (1, 0), (1, 0)]);
    // Same inputs in every layer (each layer has its own cache): the same outputs.
    for o in &outputs[1..] {
        assert_eq!(o, &outputs[0]);
    }
}
