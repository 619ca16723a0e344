//! The sending side of one tcp stream: a writer task that frames jobs straight from registered
//! memory, and an ack reader task that settles batches.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crc32fast::Hasher;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::wire::{self, Ack, Header};
use super::Inner;
use crate::batch::BatchState;
use crate::error::{Result, TransferError};

/// Payloads up to this size are copied into the stream's staging buffer with their header and
/// trailer (one write for many small frames); larger ones go straight from registered memory,
/// in one vectored write with the staged bytes before them.
const SMALL_FRAME: u64 = 16 << 10;
/// The staging buffer is written out once it holds this much.
const FLUSH_AT: usize = 256 << 10;
/// Bytes handed to one `write` from registered memory (and hashed while in cache).
const CHUNK: usize = 512 << 10;
/// Largest payload [`write_gathered`] writes together with others.
const GATHER_MAX: u64 = 256 << 10;
/// Most frames one [`write_gathered`] call writes (an iovec of `2n + 1` pieces).
const GATHER_FRAMES: usize = 16;
/// How long a connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One frame to send: `len` bytes at address `src` to `dst_region` at `dst_offset`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Frame {
    pub src: usize,
    pub len: u64,
    pub dst_region: u32,
    pub dst_offset: u64,
}

/// A batch's frames on one stream.
#[derive(Debug)]
pub(crate) struct Job {
    pub batch: u64,
    pub state: Arc<BatchState>,
    pub frames: Vec<Frame>,
}

/// Batches with frames outstanding on a stream, and whether it died.
#[derive(Debug, Default)]
struct Pending {
    dead: Option<TransferError>,
    /// Wire batch id → (state, frames not yet acked on this stream).
    batches: HashMap<u64, (Arc<BatchState>, u64)>,
}

/// One connection to a peer's listener.
#[derive(Debug)]
pub(crate) struct Stream {
    peer: String,
    jobs: mpsc::UnboundedSender<Job>,
    pending: Mutex<Pending>,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Stream {
    /// Connects to `peer` and starts the stream's writer and ack reader.
    pub async fn connect(inner: &Arc<Inner>, peer: &str) -> Result<Arc<Stream>> {
        let unreachable = |reason: String| TransferError::PeerUnreachable {
            peer: peer.to_string(),
            reason,
        };
        let sock = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(peer)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(unreachable(format!("connect: {e}"))),
            Err(_) => return Err(unreachable("connect timed out".into())),
        };
        sock.set_nodelay(true)
            .map_err(|e| unreachable(format!("set_nodelay: {e}")))?;
        let (rd, wr) = sock.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = Arc::new(Stream {
            peer: peer.to_string(),
            jobs: tx,
            pending: Mutex::new(Pending::default()),
            tasks: Mutex::new(Vec::new()),
        });
        let w = inner.spawn(write_loop(inner.clone(), stream.clone(), wr, rx));
        let r = inner.spawn(ack_loop(stream.clone(), rd));
        stream.tasks.lock().unwrap().extend([w, r]);
        Ok(stream)
    }

    /// [`TransferError::PeerUnreachable`] naming this stream's peer.
    pub fn unreachable(&self, reason: impl Into<String>) -> TransferError {
        TransferError::PeerUnreachable {
            peer: self.peer.clone(),
            reason: reason.into(),
        }
    }

    /// Queues a batch's frames; on a dead stream the batch fails at once.
    pub fn enqueue(&self, job: Job) {
        let mut p = self.pending.lock().unwrap();
        if let Some(e) = &p.dead {
            job.state.fail(e.clone());
            return;
        }
        p.batches
            .insert(job.batch, (job.state.clone(), job.frames.len() as u64));
        if self.jobs.send(job).is_err() {
            drop(p);
            self.kill(self.unreachable("the stream's writer stopped"));
        }
    }

    /// Marks the stream dead with `e`, fails every batch with frames outstanding on it and
    /// stops its tasks (the connection closes).
    pub fn kill(&self, e: TransferError) {
        let batches: Vec<_> = {
            let mut p = self.pending.lock().unwrap();
            p.dead.get_or_insert(e.clone());
            p.batches.drain().collect()
        };
        for (_, (state, _)) in batches {
            state.fail(e.clone());
        }
        for t in self.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }

