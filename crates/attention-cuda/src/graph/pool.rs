//! The backend's side of CUDA-graph capture: [`GraphPool`], the static buffers of one captured
//! batch size (PyTorch's graph memory pool plus SGLang's static input buffers).
//!
//! A captured graph holds device addresses, so every buffer its launches touch must stay put
//! between replays, and nothing may be allocated or copied from the host inside the capture.
//! The backend routes its allocations, uploads and launches through the pool installed for the
//! phase the runner ([`super::CudaGraphRunner`]) is in:
//! - [`Phase::Warmup`]: an eager forward of the dummy batch; every allocation and upload is
//!   made on the device and kept, in call order.
//! - [`Phase::Capture`]: the same forward inside the device's capture; allocations and uploads
//!   are served by the kept buffers in the same order (an upload writes nothing: its buffer
//!   is a static input, filled before each replay), and each launch is recorded.
//! - [`Phase::Feed`]: before a replay, the forward of the real (padded) batch runs its host
//!   logic again: uploads write the step's data into their static buffers, and each launch,
//!   instead of running, must equal the captured one (kernel, geometry, buffers and scalars),
//!   so a replay never runs a launch whose arguments the step would have changed.

use std::sync::Arc;

use attention::{AttentionError, Result};

use crate::device::{Device, KernelArg, LaunchConfig};
use crate::specs::Spec;

/// What the pool does with the backend's allocations, uploads and launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Allocate on the device and keep (an eager forward).
    Warmup,
    /// Serve the kept buffers; record launches (inside the device's capture).
    Capture,
    /// Serve the kept buffers, write uploads into them; check launches, run none.
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

/// The static buffers and recorded launches of one captured batch size (see the
/// [module docs](self)).
pub struct GraphPool<B> {
    phase: Phase,
    bufs: Vec<Arc<B>>,
    next: usize,
    launches: Vec<LaunchRecord>,
    next_launch: usize,
    /// Bytes of the page table's static buffer: room for the largest batch it will take.
    pub(crate) table_bytes: usize,
    /// The KV length the split-KV plan is made for (the captured grid is fixed, so the plan
    /// is made for the longest request the graph will see, not for the step's).
    pub(crate) max_kv_len: usize,
}

impl<B> GraphPool<B> {
    /// An empty pool whose page table holds `table_bytes` and whose split plan covers
    /// `max_kv_len` positions.
    pub fn new(table_bytes: usize, max_kv_len: usize) -> Self {
        GraphPool {
            phase: Phase::Warmup,
            bufs: Vec::new(),
            next: 0,
            launches: Vec::new(),
            next_launch: 0,
            table_bytes,
            max_kv_len,
        }
    }

    /// The phase the pool serves.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Starts a pass of the forward in `phase` (from the first buffer and launch).
    pub fn start(&mut self, phase: Phase) {
        self.phase = phase;
        self.next = 0;
        self.next_launch = 0;
        if phase == Phase::Capture {
            self.launches.clear();
        }
    }

    /// Checks, after a feed pass, that the forward made every captured launch (a shorter
    /// forward would leave the graph running launches the step did not ask for).
    pub fn finish(&self) -> Result<()> {
        if self.phase == Phase::Feed && self.next_launch != self.launches.len() {
            return Err(refused(format!(
                "the forward made {} launches, the graph has {}",
                self.next_launch,
                self.launches.len()
            )));
        }
        Ok(())
    }

    /// Launches recorded by the capture.
    pub fn launches(&self) -> usize {
        self.launches.len()
    }

    /// Static buffers kept by the warmup.
    pub fn buffers(&self) -> usize {
        self.bufs.len()
    }

    /// The next kept buffer, which must hold `bytes`.
    fn take<D: Device<Buffer = B>>(&mut self, device: &D, bytes: usize) -> Result<usize> {
        let i = self.next;
        let Some(b) = self.bufs.get(i) else {
            return Err(refused(format!(
                "the forward asked for buffer {} of {bytes} bytes; its warmup made {}",
                i + 1,
                self.bufs.len()
            )));
        };
        if device.len(b) < bytes {
            return Err(refused(format!(
                "buffer {} holds {} bytes, the forward asked for {bytes}",
                i + 1,
                device.len(b)
            )));
        }
        self.next += 1;
        Ok(i)
    }

    /// A buffer of at least `bytes` (zeroed only at warmup: the kernels write every element
    /// of their outputs).
    pub fn alloc<D: Device<Buffer = B>>(&mut self, device: &D, bytes: usize) -> Result<Arc<B>> {
        if self.phase == Phase::Warmup {
            let b = Arc::new(device.alloc_zeroed(bytes)?);
            self.bufs.push(Arc::clone(&b));
            return Ok(b);
        }
        let i = self.take(device, bytes)?;
        Ok(Arc::clone(&self.bufs[i]))
    }

