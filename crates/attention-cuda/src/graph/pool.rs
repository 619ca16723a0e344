//! The backend's side of CUDA-graph capture: [`GraphPool`], the one pool of device memory every
//! captured batch size shares (PyTorch's graph memory pool, `graph_pool_handle`, which SGLang
//! captures every size into, largest first), and [`GraphTape`], what one size keeps of its own
//! (which pool buffer each of its forward's allocations takes, its captured launches).
//!
//! A captured graph holds device addresses, so every buffer its launches touch must stay put
//! between replays, and nothing may be allocated or copied from the host inside the capture.
//! The backend routes its allocations, uploads and launches through the pool, installed with
//! a size's tape for the phase the runner ([`super::CudaGraphRunner`]) is in:
//! - [`Phase::Warmup`]: an eager forward of the dummy batch. Each allocation and upload takes
//!   a pool buffer (see below), allocating a new one only when none is free, and the tape
//!   records which, in call order.
//! - [`Phase::Capture`]: the same forward inside the device's capture; allocations and uploads
//!   are served by the taped buffers in the same order (an upload writes nothing: its buffer
//!   is a static input, filled before each replay), and each launch is recorded.
//! - [`Phase::Feed`]: before a replay, the forward of the real (padded) batch runs its host
//!   logic again: uploads write the step's data into their static buffers, and each launch,
//!   instead of running, must equal the captured one (kernel, geometry, buffers and scalars),
//!   so a replay never runs a launch whose arguments the step would have changed.
//!
//! ## Which buffer an allocation takes
//! The buffer the first size's (the largest's) allocation of the same index took, if it is
//! free and holds it; else the smallest free buffer that holds it; else a new one. A smaller
//! size runs the same code with smaller shapes, so at its k-th allocation the same tensors are
//! live as at the largest's, and the largest's k-th buffer is free and large enough: it adds
//! nothing to the pool. Free means:
//! - an intermediate (an allocation) may take a buffer no live tensor holds (the pool's is
//!   the only reference) that is no static input of this forward: the forward dropped the
//!   tensor that used it, and launches run in issue order on one stream, so every launch that
//!   read or wrote the old tensor runs before any that writes the new one (PyTorch's caching
//!   allocator reuses a graph pool's freed blocks the same way);
//! - a static input (an upload) takes a buffer this forward has not touched yet and keeps it
//!   to itself for the rest of the forward: it is written before the replay starts, so no
//!   launch of the replay may write it before it is read.
//!
//! Within one forward two live tensors never share a buffer. Across sizes the pool is shared,
//! which is sound because replays never overlap: they are issued on one stream, one at a time
//! (`&mut` [`super::CudaGraphRunner`]), each replay's feed pass rewrites every static input
//! the replay reads, every other buffer a replay reads was written earlier in that replay
//! (the kernels write every element of their outputs: the same assumption that lets a graph
//! replay twice), and a replay's output (the logits) is read back before the next replay is
//! issued. A forward whose allocations are not the largest's, shrunk (a larger split-KV
//! scratch at a smaller size, say), takes what else is free, and one that fits nothing free
//! grows the pool (counted as that size's [`GraphTape::added_bytes`]) rather than overlapping
//! a live buffer. In the capture and feed
//! passes each taped buffer is checked again (it holds the request and no live tensor holds
//! it): a forward whose allocations changed is a typed error, never a silent overlap.

use std::sync::Arc;

use attention::{AttentionError, Result};

use crate::device::{Device, KernelArg, LaunchConfig};
use crate::specs::Spec;

/// What the pool does with the backend's allocations, uploads and launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Take a free pool buffer (or allocate one) and tape it; run launches (an eager forward).
    Warmup,
    /// Serve the taped buffers; record launches (inside the device's capture).
    Capture,
    /// Serve the taped buffers, write uploads into them; check launches, run none.
    Feed,
}

/// One launch's identity: what a replay runs.
#[derive(Debug, Clone, PartialEq)]
struct LaunchRecord {
    spec: String,
    kernel: String,
    cfg: LaunchConfig,
    /// Buffers by device address, scalars by value (f32 by bits).
    args: Vec<(u8, u64)>,
}

