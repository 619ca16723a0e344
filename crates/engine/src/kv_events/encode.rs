//! vLLM's `KVEventBatch` in msgpack, byte for byte as msgspec encodes it with
//! `array_like=True, omit_defaults=True` (`vllm/distributed/kv_events.py`): a batch is the array
//! `[ts, [event, ...]]` (plus `data_parallel_rank` only when set), and each event a tagged array
//! whose first element is its class name:
//!
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
//! - `["BlockRemoved", block_hashes, medium]`
//! - `["AllBlocksCleared"]`
//!
//! `lora_id` and `medium` have no default in vLLM's structs, so they are written (as nil).
//! Integers take their smallest msgpack form and floats are float64, as msgspec writes them.

use std::convert::Infallible;

use radix_cache::KvEvent;
use rmp::encode::{self, ByteBuf, ValueWriteError};

use super::KvEventsError;

/// One batch's msgpack payload: `ts` in seconds since the epoch, `events` in order, and the
/// data-parallel rank when there is one (kvserve: none, so the field is omitted).
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: Option<i64>,
) -> Result<Vec<u8>, KvEventsError> {
    let mut w = ByteBuf::new();
    array_len(&mut w, 2 + usize::from(data_parallel_rank.is_some()))?;
    ok(encode::write_f64(&mut w, ts));
    array_len(&mut w, events.len())?;
    for ev in events {
        encode_event(&mut w, ev)?;
    }
    if let Some(rank) = data_parallel_rank {
        ok(encode::write_sint(&mut w, rank));
    }
    Ok(w.into_vec())
}

fn encode_event(w: &mut ByteBuf, ev: &KvEvent) -> Result<(), KvEventsError> {
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            array_len(w, 7)?;
            ok(encode::write_str(w, "BlockStored"));
            ints(w, block_hashes)?;
            match parent_block_hash {
                Some(h) => _ = ok(encode::write_sint(w, *h)),
                None => nil(w),
            }
            array_len(w, token_ids.len())?;
            for &t in token_ids {
                ok(encode::write_uint(w, t.into()));
            }
            ok(encode::write_uint(w, (*block_size).into()));
            nil(w); // lora_id
            nil(w); // medium
        }
        KvEvent::BlockRemoved { block_hashes } => {
            array_len(w, 3)?;
            ok(encode::write_str(w, "BlockRemoved"));
            ints(w, block_hashes)?;
            nil(w); // medium
        }
        KvEvent::AllBlocksCleared => {
            array_len(w, 1)?;
            ok(encode::write_str(w, "AllBlocksCleared"));
        }
    }
    Ok(())
}

fn ints(w: &mut ByteBuf, values: &[i64]) -> Result<(), KvEventsError> {
    array_len(w, values.len())?;
    for &v in values {
        ok(encode::write_sint(w, v));
    }
    Ok(())
}

fn array_len(w: &mut ByteBuf, len: usize) -> Result<(), KvEventsError> {
    let len = u32::try_from(len).map_err(|_| {
        KvEventsError::Encode(format!("an array of {len} items is beyond msgpack's limit"))
    })?;
    ok(encode::write_array_len(w, len));
    Ok(())
}

fn nil(w: &mut ByteBuf) {
    match encode::write_nil(w) {
        Ok(()) => {}
        Err(e) => match e {},
    }
}

