//! [`CompileCache`]: the run-time compilers' output kept on disk (NVRTC's PTX, hipRTC's code
//! objects), so a process compiles each kernel specialisation once per machine rather than
//! once per run (a model's first step compiles several specialisations, seconds each; the GPU
//! check's tests each open a device of their own).
//!
//! An entry's file name holds a SHA-256 of everything the compile depends on (the compiler's
//! version, the options, the whole compiled text with its defines) and of the
//! [`Artifact`] kind, so a changed source, define or compiler never finds an old entry.
//! Entries are written to a temporary file and renamed into place, so a reader sees a whole
//! file or none. Each file ends with a line that holds a hash of what precedes it, and a file
//! whose end line is missing or does not match (truncated, altered, foreign) or whose content is
//! not a whole artifact of its kind is a miss. The cache is best effort: a directory that cannot be created or written leaves
//! compiles uncached. Entries are never removed (a kernel source change adds new ones, as
//! Triton's cache does): deleting the directory is always safe.
//! Built without the CUDA features, so its tests always run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

/// The environment variable naming the cache directory; `off` (or empty) turns the cache off.
/// Unset: `$XDG_CACHE_HOME/kvserve/kernels`, else `$HOME/.cache/kvserve/kernels`.
pub const KERNEL_CACHE_VAR: &str = "KVSERVE_KERNEL_CACHE";

/// What a compile produced, and so how an entry is named and checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Artifact {
    /// NVRTC's PTX: text that declares its version and target (`.ptx`).
    Ptx,
    /// hipRTC's AMD code object: an ELF whose header tables lie within the file, or a clang
    /// offload bundle whose entries do (`.hsaco`).
    CodeObject,
}

impl Artifact {
    fn extension(self) -> &'static str {
        match self {
            Artifact::Ptx => "ptx",
            Artifact::CodeObject => "hsaco",
        }
    }

    /// Whether `bytes` is a whole artifact of this kind (a truncated or foreign file is not).
    pub fn is_whole(self, bytes: &[u8]) -> bool {
        match self {
            Artifact::Ptx => std::str::from_utf8(bytes).is_ok_and(|text| {
                text.contains(".version") && text.contains(".target") && !text.contains('\0')
            }),
            Artifact::CodeObject => elf64_is_whole(bytes) || offload_bundle_is_whole(bytes),
        }
    }
}

/// A little-endian unsigned integer of `N` bytes at `at`, or `None` past the end.
fn le(bytes: &[u8], at: usize, n: usize) -> Option<u64> {
    let field = bytes.get(at..at.checked_add(n)?)?;
    Some(field.iter().rev().fold(0u64, |v, &b| v << 8 | b as u64))
}

/// A 64-bit little-endian ELF whose program and section header tables end within the file
/// (the section headers come last in the code objects the LLVM linker writes, so a truncated
/// file fails).
fn elf64_is_whole(bytes: &[u8]) -> bool {
    let table_end = |off: usize, entsize: usize, num: usize| -> Option<u64> {
        let (off, entsize, num) = (
            le(bytes, off, 8)?,
            le(bytes, entsize, 2)?,
            le(bytes, num, 2)?,
        );
        off.checked_add(entsize.checked_mul(num)?)
    };
    bytes.len() >= 64
        && bytes.starts_with(b"\x7fELF\x02\x01")
        && [(0x20, 0x36, 0x38), (0x28, 0x3a, 0x3c)]
            .iter()
            .all(|&(o, e, n)| table_end(o, e, n).is_some_and(|end| end <= bytes.len() as u64))
}

