//! The control channel's wire format (SGLang's ZMQ messages of `disaggregation/mooncake/conn.py`,
//! as tagged JSON): each frame is a big-endian `u32` length and that many bytes of one
//! [`ControlMsg`]. A frame over [`MAX_FRAME`] or one that does not parse ends the connection
//! with an error (the caller logs it), never a panic.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::engine::{RegionId, SegmentDesc};
use crate::pd::config::{ServerCompat, TransferAux};

/// The largest frame either side accepts (16 MiB: a TransferInfo for a million pages).
pub const MAX_FRAME: usize = 16 << 20;

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum ControlMsg {
    /// Decode → prefill, first on a connection (SGLang's KV-args registration, room `"None"`):
    /// the decode's compatibility record, its engine segment, and its KV regions (ids into the
    /// segment, with each one's page bytes) in the same layer/buffer order as the prefill's.
    Register {
        /// The decode server's compatibility record.
        compat: ServerCompat,
        /// Its engine's segment descriptor.
        segment: SegmentDesc,
        /// `(region id, item_len)` of each KV region, in layer/buffer order.
        kv_regions: Vec<(RegionId, u64)>,
    },
    /// Prefill → decode: the registration was refused; the connection closes.
    RegisterError {
        /// Why.
        error: String,
    },
    /// Decode → prefill, per room: where to write.
    TransferInfo {
        /// The bootstrap room.
        room: u64,
        /// Destination page ids for prompt positions `decode_prefix_len..`, in order.
        dst_pages: Vec<u32>,
        /// Positions decode already holds.
        decode_prefix_len: usize,
    },
    /// Either way: stop the room.
    Abort {
        /// The room.
        room: u64,
        /// Why.
        reason: String,
    },
    /// Prefill → decode: the room's end.
    Status {
        /// The room.
        room: u64,
        /// `true`: every page and the aux landed.
        success: bool,
        /// With success: the aux row.
        aux: Option<TransferAux>,
        /// With failure: why.
        error: Option<String>,
        /// KV bytes written.
        bytes: u64,
    },
    /// Prefill → decode: the room is stopped and none of its writes is still in flight.
    AbortAck {
        /// The room.
        room: u64,
    },
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// A socket error.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A length over the cap.
    #[error("frame of {0} bytes is over the {MAX_FRAME}-byte cap")]
    TooLarge(usize),
    /// Bytes that are not a [`ControlMsg`].
    #[error("malformed control message: {0}")]
    Malformed(String),
}

/// Writes one frame.
pub async fn write_msg<W: AsyncWrite + Unpin>(w: &mut W, msg: &ControlMsg) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    w.flush().await
}

/// Reads one frame: [`FrameError::Closed`] on a clean end between frames.
pub async fn read_msg<R: AsyncRead + Unpin>(r: &mut R) -> Result<ControlMsg, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map_err(|e| FrameError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_bad_frames_are_errors() {
        let msg = ControlMsg::TransferInfo {
            room: 7,
            dst_pages: vec![3, 4],
            decode_prefix_len: 16,
        };
        let mut buf = Vec::new();
        write_msg(&mut buf, &msg).await.unwrap();
        assert_eq!(read_msg(&mut buf.as_slice()).await.unwrap(), msg);
        assert!(matches!(
            read_msg(&mut &[][..]).await,
            Err(FrameError::Closed)
        ));
        let huge = (MAX_FRAME as u32 + 1).to_be_bytes();
        assert!(matches!(
            read_msg(&mut &huge[..]).await,
            Err(FrameError::TooLarge(_))
        ));
        let mut junk = 3u32.to_be_bytes().to_vec();
        junk.extend_from_slice(b"{x}");
        assert!(matches!(
            read_msg(&mut junk.as_slice()).await,
            Err(FrameError::Malformed(_))
        ));
    }
}
