//! [`HiCacheFile`]: SGLang's `file` L3 backend, one file per page (see the type's docs).

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kv_pool::PageKey;

use super::counters::Counters;
use super::hex::key_hex;
use super::{check_len, HiCacheStorage, StorageError, StorageNamespace, StorageStats};

/// SGLang's `file` L3 backend (`HiCacheFile`): one file per page, `<root>/<namespace>/<hex
/// key>.bin`, holding the page's bytes in kv-pool's canonical packed format.
///
/// A page is written to a unique temporary name in the same directory and renamed over its
/// final name, so a reader (this process, another server sharing the directory, or the next
/// start after a crash) sees either the whole page or none of it. Every read checks the file's
/// size against `page_bytes`: a file of another size (another writer's format, a short file
/// left by a power loss before the rename was flushed) is a miss and an error, never bytes
/// handed to the device.
#[derive(Debug)]
pub struct HiCacheFile {
    /// `<root>/<namespace>`: every page of this namespace, nothing else.
    dir: PathBuf,
    page_bytes: usize,
    /// Makes temporary names unique between the calls of one process.
    tmp_seq: AtomicU64,
    counters: Counters,
}

impl HiCacheFile {
    /// Opens (creating it if needed) `<root>/<namespace>` for pages of `page_bytes` bytes.
    /// Pages already there from an earlier run are found by the next lookup.
    pub fn open(
        root: &Path,
        namespace: &StorageNamespace,
        page_bytes: usize,
    ) -> Result<Self, StorageError> {
        if page_bytes == 0 {
            return Err(StorageError::InvalidConfig(
                "page_bytes must be at least 1".into(),
            ));
        }
        let dir = root.join(namespace.prefix());
        fs::create_dir_all(&dir).map_err(|e| StorageError::Backend {
            backend: "file",
            reason: format!("cannot create {}: {e}", dir.display()),
        })?;
        Ok(HiCacheFile {
            dir,
            page_bytes,
            tmp_seq: AtomicU64::new(0),
            counters: Counters::default(),
        })
    }

    /// The directory holding this namespace's pages.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn page_path(&self, key: &PageKey) -> PathBuf {
        self.dir.join(format!("{}.bin", key_hex(key)))
    }

    /// Whether the page is there with the right size: `Ok(false)` when absent, `Err` when the
    /// file cannot be inspected or has another size.
    fn page_present(&self, key: &PageKey) -> io::Result<bool> {
        match fs::metadata(self.page_path(key)) {
            Ok(meta) if meta.len() == self.page_bytes as u64 => Ok(true),
            Ok(meta) => Err(wrong_size(meta.len(), self.page_bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Reads one page into `out` (`page_bytes` long): `Ok(false)` when absent.
    fn read_page(&self, key: &PageKey, out: &mut [u8]) -> io::Result<bool> {
        let mut file = match File::open(self.page_path(key)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len();
        if len != self.page_bytes as u64 {
            return Err(wrong_size(len, self.page_bytes));
        }
        file.read_exact(out)?;
        Ok(true)
    }

    /// Writes one page through a temporary file renamed into place; an existing page of the
    /// right size is kept (pages are content-addressed, so it holds the same bytes).
    fn write_page(&self, key: &PageKey, page: &[u8]) -> io::Result<()> {
        if self.page_present(key).unwrap_or(false) {
            return Ok(());
        }
        let path = self.page_path(key);
        let tmp = self.dir.join(format!(
            "{}.bin.tmp.{}.{}",
            key_hex(key),
            std::process::id(),
            self.tmp_seq.fetch_add(1, Relaxed)
        ));
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(page))
            .and_then(|()| fs::rename(&tmp, &path));
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }

    /// Runs `page(i)` for `i = 0..n` while it finds its page; returns how many did. An error
    /// ends the run as a miss and is counted; a run without errors ends a failure streak.
    fn leading(
        &self,
        what: &str,
        n: usize,
        mut page: impl FnMut(usize) -> io::Result<bool>,
    ) -> usize {
        for i in 0..n {
            match page(i) {
                Ok(true) => {}
                Ok(false) => {
                    self.counters.success("file");
                    return i;
                }
                Err(e) => {
                    self.failure(what, &e);
                    return i;
                }
            }
        }
        self.counters.success("file");
        n
    }

    fn failure(&self, what: &str, e: &io::Error) {
        self.counters
            .failure("file", &format!("{what} in {}: {e}", self.dir.display()));
    }
}

fn wrong_size(len: u64, page_bytes: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("a page file of {len} bytes, expected {page_bytes}"),
    )
}

impl HiCacheStorage for HiCacheFile {
    fn name(&self) -> &'static str {
        "file"
    }

    fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    fn batch_exists(&self, keys: &[PageKey]) -> usize {
        let found = self.leading("lookup", keys.len(), |i| self.page_present(&keys[i]));
        self.counters.lookup(keys.len(), found);
        found
    }

    fn batch_get(&self, keys: &[PageKey], out: &mut [u8]) -> Result<usize, StorageError> {
        check_len("batch_get output", keys.len(), self.page_bytes, out.len())?;
        let pb = self.page_bytes;
        let found = self.leading("read", keys.len(), |i| {
            self.read_page(&keys[i], &mut out[i * pb..(i + 1) * pb])
        });
        self.counters.lookup(keys.len(), found);
        self.counters.get(found * self.page_bytes);
        Ok(found)
    }

    fn batch_set(&self, keys: &[PageKey], data: &[u8]) -> Result<(), StorageError> {
        check_len("batch_set input", keys.len(), self.page_bytes, data.len())?;
        for (key, page) in keys.iter().zip(data.chunks_exact(self.page_bytes)) {
            if let Err(e) = self.write_page(key, page) {
                self.failure("write", &e);
                self.counters.set(0);
                return Err(StorageError::Backend {
                    backend: "file",
                    reason: format!("writing a page under {}: {e}", self.dir.display()),
                });
            }
        }
        self.counters.success("file");
        self.counters.set(data.len());
        Ok(())
    }

    fn clear(&self) -> Result<(), StorageError> {
        let entries = fs::read_dir(&self.dir).map_err(|e| StorageError::Backend {
            backend: "file",
            reason: format!("listing {}: {e}", self.dir.display()),
        })?;
        for entry in entries {
            let removed = entry.and_then(|entry| {
                let is_file = entry.file_type()?.is_file();
                if is_file {
                    fs::remove_file(entry.path())
                } else {
                    Ok(())
                }
            });
            if let Err(e) = removed {
                if e.kind() != io::ErrorKind::NotFound {
                    self.failure("clear", &e);
                    return Err(StorageError::Backend {
                        backend: "file",
                        reason: format!("clearing {}: {e}", self.dir.display()),
                    });
                }
            }
        }
        Ok(())
    }

    fn stats(&self) -> StorageStats {
        self.counters.snapshot()
    }
}