    /// A static input holding `data` (allocated with `capacity` bytes at warmup, so later
    /// steps with more data fit): written at warmup and before each replay, not in the
    /// capture.
    pub fn upload<D: Device<Buffer = B>>(
        &mut self,
        device: &D,
        data: &[u8],
        capacity: usize,
    ) -> Result<Arc<B>> {
        match self.phase {
            Phase::Warmup => {
                let mut b = device.alloc_zeroed(capacity.max(data.len()))?;
                device.write(&mut b, 0, data)?;
                let b = Arc::new(b);
                self.bufs.push(Arc::clone(&b));
                Ok(b)
            }
            Phase::Capture => {
                let i = self.take(device, data.len())?;
                Ok(Arc::clone(&self.bufs[i]))
            }
            Phase::Feed => {
                let i = self.take(device, data.len())?;
                let b = Arc::get_mut(&mut self.bufs[i]).ok_or_else(|| {
                    refused(format!(
                        "static input {} is still held from the previous replay",
                        i + 1
                    ))
                })?;
                device.write(b, 0, data)?;
                Ok(Arc::clone(&self.bufs[i]))
            }
        }
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
                self.launches
                    .push(LaunchRecord::new(device, spec, kernel, cfg, args));
                device.launch(spec, kernel, cfg, args)
            }
            Phase::Feed => {
                let got = LaunchRecord::new(device, spec, kernel, cfg, args);
                let i = self.next_launch;
                match self.launches.get(i) {
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
                        self.launches.len()
                    ))),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

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
        let mut pool = GraphPool::new(0, 0);
        pool.start(Phase::Warmup);
        let [warm_in, warm_out] = pass(&mut pool, &d, &[1, 2], 7).unwrap();
        assert_eq!((pool.buffers(), *d.launched.lock().unwrap()), (2, 1));
        assert_eq!(
            &warm_in[..3],
            &[1, 2, 0],
            "the input is written, with room for 8"
        );
        drop((warm_in, warm_out));

        pool.start(Phase::Capture);
        let [cap_in, cap_out] = pass(&mut pool, &d, &[9, 9, 9], 7).unwrap();
        assert_eq!(&cap_in[..3], &[1, 2, 0], "the capture writes no input");
        assert_eq!((pool.launches(), *d.launched.lock().unwrap()), (1, 2));
        let addresses = (cap_in.as_ptr(), cap_out.as_ptr());
        drop((cap_in, cap_out));

        // Feed: the same buffers, the input written, the launch checked and not issued.
        pool.start(Phase::Feed);
        let [fed_in, fed_out] = pass(&mut pool, &d, &[5, 6, 7], 7).unwrap();
        assert_eq!((fed_in.as_ptr(), fed_out.as_ptr()), addresses);
        assert_eq!(&fed_in[..3], &[5, 6, 7]);
        assert_eq!(*d.launched.lock().unwrap(), 2);
        pool.finish().unwrap();

        // While the last feed's input is held, the next feed cannot refill it.
        pool.start(Phase::Feed);
        let m = message(pass(&mut pool, &d, &[1], 7));
        assert!(m.contains("still held"), "{m}");
        drop((fed_in, fed_out));

        // A changed scalar, more data than the static input holds, and a shorter forward.
        pool.start(Phase::Feed);
        let m = message(pass(&mut pool, &d, &[1], 8));
        assert!(m.contains("differs from the captured one"), "{m}");
        pool.start(Phase::Feed);
        let m = message(pass(&mut pool, &d, &[0; 9], 7));
        assert!(m.contains("holds 8 bytes"), "{m}");
        pool.start(Phase::Feed);
        let _kept = pool.upload(&d, &[1], 8).unwrap();
        let m = message(pool.finish());
        assert!(m.contains("made 0 launches, the graph has 1"), "{m}");
    }

    #[test]
    fn a_forward_that_allocates_more_than_its_warmup_is_refused() {
        let d = HostDevice::default();
        let mut pool = GraphPool::new(0, 0);
        pool.start(Phase::Warmup);
        pool.alloc(&d, 4).unwrap();
        pool.start(Phase::Capture);
        pool.alloc(&d, 4).unwrap();
        let m = message(pool.alloc(&d, 4));
        assert!(m.contains("its warmup made 1"), "{m}");
        pool.start(Phase::Capture);
        let m = message(pool.alloc(&d, 5));
        assert!(m.contains("holds 4 bytes"), "{m}");
        pool.start(Phase::Feed);
        pool.alloc(&d, 4).unwrap();
        let launch = pool.launch(&d, &kernels::dense(), "silu_mul", CFG, &[]);
        assert!(message(launch).contains("more launches than the 0 captured"));
    }
}