    /// Settles one ack; `Err` (the stream must die) when it covers more frames than the batch
    /// has outstanding on this stream.
    fn on_ack(&self, ack: Ack) -> std::result::Result<(), String> {
        let mut p = self.pending.lock().unwrap();
        let Some((state, left)) = p.batches.get_mut(&ack.batch) else {
            return Ok(()); // a batch that already failed
        };
        let state = state.clone();
        match ack.code {
            wire::ACK_OK => {
                let n = u64::from(ack.frames);
                if n == 0 || n > *left {
                    return Err(format!(
                        "an ack for {n} frames of batch {} with {left} outstanding",
                        ack.batch
                    ));
                }
                *left -= n;
                if *left == 0 {
                    p.batches.remove(&ack.batch);
                }
                drop(p);
                state.complete(n);
            }
            code => {
                p.batches.remove(&ack.batch);
                drop(p);
                state.fail(if code == wire::ACK_CORRUPTED {
                    TransferError::Corrupted {
                        region: ack.dst_region,
                        offset: ack.dst_offset,
                    }
                } else {
                    TransferError::BadSegment(format!(
                        "the receiver refused destination region {} offset {}: outside its \
                         registered memory (a stale segment descriptor?)",
                        ack.dst_region, ack.dst_offset
                    ))
                });
            }
        }
        Ok(())
    }
}

/// Writes jobs until the stream is killed; an I/O error kills it.
async fn write_loop(
    inner: Arc<Inner>,
    stream: Arc<Stream>,
    mut wr: OwnedWriteHalf,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    let mut out: Vec<u8> = Vec::with_capacity(FLUSH_AT + SMALL_FRAME as usize + 64);
    while let Some(job) = jobs.recv().await {
        if let Err(e) = write_job(&inner, &mut wr, &mut out, &job).await {
            stream.kill(stream.unreachable(format!("write: {e}")));
            return;
        }
    }
}

/// Writes one job's frames (skipped when its batch already failed).
async fn write_job(
    inner: &Inner,
    wr: &mut OwnedWriteHalf,
    out: &mut Vec<u8>,
    job: &Job,
) -> io::Result<()> {
    let mut skip_to = 0;
    for (i, f) in job.frames.iter().enumerate() {
        if i < skip_to {
            continue; // written by `write_gathered`
        }
        if job.state.is_settled() {
            break;
        }
        if inner.cfg.corrupt_frame.is_none() && gatherable(f) {
            let run = job.frames[i..]
                .iter()
                .take(GATHER_FRAMES)
                .take_while(|f| gatherable(f))
                .count();
            let end = i + run;
            write_gathered(inner, wr, out, job, i..end).await?;
            skip_to = end;
            continue;
        }
        let last = i + 1 == job.frames.len();
        let header = Header {
            dst_region: f.dst_region,
            batch: job.batch,
            dst_offset: f.dst_offset,
            len: f.len as u32, // at most FRAME_MAX
            flags: if last { wire::FLAG_ACK_NOW } else { 0 },
        };
        out.extend_from_slice(&header.encode());
        let n = inner.frames_sent.fetch_add(1, Ordering::Relaxed);
        let corrupt = inner.cfg.corrupt_frame == Some(n);
        let mut hasher = Hasher::new();
        if f.len <= SMALL_FRAME || corrupt {
            let at = out.len();
            with_registered(inner, f.src, f.len as usize, |s| {
                out.extend_from_slice(s);
                hasher.update(s);
            })?;
            if corrupt && f.len > 0 {
                out[at] ^= 0xff; // after the checksum: the receiver must notice
            }
        } else {
            write_registered(inner, wr, out, f.src, f.len as usize, &mut hasher).await?;
        }
        out.extend_from_slice(&hasher.finalize().to_le_bytes());
        if out.len() >= FLUSH_AT {
            wr.write_all(out).await?;
            out.clear();
        }
    }
    if !out.is_empty() {
        wr.write_all(out).await?;
        out.clear();
    }
    Ok(())
}

/// Frames that [`write_gathered`] writes together: too large to stage, small enough that hashing
/// them first leaves them in cache for the kernel's copy.
fn gatherable(f: &Frame) -> bool {
    f.len > SMALL_FRAME && f.len <= GATHER_MAX
}

