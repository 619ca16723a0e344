//! `--hicache-storage-backend-extra-config` parsing, the backend names, and the storage suite
//! on the in-memory store and on it switched down (the failing mock).

use std::sync::Arc;
use std::time::Duration;

use hicache::storage::testing::{check_storage, check_unreachable, MemoryStorage};
use hicache::storage::{HiCacheStorage, StorageConfig, StorageError, StorageKind};

#[test]
fn empty_config_is_sglangs_defaults() {
    for text in ["", "  ", "{}"] {
        let cfg = StorageConfig::from_json(text).unwrap();
        assert_eq!(cfg, StorageConfig::default());
    }
    let cfg = StorageConfig::default();
    assert_eq!(cfg.prefetch_threshold, 256);
    assert_eq!(cfg.prefetch_timeout_base_s, 2.0);
    assert_eq!(cfg.prefetch_timeout_per_ki_token_s, 0.1);
    assert_eq!(cfg.prefetch_timeout_max_s, 30.0);
    assert_eq!(cfg.file_path, None);
    assert_eq!(cfg.url, None);
    assert!(cfg.cluster_urls.is_empty());
}

#[test]
fn sglangs_keys_and_ours_are_read() {
    let cfg = StorageConfig::from_json(
        r#"{"prefetch_threshold": 512, "prefetch_timeout_base": 1, "prefetch_timeout_per_ki_token": 0.25,
            "prefetch_timeout_max": 10.5, "hicache_storage_pass_prefix_keys": true, "tp_lcm_size": 4,
            "urls": ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"],
            "connect_timeout_ms": 250, "io_timeout_ms": 750}"#,
    )
    .unwrap();
    assert_eq!(cfg.prefetch_threshold, 512);
    assert_eq!(cfg.prefetch_timeout_base_s, 1.0);
    assert_eq!(cfg.prefetch_timeout_per_ki_token_s, 0.25);
    assert_eq!(cfg.prefetch_timeout_max_s, 10.5);
    assert!(cfg.pass_prefix_keys);
    assert_eq!(cfg.tp_lcm_size, Some(4));
    assert_eq!(cfg.cluster_urls.len(), 2);
    assert_eq!(cfg.connect_timeout, Duration::from_millis(250));
    assert_eq!(cfg.io_timeout, Duration::from_millis(750));
    let cfg = StorageConfig::from_json(r#"{"redis_url": "redis://h:1/2"}"#).unwrap();
    assert_eq!(cfg.url.as_deref(), Some("redis://h:1/2"));
    let cfg = StorageConfig::from_json(r#"{"file_path": "/data/kv"}"#).unwrap();
    assert_eq!(
        cfg.file_path.as_deref(),
        Some(std::path::Path::new("/data/kv"))
    );
}

#[test]
fn unknown_keys_are_refused_naming_the_key() {
    let err = StorageConfig::from_json(r#"{"prefetch_treshold": 1}"#).unwrap_err();
    assert!(
        matches!(&err, StorageError::UnknownConfigKey { key } if key == "prefetch_treshold"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("`prefetch_treshold`") && msg.contains("prefetch_threshold"),
        "{msg}"
    );
}

#[test]
fn bad_values_are_typed_errors_naming_the_key() {
    for (json, key) in [
        (r#"{"prefetch_threshold": 1.5}"#, "prefetch_threshold"),
        (r#"{"prefetch_threshold": -1}"#, "prefetch_threshold"),
        (r#"{"prefetch_timeout_base": "2"}"#, "prefetch_timeout_base"),
        (r#"{"prefetch_timeout_max": -3}"#, "prefetch_timeout_max"),
        (
            r#"{"hicache_storage_pass_prefix_keys": 1}"#,
            "hicache_storage_pass_prefix_keys",
        ),
        (r#"{"file_path": 3}"#, "file_path"),
        (r#"{"file_path": ""}"#, "file_path"),
        (r#"{"urls": "redis://h:1"}"#, "urls"),
        (r#"{"urls": []}"#, "urls"),
        (r#"{"urls": [1]}"#, "urls"),
        (r#"{"url": "redis://a:1", "urls": ["redis://b:1"]}"#, "urls"),
        (
            r#"{"url": "redis://a:1", "redis_url": "redis://b:1"}"#,
            "redis_url",
        ),
        (r#"{"file_path": "/a", "directory": "/b"}"#, "directory"),
        (r#"{"io_timeout_ms": 0}"#, "io_timeout_ms"),
    ] {
        let err = StorageConfig::from_json(json).unwrap_err();
        assert!(
            matches!(err, StorageError::InvalidConfig(_)),
            "{json}: {err:?}"
        );
        assert!(err.to_string().contains(key), "{json}: {err}");
    }
    for json in ["[1]", "3", "{", "\"x\""] {
        assert!(
            matches!(
                StorageConfig::from_json(json),
                Err(StorageError::InvalidConfig(_))
            ),
            "{json}"
        );
    }
}

#[test]
fn at_file_reads_json_and_refuses_other_formats() {
    let path = std::env::temp_dir().join(format!("kvserve-extra-{}.json", std::process::id()));
    std::fs::write(&path, r#"{"prefetch_threshold": 64}"#).unwrap();
    let cfg = StorageConfig::from_arg(&format!("@{}", path.display())).unwrap();
    assert_eq!(cfg.prefetch_threshold, 64);
    std::fs::remove_file(&path).unwrap();
    assert!(
        StorageConfig::from_arg(&format!("@{}", path.display())).is_err(),
        "missing file"
    );
    assert!(
        StorageConfig::from_arg("@/etc/x.toml").is_err(),
        "TOML is not read"
    );
    assert_eq!(
        StorageConfig::from_arg("{}").unwrap(),
        StorageConfig::default()
    );
}

#[test]
fn backend_names_round_trip() {
    for kind in [StorageKind::File, StorageKind::Redis] {
        assert_eq!(kind.to_string().parse::<StorageKind>().unwrap(), kind);
    }
    assert!("mooncake".parse::<StorageKind>().is_err());
}

#[test]
fn memory_store_passes_the_suite_and_switched_down_is_a_miss() {
    let world = MemoryStorage::new(1);
    check_storage("memory", &mut |ns, pb| {
        Arc::new(world.with_namespace(ns, pb)) as Arc<dyn HiCacheStorage>
    });
    let store = world.with_namespace(
        &hicache::storage::StorageNamespace::from_prefix("x").unwrap(),
        16,
    );
    world.set_down(true);
    check_unreachable(&store);
    world.set_down(false);
    store.batch_set(&[[1; 32]], &[7; 16]).unwrap();
    assert_eq!(store.batch_exists(&[[1; 32]]), 1);
}

#[test]
fn snapshot_config_error_messages() {
    let mut text = String::new();
    for json in [
        r#"{"prefetch_treshold": 1}"#,
        r#"{"max_size": "200G"}"#,
        r#"{"prefetch_threshold": 1.5}"#,
        r#"{"prefetch_timeout_max": -3}"#,
        r#"{"hicache_storage_pass_prefix_keys": "yes"}"#,
        r#"{"urls": "redis://h:1"}"#,
        r#"{"url": "redis://a:1", "urls": ["redis://b:1"]}"#,
        r#"{"file_path": "/a", "directory": "/b"}"#,
        r#"{"io_timeout_ms": 0}"#,
        r#"[1, 2]"#,
        r#"{"url": "#,
    ] {
        let err = StorageConfig::from_json(json).unwrap_err();
        text.push_str(&format!("{json}\n  => {err}\n"));
    }
    let ns = hicache::storage::StorageNamespace::from_prefix("n").unwrap();
    for (kind, json) in [
        (StorageKind::File, r#"{"url": "redis://a:1"}"#),
        (StorageKind::Redis, "{}"),
        (
            StorageKind::Redis,
            r#"{"url": "redis://a:1", "file_path": "/a"}"#,
        ),
        (StorageKind::Redis, r#"{"url": "http://a:1"}"#),
    ] {
        let cfg = StorageConfig::from_json(json).unwrap();
        let Err(err) = hicache::storage::open_storage(kind, &cfg, &ns, 8) else {
            panic!("{kind} {json} opened");
        };
        text.push_str(&format!("open_storage({kind}, {json})\n  => {err}\n"));
    }
    insta::assert_snapshot!(text);
}
