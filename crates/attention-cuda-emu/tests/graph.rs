//! CUDA graphs for decode on the emulated device: the tiny Llama decoder's decode forward
//! (embedding, every layer, logits) is captured for batch sizes 1, 2 and 4 and replayed, and
//! the replayed logits are bitwise the eager forward's, for exact and padded batch sizes. The
//! capture is checked, not trusted: the device refuses allocations, copies and reads inside
//! it, a forward that reads back a tensor cannot be captured, and a replay whose launches
//! would differ from the captured ones is refused.

mod common;

use attention::{AttentionError, Backend, BatchMetadata, DecodeGraphs, RequestKv};
use attention_cuda::{
    CudaBackend, CudaConfig, CudaGraphConfig, CudaGraphRunner, CudaKvStore, DecodeForward, Device,
    GraphRoute,
};
use attention_cuda_emu::{emu_or_skip, EmuDevice};
use kv_pool::{KvDtype, KvLayout, Slot};
use model::tiny::random_weights;
use model::{Model, ModelError};

type Emu = CudaBackend<EmuDevice>;

const PAGE: u32 = 16;
const PAGES_PER_REQUEST: u32 = 4;

fn graph_config() -> CudaGraphConfig {
    CudaGraphConfig {
        cuda_graph_max_bs: Some(4),
        max_running_requests: 8,
        max_context_len: (PAGES_PER_REQUEST * PAGE) as usize,
        page_size: PAGE,
    }
}

fn model_err(e: ModelError) -> AttentionError {
    match e {
        ModelError::Attention(e) => e,
        e => AttentionError::Device(e.to_string()),
    }
}

/// The decode forward as the model runner makes it: plan, embedding, layers, logits.
fn forward(
    b: &Emu,
    model: &Model<Emu>,
    store: &mut CudaKvStore<EmuDevice>,
    meta: &BatchMetadata,
    ids: &[u32],
) -> attention::Result<attention_cuda::CudaTensor<EmuDevice>> {
    let positions = meta.positions();
    let plan = b.plan(meta)?;
    let mut x = model.embed(b, ids).map_err(model_err)?;
    for layer in 0..model.num_layers() {
        model
            .layer_forward(b, layer, &plan, store, &mut x, &positions)
            .map_err(model_err)?;
    }
    model.logits(b, &x, None).map_err(model_err)
}

/// Request `r`'s slots for `len` positions (its own pages, after the padding page).
/// One decode request (one new token) per slot list.
fn decode_kvs(lists: &[Vec<Slot>]) -> Vec<RequestKv<'_>> {
    lists
        .iter()
        .map(|s| RequestKv {
            slots: s,
            extend_len: 1,
        })
        .collect()
}

fn slots(r: usize, len: usize) -> Vec<Slot> {
    let first = 1 + r as u32 * PAGES_PER_REQUEST;
    (0..len as u32)
        .map(|p| Slot((first + p / PAGE) * PAGE + p % PAGE))
        .collect()
}

/// A backend, the tiny model on it, and a store with `lens[r] - 1` positions of every request
/// prefilled (eagerly), so that a decode step appends position `lens[r] - 1`.
fn setup(device: EmuDevice, lens: &[usize]) -> (Emu, Model<Emu>, CudaKvStore<EmuDevice>) {
    let b = CudaBackend::new(device, CudaConfig::default());
    let config = common::llama_config();
    let model = Model::load(&b, config.clone(), &random_weights(&config, 0x9a4b)).unwrap();
    let shape = config.kv_shape(KvDtype::Bf16).unwrap();
    let layout = KvLayout::new(shape, PAGE, 9 * (PAGES_PER_REQUEST * PAGE) as usize).unwrap();
    let mut store = b.new_kv_store(layout).unwrap();
    let lists: Vec<Vec<Slot>> = (0..lens.len()).map(|r| slots(r, lens[r] - 1)).collect();
    let kvs: Vec<RequestKv<'_>> = lists
        .iter()
        .map(|s| RequestKv {
            slots: s,
            extend_len: s.len(),
        })
        .collect();
    let meta = BatchMetadata::new(PAGE, &kvs).unwrap();
    let ids: Vec<u32> = (0..meta.num_tokens() as u32)
        .map(|i| i * 37 % 512)
        .collect();
    forward(&b, &model, &mut store, &meta, &ids).unwrap();
    (b, model, store)
}