/// The value of a write into a [`ByteBuf`], which cannot fail.
fn ok<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => {
            match e {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmp::decode::{self, Bytes, RmpRead};
    use rmp::Marker;

    /// A readable rendering of any msgpack value this module writes (decoded with rmp's own
    /// reader, not with the encoder's code).
    fn render(rd: &mut Bytes<'_>) -> String {
        let m = decode::read_marker(rd).expect("a marker");
        let uint = |rd: &mut Bytes<'_>, n: usize| {
            let mut v = 0u64;
            for _ in 0..n {
                v = v << 8 | u64::from(byte(rd));
            }
            v
        };
        match m {
            Marker::Null => "nil".into(),
            Marker::FixPos(v) => v.to_string(),
            Marker::FixNeg(v) => v.to_string(),
            Marker::U8 => uint(rd, 1).to_string(),
            Marker::U16 => uint(rd, 2).to_string(),
            Marker::U32 => uint(rd, 4).to_string(),
            Marker::U64 => uint(rd, 8).to_string(),
            Marker::I8 => (uint(rd, 1) as u8 as i8).to_string(),
            Marker::I16 => (uint(rd, 2) as u16 as i16).to_string(),
            Marker::I32 => (uint(rd, 4) as u32 as i32).to_string(),
            Marker::I64 => (uint(rd, 8) as i64).to_string(),
            Marker::F64 => format!("{:?}f64", f64::from_bits(uint(rd, 8))),
            Marker::FixStr(n) => {
                let s: Vec<u8> = (0..n).map(|_| byte(rd)).collect();
                format!("{:?}", String::from_utf8(s).unwrap())
            }
            Marker::FixArray(n) => items(rd, n.into()),
            Marker::Array16 => {
                let n = uint(rd, 2) as u32;
                items(rd, n)
            }
            other => panic!("unexpected marker {other:?}"),
        }
    }

    fn byte(rd: &mut Bytes<'_>) -> u8 {
        rd.read_u8().expect("a byte")
    }

    fn items(rd: &mut Bytes<'_>, n: u32) -> String {
        let v: Vec<String> = (0..n).map(|_| render(rd)).collect();
        format!("[{}]", v.join(", "))
    }

    fn rendered(bytes: &[u8]) -> String {
        let mut rd = Bytes::new(bytes);
        let s = render(&mut rd);
        assert!(rd.remaining_slice().is_empty(), "trailing bytes");
        s
    }

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![-7_046_029_254_386_353_131, 1_234_567_890_123],
                parent_block_hash: None,
                token_ids: (0..8).map(|t| t * 40_000).collect(),
                block_size: 4,
            },
            KvEvent::BlockStored {
                block_hashes: vec![300],
                parent_block_hash: Some(1_234_567_890_123),
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![300, -40_000],
            },
            KvEvent::AllBlocksCleared,
        ]
    }

    #[test]
    fn a_batch_decodes_to_vllms_array_like_structs() {
        let bytes = encode_batch(1_764_000_000.25, &sample(), None).unwrap();
        insta::assert_snapshot!(rendered(&bytes));
        let with_rank = encode_batch(0.5, &[], Some(3)).unwrap();
        assert_eq!(rendered(&with_rank), "[0.5f64, [], 3]");
    }

    /// One small batch against bytes written out by hand from the msgpack spec.
    #[test]
    fn a_small_batch_is_these_bytes() {
        let events = [
            KvEvent::BlockStored {
                block_hashes: vec![-1, 200],
                parent_block_hash: None,
                token_ids: vec![5, 300],
                block_size: 1,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![-100],
            },
            KvEvent::AllBlocksCleared,
        ];
        let mut want = vec![
            0x92, // fixarray(2): [ts, events]
            0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0,    // float64 1.5
            0x93, // fixarray(3): three events
            0x97, // fixarray(7): BlockStored
            0xab, // fixstr(11)
        ];
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[
            0x92, 0xff, 0xcc, 0xc8, // [-1 (negative fixint), 200 (uint8)]
            0xc0, // parent: nil
            0x92, 0x05, 0xcd, 0x01, 0x2c, // [5 (positive fixint), 300 (uint16)]
            0x01, // block_size
            0xc0, 0xc0, // lora_id, medium
            0x93, // fixarray(3): BlockRemoved
            0xac, // fixstr(12)
        ]);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0xd0, 0x9c, 0xc0]); // [-100 (int8)], medium nil
        want.extend_from_slice(&[0x91, 0xb0]); // fixarray(1), fixstr(16)
        want.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(encode_batch(1.5, &events, None).unwrap(), want);
    }
}