/// Writes frames `range` of `job` (all [`gatherable`]) with one vectored write for all of them
/// (fewer system calls than one per frame): each payload is hashed first, so every trailer is
/// known before the headers, payloads and trailers go out together. Empties `out` (its bytes go
/// first).
async fn write_gathered(
    inner: &Inner,
    wr: &mut OwnedWriteHalf,
    out: &mut Vec<u8>,
    job: &Job,
    range: std::ops::Range<usize>,
) -> io::Result<()> {
    let frames = &job.frames[range.clone()];
    // seps[k]: the bytes before payload k (the staged bytes or trailer k-1, then header k);
    // seps[n]: the last trailer.
    let mut seps: Vec<Vec<u8>> = Vec::with_capacity(frames.len() + 1);
    let mut sep = std::mem::take(out);
    for (k, f) in frames.iter().enumerate() {
        let header = Header {
            dst_region: f.dst_region,
            batch: job.batch,
            dst_offset: f.dst_offset,
            len: f.len as u32, // at most GATHER_MAX
            flags: if range.start + k + 1 == job.frames.len() {
                wire::FLAG_ACK_NOW
            } else {
                0
            },
        };
        sep.extend_from_slice(&header.encode());
        seps.push(std::mem::take(&mut sep));
        inner.frames_sent.fetch_add(1, Ordering::Relaxed);
        let mut hasher = Hasher::new();
        with_registered(inner, f.src, f.len as usize, |s| hasher.update(s))?;
        sep.extend_from_slice(&hasher.finalize().to_le_bytes());
    }
    seps.push(sep);
    let total = seps.iter().map(Vec::len).sum::<usize>()
        + frames.iter().map(|f| f.len as usize).sum::<usize>();
    let mut done = 0;
    while done < total {
        wr.writable().await?;
        let guard = inner.regions.read().unwrap();
        if guard.closed {
            return Err(io::Error::other("the engine was dropped"));
        }
        let mut bufs = Vec::with_capacity(2 * frames.len() + 1);
        let mut skip = done;
        for (k, sep) in seps.iter().enumerate() {
            // SAFETY: as in `with_registered` (checked at submit; the engine lives: checked
            // above under the lock that `Drop` takes, held until the write returns).
            let payload = frames
                .get(k)
                .map(|f| unsafe { std::slice::from_raw_parts(f.src as *const u8, f.len as usize) });
            for piece in std::iter::once(&sep[..]).chain(payload) {
                if skip >= piece.len() {
                    skip -= piece.len();
                } else {
                    bufs.push(io::IoSlice::new(&piece[skip..]));
                    skip = 0;
                }
            }
        }
        let res = wr.try_write_vectored(&bufs);
        drop(bufs);
        drop(guard);
        match res {
            Ok(k) => done += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    *out = seps.swap_remove(0);
    out.clear();
    Ok(())
}

/// Calls `f` with `len` bytes of registered memory at `addr`, under the region lock; an error
/// once the engine has dropped.
fn with_registered(
    inner: &Inner,
    addr: usize,
    len: usize,
    f: impl FnOnce(&[u8]),
) -> io::Result<()> {
    let guard = inner.regions.read().unwrap();
    if guard.closed {
        return Err(io::Error::other("the engine was dropped"));
    }
    // SAFETY: `addr..addr + len` was checked against a registered region at submit, and
    // `register`'s contract keeps registered memory valid and untouched by its owner while the
    // batch is in flight and the engine lives (checked above, under the lock that `Drop` takes).
    f(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    Ok(())
}

/// Writes the staged bytes `out` and then `len` bytes of registered memory at `addr` straight
/// to the socket (vectored: one system call for both), hashing each piece of the payload right
/// after the kernel took it. Empties `out`.
async fn write_registered(
    inner: &Inner,
    wr: &mut OwnedWriteHalf,
    out: &mut Vec<u8>,
    addr: usize,
    len: usize,
    hasher: &mut Hasher,
) -> io::Result<()> {
    let (mut staged, mut pos) = (0, 0);
    while staged < out.len() || pos < len {
        wr.writable().await?;
        let n = (len - pos).min(CHUNK);
        let mut res = Ok(0);
        with_registered(inner, addr + pos, n, |s| {
            let bufs = [io::IoSlice::new(&out[staged..]), io::IoSlice::new(s)];
            res = wr.try_write_vectored(&bufs);
            if let Ok(k) = res {
                let from_payload = k.saturating_sub(out.len() - staged);
                hasher.update(&s[..from_payload]);
            }
        })?;
        match res {
            Ok(k) => {
                let from_staged = k.min(out.len() - staged);
                staged += from_staged;
                pos += k - from_staged;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    out.clear();
    Ok(())
}

/// Reads acks until the connection closes; then (or on a bad ack) kills the stream. Buffered:
/// acks that arrived together cost one system call.
async fn ack_loop(stream: Arc<Stream>, rd: OwnedReadHalf) {
    let mut rd = BufReader::with_capacity(64 * wire::ACK_LEN, rd);
    let mut buf = [0u8; wire::ACK_LEN];
    let why = loop {
        match rd.read_exact(&mut buf).await {
            Ok(_) => {
                if let Err(why) = stream.on_ack(Ack::decode(&buf)) {
                    break why;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                break "the peer closed the connection".to_string()
            }
            Err(e) => break format!("read: {e}"),
        }
    };
    stream.kill(stream.unreachable(why));
}
