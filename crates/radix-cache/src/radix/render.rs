//! Read-only views of the tree for tests and diagnostics: a rendering, the eviction order, and
//! the invariant check. Builds on `arena` and `index`; changes nothing.

use std::fmt::Write as _;

use kv_pool::{Allocator, Owner, OwnershipCheck};

use crate::policy::EvictionPolicy;
use crate::radix::arena::{RadixCache, NONE};
use crate::radix::host::PrefetchStage;
use crate::NodeId;

impl<P: EvictionPolicy> RadixCache<P> {
    /// A readable rendering of the whole tree, children ordered by their first token; tokens
    /// formatted by `token` (e.g. letters in tests). Long keys are abbreviated.
    pub fn render_with(&self, token: &dyn Fn(u32) -> String) -> String {
        let mut out = format!(
            "radix P={} policy={} evictable={} protected={} nodes={} leaves_indexed={}\n",
            self.page_size,
            self.policy.name(),
            self.evictable,
            self.protected,
            self.node_count(),
            self.index.len()
        );
        if let Some(tier) = self.tier.as_ref() {
            let _ = writeln!(
                out,
                "host {} slots={} free={} host_leaves_indexed={} ops_in_flight={} prefetches={}",
                tier.cfg.write_policy,
                tier.cfg.host_slots,
                tier.host.available_size(),
                tier.index.len(),
                tier.ops.len(),
                tier.prefetches.len()
            );
        }
        let mut roots: Vec<_> = self.roots.iter().collect();
        roots.sort();
        for (ns, &r) in roots {
            let _ = writeln!(
                out,
                "[root{}]",
                ns.as_ref().map_or(String::new(), |k| format!(" {k:?}"))
            );
            self.render_children(r, "", token, &mut out);
        }
        out
    }

    fn render_children(
        &self,
        i: u32,
        indent: &str,
        token: &dyn Fn(u32) -> String,
        out: &mut String,
    ) {
        let mut kids: Vec<u32> = self.nodes[i as usize].children.iter().collect();
        kids.sort_by(|&a, &b| self.node_tokens(a).cmp(self.node_tokens(b)));
        for (k, &c) in kids.iter().enumerate() {
            let last = k + 1 == kids.len();
            let n = &self.nodes[c as usize];
            let abbreviate = |v: Vec<String>| {
                if v.len() > 12 {
                    format!(
                        "{} … {} ({} tokens)",
                        v[..8].join(" "),
                        v[v.len() - 2..].join(" "),
                        v.len()
                    )
                } else {
                    v.join(" ")
                }
            };
            let toks = abbreviate(self.node_tokens(c).iter().map(|&t| token(t)).collect());
            let slots = abbreviate(self.node_slots(c).iter().map(|s| s.0.to_string()).collect());
            // With a host tier: the node's tier, its host slots, and its pins.
            let (tier, slots) = if self.tier.is_some() {
                let host = abbreviate(
                    self.node_host_slots(c)
                        .iter()
                        .map(|s| s.0.to_string())
                        .collect(),
                );
                let (t, device, host) = match (n.on_device, n.backed_up) {
                    (true, false) => ("D", format!("[{slots}]"), String::new()),
                    (true, true) => ("D+H", format!("[{slots}]"), format!(" host=[{host}]")),
                    (false, _) => ("H", "-".to_string(), format!(" host=[{host}]")),
                };
                let pins = if n.host_ref > 0 {
                    format!(" host_ref={}", n.host_ref)
                } else {
                    String::new()
                };
                (format!(" {t}"), format!("{device}{host}{pins}"))
            } else {
                (String::new(), format!("[{slots}]"))
            };
            let _ = writeln!(
                out,
                "{indent}{} n{}{tier} [{toks}] slots={slots} lock={} hits={} access={}{}{}{}",
                if last { "└─" } else { "├─" },
                c,
                n.lock_ref,
                n.hit_count,
                n.last_access,
                if n.priority != 0 {
                    format!(" prio={}", n.priority)
                } else {
                    String::new()
                },
                if n.indexed.is_some() {
                    " evictable"
                } else {
                    ""
                },
                if self.tier.as_ref().is_some_and(|t| t.keys.contains_key(&c)) {
                    " host-evictable"
                } else {
                    ""
                },
            );
            let deeper = format!("{indent}{}", if last { "   " } else { "│  " });
            self.render_children(c, &deeper, token, out);
        }
    }

    /// The evictable leaves in the order they would go now: each leaf's handle and its own
    /// tokens (not the path above it). For tests and diagnostics.
    pub fn eviction_order(&self) -> Vec<(NodeId, Vec<u32>)> {
        self.index
            .iter()
            .map(|(_, i)| (self.id(i), self.node_tokens(i).to_vec()))
            .collect()
    }

