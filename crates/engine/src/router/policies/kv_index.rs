//! The `kv_events` policy's index of which worker holds which pages ([`KvIndex`]), rebuilt
//! from the workers' KV events.
//!
//! A page is named by its block id (SGLang's chained SHA-256 of the page and every token
//! before it, as an `i64`), so a block id stands for its whole prefix. Per worker the index
//! keeps a map block id → page (its parent's block id, and how many of its children the
//! worker holds): the tree of the worker's pages kept by its edges, as Dynamo's `RadixTree`
//! of block hashes keeps it. Each operation costs its own pages, never the depth of their
//! chain (a Mooncake prompt is thousands of pages):
//! - `BlockStored` finds its parent with one lookup and adds its pages under it;
//! - `BlockRemoved` takes its pages away, `AllBlocksCleared` drops the worker's map;
//! - the longest cached prefix of a request on a worker is the longest run of the request's
//!   leading chained block ids the worker holds, each under the one before it: one lookup per
//!   matched page.
//!
//! Reachability. A worker evicts leaves first (a page's ancestors outlive it), so every held
//! page hangs from the root by held pages. A removal that is not leaf-first (an inner page
//! whose children the worker still holds) leaves those children cut off: they still count as
//! held ([`KvIndex::held_pages`]), are never matched (a match walks from the root), and are
//! remembered per missing parent, so that storing that page again hangs them back. Only while
//! a worker has cut-off pages does a `BlockStored` walk up its parent's chain to check that it
//! is reachable.
//!
//! A `BlockStored` whose parent the index does not hold, or holds cut off (the router
//! subscribed late, missed a batch, or the worker removed an inner page), cannot be placed;
//! its pages are counted in [`KvIndex::unplaced`] and left out (routing then underestimates
//! that worker's cache, never overestimates it).

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use radix_cache::events::{digest_to_block_id, page_digest};
use radix_cache::KvEvent;
use rustc_hash::FxHashMap;

use super::WorkerId;

/// What can go wrong while indexing events.
#[derive(Debug, thiserror::Error)]
pub enum KvIndexError {
    /// A worker reports pages of another size than the first one did.
    #[error("worker {worker:?} reports pages of {got} tokens; the index has {want}")]
    BlockSize {
        /// The worker.
        worker: WorkerId,
        /// The size it reported.
        got: u32,
        /// The size the index keys on.
        want: u32,
    },
}

/// A page a worker holds: its parent page (`None` at the root) and how many of its children
/// the worker holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Page {
    parent: Option<i64>,
    children: u32,
}

/// The pages one worker holds.
#[derive(Debug, Default)]
struct Pages {
    pages: FxHashMap<i64, Page>,
    /// Per page the worker does not hold, how many held pages name it as their parent (cut
    /// off by a removal that was not leaf-first); empty while every held page is reachable.
    cut: FxHashMap<i64, u32>,
}

impl Pages {
    /// Whether `page` is held and hangs from the root by held pages.
    fn reachable(&self, page: i64) -> bool {
        if self.cut.is_empty() {
            return self.pages.contains_key(&page);
        }
        let mut at = page;
        // A chain longer than the pages held loops (only colliding hashes could make one).
        for _ in 0..=self.pages.len() {
            match self.pages.get(&at) {
                None => return false,
                Some(Page { parent: None, .. }) => return true,
                Some(Page {
                    parent: Some(p), ..
                }) => at = *p,
            }
        }
        false
    }

    /// Adds the chain `hashes` under `parent` (reachable, or `None`: the root); a page held
    /// already is kept as it is.
    fn store(&mut self, hashes: &[i64], mut parent: Option<i64>) {
        for &h in hashes {
            if let Entry::Vacant(e) = self.pages.entry(h) {
                // Children cut off when `h` was removed hang from it again.
                let children = self.cut.remove(&h).unwrap_or(0);
                e.insert(Page { parent, children });
                if let Some(p) = parent.and_then(|p| self.pages.get_mut(&p)) {
                    p.children += 1;
                }
            }
            parent = Some(h);
        }
    }

    /// Takes the pages `hashes` away (those not held are ignored). A worker lists a removed
    /// run root first: taken last page first, its pages are never cut off on the way (the end
    /// state does not depend on the order).
    fn remove(&mut self, hashes: &[i64]) {
        for h in hashes.iter().rev() {
            let Some(page) = self.pages.remove(h) else {
                continue;
            };
            if let Some(p) = page.parent {
                match self.pages.get_mut(&p) {
                    Some(parent) => parent.children -= 1,
                    None => uncount(&mut self.cut, p),
                }
            }
            if page.children > 0 {
                *self.cut.entry(*h).or_default() += page.children;
            }
        }
    }

