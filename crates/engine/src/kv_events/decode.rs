//! Reading vLLM's `KVEventBatch` msgpack back ([`decode_batch`]): what a subscriber (the
//! router's `kv_events` policy) does with each message of a worker's stream, the inverse of
//! [`super::encode::encode_batch`]. Tolerant as msgspec is: fields past the ones known here
//! (newer vLLM adds some) are skipped, integers take any msgpack width. A payload that is not
//! a batch is a [`KvEventsError::Decode`] naming what is wrong, never a panic.

use radix_cache::KvEvent;
use rmp::Marker;

use super::KvEventsError;

/// Deepest nesting accepted (a batch needs 4).
const MAX_DEPTH: usize = 16;

/// A msgpack value, as far as batches need one.
#[derive(Debug, Clone, PartialEq)]
enum V {
    Nil,
    Int(i64),
    Float(f64),
    Str(String),
    Arr(Vec<V>),
    /// Booleans, binaries, maps and extensions: read past, never needed.
    Other,
}

fn err(m: impl Into<String>) -> KvEventsError {
    KvEventsError::Decode(m.into())
}

fn take<'a>(rd: &mut &'a [u8], n: usize) -> Result<&'a [u8], KvEventsError> {
    if rd.len() < n {
        return Err(err("the payload ends in the middle of a value"));
    }
    let (head, tail) = rd.split_at(n);
    *rd = tail;
    Ok(head)
}

fn be(rd: &mut &[u8], n: usize) -> Result<u64, KvEventsError> {
    Ok(take(rd, n)?
        .iter()
        .fold(0u64, |a, &b| (a << 8) | u64::from(b)))
}

fn value(rd: &mut &[u8], depth: usize) -> Result<V, KvEventsError> {
    if depth > MAX_DEPTH {
        return Err(err("values nested too deep"));
    }
    let m = Marker::from_u8(take(rd, 1)?[0]);
    let many = |rd: &mut &[u8], n: usize| -> Result<Vec<V>, KvEventsError> {
        (0..n).map(|_| value(rd, depth + 1)).collect()
    };
    let skip = |rd: &mut &[u8], n: usize| take(rd, n).map(|_| V::Other);
    Ok(match m {
        Marker::Null => V::Nil,
        Marker::True | Marker::False => V::Other,
        Marker::FixPos(n) => V::Int(n.into()),
        Marker::FixNeg(n) => V::Int(n.into()),
        Marker::U8 => V::Int(be(rd, 1)? as i64),
        Marker::U16 => V::Int(be(rd, 2)? as i64),
        Marker::U32 => V::Int(be(rd, 4)? as i64),
        Marker::U64 => V::Int(i64::try_from(be(rd, 8)?).map_err(|_| err("an integer over 2^63"))?),
        Marker::I8 => V::Int(be(rd, 1)? as u8 as i8 as i64),
        Marker::I16 => V::Int(be(rd, 2)? as u16 as i16 as i64),
        Marker::I32 => V::Int(be(rd, 4)? as u32 as i32 as i64),
        Marker::I64 => V::Int(be(rd, 8)? as i64),
        Marker::F32 => V::Float(f32::from_bits(be(rd, 4)? as u32).into()),
        Marker::F64 => V::Float(f64::from_bits(be(rd, 8)?)),
        Marker::FixStr(n) => str_of(take(rd, n.into())?)?,
        Marker::Str8 => {
            let n = be(rd, 1)? as usize;
            str_of(take(rd, n)?)?
        }
        Marker::Str16 => {
            let n = be(rd, 2)? as usize;
            str_of(take(rd, n)?)?
        }
        Marker::Str32 => {
            let n = be(rd, 4)? as usize;
            str_of(take(rd, n)?)?
        }
        Marker::Bin8 => {
            let n = be(rd, 1)? as usize;
            skip(rd, n)?
        }
        Marker::Bin16 => {
            let n = be(rd, 2)? as usize;
            skip(rd, n)?
        }
        Marker::Bin32 => {
            let n = be(rd, 4)? as usize;
            skip(rd, n)?
        }
        Marker::FixArray(n) => V::Arr(many(rd, n.into())?),
        Marker::Array16 => V::Arr({
            let n = be(rd, 2)? as usize;
            many(rd, n)
        }?),
        Marker::Array32 => V::Arr({
            let n = be(rd, 4)? as usize;
            many(rd, n)
        }?),
        Marker::FixMap(n) => many(rd, 2 * usize::from(n)).map(|_| V::Other)?,
        Marker::Map16 => {
            let n = 2 * be(rd, 2)? as usize;
            many(rd, n)
        }
        .map(|_| V::Other)?,
        Marker::Map32 => {
            let n = 2 * be(rd, 4)? as usize;
            many(rd, n)
        }
        .map(|_| V::Other)?,
        Marker::FixExt1 => skip(rd, 2)?,
        Marker::FixExt2 => skip(rd, 3)?,
        Marker::FixExt4 => skip(rd, 5)?,
        Marker::FixExt8 => skip(rd, 9)?,
        Marker::FixExt16 => skip(rd, 17)?,
        Marker::Ext8 => {
            let n = 1 + be(rd, 1)? as usize;
            skip(rd, n)?
        }
        Marker::Ext16 => {
            let n = 1 + be(rd, 2)? as usize;
            skip(rd, n)?
        }
        Marker::Ext32 => {
            let n = 1 + be(rd, 4)? as usize;
            skip(rd, n)?
        }
        Marker::Reserved => return Err(err("a reserved msgpack marker (0xc1)")),
    })
}

