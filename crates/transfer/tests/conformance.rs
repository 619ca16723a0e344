//! Every backend of this crate passes the TransferEngine conformance suite.

use transfer::testing::check_transfer_engine;
use transfer::{new_engine, BackendKind, TransferConfig};

fn run(kind: BackendKind, moves_data: bool) {
    let cfg = TransferConfig::default();
    check_transfer_engine(|| new_engine(kind, &cfg).unwrap(), moves_data);
}

#[test]
fn tcp_conforms() {
    run(BackendKind::Tcp, true);
}

#[test]
fn tcp_with_one_stream_conforms() {
    let cfg = TransferConfig {
        streams: 1,
        ..TransferConfig::default()
    };
    check_transfer_engine(|| new_engine(BackendKind::Tcp, &cfg).unwrap(), true);
}

#[test]
fn shm_conforms() {
    run(BackendKind::Shm, true);
}

#[test]
fn fake_conforms() {
    run(BackendKind::Fake, false);
}
