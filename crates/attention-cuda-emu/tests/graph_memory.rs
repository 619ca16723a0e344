//! The device memory CUDA graphs hold, from the shared pool's recorded allocations: the
//! decode forward of a model is captured at every batch size on a device that only counts
//! bytes ([`CountingDevice`]: buffers are lengths at distinct addresses, launches run
//! nothing), so a 7B-shaped model's graphs can be sized on any machine. The capture's host
//! logic (the backend's plans and allocations, the pool's choices) is the real one; only the
//! kernels do not run, which the bytes do not depend on.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use attention::{AttentionError, Backend, BatchMetadata, DecodeGraphs, Result};
use attention_cuda::{
    CudaBackend, CudaConfig, CudaGraphConfig, CudaGraphRunner, Device, GraphMemory, KernelArg,
    LaunchConfig, Spec,
};
use kv_pool::{KvDtype, KvLayout};
use model::{
    expected_tensors, Architecture, HostTensor, Model, ModelConfig, ModelError, TensorSource,
};

/// A device whose memory is only lengths: each allocation gets a distinct address, copies
/// check their bounds and move nothing, launches run nothing; a capture refuses allocations
/// and copies as the real devices do.
#[derive(Default)]
struct CountingDevice {
    next_address: AtomicUsize,
    capturing: AtomicBool,
}

/// A [`CountingDevice`] allocation.
struct Counted {
    address: usize,
    len: usize,
}

impl CountingDevice {
    fn outside_capture(&self, what: &str) -> Result<()> {
        if self.capturing.load(Ordering::SeqCst) {
            return Err(AttentionError::Device(format!(
                "{what} inside a graph capture"
            )));
        }
        Ok(())
    }
}

impl Device for CountingDevice {
    type Buffer = Counted;
    type Graph = ();

    fn name(&self) -> &str {
        "counting"
    }
    fn alloc_zeroed(&self, bytes: usize) -> Result<Counted> {
        self.outside_capture("an allocation")?;
        let len = bytes.max(1);
        let address = self
            .next_address
            .fetch_add(len.next_multiple_of(256), Ordering::SeqCst);
        Ok(Counted { address, len })
    }
    fn write(&self, dst: &mut Counted, offset: usize, src: &[u8]) -> Result<()> {
        self.outside_capture("a write")?;
        attention_cuda::device::check_range("write", dst.len, offset, src.len())
    }
    fn read(&self, src: &Counted, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.outside_capture("a read")?;
        attention_cuda::device::check_range("read", src.len, offset, dst.len())?;
        dst.fill(0);
        Ok(())
    }
    fn len(&self, buf: &Counted) -> usize {
        buf.len
    }
    fn address(&self, buf: &Counted) -> usize {
        buf.address
    }
    fn launch(
        &self,
        _: &Spec,
        _: &str,
        _: LaunchConfig,
        _: &[KernelArg<'_, Counted>],
    ) -> Result<()> {
        Ok(())
    }
    fn begin_capture(&self) -> Result<()> {
        self.capturing.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn end_capture(&self) -> Result<()> {
        self.capturing.store(false, Ordering::SeqCst);
        Ok(())
    }
    unsafe fn replay(&self, _: &()) -> Result<()> {
        Ok(())
    }
}

/// Every tensor `config`'s loader expects, zeros made one at a time when loaded (a 7B model
/// is never whole on the host).
struct ZeroWeights(Vec<(String, Vec<usize>)>);

impl TensorSource for ZeroWeights {
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.0.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        names
    }
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        let (_, shape) = self.0.iter().find(|(n, _)| n == name)?;
        Some((shape.clone(), "F32".into()))
    }
    fn load(&self, name: &str) -> model::Result<HostTensor> {
        let (shape, _) = self
            .info(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let data = vec![0.0; shape.iter().product()];
        Ok(HostTensor { shape, data })
    }
}

/// Captures `config`'s decode forward under `graphs` on a [`CountingDevice`]; its memory.
fn graph_memory(config: &ModelConfig, graphs: CudaGraphConfig) -> GraphMemory {
    let b = CudaBackend::new(CountingDevice::default(), CudaConfig::default());
    let weights = ZeroWeights(expected_tensors(config));
    let model = Model::load(&b, config.clone(), &weights).unwrap();
    let shape = config.kv_shape(KvDtype::Bf16).unwrap();
    let layout = KvLayout::new(shape, graphs.page_size, 4 * graphs.page_size as usize).unwrap();
    let mut store = b.new_kv_store(layout).unwrap();
    let mut forward = |b: &CudaBackend<CountingDevice>, meta: &BatchMetadata, ids: &[u32]| {
        common::decode_forward(b, &model, &mut store, meta, ids)
    };
    let mut runner = CudaGraphRunner::new(&b, graphs).unwrap();
    runner.capture(&mut forward).unwrap();
    runner.memory()
}

/// The pool holds what the largest size's forward needs and nothing more: every smaller size
/// finds its buffers there, so the graphs' memory is the largest size's, not the sum of a
/// pool per size.
#[test]
fn the_shared_pool_is_the_largest_sizes() {
    let memory = graph_memory(
        &common::llama_config(),
        CudaGraphConfig {
            cuda_graph_max_bs: Some(16),
            max_running_requests: 16,
            max_context_len: 256,
            page_size: 16,
        },
    );
    let largest = &memory.sizes[0];
    assert_eq!(largest.bs, 16);
    assert_eq!(memory.pool_bytes, largest.added_bytes);
    assert!(memory.sizes[1..].iter().all(|s| s.added_bytes == 0));
    assert!(largest.added_bytes < largest.requested_bytes);
    assert!(memory.pool_bytes * 2 < memory.per_size_pools_bytes());
    insta::assert_snapshot!(memory.to_string());
}

/// A 7B-shaped Llama (Llama-2-7B: hidden 4096, 32 layers, 32 heads of 128, intermediate
/// 11008, vocabulary 32000) at SGLang's default 23 sizes (1 … 160), context 4096, page 16:
/// the graphs' memory with one shared pool against one pool per size (the figures in
/// `attention_cuda::graph`'s docs and the README; a few seconds: the zero weights are never
/// touched on the host). Print it with
/// `cargo test -p attention-cuda-emu --test graph_memory 7b -- --nocapture`.
#[test]
fn a_7b_models_graph_memory_at_the_default_sizes() {
    let config = ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 4096,
        intermediate_size: 11008,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 32,
        head_dim: 128,
        vocab_size: 32000,
        tie_word_embeddings: false,
        max_position_embeddings: 4096,
        ..common::llama_config()
    };
    let memory = graph_memory(
        &config,
        CudaGraphConfig {
            cuda_graph_max_bs: None,
            max_running_requests: 4096,
            max_context_len: 4096,
            page_size: 16,
        },
    );
    println!("{memory}");
    assert_eq!(memory.sizes.len(), 23);
    assert_eq!(memory.sizes[0].bs, 160);
    assert!(memory.sizes[1..].iter().all(|s| s.added_bytes == 0));
    insta::assert_snapshot!(memory.to_string());
}
