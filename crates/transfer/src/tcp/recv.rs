//! The receiving side: the listener and one task per connection that lands frames in the
//! registered destination and acks each.

use std::io;
use std::sync::Arc;

use crc32fast::Hasher;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::wire::{self, Ack, Header};
use super::Inner;
use crate::region::in_bounds;

/// Bytes read per call into the staging buffer (headers, trailers, small payloads).
const BUF: usize = 256 << 10;
/// Payload bytes still to come above which reads go straight into the destination.
const DIRECT_MIN: usize = 64 << 10;
/// Bytes read straight into the destination per call (and hashed while in cache).
const CHUNK: usize = 512 << 10;

/// Accepts connections until the engine drops (it aborts this task).
pub(crate) async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    while let Ok((sock, _)) = listener.accept().await {
        let _ = sock.set_nodelay(true);
        inner.spawn(serve(inner.clone(), sock));
    }
}

/// Lands one connection's frames until it closes or sends something this side refuses.
async fn serve(inner: Arc<Inner>, sock: TcpStream) {
    let (rd, wr) = sock.into_split();
    let (acks, rx) = mpsc::unbounded_channel();
    let writer = tokio::spawn(write_acks(wr, rx));
    let mut reader = Reader {
        rd,
        buf: vec![0u8; BUF].into_boxed_slice(),
        start: 0,
        end: 0,
    };
    // Any error ends the connection: the sender fails what it has outstanding.
    let _ = read_frames(&inner, &mut reader, &acks).await;
    drop(acks);
    let _ = writer.await;
}

/// Writes acks as they come, many per write when they queue up.
async fn write_acks(mut wr: OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Ack>) {
    let mut out = Vec::new();
    while let Some(a) = rx.recv().await {
        out.extend_from_slice(&a.encode());
        while let Ok(a) = rx.try_recv() {
            out.extend_from_slice(&a.encode());
        }
        if wr.write_all(&out).await.is_err() {
            return;
        }
        out.clear();
    }
}

async fn read_frames(
    inner: &Inner,
    reader: &mut Reader,
    acks: &mpsc::UnboundedSender<Ack>,
) -> io::Result<()> {
    let send = |a: Ack| {
        acks.send(a)
            .map_err(|_| io::Error::other("the ack writer stopped"))
    };
    // Frames of one batch that landed intact and are not acked yet (see `wire`).
    let mut pending: Option<Ack> = None;
    // After a large frame, read headers and trailers exactly, so that the next large payload
    // is read straight into its destination instead of through the buffer.
    let mut greedy = false;
    loop {
        if !reader.fill_to(wire::HEADER_LEN, true, greedy).await? {
            if let Some(a) = pending.take() {
                let _ = send(a);
            }
            return Ok(()); // closed between frames
        }
        let Some(h) = Header::decode(reader.take(wire::HEADER_LEN)) else {
            return Err(io::Error::other("bad frame magic"));
        };
        if let Some(a) = pending.take_if(|a| a.batch != h.batch) {
            send(a)?;
        }
        let ack = Ack {
            batch: h.batch,
            code: wire::ACK_OK,
            dst_region: h.dst_region,
            dst_offset: h.dst_offset,
            frames: 1,
        };
        let len = h.len as usize;
        // Our own registration decides where bytes may land, never the header.
        let dst = {
            let table = inner.regions.read().unwrap();
            table
                .get(h.dst_region)
                .filter(|r| {
                    in_bounds(
                        "destination",
                        h.dst_region,
                        h.dst_offset,
                        h.len.into(),
                        r.len,
                    )
                    .is_ok()
                })
                .map(|r| r.addr + h.dst_offset as usize)
        };
        let Some(dst) = dst else {
            if let Some(a) = pending.take() {
                send(a)?;
            }
            send(Ack {
                code: wire::ACK_REFUSED,
                ..ack
            })?;
            return Err(io::Error::other("frame outside the registered memory"));
        };
        let mut hasher = Hasher::new();
        greedy = len < DIRECT_MIN;
        reader
            .read_into(inner, dst, len, !greedy, &mut hasher)
            .await?;
        reader.fill_to(wire::TRAILER_LEN, false, greedy).await?;
        let sum = u32::from_le_bytes(reader.take(wire::TRAILER_LEN).try_into().unwrap());
        if sum != hasher.finalize() {
            if let Some(a) = pending.take() {
                send(a)?;
            }
            send(Ack {
                code: wire::ACK_CORRUPTED,
                ..ack
            })?;
            continue;
        }
        let p = pending.get_or_insert(Ack { frames: 0, ..ack });
        p.frames += 1;
        if h.flags & wire::FLAG_ACK_NOW != 0 || p.frames == u32::MAX {
            send(pending.take().expect("just set"))?;
        }
    }
}

