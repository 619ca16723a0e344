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
use model::Model;

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
    common::decode_forward(&b, &model, &mut store, &meta, &ids).unwrap();
    (b, model, store)
}

/// A decode step: requests `0..bs` each appending its last position, their token ids, and
/// the eager forward's logits.
type Decode = (Vec<Vec<Slot>>, Vec<u32>, Vec<f32>);

/// The eager decode of requests `0..bs` of `lens` positions (tokens `100 + r`), for every
/// `bs` in `1..=lens.len()`.
fn eager_decodes(
    b: &Emu,
    model: &Model<Emu>,
    store: &mut CudaKvStore<EmuDevice>,
    lens: &[usize],
) -> Vec<Decode> {
    (1..=lens.len())
        .map(|bs| {
            let lists: Vec<Vec<Slot>> = (0..bs).map(|r| slots(r, lens[r])).collect();
            let kvs = decode_kvs(&lists);
            let meta = BatchMetadata::new_decode(PAGE, &kvs).unwrap();
            let ids: Vec<u32> = (0..bs as u32).map(|r| 100 + r).collect();
            let out = common::decode_forward(b, model, store, &meta, &ids).unwrap();
            let logits = b.download(&out).unwrap();
            (lists, ids, logits)
        })
        .collect()
}

/// Replays `decode` through `runner`: its logits must be bitwise the eager ones.
fn assert_replay_is_eager(
    runner: &mut CudaGraphRunner<EmuDevice>,
    fwd: &mut DecodeForward<'_, EmuDevice>,
    (lists, ids, want): &Decode,
) {
    let kvs = decode_kvs(lists);
    let got = runner
        .replay(&kvs, ids, fwd)
        .unwrap()
        .expect("a captured size");
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| g.to_bits() == w.to_bits());
    assert!(same, "bs {}: replayed logits differ from eager", kvs.len());
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
    let eager = eager_decodes(&b, &model, &mut store, &lens);
    let (model_ref, store_ref) = (&model, &mut store);
    let mut fwd = move |b: &Emu, meta: &BatchMetadata, ids: &[u32]| {
        common::decode_forward(b, model_ref, store_ref, meta, ids)
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
        for decode in &eager {
            assert_replay_is_eager(&mut runner, fwd, decode);
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
        let out = common::decode_forward(b, model_ref, store_ref, meta, ids)?;
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

/// Every size shares one pool: graphs captured for 1, 2, 4, 7 and 8 replayed in an interleaved
/// order (each size after others have overwritten the buffers it shares with them) give
/// bitwise the eager logits each time, for fixed sequences and random ones; the pool is the
/// largest size's.
#[test]
fn interleaved_sizes_through_the_shared_pool_are_bitwise_the_eager_decode() {
    let test = "interleaved_sizes_through_the_shared_pool_are_bitwise_the_eager_decode";
    let Some(device) = emu_or_skip(test) else {
        return;
    };
    let lens = [9, 30, 17, 5, 40, 12, 64, 1];
    // Request 7 decodes its first position: nothing to prefill.
    let (b, model, mut store) = setup(device, &lens[..7]);
    let eager = eager_decodes(&b, &model, &mut store, &lens);
    let (model_ref, store_ref) = (&model, &mut store);
    let mut fwd = move |b: &Emu, meta: &BatchMetadata, ids: &[u32]| {
        common::decode_forward(b, model_ref, store_ref, meta, ids)
    };
    let fwd: &mut DecodeForward<'_, EmuDevice> = &mut fwd;
    let mut runner = CudaGraphRunner::new(
        &b,
        CudaGraphConfig {
            cuda_graph_max_bs: Some(8),
            ..graph_config()
        },
    )
    .unwrap();
    runner.capture(fwd).unwrap();
    // SGLang's list below the request table's 8 adds 7.
    assert_eq!(runner.captured_bs(), vec![1, 2, 4, 7, 8]);
    let memory = runner.memory();
    assert_eq!(memory.pool_bytes, memory.sizes[0].added_bytes, "{memory}");
    assert!(
        memory.sizes[1..].iter().all(|s| s.added_bytes == 0),
        "{memory}"
    );

    let mut replay = |bs: usize| assert_replay_is_eager(&mut runner, fwd, &eager[bs - 1]);
    // Exact sizes, then sizes padded to 4 and 7.
    for bs in [8, 1, 4, 8, 2, 1, 3, 7, 5, 1, 6, 2] {
        replay(bs);
    }
    // Pseudo-random orders (a fixed seed, so a failure reproduces).
    let mut state = 0x5eed_u64;
    for _ in 0..24 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        replay(1 + (state >> 33) as usize % lens.len());
    }
}