/// A clang offload bundle (`__CLANG_OFFLOAD_BUNDLE__`, an entry count, then per entry its
/// offset, size, triple length and triple) whose entries all end within the file.
fn offload_bundle_is_whole(bytes: &[u8]) -> bool {
    const MAGIC: &[u8] = b"__CLANG_OFFLOAD_BUNDLE__";
    let check = || -> Option<bool> {
        let count = le(bytes, MAGIC.len(), 8)?;
        let mut at = MAGIC.len() + 8;
        for _ in 0..count {
            let (offset, size, triple) = (
                le(bytes, at, 8)?,
                le(bytes, at + 8, 8)?,
                le(bytes, at + 16, 8)?,
            );
            if offset.checked_add(size)? > bytes.len() as u64 {
                return Some(false);
            }
            at = at
                .checked_add(24)?
                .checked_add(usize::try_from(triple).ok()?)?;
        }
        Some(count > 0 && at <= bytes.len())
    };
    bytes.starts_with(MAGIC) && check() == Some(true)
}

/// The start of an entry's last line: `\n// kvserve-cache-end <32 hex digits>\n`, the first
/// 16 bytes of the SHA-256 of the bytes before it (a PTX comment, should the file be read as
/// PTX).
const END_LINE: &[u8] = b"\n// kvserve-cache-end ";
/// The end line's length.
const END_LEN: usize = END_LINE.len() + 32 + 1;

/// The first 16 bytes of the SHA-256 of `parts`, each with its length (so no two splits of one
/// text hash alike), in hex.
fn hash_hex(parts: &[&[u8]]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `content` followed by its end line.
fn with_end_line(content: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(content.len() + END_LEN);
    file.extend_from_slice(content);
    file.extend_from_slice(END_LINE);
    file.extend_from_slice(hash_hex(&[content]).as_bytes());
    file.push(b'\n');
    file
}

/// The content of a file written by [`with_end_line`], or `None` when its end line is missing
/// or does not match what precedes it.
fn without_end_line(file: &[u8]) -> Option<&[u8]> {
    let (content, end) = file.split_at(file.len().checked_sub(END_LEN)?);
    let (marker, rest) = end.split_at(END_LINE.len());
    let (hex, newline) = rest.split_at(32);
    (marker == END_LINE && newline == b"\n" && hex == hash_hex(&[content]).as_bytes())
        .then_some(content)
}

/// A directory of compiled kernels, one file per compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileCache {
    dir: PathBuf,
}

