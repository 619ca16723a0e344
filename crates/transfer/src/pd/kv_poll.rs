//! [`KvPoll`], SGLang's `KVPoll` (`disaggregation/base/conn.py`), and [`PollCell`], the rule
//! every room's status follows: it only rises, except `Failed`, which overrides anything but
//! `Success`; a terminal status never changes again.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where one request's KV transfer stands, with SGLang's codes.
#[doc(alias = "KVPoll")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[repr(u8)]
pub enum KvPoll {
    /// The transfer failed (timeout, dead peer, transfer error, abort); terminal.
    Failed = 0,
    /// Waiting for the peer: the handshake is not done.
    Bootstrapping = 1,
    /// The handshake is done; prefill waits for the decode's destination pages (decode: for
    /// `send_metadata`).
    WaitingForInput = 2,
    /// Pages are moving.
    Transferring = 3,
    /// Every page and the aux data landed; terminal.
    Success = 4,
}

impl KvPoll {
    /// SGLang's name for the state.
    pub fn name(self) -> &'static str {
        match self {
            KvPoll::Failed => "Failed",
            KvPoll::Bootstrapping => "Bootstrapping",
            KvPoll::WaitingForInput => "WaitingForInput",
            KvPoll::Transferring => "Transferring",
            KvPoll::Success => "Success",
        }
    }

    /// `Failed` or `Success`.
    pub fn is_terminal(self) -> bool {
        matches!(self, KvPoll::Failed | KvPoll::Success)
    }
}

impl fmt::Display for KvPoll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A room's status with its history. [`PollCell::set`] applies SGLang's rule: a status only
/// rises (the max of old and new), `Failed` overrides a non-terminal status, and once `Failed`
/// or `Success` nothing changes (a finished room is never resurrected or failed late).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PollCell {
    history: Vec<KvPoll>,
}

impl Default for PollCell {
    fn default() -> Self {
        Self::new()
    }
}

impl PollCell {
    /// A new room: `Bootstrapping`.
    pub fn new() -> Self {
        PollCell {
            history: vec![KvPoll::Bootstrapping],
        }
    }

    /// The current status.
    pub fn get(&self) -> KvPoll {
        *self.history.last().expect("history starts non-empty")
    }

    /// Applies `to` under the rule; returns whether the status changed.
    pub fn set(&mut self, to: KvPoll) -> bool {
        let now = self.get();
        let next = if now.is_terminal() {
            now
        } else if to == KvPoll::Failed {
            KvPoll::Failed
        } else {
            now.max(to)
        };
        if next != now {
            self.history.push(next);
            true
        } else {
            false
        }
    }

    /// Every status the room has had, in order (no repeats).
    pub fn history(&self) -> &[KvPoll] {
        &self.history
    }

    /// The history as `Bootstrapping → WaitingForInput → Success`.
    pub fn render(&self) -> String {
        let names: Vec<&str> = self.history.iter().map(|s| s.name()).collect();
        names.join(" → ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn poll() -> impl Strategy<Value = KvPoll> {
        prop_oneof![
            Just(KvPoll::Failed),
            Just(KvPoll::Bootstrapping),
            Just(KvPoll::WaitingForInput),
            Just(KvPoll::Transferring),
            Just(KvPoll::Success),
        ]
    }

    #[test]
    fn codes_are_sglangs() {
        let codes: Vec<u8> = [
            KvPoll::Failed,
            KvPoll::Bootstrapping,
            KvPoll::WaitingForInput,
            KvPoll::Transferring,
            KvPoll::Success,
        ]
        .iter()
        .map(|&s| s as u8)
        .collect();
        assert_eq!(codes, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn failed_overrides_but_success_is_final() {
        let mut c = PollCell::new();
        assert!(c.set(KvPoll::Transferring));
        assert!(!c.set(KvPoll::WaitingForInput));
        assert!(c.set(KvPoll::Success));
        assert!(!c.set(KvPoll::Failed));
        assert_eq!(c.render(), "Bootstrapping → Transferring → Success");
        let mut c = PollCell::new();
        assert!(c.set(KvPoll::Failed));
        assert!(!c.set(KvPoll::Success));
        assert_eq!(c.get(), KvPoll::Failed);
    }

    proptest! {
        #[test]
        fn status_rises_until_terminal(updates in proptest::collection::vec(poll(), 0..20)) {
            let mut c = PollCell::new();
            for u in updates {
                let before = c.get();
                c.set(u);
                let after = c.get();
                if before.is_terminal() {
                    prop_assert_eq!(after, before);
                } else if u == KvPoll::Failed {
                    prop_assert_eq!(after, KvPoll::Failed);
                } else {
                    prop_assert_eq!(after, before.max(u));
                }
            }
            let h = c.history();
            for w in h.windows(2) {
                prop_assert!(w[1] == KvPoll::Failed || w[1] > w[0]);
                prop_assert!(!w[0].is_terminal());
            }
        }
    }
}
