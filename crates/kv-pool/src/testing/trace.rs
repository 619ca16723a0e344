//! [`Trace`]: an allocator under test that records every operation applied to it, so a failed
//! property reports the exact sequence that led there.

use std::fmt::{self, Debug, Write as _};

use crate::allocator::{render_page_runs, Allocator, AllocatorState, DecodeRequest, ExtendRequest};
use crate::ids::{Page, Slot};

/// An allocator under test plus the log of the operations applied to it. It is itself an
/// [`Allocator`]: every state-changing call is forwarded and logged with its result; queries
/// (`available_size`, `is_allocated`, …) are forwarded unlogged. A check fails through
/// [`Trace::failure`], whose message names the property, the page size and the log.
pub struct Trace<'a> {
    alloc: &'a mut dyn Allocator,
    property: &'static str,
    ops: Vec<String>,
}

/// `[a-b c]`: slot ids as ascending runs.
pub(super) fn render_slots(slots: &[Slot]) -> String {
    format!("[{}]", render_page_runs(slots.iter().map(|s| s.0)))
}

fn render_last_loc(last_loc: Option<Slot>) -> String {
    last_loc.map_or(String::new(), |l| format!("@{}", l.0))
}

/// An extend batch as `prefix→seq@last_loc, …` (`@last_loc` only when given), as failure logs
/// and snapshots show it.
pub fn render_extend_batch(batch: &[ExtendRequest]) -> String {
    let desc: Vec<String> = batch
        .iter()
        .map(|r| {
            format!(
                "{}→{}{}",
                r.prefix_len,
                r.seq_len,
                render_last_loc(r.last_loc)
            )
        })
        .collect();
    desc.join(", ")
}

/// A decode batch as `seq@last_loc, …` (`@last_loc` only when given).
pub fn render_decode_batch(batch: &[DecodeRequest]) -> String {
    let desc: Vec<String> = batch
        .iter()
        .map(|r| format!("{}{}", r.seq_len, render_last_loc(r.last_loc)))
        .collect();
    desc.join(", ")
}

/// An [`ExtendRequest`] from plain numbers (`last_loc` as a slot id), for scripted tests.
pub fn ext(prefix_len: usize, seq_len: usize, last_loc: Option<u32>) -> ExtendRequest {
    ExtendRequest {
        prefix_len,
        seq_len,
        last_loc: last_loc.map(Slot),
    }
}

/// A [`DecodeRequest`] from plain numbers (`last_loc` as a slot id), for scripted tests.
pub fn dec(seq_len: usize, last_loc: Option<u32>) -> DecodeRequest {
    DecodeRequest {
        seq_len,
        last_loc: last_loc.map(Slot),
    }
}

impl<'a> Trace<'a> {
    /// Starts a trace of `alloc` for `property`, checking that the factory honoured the page
    /// size `p` it was asked for.
    pub fn new(
        property: &'static str,
        p: u32,
        alloc: &'a mut dyn Allocator,
    ) -> Result<Self, String> {
        let trace = Trace {
            alloc,
            property,
            ops: Vec::new(),
        };
        let got = trace.alloc.page_size();
        if got != p {
            return Err(trace.failure(format!(
                "the factory was asked for page size {p} and built an allocator with page size {got}"
            )));
        }
        Ok(trace)
    }

    /// Names the property the following operations check (it appears in failure messages).
    pub fn property(&mut self, property: &'static str) {
        self.property = property;
    }

    /// Adds a line to the log without calling the allocator (e.g. the high-level step a group
    /// of calls belongs to).
    pub fn note(&mut self, line: impl Into<String>) {
        self.ops.push(line.into());
    }

    /// The operations logged so far, oldest first.
    pub fn ops(&self) -> &[String] {
        &self.ops
    }

    /// A failure message: the property, the page size, `what` went wrong and the log.
    pub fn failure(&self, what: impl fmt::Display) -> String {
        let mut s = format!(
            "allocator conformance: property \"{}\" failed at P={}: {what}\noperations, oldest first:",
            self.property,
            self.alloc.page_size()
        );
        if self.ops.is_empty() {
            s.push_str(" (none)");
        }
        for (i, op) in self.ops.iter().enumerate() {
            let _ = write!(s, "\n  {:>3}. {op}", i + 1);
        }
        s
    }

    /// `Ok` when `cond` holds, else a [`Trace::failure`] with the message `what` builds.
    pub fn ensure(&self, cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
        if cond {
            Ok(())
        } else {
            Err(self.failure(what()))
        }
    }