impl CompileCache {
    /// A cache in `dir` (created on the first [`put`](CompileCache::put)).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        CompileCache { dir: dir.into() }
    }

    /// The cache the environment names ([`KERNEL_CACHE_VAR`]), or `None` when it is off or no
    /// directory can be named.
    pub fn from_env() -> Option<Self> {
        let var = |name: &str| std::env::var_os(name).map(PathBuf::from);
        cache_dir(
            var(KERNEL_CACHE_VAR).as_deref(),
            var("XDG_CACHE_HOME").as_deref(),
            var("HOME").as_deref(),
        )
        .map(CompileCache::at)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The `artifact` stored for the compile of `name` (a specialisation's name, for the reader
    /// of the directory) from `key` (everything the compile depends on), or `None`.
    pub fn get(&self, artifact: Artifact, name: &str, key: &[&str]) -> Option<Vec<u8>> {
        let file = std::fs::read(self.path(artifact, name, key)).ok()?;
        let content = without_end_line(&file)?;
        artifact.is_whole(content).then(|| content.to_vec())
    }

    /// Stores `bytes`, the `artifact` of the compile of `name` from `key`. `Err` says why it
    /// could not.
    pub fn put(
        &self,
        artifact: Artifact,
        name: &str,
        key: &[&str],
        bytes: &[u8],
    ) -> Result<(), String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        if !artifact.is_whole(bytes) {
            return Err(format!("{name}: not a whole {artifact:?}"));
        }
        let fail = |e: std::io::Error| format!("kernel cache {}: {e}", self.dir.display());
        std::fs::create_dir_all(&self.dir).map_err(fail)?;
        let path = self.path(artifact, name, key);
        let tmp = self.dir.join(format!(
            ".{name}.{}.{}.tmp",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let written =
            std::fs::write(&tmp, with_end_line(bytes)).and_then(|()| std::fs::rename(&tmp, &path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map_err(fail)
    }

    /// `<dir>/<name>-<first 16 bytes of the SHA-256 of the kind and key, hex>.<extension>`.
    fn path(&self, artifact: Artifact, name: &str, key: &[&str]) -> PathBuf {
        let mut parts: Vec<&[u8]> = vec![b"kvserve-kernel-2", artifact.extension().as_bytes()];
        parts.extend(key.iter().map(|part| part.as_bytes()));
        let hex = hash_hex(&parts);
        self.dir
            .join(format!("{name}-{hex}.{}", artifact.extension()))
    }
}

/// The cache directory from the values of [`KERNEL_CACHE_VAR`], `XDG_CACHE_HOME` and `HOME`.
pub fn cache_dir(var: Option<&Path>, xdg: Option<&Path>, home: Option<&Path>) -> Option<PathBuf> {
    fn set(p: Option<&Path>) -> Option<&Path> {
        p.filter(|p| !p.as_os_str().is_empty())
    }
    match set(var) {
        Some(p) if p == Path::new("off") => None,
        Some(p) => Some(p.to_path_buf()),
        None if var.is_some() => None, // set and empty: off
        None => set(xdg)
            .map(|x| x.join("kvserve").join("kernels"))
            .or_else(|| set(home).map(|h| h.join(".cache").join("kvserve").join("kernels"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &[u8] = b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.8\n.target sm_90\n\
                         .address_size 64\n";

    /// A minimal ELF64 header (64 bytes) with one program header at 64 and two section headers
    /// at 120, as a linker lays them out: 248 bytes in all.
    fn elf() -> Vec<u8> {
        let mut b = vec![0u8; 248];
        b[..6].copy_from_slice(b"\x7fELF\x02\x01");
        b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        b[0x28..0x30].copy_from_slice(&120u64.to_le_bytes()); // e_shoff
        b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        b[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        b[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes()); // e_shnum
        b
    }

    /// A clang offload bundle of one 16-byte entry for `triple`.
    fn bundle() -> Vec<u8> {
        let triple = b"hipv4-amdgcn-amd-amdhsa--gfx90a";
        let mut b = b"__CLANG_OFFLOAD_BUNDLE__".to_vec();
        b.extend(1u64.to_le_bytes());
        let offset = (b.len() + 24 + triple.len()) as u64;
        for v in [offset, 16, triple.len() as u64] {
            b.extend(v.to_le_bytes());
        }
        b.extend(triple);
        b.extend([7u8; 16]);
        b
    }

    fn temp_dir(test: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kvserve-kernels-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn an_entry_is_found_only_by_its_own_key_and_kind() {
        let dir = temp_dir("key");
        let cache = CompileCache::at(&dir);
        let key = ["13.5", "-arch", "src"];
        assert_eq!(cache.get(Artifact::Ptx, "attention_f16", &key), None);
        cache
            .put(Artifact::Ptx, "attention_f16", &key, PTX)
            .unwrap();
        assert_eq!(
            cache.get(Artifact::Ptx, "attention_f16", &key).as_deref(),
            Some(PTX)
        );
        // Another compiler, option, source or split of the same text misses.
        for other in [
            ["13.6", "-arch", "src"],
            ["13.5", "-arch2", "src"],
            ["13.5", "-arch", "src2"],
            ["13.5", "-archs", "rc"],
        ] {
            assert_eq!(
                cache.get(Artifact::Ptx, "attention_f16", &other),
                None,
                "{other:?}"
            );
        }
        // The same key for hipRTC is another entry.
        assert_eq!(cache.get(Artifact::CodeObject, "attention_f16", &key), None);
        cache
            .put(Artifact::CodeObject, "attention_f16", &key, &elf())
            .unwrap();
        assert_eq!(
            cache.get(Artifact::CodeObject, "attention_f16", &key),
            Some(elf())
        );
        assert_eq!(
            cache.get(Artifact::Ptx, "attention_f16", &key).as_deref(),
            Some(PTX)
        );
        // Two files, no temporary left behind.
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|f| f.unwrap().path().extension().unwrap().to_owned())
            .collect();
        files.sort();
        assert_eq!(files, ["hsaco", "ptx"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_whole_artifact_is_a_miss_and_is_never_stored() {
        let dir = temp_dir("junk");
        let cache = CompileCache::at(&dir);
        for (artifact, whole) in [
            (Artifact::Ptx, PTX.to_vec()),
            (Artifact::CodeObject, elf()),
            (Artifact::CodeObject, bundle()),
        ] {
            assert!(cache.put(artifact, "k", &["a"], b"garbage").is_err());
            cache.put(artifact, "k", &["a"], &whole).unwrap();
            assert_eq!(cache.get(artifact, "k", &["a"]), Some(whole.clone()));
            // Truncated on disk (another writer's crash, a full disk) by any amount, or one
            // byte altered: a miss, not a bad module.
            let path = cache.path(artifact, "k", &["a"]);
            let stored = std::fs::read(&path).unwrap();
            for cut in [1, END_LEN, stored.len() - 8, stored.len()] {
                std::fs::write(&path, &stored[..stored.len() - cut]).unwrap();
                assert_eq!(
                    cache.get(artifact, "k", &["a"]),
                    None,
                    "{artifact:?} less {cut}"
                );
            }
            let mut altered = stored.clone();
            altered[3] ^= 1;
            std::fs::write(&path, &altered).unwrap();
            assert_eq!(
                cache.get(artifact, "k", &["a"]),
                None,
                "{artifact:?} altered"
            );
            // The content without its end line (a file another program wrote) is a miss too.
            std::fs::write(&path, &whole).unwrap();
            assert_eq!(cache.get(artifact, "k", &["a"]), None, "{artifact:?} bare");
            std::fs::write(&path, &stored).unwrap();
            assert_eq!(cache.get(artifact, "k", &["a"]), Some(whole.clone()));
        }
        // A code object short of its last byte is not whole.
        for whole in [elf(), bundle()] {
            assert!(Artifact::CodeObject.is_whole(&whole));
            assert!(!Artifact::CodeObject.is_whole(&whole[..whole.len() - 1]));
        }
        // A PTX is not a code object, and the reverse.
        assert!(!Artifact::CodeObject.is_whole(PTX));
        assert!(!Artifact::Ptx.is_whole(&elf()));
        // Header fields that overflow or point past the end are refused, not a panic.
        let mut huge = elf();
        huge[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!Artifact::CodeObject.is_whole(&huge));
        let mut many = bundle();
        many[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!Artifact::CodeObject.is_whole(&many));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unwritable_directory_is_an_error_not_a_panic() {
        let file = temp_dir("file");
        std::fs::write(&file, "a file where the directory would be").unwrap();
        let cache = CompileCache::at(file.join("kernels"));
        assert!(cache.put(Artifact::Ptx, "k", &["a"], PTX).is_err());
        assert_eq!(cache.get(Artifact::Ptx, "k", &["a"]), None);
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn the_directory_comes_from_the_variable_then_xdg_then_home() {
        let p = |s: &str| Some(PathBuf::from(s));
        let dir = |var: Option<&str>, xdg: Option<&str>, home: Option<&str>| {
            cache_dir(var.map(Path::new), xdg.map(Path::new), home.map(Path::new))
        };
        assert_eq!(dir(Some("/c"), Some("/x"), Some("/h")), p("/c"));
        assert_eq!(dir(Some("off"), Some("/x"), Some("/h")), None);
        assert_eq!(dir(Some(""), Some("/x"), Some("/h")), None);
        assert_eq!(dir(None, Some("/x"), Some("/h")), p("/x/kvserve/kernels"));
        assert_eq!(
            dir(None, Some(""), Some("/h")),
            p("/h/.cache/kvserve/kernels")
        );
        assert_eq!(dir(None, None, Some("/h")), p("/h/.cache/kvserve/kernels"));
        assert_eq!(dir(None, None, None), None);
    }
}
