//! Shared memory: [`SharedMemory`] (a memfd mapping a store lives in, that peers can map by
//! path) and [`Mapping`] (a peer's memory mapped here).

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use kv_pool::HostMemory;

use crate::error::{Result, TransferError};

/// The live [`SharedMemory`] mappings of this process: `(addr, len, fd)`, so that `register`
/// can tell whether a region lies in one (and which).
static LIVE: Mutex<Vec<(usize, usize, RawFd)>> = Mutex::new(Vec::new());

/// The last OS error as a [`TransferError::Io`].
fn os_error(context: &str) -> TransferError {
    TransferError::io(context, &std::io::Error::last_os_error())
}

/// Anonymous shared memory (`memfd_create` + `mmap(MAP_SHARED)`), zeroed, that another process
/// maps through [`path`](SharedMemory::path) (`/proc/<pid>/fd/<fd>`). The memory is freed when
/// the last process unmaps it and closes its descriptor, even when this process is killed.
/// A [`HostMemory`], so a `HostKvStore` can live in it (the PD decode server's store).
#[derive(Debug)]
pub struct SharedMemory {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory owned by this value; the raw pointer is only an address.
unsafe impl Send for SharedMemory {}
// SAFETY: as above; `&SharedMemory` hands out only the address and length.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Creates `len` zeroed bytes of shared memory. A zero `len` is
    /// [`TransferError::BadRegion`]; a failed system call is [`TransferError::Io`].
    pub fn create(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(TransferError::BadRegion(
                "shared memory of 0 bytes".to_string(),
            ));
        }
        // SAFETY: a valid NUL-terminated name and flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kvserve-kv".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `fd` is a new descriptor this value now owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `fd` is a valid memfd; the result is checked.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_error(&format!(
                "ftruncate of shared memory to {len} bytes"
            )));
        }
        let ptr = map(fd.as_raw_fd(), len)?;
        LIVE.lock()
            .unwrap()
            .push((ptr as usize, len, fd.as_raw_fd()));
        Ok(SharedMemory { ptr, len, fd })
    }

    /// The path a peer process opens to map the same memory: `/proc/<pid>/fd/<fd>`.
    pub fn path(&self) -> String {
        fd_path(self.fd.as_raw_fd())
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a zero length is refused at creation).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        LIVE.lock()
            .unwrap()
            .retain(|&(addr, _, _)| addr != self.ptr as usize);
        // SAFETY: `ptr..ptr + len` is the mapping `create` made; nothing refers to it after the
        // owner drops it (`HostMemory`'s and `register`'s contracts).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// SAFETY: the mapping is valid for reads and writes, fixed, and owned by this value until it
// drops; `as_ptr` and `len` never change.
unsafe impl HostMemory for SharedMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// `/proc/<pid>/fd/<fd>` of this process.
fn fd_path(fd: RawFd) -> String {
    format!("/proc/{}/fd/{fd}", std::process::id())
}

/// Maps `len` bytes of `fd` shared, read-write.
fn map(fd: RawFd, len: usize) -> Result<*mut u8> {
    // SAFETY: a fresh mapping chosen by the kernel; the result is checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(os_error(&format!("mmap of {len} bytes of shared memory")));
    }
    Ok(ptr.cast())
}

/// The live [`SharedMemory`] that holds `addr..addr + len`: `(its base, its length)`.
pub(crate) fn containing(addr: usize, len: usize) -> Option<(usize, usize)> {
    LIVE.lock()
        .unwrap()
        .iter()
        .find(|&&(a, l, _)| addr >= a && addr + len <= a + l)
        .map(|&(a, l, _)| (a, l))
}

/// A duplicate descriptor of the live [`SharedMemory`] whose mapping starts at `base`, and its
/// path: the engine keeps it open so the path stays valid for peers as long as it lives.
pub(crate) fn dup_of(base: usize) -> Result<(OwnedFd, String)> {
    let live = LIVE.lock().unwrap();
    let &(_, _, fd) = live
        .iter()
        .find(|&&(a, _, _)| a == base)
        .ok_or_else(|| TransferError::BadRegion("the shared memory was dropped".into()))?;
    // SAFETY: `fd` is open while its `SharedMemory` is live (we hold the registry lock, which
    // its `Drop` takes first); the result is checked.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(os_error("duplicating the shared memory's descriptor"));
    }
    // SAFETY: a new descriptor we now own.
    let dup = unsafe { OwnedFd::from_raw_fd(dup) };
    let path = fd_path(dup.as_raw_fd());
    Ok((dup, path))
}

/// A peer's shared memory mapped into this process, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: plain shared memory; writers keep to the transfer contract (disjoint blocks).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Opens and maps the whole file at `path` (a peer's `/proc/<pid>/fd/<fd>`).
    pub fn open(path: &str) -> Result<Self> {
        let unreachable = |reason: String| TransferError::PeerUnreachable {
            peer: path.to_string(),
            reason,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| unreachable(format!("open: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| unreachable(format!("stat: {e}")))?
            .len() as usize;
        if len == 0 {
            return Err(TransferError::BadSegment(format!("{path} is empty")));
        }
        let ptr = map(file.as_raw_fd(), len)?;
        Ok(Mapping { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping `open` made; copies into it hold an `Arc` of this value.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