fn str_of(bytes: &[u8]) -> Result<V, KvEventsError> {
    std::str::from_utf8(bytes)
        .map(|s| V::Str(s.to_string()))
        .map_err(|_| err("a string that is not UTF-8"))
}

fn ints(v: Option<&V>, what: &str) -> Result<Vec<i64>, KvEventsError> {
    match v {
        Some(V::Arr(items)) => items
            .iter()
            .map(|x| match x {
                V::Int(i) => Ok(*i),
                _ => Err(err(format!(
                    "{what} holds something that is not an integer"
                ))),
            })
            .collect(),
        _ => Err(err(format!("{what} is not a list"))),
    }
}

fn event(v: &V) -> Result<KvEvent, KvEventsError> {
    let V::Arr(f) = v else {
        return Err(err("an event is not an array"));
    };
    match f.first() {
        Some(V::Str(tag)) if tag == "BlockStored" => {
            let parent_block_hash = match f.get(2) {
                Some(V::Nil) => None,
                Some(V::Int(h)) => Some(*h),
                _ => {
                    return Err(err(
                        "BlockStored's parent_block_hash is not an integer or nil",
                    ))
                }
            };
            let token_ids = ints(f.get(3), "BlockStored's token_ids")?
                .into_iter()
                .map(|t| u32::try_from(t).map_err(|_| err("a token id out of range")))
                .collect::<Result<_, _>>()?;
            let block_size = match f.get(4) {
                Some(V::Int(n)) if (1..=i64::from(u32::MAX)).contains(n) => *n as u32,
                _ => return Err(err("BlockStored's block_size is not a positive integer")),
            };
            Ok(KvEvent::BlockStored {
                block_hashes: ints(f.get(1), "BlockStored's block_hashes")?,
                parent_block_hash,
                token_ids,
                block_size,
            })
        }
        Some(V::Str(tag)) if tag == "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: ints(f.get(1), "BlockRemoved's block_hashes")?,
        }),
        Some(V::Str(tag)) if tag == "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        Some(V::Str(tag)) => Err(err(format!("an unknown event {tag:?}"))),
        _ => Err(err("an event without its class name")),
    }
}

/// A batch's timestamp (seconds since the epoch) and events, from its msgpack payload.
pub fn decode_batch(payload: &[u8]) -> Result<(f64, Vec<KvEvent>), KvEventsError> {
    let mut rd = payload;
    let v = value(&mut rd, 0)?;
    if !rd.is_empty() {
        return Err(err("bytes after the batch"));
    }
    let V::Arr(f) = v else {
        return Err(err("a batch is not an array"));
    };
    let ts = match f.first() {
        Some(V::Float(t)) => *t,
        Some(V::Int(t)) => *t as f64,
        _ => return Err(err("a batch's timestamp is not a number")),
    };
    let Some(V::Arr(events)) = f.get(1) else {
        return Err(err("a batch's events are not a list"));
    };
    Ok((ts, events.iter().map(event).collect::<Result<_, _>>()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::encode_batch;
    use proptest::prelude::*;

    fn arb_event() -> impl Strategy<Value = KvEvent> {
        prop_oneof![
            (
                proptest::collection::vec(any::<i64>(), 0..4),
                proptest::option::of(any::<i64>()),
                proptest::collection::vec(any::<u32>(), 0..40),
                1u32..64,
            )
                .prop_map(
                    |(block_hashes, parent_block_hash, token_ids, block_size)| {
                        KvEvent::BlockStored {
                            block_hashes,
                            parent_block_hash,
                            token_ids,
                            block_size,
                        }
                    }
                ),
            proptest::collection::vec(any::<i64>(), 0..4)
                .prop_map(|block_hashes| KvEvent::BlockRemoved { block_hashes }),
            Just(KvEvent::AllBlocksCleared),
        ]
    }

    proptest! {
        /// Whatever the encoder writes reads back as it was.
        #[test]
        fn decode_inverts_encode(
            ts in 0.0f64..2e9,
            events in proptest::collection::vec(arb_event(), 0..8),
            rank in proptest::option::of(0i64..8),
        ) {
            let bytes = encode_batch(ts, &events, rank).unwrap();
            prop_assert_eq!(decode_batch(&bytes).unwrap(), (ts, events));
        }

        /// Any bytes: an error or a batch, never a panic.
        #[test]
        fn garbage_is_an_error_not_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_batch(&bytes);
        }
    }

    #[test]
    fn truncated_and_foreign_payloads_say_what_is_wrong() {
        let ok = encode_batch(1.5, &[KvEvent::AllBlocksCleared], None).unwrap();
        let e = decode_batch(&ok[..ok.len() - 1]).unwrap_err();
        assert!(e.to_string().contains("ends in the middle"), "{e}");
        // A batch with an event from a newer vLLM.
        let mut w = Vec::new();
        rmp::encode::write_array_len(&mut w, 2).unwrap();
        rmp::encode::write_f64(&mut w, 1.0).unwrap();
        rmp::encode::write_array_len(&mut w, 1).unwrap();
        rmp::encode::write_array_len(&mut w, 1).unwrap();
        rmp::encode::write_str(&mut w, "BlockMoved").unwrap();
        let e = decode_batch(&w).unwrap_err();
        assert!(
            e.to_string().contains("unknown event \"BlockMoved\""),
            "{e}"
        );
    }
}