    /// How many of `block_ids`' leading pages are held, each under the one before it.
    fn matched(&self, block_ids: &[i64]) -> usize {
        let mut parent = None;
        block_ids
            .iter()
            .take_while(|&&h| {
                let held = self.pages.get(&h).is_some_and(|p| p.parent == parent);
                parent = Some(h);
                held
            })
            .count()
    }

    /// Checks the children counts and the cut-off counts against the parent links.
    fn check(&self) -> Result<(), String> {
        let mut children: FxHashMap<i64, u32> = FxHashMap::default();
        let mut cut: FxHashMap<i64, u32> = FxHashMap::default();
        for page in self.pages.values() {
            if let Some(p) = page.parent {
                let count = if self.pages.contains_key(&p) {
                    &mut children
                } else {
                    &mut cut
                };
                *count.entry(p).or_default() += 1;
            }
        }
        for (&h, page) in &self.pages {
            let want = children.get(&h).copied().unwrap_or(0);
            if page.children != want {
                return Err(format!(
                    "page {h} counts {} children, {want} held",
                    page.children
                ));
            }
        }
        if cut != self.cut {
            return Err(format!("cut off {:?}, counted {:?}", cut, self.cut));
        }
        Ok(())
    }
}

/// One less page cut off below the missing page `p`.
fn uncount(cut: &mut FxHashMap<i64, u32>, p: i64) {
    if let Some(n) = cut.get_mut(&p) {
        *n -= 1;
        if *n == 0 {
            cut.remove(&p);
        }
    }
}

/// Which worker holds which pages.
#[derive(Debug, Default)]
pub struct KvIndex {
    block_size: Option<u32>,
    workers: HashMap<WorkerId, Pages>,
    unplaced: u64,
}

impl KvIndex {
    /// The workers' page size in tokens (`None` until the first `BlockStored`).
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// Pages `worker` holds (cut-off ones included).
    pub fn held_pages(&self, worker: WorkerId) -> usize {
        self.workers.get(&worker).map_or(0, |w| w.pages.len())
    }

    /// Pages left out because their parent was unknown or cut off.
    pub fn unplaced(&self) -> u64 {
        self.unplaced
    }

    /// How many of `block_ids`' leading pages `worker` holds.
    pub fn matched_pages(&self, worker: WorkerId, block_ids: &[i64]) -> usize {
        self.workers
            .get(&worker)
            .map_or(0, |w| w.matched(block_ids))
    }

    /// How many leading pages of `tokens` each of `workers` holds: [`matched_pages`] of
    /// `tokens`' block ids for each, but each block id computed only while some worker still
    /// matches (a prompt's pages past every worker's match are never hashed).
    ///
    /// [`matched_pages`]: Self::matched_pages
    pub fn matched_pages_of(&self, workers: &[WorkerId], tokens: &[u32]) -> Vec<usize> {
        let mut matched = vec![0; workers.len()];
        let Some(size) = self.block_size else {
            return matched;
        };
        let held: Vec<Option<&Pages>> = workers.iter().map(|w| self.workers.get(w)).collect();
        let (mut digest, mut parent) = (None, None);
        for (i, page) in tokens.chunks_exact(size.max(1) as usize).enumerate() {
            if !held
                .iter()
                .zip(&matched)
                .any(|(w, &m)| w.is_some() && m == i)
            {
                break;
            }
            let d = page_digest(digest.as_ref(), page);
            let h = digest_to_block_id(&d);
            for (w, m) in held.iter().zip(&mut matched) {
                let on = w
                    .and_then(|w| w.pages.get(&h))
                    .is_some_and(|p| p.parent == parent);
                if *m == i && on {
                    *m += 1;
                }
            }
            (digest, parent) = (Some(d), Some(h));
        }
        matched
    }