impl LaunchRecord {
    fn new<D: Device>(
        device: &D,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, D::Buffer>],
    ) -> Self {
        let args = args
            .iter()
            .map(|a| match a {
                KernelArg::Buf(b) => (0, device.address(b) as u64),
                KernelArg::U32(x) => (1, u64::from(*x)),
                KernelArg::F32(x) => (2, u64::from(x.to_bits())),
            })
            .collect();
        LaunchRecord {
            spec: spec.name(),
            kernel: kernel.to_string(),
            cfg,
            args,
        }
    }
}

fn refused(what: String) -> AttentionError {
    AttentionError::Device(format!("CUDA graph: {what}"))
}

/// What one captured batch size keeps of its own (see the [module docs](self)): the pool
/// buffer each allocation of its forward takes, in call order, and its captured launches.
#[derive(Debug, Clone, Default)]
pub struct GraphTape {
    /// The pool buffer of the forward's k-th allocation or upload.
    slots: Vec<usize>,
    launches: Vec<LaunchRecord>,
    /// Bytes the forward asked for, every allocation and upload capacity summed: what a pool
    /// of its own (one buffer per allocation) held before the pool was shared.
    requested_bytes: usize,
    /// Bytes of the buffers its warmup added to the pool.
    added_bytes: usize,
    /// Bytes of the page table's static buffer: room for the largest batch it will take.
    pub(crate) table_bytes: usize,
    /// The KV length the split-KV plan is made for (the captured grid is fixed, so the plan
    /// is made for the longest request the graph will see, not for the step's).
    pub(crate) max_kv_len: usize,
}

impl GraphTape {
    /// A tape whose page table holds `table_bytes` and whose split plan covers `max_kv_len`
    /// positions, with nothing taped yet.
    pub fn new(table_bytes: usize, max_kv_len: usize) -> Self {
        GraphTape {
            table_bytes,
            max_kv_len,
            ..GraphTape::default()
        }
    }

    /// Launches recorded by the capture.
    pub fn launches(&self) -> usize {
        self.launches.len()
    }

    /// Allocations and uploads of the forward (each served by one pool buffer).
    pub fn allocations(&self) -> usize {
        self.slots.len()
    }

    /// Bytes the forward asked for (every allocation and upload capacity summed): what the
    /// size's own pool held when every size had one.
    pub fn requested_bytes(&self) -> usize {
        self.requested_bytes
    }

    /// Bytes of the buffers this size's warmup added to the shared pool (what no free
    /// buffer already held).
    pub fn added_bytes(&self) -> usize {
        self.added_bytes
    }
}

/// What a pool buffer is to the forward now running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Not taken by this forward yet.
    Untouched,
    /// An intermediate of this forward (free again once no tensor holds it).
    Intermediate,
    /// A static input of this forward: its own until the forward ends.
    StaticInput,
}

/// The device memory every captured size shares, and the pass of one size's forward over it
/// (see the [module docs](self)).
pub struct GraphPool<B> {
    bufs: Vec<Arc<B>>,
    /// The first (largest) size's tape: the buffer its k-th allocation took, which a later
    /// size's k-th allocation takes first.
    reference: Vec<usize>,
    phase: Phase,
    tape: GraphTape,
    uses: Vec<Use>,
    next: usize,
    next_launch: usize,
}

impl<B> Default for GraphPool<B> {
    fn default() -> Self {
        GraphPool {
            bufs: Vec::new(),
            reference: Vec::new(),
            phase: Phase::Warmup,
            tape: GraphTape::default(),
            uses: Vec::new(),
            next: 0,
            next_launch: 0,
        }
    }
}

impl<B> GraphPool<B> {
    /// An empty pool.
    pub fn new() -> Self {
        GraphPool::default()
    }

    /// The phase the pool serves.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The tape of the size whose forward runs now.
    pub fn tape(&self) -> &GraphTape {
        &self.tape
    }

