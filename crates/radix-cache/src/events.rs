//! KV events and SGLang's page hashes, for cache-aware routers (`mem_cache/events.py`,
//! `mem_cache/utils.py`).
//!
//! A page's block hash is SHA-256 chained over the previous page's digest and the page's token
//! ids as little-endian u32 (the first page has no previous digest); the event id is the first
//! 16 hex digits of the digest read as a signed 64-bit integer (the first 8 bytes big-endian).

use sha2::{Digest, Sha256};

/// A SHA-256 page digest.
pub type PageDigest = [u8; 32];

/// The digest of `page` chained after `prev` (`None` for a first page), as SGLang's
/// `get_hash_str(token_ids, prior_hash)`.
pub fn page_digest(prev: Option<&PageDigest>, page: &[u32]) -> PageDigest {
    let mut h = Sha256::new();
    if let Some(prev) = prev {
        h.update(prev);
    }
    for &t in page {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The digests of the whole pages of `tokens` (pages of `page_size`), chained after `seed`
/// (SGLang's page hash chain; storage page keys are these digests).
pub fn chain_digests(
    seed: Option<&PageDigest>,
    tokens: &[u32],
    page_size: usize,
) -> Vec<PageDigest> {
    let mut prev = seed.copied();
    tokens
        .chunks_exact(page_size.max(1))
        .map(|page| {
            let d = page_digest(prev.as_ref(), page);
            prev = Some(d);
            d
        })
        .collect()
}

/// The seed a namespace's page chain starts from: none for the default namespace (so its
/// hashes are SGLang's), `sha256(extra_key)` otherwise, so two namespaces never share a page
/// hash (events) or a storage key.
pub fn namespace_seed(extra_key: Option<&str>) -> Option<PageDigest> {
    extra_key.map(|k| Sha256::digest(k.as_bytes()).into())
}

/// SGLang's `hash_str_to_int64`: the first 16 hex digits as a signed 64-bit integer.
pub fn digest_to_block_id(d: &PageDigest) -> i64 {
    i64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

/// Lowercase hex of a digest (SGLang keeps hashes as hex strings).
pub fn digest_hex(d: &PageDigest) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A change to the set of cached pages, as SGLang publishes it to cache-aware routers
/// (`--kv-events-config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Pages entered the cache: one event per inserted run of pages.
    BlockStored {
        /// Block id of each page, in order.
        block_hashes: Vec<i64>,
        /// Block id of the page before the first one, if it is not at the root.
        parent_block_hash: Option<i64>,
        /// The run's token ids.
        token_ids: Vec<u32>,
        /// Tokens per page.
        block_size: u32,
    },
    /// Pages left the cache.
    BlockRemoved {
        /// Block ids of the removed pages.
        block_hashes: Vec<i64>,
    },
    /// The cache was reset: every page left at once.
    AllBlocksCleared,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_chain_like_sglang() {
        // hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in [1, 2, 3, 4])).hexdigest()
        let d1 = page_digest(None, &[1, 2, 3, 4]);
        let mut bytes = Vec::new();
        for t in [1u32, 2, 3, 4] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(d1, <[u8; 32]>::from(Sha256::digest(&bytes)));
        // Chained: sha256(bytes.fromhex(prior) + tokens).
        let d2 = page_digest(Some(&d1), &[5, 6, 7, 8]);
        let mut chained = d1.to_vec();
        for t in [5u32, 6, 7, 8] {
            chained.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(d2, <[u8; 32]>::from(Sha256::digest(&chained)));
        // int64 conversion: first 16 hex digits, two's complement.
        let hex = digest_hex(&d2);
        let u = u64::from_str_radix(&hex[..16], 16).unwrap();
        assert_eq!(digest_to_block_id(&d2), u as i64);
    }

    #[test]
    fn known_vector() {
        // sha256 of the empty token list (no prior) is sha256(b"").
        assert_eq!(
            digest_hex(&page_digest(None, &[])),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