    /// Every node's stored eviction key with its handle, read from the nodes (not from the
    /// ordered index), smallest first: what `evict` must take next is the first entry.
    #[cfg(feature = "testing")]
    pub(crate) fn stored_keys(&self) -> Vec<(crate::EvictionKey, NodeId)> {
        let mut keys: Vec<(crate::EvictionKey, u32)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((n.indexed?, i as u32)))
            .filter(|&(_, i)| self.nodes[i as usize].live)
            .collect();
        keys.sort_unstable();
        keys.into_iter().map(|(k, i)| (k, self.id(i))).collect()
    }

    /// Checks the tree's internal invariants (sizes, lock counts, index membership, page
    /// alignment, parent links); returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let p = self.page_size as usize;
        let (mut evictable, mut protected, mut leaves, mut host_leaves) = (0, 0, 0, 0);
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            let i = i as u32;
            if n.parent == NONE {
                continue;
            }
            if n.len == 0 || n.len % p != 0 {
                return Err(format!(
                    "n{i} holds {} tokens, not a positive multiple of {p}",
                    n.len
                ));
            }
            let par = &self.nodes[n.parent as usize];
            if !par.live || !par.children.iter().any(|c| c == i) {
                return Err(format!("n{i} is not among its parent's children"));
            }
            if par.parent != NONE && par.lock_ref < n.lock_ref {
                return Err(format!(
                    "n{i} has more locks ({}) than its parent ({})",
                    n.lock_ref, par.lock_ref
                ));
            }
            if n.depth != par.depth + par.len {
                return Err(format!("n{i} depth {} != parent depth + len", n.depth));
            }
            let device_children = n
                .children
                .iter()
                .filter(|&c| self.nodes[c as usize].on_device)
                .count();
            if device_children != n.device_children as usize {
                return Err(format!(
                    "n{i} counts {} children on device, has {device_children}",
                    n.device_children
                ));
            }
            if n.on_device && !par.on_device {
                return Err(format!("n{i} is on device below a host-only parent"));
            }
            if !n.on_device && !n.backed_up {
                return Err(format!("n{i} is neither on device nor backed up"));
            }
            if let Some(tier) = self.tier.as_ref() {
                let prefix = tier.cfg.write_policy.threshold().is_some();
                if prefix && n.backed_up && par.parent != NONE && !par.backed_up {
                    return Err(format!("n{i} is backed up below a parent that is not"));
                }
                let should = self.is_host_leaf(i);
                let key = tier.keys.get(&i);
                if should != key.is_some() || key.is_some_and(|&k| !tier.index.contains(&(k, i))) {
                    return Err(format!(
                        "n{i}: host leaf = {should}, host-indexed = {key:?}"
                    ));
                }
                host_leaves += usize::from(should);
            } else if n.backed_up || !n.on_device {
                return Err(format!("n{i} has host state in a tree without a host tier"));
            }
            if !n.on_device {
                // Host-only: no device tokens.
            } else if n.lock_ref > 0 {
                protected += n.len;
            } else {
                evictable += n.len;
            }
            let should = self.is_evictable_leaf(i);
            if should != n.indexed.is_some()
                || (should && !self.index.contains(n.indexed.unwrap(), i))
            {
                return Err(format!(
                    "n{i}: evictable leaf = {should}, indexed = {:?}",
                    n.indexed
                ));
            }
            leaves += usize::from(should);
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return Err(format!(
                "sizes: counted evictable {evictable} protected {protected}, recorded {} {}",
                self.evictable, self.protected
            ));
        }
        if leaves != self.index.len() {
            return Err(format!(
                "index holds {} entries for {leaves} evictable leaves",
                self.index.len()
            ));
        }
        if let Some(tier) = self.tier.as_ref() {
            if host_leaves != tier.index.len() {
                return Err(format!(
                    "host index holds {} entries for {host_leaves} host leaves",
                    tier.index.len()
                ));
            }
            self.check_host_partition()?;
        }
        Ok(())
    }

    /// The host partition: free host pages, host pages of backed-up nodes, pages of in-flight
    /// prefetches and pages of dropped nodes awaiting a copy's ack are the host pool, each
    /// exactly once (a second [`OwnershipCheck`] over the host allocator).
    fn check_host_partition(&self) -> std::result::Result<(), String> {
        let Some(tier) = self.tier.as_ref() else {
            return Ok(());
        };
        let mut check = OwnershipCheck::new(&tier.host);
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && n.parent != NONE && n.backed_up {
                check.claim(Owner::TreeNode(i as u64), self.node_host_slots(i as u32));
            }
        }
        for (&rid, pf) in &tier.prefetches {
            if let PrefetchStage::Fetching { host, .. } = &pf.stage {
                check.claim(Owner::Other("prefetch", rid), host);
            }
        }
        for (op, host) in &tier.orphans {
            check.claim(Owner::Other("orphan", op.0), host);
        }
        check
            .finish()
            .map(|_| ())
            .map_err(|e| format!("host partition: {e}"))
    }
}