    /// Starts a pass of a forward in `phase` over `tape` (from its first buffer and launch):
    /// a warmup tapes afresh, a capture records its launches afresh.
    pub fn start(&mut self, phase: Phase, mut tape: GraphTape) {
        match phase {
            Phase::Warmup => {
                tape.slots.clear();
                tape.requested_bytes = 0;
                tape.added_bytes = 0;
            }
            Phase::Capture => tape.launches.clear(),
            Phase::Feed => {}
        }
        self.phase = phase;
        self.tape = tape;
        self.uses = vec![Use::Untouched; self.bufs.len()];
        self.next = 0;
        self.next_launch = 0;
    }

    /// Ends the pass: the tape back, with whether the forward made every taped allocation and
    /// (feed) every captured launch (a shorter forward would leave the graph running launches
    /// the step did not ask for).
    pub fn end(&mut self) -> (GraphTape, Result<()>) {
        let tape = std::mem::take(&mut self.tape);
        if self.phase == Phase::Warmup && self.reference.is_empty() {
            self.reference = tape.slots.clone();
        }
        let check = if self.phase != Phase::Warmup && self.next != tape.slots.len() {
            Err(refused(format!(
                "the forward made {} allocations, its warmup {}",
                self.next,
                tape.slots.len()
            )))
        } else if self.phase == Phase::Feed && self.next_launch != tape.launches.len() {
            Err(refused(format!(
                "the forward made {} launches, the graph has {}",
                self.next_launch,
                tape.launches.len()
            )))
        } else {
            Ok(())
        };
        (tape, check)
    }

    /// Buffers in the pool.
    pub fn buffers(&self) -> usize {
        self.bufs.len()
    }

    /// Bytes of device memory the pool holds.
    pub fn bytes<D: Device<Buffer = B>>(&self, device: &D) -> usize {
        self.bufs.iter().map(|b| device.len(b)).sum()
    }

    /// Whether buffer `i` may serve the forward's next request of `kind` for `bytes`.
    fn free_for<D: Device<Buffer = B>>(
        &self,
        device: &D,
        i: usize,
        kind: Use,
        bytes: usize,
    ) -> bool {
        let usable = match kind {
            Use::StaticInput => self.uses[i] == Use::Untouched,
            _ => self.uses[i] != Use::StaticInput,
        };
        usable && Arc::strong_count(&self.bufs[i]) == 1 && device.len(&self.bufs[i]) >= bytes
    }

    /// The buffer of the forward's next allocation (`kind`, `bytes`): at warmup the one the
    /// first size's same allocation took if it is free and holds it, else the smallest free
    /// one that holds it, else a new one, taped; afterwards the taped one, checked.
    fn take<D: Device<Buffer = B>>(
        &mut self,
        device: &D,
        kind: Use,
        bytes: usize,
    ) -> Result<usize> {
        let k = self.next;
        let i = if self.phase == Phase::Warmup {
            let first = self.reference.get(k).copied();
            let best = first
                .filter(|&i| self.free_for(device, i, kind, bytes))
                .or_else(|| {
                    (0..self.bufs.len())
                        .filter(|&i| self.free_for(device, i, kind, bytes))
                        .min_by_key(|&i| device.len(&self.bufs[i]))
                });
            let i = match best {
                Some(i) => i,
                None => {
                    self.bufs.push(Arc::new(device.alloc_zeroed(bytes)?));
                    self.uses.push(Use::Untouched);
                    self.tape.added_bytes += device.len(&self.bufs[self.bufs.len() - 1]);
                    self.bufs.len() - 1
                }
            };
            self.tape.slots.push(i);
            self.tape.requested_bytes += bytes.max(1);
            i
        } else {
            let Some(&i) = self.tape.slots.get(k) else {
                return Err(refused(format!(
                    "the forward asked for allocation {} of {bytes} bytes; its warmup made {}",
                    k + 1,
                    self.tape.slots.len()
                )));
            };
            if !self.free_for(device, i, kind, bytes) {
                return Err(refused(format!(
                    "allocation {} of {bytes} bytes does not fit its buffer {} ({} bytes, {:?}, \
                     {} holders) as its warmup's did",
                    k + 1,
                    i + 1,
                    device.len(&self.bufs[i]),
                    self.uses[i],
                    Arc::strong_count(&self.bufs[i]) - 1
                )));
            }
            i
        };
        self.uses[i] = kind;
        self.next += 1;
        Ok(i)
    }

