//! [`KvSender`]: the prefill side of one request (SGLang's `KVSender`,
//! `disaggregation/base/conn.py`).

use std::sync::Arc;

use kv_pool::Page;
use tokio::sync::mpsc;

use crate::coalesce;
use crate::pd::config::{TransferAux, TransferInfo};
use crate::pd::error::PdError;
use crate::pd::kv_poll::KvPoll;
use crate::pd::prefill;
use crate::pd::state::{Job, Shared};

/// The prefill side of one request's transfer (SGLang's `KVSender`). Created by
/// [`KvManager::create_sender`](crate::pd::KvManager::create_sender); `Bootstrapping` until the
/// decode's TransferInfo arrives, then `WaitingForInput`; each [`send`](KvSender::send) queues
/// one batch (`Transferring`); after the last one and every earlier batch landed, `Success`.
/// Dropping it forgets the room (a live one is aborted first); keep the source pages until
/// [`poll`](KvSender::poll) is terminal, as batches read them until then.
#[doc(alias = "KVSender")]
#[derive(Debug)]
pub struct KvSender {
    room: u64,
    shared: Arc<Shared>,
}

impl KvSender {
    pub(crate) fn new(room: u64, shared: Arc<Shared>) -> Self {
        KvSender { room, shared }
    }

    /// The bootstrap room.
    pub fn room(&self) -> u64 {
        self.room
    }

    /// Where the room stands.
    pub fn poll(&self) -> KvPoll {
        let st = self.shared.lock();
        st.rooms
            .get(&self.room)
            .map_or(KvPoll::Failed, |r| r.cell.get())
    }

    /// Every status the room has had, in order.
    pub fn history(&self) -> Vec<KvPoll> {
        let st = self.shared.lock();
        st.rooms
            .get(&self.room)
            .map_or_else(Vec::new, |r| r.cell.history().to_vec())
    }

    /// What decode asked for (SGLang's `pop_decode_prefix_len` and `init`'s page count), once
    /// the handshake is done (`WaitingForInput` or later, while decode's request is known).
    pub fn transfer_info(&self) -> Option<TransferInfo> {
        let st = self.shared.lock();
        let r = st.rooms.get(&self.room)?;
        r.conn.map(|_| TransferInfo {
            decode_prefix_len: r.decode_prefix_len,
            num_pages: r.dst_pages.len(),
        })
    }

    /// Queues the KV of `src_pages` (the pages of prompt positions `decode_prefix_len..`, in
    /// order, continuing where the previous call stopped) for the decode's destination pages.
    /// A non-last call sends whole pages only; `last` (the first token and metadata) ends the
    /// transfer and must bring the page count to exactly `num_pages`. Refused with nothing
    /// queued: before the handshake or after the end ([`PdError::WrongState`]), more pages
    /// than decode gave, or a last call short of them ([`PdError::PageCountMismatch`]).
    pub fn send(&self, src_pages: &[Page], last: Option<TransferAux>) -> Result<(), PdError> {
        let room = self.room;
        let mut st = self.shared.lock();
        let st = &mut *st;
        let r = st
            .rooms
            .get_mut(&room)
            .expect("a live sender's room exists");
        let state = r.cell.get();
        if !matches!(state, KvPoll::WaitingForInput | KvPoll::Transferring) || r.last_sent {
            return Err(PdError::WrongState {
                room,
                call: "send",
                needs: "WaitingForInput or Transferring before the last chunk",
                state,
            });
        }
        let (from, total) = (r.sent_pages, r.dst_pages.len());
        let to = from + src_pages.len();
        if to > total {
            return Err(PdError::PageCountMismatch {
                room,
                detail: format!(
                    "{} pages sent after {from} but decode gave only {total} destination pages",
                    src_pages.len()
                ),
            });
        }
        if last.is_some() && to != total {
            return Err(PdError::PageCountMismatch {
                room,
                detail: format!(
                    "the last chunk ends at page {to} but decode gave {total} destination pages"
                ),
            });
        }
        let conn_id = r.conn.expect("WaitingForInput has a connection");
        let Some(conn) = st.conns.get(&conn_id) else {
            return Err(PdError::WrongState {
                room,
                call: "send",
                needs: "a live decode connection",
                state: KvPoll::Failed,
            });
        };
        let runs = coalesce::page_runs(src_pages, &r.dst_pages[from..to])?;
        let blocks = coalesce::blocks(&runs, &self.shared.local, &conn.dst)?;
        let segment = conn.segment;
        r.sent_pages = to;
        r.last_sent = last.is_some();
        let worker = r.worker.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let target = prefill::Target {
                room,
                generation: r.generation,
                conn: conn_id,
                segment,
            };
            self.shared
                .rt
                .spawn(prefill::run_worker(self.shared.clone(), target, rx));
            tx
        });
        let _ = worker.send(Job::Send { blocks, aux: last });
        st.transition(room, KvPoll::Transferring, None);
        Ok(())
    }

    /// Fails the room and tells decode (once batches in flight have settled); no-op when the
    /// room already ended.
    pub fn abort(&self, reason: &str) {
        let room = self.room;
        let mut st = self.shared.lock();
        if !st.transition(
            room,
            KvPoll::Failed,
            Some(format!("aborted by prefill: {reason}")),
        ) {
            return;
        }
        let r = &st.rooms[&room];
        let (worker, conn, failure) = (r.worker.clone(), r.conn, r.failure.clone());
        let queued = worker.is_some_and(|w| w.send(Job::Abort { ack: false }).is_ok());
        if let (false, Some(conn)) = (queued, conn) {
            if let Some(c) = st.conns.get(&conn) {
                let _ =
                    c.tx.send(prefill::failed_status(room, failure.unwrap_or_default()));
            }
        }
    }

    /// Why the room failed, once `Failed` (SGLang's `failure_exception`).
    pub fn failure(&self) -> Option<String> {
        let st = self.shared.lock();
        st.rooms.get(&self.room).and_then(|r| r.failure.clone())
    }
}

impl Drop for KvSender {
    fn drop(&mut self) {
        self.abort("the sender was dropped");
        self.shared.lock().rooms.remove(&self.room);
    }
}