    /// `Ok` when `got == want`, else a [`Trace::failure`] showing both.
    pub fn ensure_eq<T: PartialEq + Debug>(
        &self,
        got: T,
        want: T,
        what: &str,
    ) -> Result<(), String> {
        self.ensure(got == want, || {
            format!("{what}: got {got:?}, expected {want:?}")
        })
    }

    /// `Ok(value)` for `Ok`, else a failure saying the call `what` was refused.
    pub fn expect_ok<T>(&self, result: crate::Result<T>, what: &str) -> Result<T, String> {
        result.map_err(|e| self.failure(format!("{what} was refused: {e}")))
    }

    /// `Ok` when `state` equals a fresh snapshot: `what` changed nothing.
    pub fn ensure_unchanged(&self, before: &AllocatorState, what: &str) -> Result<(), String> {
        self.ensure(self.alloc.backup_state() == *before, || {
            format!("{what} changed the allocator's state")
        })
    }

    fn log<T>(&mut self, call: String, result: &crate::Result<T>, shown: impl FnOnce() -> String) {
        let line = match result {
            Ok(_) => format!("{call} -> {}", shown()),
            Err(e) => format!("{call} -> Err({e})"),
        };
        self.ops.push(line);
    }
}

impl Allocator for Trace<'_> {
    fn page_size(&self) -> u32 {
        self.alloc.page_size()
    }

    fn size(&self) -> usize {
        self.alloc.size()
    }

    fn num_pages(&self) -> usize {
        self.alloc.num_pages()
    }

    fn available_size(&self) -> usize {
        self.alloc.available_size()
    }

    fn alloc(&mut self, n: usize, out: &mut Vec<Slot>) -> crate::Result<()> {
        let start = out.len();
        let r = self.alloc.alloc(n, out);
        self.log(format!("alloc({n})"), &r, || render_slots(&out[start..]));
        r
    }

    fn alloc_extend(&mut self, batch: &[ExtendRequest], out: &mut Vec<Slot>) -> crate::Result<()> {
        let start = out.len();
        let r = self.alloc.alloc_extend(batch, out);
        self.log(
            format!("alloc_extend({})", render_extend_batch(batch)),
            &r,
            || render_slots(&out[start..]),
        );
        r
    }

    fn alloc_decode(&mut self, batch: &[DecodeRequest], out: &mut Vec<Slot>) -> crate::Result<()> {
        let start = out.len();
        let r = self.alloc.alloc_decode(batch, out);
        self.log(
            format!("alloc_decode({})", render_decode_batch(batch)),
            &r,
            || render_slots(&out[start..]),
        );
        r
    }

    fn free(&mut self, slots: &[Slot]) -> crate::Result<()> {
        let r = self.alloc.free(slots);
        self.log(format!("free({})", render_slots(slots)), &r, || "ok".into());
        r
    }

    fn free_group_begin(&mut self) -> crate::Result<()> {
        let r = self.alloc.free_group_begin();
        self.log("free_group_begin()".into(), &r, || "ok".into());
        r
    }

    fn free_group_end(&mut self) -> crate::Result<()> {
        let r = self.alloc.free_group_end();
        self.log("free_group_end()".into(), &r, || "ok".into());
        r
    }

    fn free_group_open(&self) -> bool {
        self.alloc.free_group_open()
    }

    fn set_sorted_release(&mut self, on: bool) {
        self.alloc.set_sorted_release(on);
        self.ops.push(format!("set_sorted_release({on})"));
    }

    fn sorted_release(&self) -> bool {
        self.alloc.sorted_release()
    }

    fn merge_and_sort_free(&mut self) {
        self.alloc.merge_and_sort_free();
        self.ops.push("merge_and_sort_free()".into());
    }

    fn backup_state(&self) -> AllocatorState {
        self.alloc.backup_state()
    }

    fn restore_state(&mut self, state: &AllocatorState) -> crate::Result<()> {
        let r = self.alloc.restore_state(state);
        self.log("restore_state(snapshot)".into(), &r, || "ok".into());
        r
    }

    fn clear(&mut self) {
        self.alloc.clear();
        self.ops.push("clear()".into());
    }

    fn is_allocated(&self, page: Page) -> bool {
        self.alloc.is_allocated(page)
    }

    fn unallocated_pages(&self) -> Vec<Page> {
        self.alloc.unallocated_pages()
    }
}