    /// Applies one worker's events, in order.
    pub fn apply(&mut self, worker: WorkerId, events: &[KvEvent]) -> Result<(), KvIndexError> {
        for ev in events {
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    block_size,
                    ..
                } => {
                    match self.block_size {
                        None => self.block_size = Some(*block_size),
                        Some(want) if want != *block_size => {
                            return Err(KvIndexError::BlockSize {
                                worker,
                                got: *block_size,
                                want,
                            })
                        }
                        Some(_) => {}
                    }
                    let pages = self.workers.entry(worker).or_default();
                    if parent_block_hash.is_none_or(|p| pages.reachable(p)) {
                        pages.store(block_hashes, *parent_block_hash);
                    } else {
                        self.unplaced += block_hashes.len() as u64;
                    }
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    if let Some(pages) = self.workers.get_mut(&worker) {
                        pages.remove(block_hashes);
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.workers.remove(&worker);
                }
            }
        }
        Ok(())
    }

    /// Forgets everything `worker` holds (it left the router).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// Checks each worker's children and cut-off counts against its pages' parent links (for
    /// tests).
    pub fn check(&self) -> Result<(), String> {
        for (w, pages) in &self.workers {
            pages.check().map_err(|e| format!("{w:?}: {e}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use kv_pool::{Allocator, AnyAllocator, Slot};
    use proptest::prelude::*;
    use radix_cache::{BuiltinPolicy, InsertOptions, PrefixCache, RadixCache};

    use super::super::{block_ids, stored_pages};
    use super::*;

    const P: usize = 4;

    fn removed(ids: &[i64]) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: ids.to_vec(),
        }
    }

    /// Stores, a branch, leaf-first removals (each making the parent a leaf) and a clear: the
    /// matches follow, each event checked.
    #[test]
    fn the_index_follows_stores_and_removals() {
        let (w0, w1) = (WorkerId(0), WorkerId(1));
        let a: Vec<u32> = (0..32).collect();
        let mut b = a[..20].to_vec();
        b.extend(100..112);
        let (ia, ib) = (block_ids(&a, P), block_ids(&b, P));
        let mut ix = KvIndex::default();
        // A long chain in two events: the second extends the first's leaf.
        ix.apply(w0, &[stored_pages(&a, 0, 5, P), stored_pages(&a, 5, 8, P)])
            .unwrap();
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w0, &ia), 8);
        // A branch after page 5 of A.
        ix.apply(w0, &[stored_pages(&b, 5, 8, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.matched_pages(w0, &ib), ix.held_pages(w0)), (8, 11));
        // Another worker's copy of A's first pages is its own.
        ix.apply(w1, &[stored_pages(&a, 0, 3, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w1, &ia), 3);
        // Leaf-first removals: B's tail, then A's last three pages, page by page.
        ix.apply(w0, &[removed(&ib[5..8])]).unwrap();
        ix.check().unwrap();
        assert_eq!(
            (ix.matched_pages(w0, &ib), ix.matched_pages(w0, &ia)),
            (5, 8)
        );
        for i in (5..8).rev() {
            ix.apply(w0, &[removed(&ia[i..i + 1])]).unwrap();
            ix.check().unwrap();
            assert_eq!(ix.matched_pages(w0, &ia), i);
        }
        // A removal of a page the worker does not hold changes nothing.
        ix.apply(w0, &[removed(&ib[6..7])]).unwrap();
        ix.check().unwrap();
        assert_eq!(ix.held_pages(w0), 5);
        // Store again on the shortened chain, then clear the worker.
        ix.apply(w0, &[stored_pages(&b, 5, 8, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w0, &ib), 8);
        ix.apply(w0, &[KvEvent::AllBlocksCleared]).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.held_pages(w0), ix.matched_pages(w0, &ia)), (0, 0));
        assert_eq!(ix.matched_pages(w1, &ia), 3);
        ix.remove_worker(w1);
        ix.check().unwrap();
        assert_eq!((ix.held_pages(w1), ix.matched_pages(w1, &ia)), (0, 0));
    }

    /// Each worker's pages as a tree, pages named by `names` (a chain's pages as `a0 a1 …`,
    /// runs of single children on one line), then the cut-off pages below each missing page.
    fn render(ix: &KvIndex, names: &HashMap<i64, String>) -> String {
        use std::fmt::Write as _;
        fn subtree(
            pages: &Pages,
            names: &HashMap<i64, String>,
            h: i64,
            depth: usize,
            out: &mut String,
        ) {
            let below = |h: i64| {
                let mut c: Vec<i64> = (pages.pages.iter())
                    .filter(|(_, p)| p.parent == Some(h))
                    .map(|(&c, _)| c)
                    .collect();
                c.sort_by_key(|c| &names[c]);
                c
            };
            let (mut run, mut at) = (vec![names[&h].as_str()], h);
            let mut next = below(at);
            while next.len() == 1 {
                at = next[0];
                run.push(&names[&at]);
                next = below(at);
            }
            let _ = writeln!(out, "{:w$}{}", "", run.join(" "), w = 2 * depth);
            for c in next {
                subtree(pages, names, c, depth + 1, out);
            }
        }
        let mut out = String::new();
        let mut workers: Vec<_> = ix.workers.iter().collect();
        workers.sort_by_key(|(w, _)| w.0);
        for (w, pages) in workers {
            let _ = writeln!(out, "worker {} ({} pages):", w.0, pages.pages.len());
            let mut tops: Vec<(Option<i64>, i64)> = (pages.pages.iter())
                .filter(|(_, p)| p.parent.is_none_or(|q| !pages.pages.contains_key(&q)))
                .map(|(&h, p)| (p.parent, h))
                .collect();
            tops.sort_by_key(|&(p, h)| (p.map(|p| names[&p].clone()), names[&h].clone()));
            for (parent, h) in tops {
                if let Some(p) = parent {
                    let _ = writeln!(out, "  cut off below {}:", names[&p]);
                }
                subtree(pages, names, h, 1 + usize::from(parent.is_some()), &mut out);
            }
        }
        let _ = writeln!(out, "unplaced: {}", ix.unplaced());
        out
    }

    /// A scripted stream, the index rendered after each event: two chains sharing a prefix
    /// on one worker, a copy on another, a leaf-first removal, an inner removal (its
    /// descendants cut off, a store under them unplaced) and the removed page stored again.
    #[test]
    fn snapshot_of_a_scripted_stream() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a[..12].to_vec();
        b.extend(100..120);
        let (ia, ib) = (block_ids(&a, P), block_ids(&b, P));
        let mut names = HashMap::new();
        for (chain, ids) in [("a", &ia), ("b", &ib)] {
            for (i, &h) in ids.iter().enumerate() {
                names.entry(h).or_insert(format!("{chain}{i}"));
            }
        }
        let (w0, w1) = (WorkerId(0), WorkerId(1));
        let script = [
            ("w0 stores a0..a4", w0, stored_pages(&a, 0, 4, P)),
            ("w0 stores a4..a6", w0, stored_pages(&a, 4, 6, P)),
            ("w0 stores b3..b6", w0, stored_pages(&b, 3, 6, P)),
            ("w1 stores a0..a2", w1, stored_pages(&a, 0, 2, P)),
            ("w0 removes b4 b5 (leaf first)", w0, removed(&ib[4..6])),
            ("w0 removes a1 (an inner page)", w0, removed(&ia[1..2])),
            (
                "w0 stores a6 under a5 (cut off)",
                w0,
                stored_pages(&a, 6, 6 + 1, P),
            ),
            ("w0 stores a1 again", w0, stored_pages(&a, 1, 2, P)),
        ];
        let mut out = String::new();
        let mut ix = KvIndex::default();
        for (what, w, ev) in script {
            ix.apply(w, &[ev]).unwrap();
            ix.check().unwrap();
            out.push_str(&format!("# {what}\n{}", render(&ix, &names)));
            let m: Vec<usize> = [&ia, &ib].iter().map(|q| ix.matched_pages(w0, q)).collect();
            out.push_str(&format!("w0 matches a: {}, b: {}\n\n", m[0], m[1]));
        }
        insta::assert_snapshot!(out);
    }

    /// A removal that is not leaf-first (an inner page of a chain, its descendants still
    /// held) cuts the descendants off: still held, never matched, and a store under them is
    /// unplaced; storing the removed page again hangs them back.
    #[test]
    fn an_inner_removal_cuts_the_chain_until_the_page_comes_back() {
        let w = WorkerId(0);
        let a: Vec<u32> = (0..40).collect();
        let ia = block_ids(&a, P);
        let mut ix = KvIndex::default();
        ix.apply(w, &[stored_pages(&a, 0, 6, P)]).unwrap();
        ix.apply(w, &[removed(&ia[2..3])]).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.held_pages(w), ix.matched_pages(w, &ia)), (5, 2));
        // Page 6 would hang under page 5, whose chain passes through the removed page 2.
        ix.apply(w, &[stored_pages(&a, 6, 7, P)]).unwrap();
        assert_eq!((ix.unplaced(), ix.held_pages(w)), (1, 5));
        // Page 2 again, under page 1 (still held): placed, and the chain is whole again.
        ix.apply(w, &[stored_pages(&a, 2, 3, P)]).unwrap();
        assert_eq!((ix.unplaced(), ix.held_pages(w)), (1, 6));
        ix.check().unwrap();
        assert_eq!(ix.matched_pages(w, &ia), 6);
        // A cut-off page removed while cut off, then its parent back: the rest hangs back.
        ix.apply(w, &[removed(&ia[1..2]), removed(&ia[3..4])])
            .unwrap();
        ix.check().unwrap();
        ix.apply(w, &[stored_pages(&a, 1, 2, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.held_pages(w), ix.matched_pages(w, &ia)), (5, 3));
        ix.apply(w, &[stored_pages(&a, 3, 10, P)]).unwrap();
        ix.check().unwrap();
        assert_eq!((ix.held_pages(w), ix.matched_pages(w, &ia)), (10, 10));
    }

    /// 40 chains of 1,000 pages, each stored in four events: every chain matches in full.
    #[test]
    fn long_chains_are_matched_in_full() {
        let w = WorkerId(3);
        let mut ix = KvIndex::default();
        let chains: Vec<Vec<u32>> = (0..40u32)
            .map(|c| (0..4000).map(|t| c * 1_000_000 + t).collect())
            .collect();
        for toks in &chains {
            for from in (0..1000).step_by(250) {
                ix.apply(w, &[stored_pages(toks, from, from + 250, P)])
                    .unwrap();
            }
        }
        assert_eq!(ix.held_pages(w), 40_000);
        for toks in &chains {
            assert_eq!(ix.matched_pages(w, &block_ids(toks, P)), 1000);
        }
        ix.check().unwrap();
        ix.apply(w, &[KvEvent::AllBlocksCleared]).unwrap();
        assert_eq!(ix.held_pages(w), 0);
    }

    /// The naive model of what the index answers: per worker, each held page with its whole
    /// chain; a store is placed when its parent's whole chain is held; a prefix matches as far
    /// as its pages are held with exactly its chain.
    #[derive(Debug, Default)]
    struct Model {
        held: HashMap<WorkerId, HashMap<i64, Vec<i64>>>,
        unplaced: u64,
    }

    impl Model {
        fn apply(&mut self, w: WorkerId, ev: &KvEvent) {
            let held = self.held.entry(w).or_default();
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    ..
                } => {
                    let mut chain = match parent_block_hash {
                        None => Vec::new(),
                        Some(p) => match held.get(p) {
                            Some(c) if c.iter().all(|h| held.contains_key(h)) => c.clone(),
                            _ => {
                                self.unplaced += block_hashes.len() as u64;
                                return;
                            }
                        },
                    };
                    for &h in block_hashes {
                        chain.push(h);
                        held.entry(h).or_insert_with(|| chain.clone());
                    }
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for h in block_hashes {
                        held.remove(h);
                    }
                }
                KvEvent::AllBlocksCleared => held.clear(),
            }
        }

        fn matched(&self, w: WorkerId, ids: &[i64]) -> usize {
            let Some(held) = self.held.get(&w) else {
                return 0;
            };
            (0..ids.len())
                .take_while(|&i| held.get(&ids[i]).is_some_and(|c| c[..] == ids[..=i]))
                .count()
        }

        fn held_pages(&self, w: WorkerId) -> usize {
            self.held.get(&w).map_or(0, HashMap::len)
        }
    }

    /// Token sequences of `pages` pages of `page` tokens over a small alphabet, so they share
    /// prefixes often.
    fn sequences(page: usize, pages: usize) -> impl Strategy<Value = Vec<Vec<u32>>> {
        prop::collection::vec(prop::collection::vec(0u32..3, page * pages), 4)
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Pages `from..from + len` of sequence `seq` (parent: the page before `from`).
        Store {
            w: u32,
            seq: usize,
            from: usize,
            len: usize,
        },
        /// Pages `from..from + len` of sequence `seq` removed, in any order, held or not.
        Remove {
            w: u32,
            seq: usize,
            from: usize,
            len: usize,
        },
        Clear {
            w: u32,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u32..3, 0usize..4, 0usize..8, 1usize..5)
                .prop_map(|(w, seq, from, len)| Op::Store { w, seq, from, len }),
            3 => (0u32..3, 0usize..4, 0usize..8, 1usize..4)
                .prop_map(|(w, seq, from, len)| Op::Remove { w, seq, from, len }),
            1 => (0u32..3).prop_map(|w| Op::Clear { w }),
        ]
    }

    proptest! {
        /// Any stream of stores (placed or not), removals (leaf-first or not, of pages held or
        /// not) and clears: after every event the index answers as the naive model does, for
        /// every sequence's prefix on every worker, and its counts are consistent.
        #[test]
        fn the_index_answers_as_the_naive_model(
            page in 1usize..3,
            seqs in sequences(2, 8),
            ops in prop::collection::vec(op(), 1..60),
        ) {
            // `sequences` made pages of 2 tokens; at page size 1 the same tokens make 16 pages.
            let pages = 16 / page;
            let ids: Vec<Vec<i64>> = seqs.iter().map(|s| block_ids(s, page)).collect();
            let (mut ix, mut model) = (KvIndex::default(), Model::default());
            for op in ops {
                let (w, ev) = match op {
                    Op::Store { w, seq, from, len } => {
                        let from = from.min(pages - 1);
                        let to = (from + len).min(pages);
                        (w, stored_pages(&seqs[seq], from, to, page))
                    }
                    Op::Remove { w, seq, from, len } => {
                        let from = from.min(pages - 1);
                        let mut gone = ids[seq][from..(from + len).min(pages)].to_vec();
                        gone.reverse();
                        (w, removed(&gone))
                    }
                    Op::Clear { w } => (w, KvEvent::AllBlocksCleared),
                };
                let w = WorkerId(w);
                ix.apply(w, std::slice::from_ref(&ev)).unwrap();
                model.apply(w, &ev);
                prop_assert_eq!(ix.check(), Ok(()));
                prop_assert_eq!(ix.unplaced(), model.unplaced);
                let all: Vec<WorkerId> = (0..4).map(WorkerId).collect();
                for (q, s) in ids.iter().zip(&seqs) {
                    let each: Vec<usize> = all.iter().map(|&w| ix.matched_pages(w, q)).collect();
                    prop_assert_eq!(ix.matched_pages_of(&all, s), each);
                }
                for w in (0..3).map(WorkerId) {
                    prop_assert_eq!(ix.held_pages(w), model.held_pages(w));
                    for (s, q) in ids.iter().enumerate() {
                        prop_assert_eq!(
                            ix.matched_pages(w, q),
                            model.matched(w, q),
                            "{:?}, sequence {}", w, s
                        );
                    }
                }
            }
        }

        /// Workers that are real radix caches (inserts of random prompts, LRU evictions, leaf
        /// parts included): after each step's events, the index matches every prompt on every
        /// worker exactly as far as that worker's cache holds it.
        #[test]
        fn the_index_mirrors_the_workers_caches(
            page in prop::sample::select(vec![1usize, 2, 4]),
            steps in prop::collection::vec(
                (0usize..2, prop::collection::vec(0u32..3, 4..40), 0usize..24),
                1..40,
            ),
        ) {
            let mut workers: Vec<(RadixCache, AnyAllocator)> = (0..2)
                .map(|_| {
                    (
                        RadixCache::new(page as u32, BuiltinPolicy::Lru).with_events(true),
                        AnyAllocator::for_page_size(4096, page as u32).unwrap(),
                    )
                })
                .collect();
            let mut ix = KvIndex::default();
            let mut prompts: Vec<Vec<u32>> = Vec::new();
            for (w, tokens, evict) in steps {
                let (cache, alloc) = &mut workers[w];
                // A prompt shares a prefix with an earlier one half the time.
                let prompt = match prompts.get(tokens[0] as usize * prompts.len() / 3) {
                    Some(earlier) if tokens[1] != 0 => {
                        let cut = earlier.len().min(tokens.len());
                        earlier[..cut].iter().chain(&tokens[2..]).copied().collect()
                    }
                    _ => tokens,
                };
                let key = &prompt[..prompt.len() / page * page];
                let mut slots: Vec<Slot> = Vec::new();
                alloc.alloc(key.len(), &mut slots).unwrap();
                let r = cache
                    .insert(key, None, &slots, InsertOptions::default())
                    .unwrap();
                alloc.free(&slots[..r.prefix_len]).unwrap();
                cache.evict(evict * page, alloc).unwrap();
                ix.apply(WorkerId(w as u32), &cache.take_events()).unwrap();
                prompts.push(prompt);
                prop_assert_eq!(ix.check(), Ok(()));
                for (i, (cache, _)) in workers.iter().enumerate() {
                    for q in &prompts {
                        prop_assert_eq!(
                            ix.matched_pages(WorkerId(i as u32), &block_ids(q, page)) * page,
                            cache.peek_prefix_len(q, None),
                            "worker {}", i
                        );
                    }
                }
            }
            prop_assert_eq!(ix.unplaced(), 0);
        }
    }
}
