//! [`KvReceiver`]: the decode side of one request (SGLang's `KVReceiver`,
//! `disaggregation/base/conn.py`).

use std::sync::Arc;
use std::time::Instant;

use kv_pool::Page;

use crate::pd::config::TransferAux;
use crate::pd::control::ControlMsg;
use crate::pd::decode;
use crate::pd::error::PdError;
use crate::pd::kv_poll::KvPoll;
use crate::pd::state::Shared;

/// The decode side of one request's transfer (SGLang's `KVReceiver`). Created by
/// [`KvManager::create_receiver`](crate::pd::KvManager::create_receiver): `Bootstrapping` until
/// the prefill server is reached and checked, then `WaitingForInput`;
/// [`send_metadata`](KvReceiver::send_metadata) gives the destination pages (`Transferring`);
/// `Success` once the prefill reports every page and the aux landed. Free the destination pages
/// of a failed room only once [`quiescent`](KvReceiver::quiescent). Dropping it forgets the room
/// (a live one is aborted first).
#[doc(alias = "KVReceiver")]
#[derive(Debug)]
pub struct KvReceiver {
    room: u64,
    shared: Arc<Shared>,
}

impl KvReceiver {
    pub(crate) fn new(room: u64, shared: Arc<Shared>) -> Self {
        KvReceiver { room, shared }
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

    /// Sends the destination pages for prompt positions `decode_prefix_len..` (page-aligned;
    /// the positions before it decode already holds) to the prefill: SGLang's `send_metadata`.
    /// Refused unless `WaitingForInput` ([`PdError::WrongState`]); nothing is sent then.
    pub fn send_metadata(
        &self,
        dst_pages: Vec<Page>,
        decode_prefix_len: usize,
    ) -> Result<(), PdError> {
        let room = self.room;
        let mut st = self.shared.lock();
        let r = st.rooms.get(&room).expect("a live receiver's room exists");
        let state = r.cell.get();
        let tx = match (&r.peer, state, r.metadata_sent) {
            (Some((addr, g)), KvPoll::WaitingForInput, false) => decode::peer_tx(&st, addr, *g),
            _ => None,
        };
        let Some(tx) = tx else {
            return Err(PdError::WrongState {
                room,
                call: "send_metadata",
                needs: "WaitingForInput",
                state,
            });
        };
        let msg = ControlMsg::TransferInfo {
            room,
            dst_pages: dst_pages.iter().map(|p| p.0).collect(),
            decode_prefix_len,
        };
        if tx.send(msg).is_err() {
            return Err(PdError::WrongState {
                room,
                call: "send_metadata",
                needs: "a live prefill connection",
                state: KvPoll::Failed,
            });
        }
        let r = st.rooms.get_mut(&room).expect("checked");
        r.metadata_sent = true;
        r.quiescent = false;
        r.transfer_start = Some(Instant::now());
        st.transition(room, KvPoll::Transferring, None);
        Ok(())
    }

    /// The prefill's first token(s) and metadata, once `Success`.
    pub fn aux(&self) -> Option<TransferAux> {
        let st = self.shared.lock();
        let r = st.rooms.get(&self.room)?;
        (r.cell.get() == KvPoll::Success)
            .then(|| r.aux.clone())
            .flatten()
    }

    /// Fails the room and, once metadata went out, sends ABORT to the prefill; no-op when the
    /// room already ended.
    pub fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        decode::abort_room(&mut st, self.room, format!("aborted by decode: {reason}"));
    }

    /// Why the room failed, once `Failed`.
    pub fn failure(&self) -> Option<String> {
        let st = self.shared.lock();
        st.rooms.get(&self.room).and_then(|r| r.failure.clone())
    }

    /// No prefill write into this room's destination pages can still land: true before
    /// `send_metadata`, after the prefill's final status or its ABORT_ACK, and once the
    /// connection to that prefill is gone. A failed room's pages may be freed once this holds.
    pub fn quiescent(&self) -> bool {
        let st = self.shared.lock();
        st.rooms.get(&self.room).is_none_or(|r| r.quiescent)
    }
}

impl Drop for KvReceiver {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        decode::abort_room(
            &mut st,
            self.room,
            "aborted by decode: the receiver was dropped".into(),
        );
        st.rooms.remove(&self.room);
    }
}
