//! The `file` L3 backend: the conformance suite, pages that survive a restart, torn and
//! foreign files, an unreachable directory, and `open_storage` with its configuration.

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

use hicache::storage::testing::{check_storage, check_unreachable, random_keys, random_pages};
use hicache::storage::{
    open_storage, HiCacheFile, HiCacheStorage, StorageConfig, StorageKind, StorageNamespace,
};
use kv_pool::{KvDtype, KvShape};

/// A fresh directory under the target's temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("kvserve-hicache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn ns(prefix: &str) -> StorageNamespace {
    StorageNamespace::from_prefix(prefix).unwrap()
}

#[test]
fn file_backend_passes_the_conformance_suite() {
    let tmp = TempDir::new("suite");
    let root = tmp.0.clone();
    check_storage("file", &mut |ns, pb| {
        Arc::new(HiCacheFile::open(&root, ns, pb).unwrap()) as Arc<dyn HiCacheStorage>
    });
}

#[test]
fn pages_are_one_file_each_under_the_namespace_and_survive_a_restart() {
    let tmp = TempDir::new("layout");
    let keys = random_keys(1, 3);
    let pages = random_pages(2, 3, 64);
    {
        let store = HiCacheFile::open(&tmp.0, &ns("m_p16"), 64).unwrap();
        store.batch_set(&keys, &pages).unwrap();
    }
    let dir = tmp.0.join("m_p16");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names.len(),
        3,
        "one file per page, no temporaries left: {names:?}"
    );
    let first = format!(
        "{}.bin",
        keys[0]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    assert!(names.contains(&first), "<hex key>.bin: {names:?}");
    assert_eq!(
        fs::read(dir.join(&first)).unwrap(),
        pages[..64],
        "the file is the page's bytes"
    );

    // A restart (a new instance) finds them.
    let store = HiCacheFile::open(&tmp.0, &ns("m_p16"), 64).unwrap();
    let mut out = vec![0u8; 3 * 64];
    assert_eq!(store.batch_get(&keys, &mut out).unwrap(), 3);
    assert_eq!(out, pages);
}

#[test]
fn a_page_file_of_the_wrong_size_is_a_miss_and_an_error() {
    let tmp = TempDir::new("torn");
    let store = HiCacheFile::open(&tmp.0, &ns("t"), 64).unwrap();
    let keys = random_keys(3, 4);
    store.batch_set(&keys, &random_pages(4, 4, 64)).unwrap();
    // Truncate page 2 (what a power loss before the rename reached the disk could leave).
    let hex: String = keys[2].iter().map(|b| format!("{b:02x}")).collect();
    fs::write(store.dir().join(format!("{hex}.bin")), [0u8; 10]).unwrap();
    let errors = store.stats().errors;
    assert_eq!(store.batch_exists(&keys), 2);
    let mut out = vec![0u8; 4 * 64];
    assert_eq!(store.batch_get(&keys, &mut out).unwrap(), 2);
    assert_eq!(
        store.stats().errors,
        errors + 2,
        "both calls counted the bad file"
    );
    // Stray temporaries of a crashed writer are not pages.
    fs::write(store.dir().join(format!("{hex}.bin.tmp.1.0")), [0u8; 64]).unwrap();
    assert_eq!(store.batch_exists(&keys[2..]), 0);
    // A rewrite repairs the page (an existing page is kept only at the right size), and clear
    // removes the temporaries too.
    store
        .batch_set(&keys[2..3], &random_pages(5, 1, 64))
        .unwrap();
    assert_eq!(store.batch_exists(&keys), 4);
    store.clear().unwrap();
    assert_eq!(fs::read_dir(store.dir()).unwrap().count(), 0);
}

#[test]
fn a_vanished_directory_is_a_miss_never_a_panic() {
    let tmp = TempDir::new("gone");
    let store = HiCacheFile::open(&tmp.0, &ns("g"), 32).unwrap();
    // The directory is replaced by a file: creating pages there fails.
    fs::remove_dir_all(store.dir()).unwrap();
    fs::write(store.dir(), b"not a directory").unwrap();
    check_unreachable(&store);
}

#[test]
fn open_storage_builds_the_file_backend_from_the_extra_config() {
    let tmp = TempDir::new("open");
    let shape = KvShape::mha(2, 8, 8, 2, KvDtype::F32).unwrap();
    let namespace = StorageNamespace::new("org/model", &shape, 4);
    let page_bytes = shape.slot_bytes() * 4;
    let json = format!(r#"{{"file_path": {:?}, "prefetch_threshold": 128}}"#, tmp.0);
    let cfg = StorageConfig::from_json(&json).unwrap();
    assert_eq!(cfg.prefetch_threshold, 128);
    let store = open_storage(StorageKind::File, &cfg, &namespace, page_bytes).unwrap();
    assert_eq!(store.name(), "file");
    assert_eq!(store.page_bytes(), page_bytes);
    store
        .batch_set(&random_keys(9, 1), &random_pages(9, 1, page_bytes))
        .unwrap();
    assert!(tmp.0.join("org-model_mha2x8x8_2l_float32_p4").is_dir());

    // `directory` is the same setting; Redis keys do not configure a file backend.
    let cfg = StorageConfig::from_json(&format!(r#"{{"directory": {:?}}}"#, tmp.0)).unwrap();
    assert!(open_storage(StorageKind::File, &cfg, &namespace, page_bytes).is_ok());
    let cfg = StorageConfig::from_json(r#"{"url": "redis://127.0.0.1:1"}"#).unwrap();
    let Err(err) = open_storage(StorageKind::File, &cfg, &namespace, page_bytes) else {
        panic!("a Redis URL configured the file backend");
    };
    assert!(err.to_string().contains("redis backend"), "{err}");
    // page_bytes 0 is refused.
    let cfg = StorageConfig::from_json(&json).unwrap();
    assert!(open_storage(StorageKind::File, &cfg, &namespace, 0).is_err());
}