#[test]
fn replayed_decode_is_bitwise_the_eager_decode() {
    let Some(device) = emu_or_skip("replayed_decode_is_bitwise_the_eager_decode") else {
        return;
    };
    // Context lengths per request; the batch sizes 1 and 2 are captured exactly, 3 is padded
    // to the captured 4.
    let lens = [9, 30, 17];
    let (b, model, mut store) = setup(device, &lens);
    let mut eager = Vec::new();
    for bs in 1..=3 {
        let lists: Vec<Vec<Slot>> = (0..bs).map(|r| slots(r, lens[r])).collect();
        let kvs = decode_kvs(&lists);
        let meta = BatchMetadata::new_decode(PAGE, &kvs).unwrap();
        let ids: Vec<u32> = (0..bs as u32).map(|r| 100 + r).collect();
        let out = forward(&b, &model, &mut store, &meta, &ids).unwrap();
        eager.push((lists, ids, b.download(&out).unwrap()));
    }
    let (model_ref, store_ref) = (&model, &mut store);
    let mut fwd = move |b: &Emu, meta: &BatchMetadata, ids: &[u32]| {
        forward(b, model_ref, store_ref, meta, ids)
    };
    let fwd: &mut DecodeForward<'_, EmuDevice> = &mut fwd;
    let mut runner = CudaGraphRunner::new(&b, graph_config()).unwrap();
    assert!(
        runner.replay(&[], &[], fwd).unwrap().is_none(),
        "nothing captured"
    );
    runner.capture(fwd).unwrap();
    assert_eq!(runner.captured_bs(), vec![1, 2, 4]);
    assert_eq!(runner.padded_bs(3), Some(4));
    assert_eq!(runner.padded_bs(5), None);
    let (launches, buffers) = runner.graph_size(4).unwrap();
    println!("bs 4: {launches} launches over {buffers} static buffers");
    assert!(
        launches > 10 && buffers > 10,
        "{launches} launches, {buffers} buffers"
    );
    // Twice each: a second replay refills the static inputs of the first.
    for _ in 0..2 {
        for (lists, ids, want) in &eager {
            let kvs = decode_kvs(lists);
            let got = runner
                .replay(&kvs, ids, fwd)
                .unwrap()
                .expect("a captured size");
            assert_eq!(got.len(), want.len(), "bs {}", kvs.len());
            let same = got
                .iter()
                .zip(want)
                .all(|(g, w)| g.to_bits() == w.to_bits());
            assert!(same, "bs {}: replayed logits differ from eager", kvs.len());
        }
    }
    // Larger than every captured size: the caller runs it eagerly.
    let lists: Vec<Vec<Slot>> = (0..5).map(|r| slots(r, 2)).collect();
    let kvs = decode_kvs(&lists);
    assert_eq!(runner.route(&kvs), GraphRoute::TooLarge { largest: 4 });
    assert!(runner.replay(&kvs, &[1; 5], fwd).unwrap().is_none());
    // Longer than the graph's context: eager too, not a wrong page table.
    let long = slots(0, 65);
    let kvs = [RequestKv {
        slots: &long,
        extend_len: 1,
    }];
    assert!(matches!(runner.route(&kvs), GraphRoute::TooLong { .. }));
    assert!(runner.replay(&kvs, &[1], fwd).unwrap().is_none());
}

#[test]
fn the_device_refuses_allocations_copies_and_reads_inside_a_capture() {
    let Some(device) =
        emu_or_skip("the_device_refuses_allocations_copies_and_reads_inside_a_capture")
    else {
        return;
    };
    let mut buf = device.alloc_zeroed(16).unwrap();
    device.begin_capture().unwrap();
    assert!(device.begin_capture().is_err(), "a nested capture");
    let refused = |r: attention::Result<()>, what: &str| match r {
        Err(AttentionError::Device(m)) => assert!(m.contains("inside a graph capture"), "{m}"),
        r => panic!("{what} inside a capture: {r:?}"),
    };
    refused(device.alloc_zeroed(4).map(drop), "an allocation");
    refused(device.write(&mut buf, 0, &[1; 4]), "a write");
    refused(device.read(&buf, 0, &mut [0; 4]), "a read");
    let graph = device.end_capture().unwrap();
    assert_eq!(graph.launches(), 0);
    assert!(device.end_capture().is_err(), "end without begin");
    device.alloc_zeroed(4).unwrap();
}

#[test]
fn a_forward_that_reads_back_cannot_be_captured() {
    let Some(device) = emu_or_skip("a_forward_that_reads_back_cannot_be_captured") else {
        return;
    };
    let (b, model, mut store) = setup(device, &[3]);
    let (model_ref, store_ref) = (&model, &mut store);
    let mut fwd = move |b: &Emu, meta: &BatchMetadata, ids: &[u32]| {
        let out = forward(b, model_ref, store_ref, meta, ids)?;
        let host = b.download(&out)?; // not capture-safe: a synchronisation
        b.upload(
            &host,
            &[meta.num_requests(), host.len() / meta.num_requests()],
        )
    };
    let mut runner = CudaGraphRunner::new(&b, graph_config()).unwrap();
    let e = runner.capture(&mut fwd).unwrap_err();
    assert!(runner.captured_bs().is_empty(), "nothing stays captured");
    assert!(
        matches!(&e, AttentionError::Device(m) if m.contains("cannot be read back")),
        "{e:?}"
    );
}

#[test]
fn a_replay_whose_launches_would_differ_is_refused() {
    let Some(device) = emu_or_skip("a_replay_whose_launches_would_differ_is_refused") else {
        return;
    };
    let (b, _, _) = setup(device, &[3]);
    let w = b.upload(&[1.0; 8], &[8]).unwrap();
    // RMSNorm with an eps that changes every call: a launch scalar the graph has baked in.
    let mut eps = 1e-6f32;
    let mut fwd = move |b: &Emu, meta: &BatchMetadata, _: &[u32]| {
        eps *= 2.0;
        let x = b.upload(
            &vec![0.5; meta.num_requests() * 8],
            &[meta.num_requests(), 8],
        )?;
        b.rms_norm(&x, &w, eps)
    };
    let mut runner = CudaGraphRunner::new(&b, graph_config()).unwrap();
    runner.capture(&mut fwd).unwrap();
    let s = slots(0, 1);
    let kvs = [RequestKv {
        slots: &s,
        extend_len: 1,
    }];
    let e = runner.replay(&kvs, &[0], &mut fwd).unwrap_err();
    assert!(
        matches!(&e, AttentionError::Device(m) if m.contains("differs from the captured one")),
        "{e:?}"
    );
}