    /// A buffer of at least `bytes` (zeroed only when the pool allocates it: the kernels
    /// write every element of their outputs).
    pub fn alloc<D: Device<Buffer = B>>(&mut self, device: &D, bytes: usize) -> Result<Arc<B>> {
        let i = self.take(device, Use::Intermediate, bytes)?;
        Ok(Arc::clone(&self.bufs[i]))
    }

    /// A static input holding `data` (room for `capacity` bytes, so later steps with more
    /// data fit): written at warmup and before each replay, not in the capture.
    pub fn upload<D: Device<Buffer = B>>(
        &mut self,
        device: &D,
        data: &[u8],
        capacity: usize,
    ) -> Result<Arc<B>> {
        let need = match self.phase {
            Phase::Warmup => capacity.max(data.len()),
            _ => data.len(),
        };
        let i = self.take(device, Use::StaticInput, need)?;
        if self.phase != Phase::Capture {
            // The take checked that the pool holds the only reference.
            let b = Arc::get_mut(&mut self.bufs[i])
                .ok_or_else(|| refused(format!("static input {} is still held", self.next)))?;
            device.write(b, 0, data)?;
        }
        Ok(Arc::clone(&self.bufs[i]))
    }

    /// Runs (warmup), records and issues (capture) or checks (feed) one launch.
    pub fn launch<D: Device<Buffer = B>>(
        &mut self,
        device: &D,
        spec: &Spec,
        kernel: &str,
        cfg: LaunchConfig,
        args: &[KernelArg<'_, B>],
    ) -> Result<()> {
        match self.phase {
            Phase::Warmup => device.launch(spec, kernel, cfg, args),
            Phase::Capture => {
                self.tape
                    .launches
                    .push(LaunchRecord::new(device, spec, kernel, cfg, args));
                device.launch(spec, kernel, cfg, args)
            }
            Phase::Feed => {
                let got = LaunchRecord::new(device, spec, kernel, cfg, args);
                let i = self.next_launch;
                match self.tape.launches.get(i) {
                    Some(want) if *want == got => {
                        self.next_launch += 1;
                        Ok(())
                    }
                    Some(want) => Err(refused(format!(
                        "launch {} differs from the captured one: {want:?}, now {got:?}",
                        i + 1
                    ))),
                    None => Err(refused(format!(
                        "the forward made more launches than the {} captured",
                        self.tape.launches.len()
                    ))),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use proptest::prelude::*;

    use super::*;
    use crate::kernels;

    /// Host memory as a device: buffers are byte vectors, launches are counted, not run.
    #[derive(Default)]
    struct HostDevice {
        launched: Mutex<usize>,
    }

    impl Device for HostDevice {
        type Buffer = Vec<u8>;
        type Graph = std::convert::Infallible;

        fn name(&self) -> &str {
            "host"
        }
        fn alloc_zeroed(&self, bytes: usize) -> Result<Vec<u8>> {
            Ok(vec![0; bytes.max(1)])
        }
        fn write(&self, dst: &mut Vec<u8>, offset: usize, src: &[u8]) -> Result<()> {
            crate::device::check_range("write", dst.len(), offset, src.len())?;
            dst[offset..offset + src.len()].copy_from_slice(src);
            Ok(())
        }
        fn read(&self, src: &Vec<u8>, offset: usize, dst: &mut [u8]) -> Result<()> {
            crate::device::check_range("read", src.len(), offset, dst.len())?;
            dst.copy_from_slice(&src[offset..offset + dst.len()]);
            Ok(())
        }
        fn len(&self, buf: &Vec<u8>) -> usize {
            buf.len()
        }
        fn address(&self, buf: &Vec<u8>) -> usize {
            buf.as_ptr() as usize
        }
        fn launch(
            &self,
            _: &Spec,
            _: &str,
            _: LaunchConfig,
            _: &[KernelArg<'_, Vec<u8>>],
        ) -> Result<()> {
            *self.launched.lock().unwrap() += 1;
            Ok(())
        }
    }

    const CFG: LaunchConfig = LaunchConfig {
        grid: [1, 1, 1],
        block: 32,
    };

    fn message(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(AttentionError::Device(m)) => m,
            r => panic!("expected a device error, got {r:?}"),
        }
    }

    /// One "forward": an upload of `data`, an output allocation, a launch over both with
    /// scalar `x`.
    fn pass(
        pool: &mut GraphPool<Vec<u8>>,
        d: &HostDevice,
        data: &[u8],
        x: u32,
    ) -> Result<[Arc<Vec<u8>>; 2]> {
        let input = pool.upload(d, data, 8)?;
        let out = pool.alloc(d, 16)?;
        let args = [
            KernelArg::Buf(&*input),
            KernelArg::Buf(&*out),
            KernelArg::U32(x),
        ];
        pool.launch(d, &kernels::dense(), "add_assign", CFG, &args)?;
        Ok([input, out])
    }

    #[test]
    fn warmup_capture_and_feed_share_buffers_and_check_launches() {
        let d = HostDevice::default();
        let mut pool = GraphPool::new();
        pool.start(Phase::Warmup, GraphTape::new(0, 0));
        let [warm_in, warm_out] = pass(&mut pool, &d, &[1, 2], 7).unwrap();
        assert_eq!((pool.buffers(), *d.launched.lock().unwrap()), (2, 1));
        assert_eq!(
            &warm_in[..3],
            &[1, 2, 0],
            "the input is written, with room for 8"
        );
        drop((warm_in, warm_out));
        let (tape, done) = pool.end();
        done.unwrap();
        assert_eq!((tape.allocations(), tape.requested_bytes()), (2, 8 + 16));

        pool.start(Phase::Capture, tape);
        let [cap_in, cap_out] = pass(&mut pool, &d, &[9, 9, 9], 7).unwrap();
        assert_eq!(&cap_in[..3], &[1, 2, 0], "the capture writes no input");
        assert_eq!(
            (pool.tape().launches(), *d.launched.lock().unwrap()),
            (1, 2)
        );
        let addresses = (cap_in.as_ptr(), cap_out.as_ptr());
        drop((cap_in, cap_out));
        let (tape, done) = pool.end();
        done.unwrap();

        // Feed: the same buffers, the input written, the launch checked and not issued.
        pool.start(Phase::Feed, tape);
        let [fed_in, fed_out] = pass(&mut pool, &d, &[5, 6, 7], 7).unwrap();
        assert_eq!((fed_in.as_ptr(), fed_out.as_ptr()), addresses);
        assert_eq!(&fed_in[..3], &[5, 6, 7]);
        assert_eq!(*d.launched.lock().unwrap(), 2);
        let (tape, done) = pool.end();
        done.unwrap();

        // While the last feed's input is held, the next feed cannot refill it.
        pool.start(Phase::Feed, tape);
        let m = message(pass(&mut pool, &d, &[1], 7));
        assert!(m.contains("1 holders"), "{m}");
        drop((fed_in, fed_out));

        // A changed scalar, more data than the static input holds, and a shorter forward.
        let (tape, _) = pool.end();
        pool.start(Phase::Feed, tape);
        let m = message(pass(&mut pool, &d, &[1], 8));
        assert!(m.contains("differs from the captured one"), "{m}");
        let (tape, _) = pool.end();
        pool.start(Phase::Feed, tape);
        let m = message(pass(&mut pool, &d, &[0; 9], 7));
        assert!(m.contains("does not fit its buffer 1 (8 bytes"), "{m}");
        let (tape, _) = pool.end();
        pool.start(Phase::Feed, tape);
        let _kept = pool.upload(&d, &[1], 8).unwrap();
        let _out = pool.alloc(&d, 16).unwrap();
        let m = message(pool.end().1);
        assert!(m.contains("made 0 launches, the graph has 1"), "{m}");
    }

    #[test]
    fn a_forward_that_allocates_otherwise_than_its_warmup_is_refused() {
        let d = HostDevice::default();
        let mut pool = GraphPool::new();
        pool.start(Phase::Warmup, GraphTape::default());
        pool.alloc(&d, 4).unwrap();
        let (tape, _) = pool.end();
        pool.start(Phase::Capture, tape);
        pool.alloc(&d, 4).unwrap();
        let m = message(pool.alloc(&d, 4));
        assert!(m.contains("its warmup made 1"), "{m}");
        let (tape, _) = pool.end();
        pool.start(Phase::Capture, tape);
        let m = message(pool.alloc(&d, 5));
        assert!(m.contains("does not fit its buffer 1 (4 bytes"), "{m}");
        let (tape, _) = pool.end();
        pool.start(Phase::Capture, tape);
        let (tape, done) = pool.end();
        let m = message(done);
        assert!(m.contains("made 0 allocations, its warmup 1"), "{m}");
        pool.start(Phase::Feed, tape);
        pool.alloc(&d, 4).unwrap();
        let launch = pool.launch(&d, &kernels::dense(), "silu_mul", CFG, &[]);
        assert!(message(launch).contains("more launches than the 0 captured"));
    }

    /// The largest size's warmup allocates; a smaller size's takes the same buffers, an
    /// intermediate the smallest free one that holds it; only what fits nothing free grows
    /// the pool.
    #[test]
    fn smaller_sizes_take_the_largest_sizes_buffers() {
        let d = HostDevice::default();
        let mut pool = GraphPool::new();
        let warmup = |pool: &mut GraphPool<Vec<u8>>, scale: usize, extra: usize| {
            pool.start(Phase::Warmup, GraphTape::default());
            let ids = pool.upload(&d, &[1; 4], 4 * scale).unwrap();
            let x = pool.alloc(&d, 16 * scale).unwrap();
            let y = pool.alloc(&d, 32 * scale).unwrap();
            drop(x); // free again: the next intermediate may take it
            let z = pool.alloc(&d, 8 * scale + extra).unwrap();
            let held = [&ids, &y, &z].map(|b| b.as_ptr() as usize);
            drop((ids, y, z));
            (pool.end().0, held)
        };
        let (big, big_held) = warmup(&mut pool, 4, 0);
        assert_eq!(pool.buffers(), 3, "z took x's buffer");
        assert_eq!(big.added_bytes(), 16 + 64 + 128);
        assert_eq!(big.requested_bytes(), 16 + 64 + 128 + 32);
        let (small, small_held) = warmup(&mut pool, 1, 0);
        assert_eq!((pool.buffers(), small.added_bytes()), (3, 0));
        assert_eq!(small_held[0], big_held[0], "the static input's buffer");
        // An intermediate larger than anything free grows the pool rather than overlapping.
        let (odd, odd_held) = warmup(&mut pool, 1, 100);
        assert_eq!((pool.buffers(), odd.added_bytes()), (4, 108));
        assert!(!big_held.contains(&odd_held[2]));
        assert_eq!(pool.bytes(&d), 16 + 64 + 128 + 108);
    }

    /// A static input never takes a buffer an intermediate of the same forward used (the
    /// replay would overwrite it before reading it), nor lends its own to one.
    #[test]
    fn static_inputs_keep_their_buffers_to_themselves() {
        let d = HostDevice::default();
        let mut pool = GraphPool::new();
        // The first size: its second intermediate takes the first's freed buffer.
        pool.start(Phase::Warmup, GraphTape::default());
        drop(pool.alloc(&d, 8).unwrap());
        drop(pool.alloc(&d, 8).unwrap());
        let (tape, _) = pool.end();
        assert_eq!((tape.slots.as_slice(), pool.buffers()), (&[0, 0][..], 1));
        // An intermediate, a static input, an intermediate of `last` bytes.
        let forward = |pool: &mut GraphPool<Vec<u8>>, last: usize| {
            pool.start(Phase::Warmup, GraphTape::default());
            drop(pool.alloc(&d, 8).unwrap());
            drop(pool.upload(&d, &[1; 8], 8).unwrap());
            drop(pool.alloc(&d, last).unwrap());
            pool.end().0
        };
        // Buffer 0 was an intermediate of this forward: the upload gets a new buffer 1, and
        // the last intermediate buffer 0 again.
        assert_eq!(forward(&mut pool, 8).slots, vec![0, 1, 0]);
        // Buffer 1 holds no tensor but is this forward's static input: a new buffer 2.
        let tape = forward(&mut pool, 16);
        assert_eq!(tape.slots, vec![0, 1, 2]);
        assert_eq!((pool.buffers(), tape.added_bytes()), (3, 16));
    }

    /// A step of a random forward: allocate, upload, or drop the `i`-th live tensor.
    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Upload(usize),
        Drop(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..64).prop_map(Op::Alloc),
            (1usize..64).prop_map(Op::Upload),
            (0usize..8).prop_map(Op::Drop),
        ]
    }

    /// Runs `ops` (sizes scaled by `scale`) through the pool's current pass; the buffers
    /// handed out, by address, with whether each is a static input.
    fn run_ops(
        pool: &mut GraphPool<Vec<u8>>,
        d: &HostDevice,
        ops: &[Op],
        scale: usize,
    ) -> Result<Vec<(usize, bool)>> {
        let mut live: Vec<Arc<Vec<u8>>> = Vec::new();
        let mut given: Vec<(usize, bool)> = Vec::new();
        for op in ops {
            let (b, is_static) = match *op {
                Op::Alloc(n) => (pool.alloc(d, n * scale)?, false),
                Op::Upload(n) => (pool.upload(d, &vec![7; n * scale], n * scale)?, true),
                Op::Drop(i) => {
                    if !live.is_empty() {
                        live.remove(i % live.len());
                    }
                    continue;
                }
            };
            let addr = b.as_ptr() as usize;
            // No live tensor shares the buffer it was given.
            assert!(live.iter().all(|l| l.as_ptr() as usize != addr), "{ops:?}");
            // A static input is the only user of its buffer in the whole forward.
            assert!(
                given.iter().all(|&(a, s)| a != addr || (!s && !is_static)),
                "{ops:?}"
            );
            given.push((addr, is_static));
            live.push(b);
        }
        Ok(given)
    }

    proptest! {
        /// Over random forwards captured for several sizes (largest first) into one pool:
        /// within a forward no live tensor shares a buffer and a static input shares with
        /// nothing; the capture and feed passes of each size get its warmup's buffers; the
        /// pool holds what the largest size's warmup allocated, the smaller ones adding
        /// nothing.
        #[test]
        fn sizes_share_one_pool_without_overlap(
            ops in proptest::collection::vec(op(), 1..40),
            scales in proptest::collection::vec(1usize..5, 1..5),
        ) {
            let d = HostDevice::default();
            let mut pool = GraphPool::new();
            let mut scales = scales;
            scales.sort_unstable_by(|a, b| b.cmp(a));
            let mut tapes = Vec::new();
            for &s in &scales {
                pool.start(Phase::Warmup, GraphTape::default());
                let warm = run_ops(&mut pool, &d, &ops, s).unwrap();
                let (tape, done) = pool.end();
                done.unwrap();
                pool.start(Phase::Capture, tape);
                let cap = run_ops(&mut pool, &d, &ops, s).unwrap();
                let (tape, done) = pool.end();
                done.unwrap();
                prop_assert_eq!(&cap, &warm);
                tapes.push((tape, warm));
            }
            let added: usize = tapes.iter().map(|(t, _)| t.added_bytes()).sum();
            prop_assert_eq!(pool.bytes(&d), added);
            prop_assert!(tapes[0].0.added_bytes() <= tapes[0].0.requested_bytes());
            // The same forward shrunk finds every buffer it needs: the pool is the largest's.
            prop_assert!(tapes[1..].iter().all(|(t, _)| t.added_bytes() == 0));
            for ((tape, warm), &s) in tapes.into_iter().zip(&scales) {
                pool.start(Phase::Feed, tape);
                prop_assert_eq!(run_ops(&mut pool, &d, &ops, s).unwrap(), warm);
                prop_assert!(pool.end().1.is_ok());
            }
        }
    }
}