/// A connection's read half with a staging buffer: `buf[start..end]` is read but not consumed.
struct Reader {
    rd: OwnedReadHalf,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Reader {
    fn available(&self) -> usize {
        self.end - self.start
    }

    /// Consumes `n` buffered bytes (`n <= available()`).
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.buf[self.start..self.start + n];
        self.start += n;
        s
    }

    /// Reads until `n` bytes are buffered. `greedy`: read as much as the buffer takes; else
    /// at most `n` bytes and one frame header beyond. `Ok(false)`: the peer closed with nothing
    /// buffered and `eof_ok`; a close anywhere else is `UnexpectedEof`.
    async fn fill_to(&mut self, n: usize, eof_ok: bool, greedy: bool) -> io::Result<bool> {
        if self.buf.len() - self.start < n {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let limit = if greedy {
            self.buf.len()
        } else {
            (self.start + n + wire::HEADER_LEN).min(self.buf.len())
        };
        while self.available() < n {
            self.rd.readable().await?;
            match self.rd.try_read(&mut self.buf[self.end..limit]) {
                Ok(0) if eof_ok && self.available() == 0 => return Ok(false),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => self.end += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Lands `len` payload bytes at `dst` (registered memory, bounds already checked), hashing
    /// them as they land: buffered bytes first, then the rest straight from the socket
    /// (`direct`: a large frame) or through the buffer. A direct read that can finish the
    /// payload also takes the trailer and the next header into the buffer (one vectored
    /// system call instead of two).
    async fn read_into(
        &mut self,
        inner: &Inner,
        dst: usize,
        len: usize,
        direct: bool,
        hasher: &mut Hasher,
    ) -> io::Result<()> {
        let mut pos = 0;
        while pos < len {
            if self.available() > 0 {
                let n = self.available().min(len - pos);
                let (start, buf) = (self.start, &self.buf);
                with_destination(inner, dst + pos, n, |d| {
                    d.copy_from_slice(&buf[start..start + n]);
                    hasher.update(d);
                    Ok(())
                })?;
                self.start += n;
                pos += n;
            } else if direct {
                self.rd.readable().await?;
                let n = (len - pos).min(CHUNK);
                let extra = if n == len - pos {
                    wire::TRAILER_LEN + wire::HEADER_LEN
                } else {
                    0
                };
                (self.start, self.end) = (0, 0);
                let (rd, buf) = (&self.rd, &mut self.buf[..extra]);
                let got = with_destination(inner, dst + pos, n, |d| {
                    let mut bufs = [io::IoSliceMut::new(d), io::IoSliceMut::new(buf)];
                    match rd.try_read_vectored(&mut bufs) {
                        Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
                        Ok(k) => {
                            let got = k.min(n);
                            hasher.update(&d[..got]);
                            Ok(k)
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                        Err(e) => Err(e),
                    }
                })?;
                pos += got.min(n);
                self.end = got.saturating_sub(n);
            } else {
                self.start = 0;
                self.end = 0;
                self.fill_to(1, false, true).await?;
            }
        }
        Ok(())
    }
}

/// Calls `f` with `len` bytes of registered destination memory at `addr`, under the region
/// lock; an error once the engine has dropped.
fn with_destination<T>(
    inner: &Inner,
    addr: usize,
    len: usize,
    f: impl FnOnce(&mut [u8]) -> io::Result<T>,
) -> io::Result<T> {
    let guard = inner.regions.read().unwrap();
    if guard.closed {
        return Err(io::Error::other("the engine was dropped"));
    }
    // SAFETY: `addr..addr + len` lies inside a region this engine registered (checked against
    // the registration when the frame's header arrived; regions are never unregistered), and
    // `register`'s contract keeps it valid and untouched by its owner while a batch writes it and
    // the engine lives (checked above, under the lock that `Drop` takes). No other reference to
    // these bytes exists in this process while the closure runs.
    let d = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
    f(d)
}
