//! vLLM's msgpack encoding of a `KVEventBatch`. The batch is a msgspec `array_like` struct;
//! the events are msgspec tagged structs, which vLLM encodes as maps with a `type` key
//! ([`Encoding::Map`], vLLM today) or, in its older releases, as arrays with the tag first
//! ([`Encoding::Array`], what some consumers still read):
//!
//! ```text
//! batch:            [ts: float64, [event, ...], data_parallel_rank: 0]
//! BlockStored:      {"type": "BlockStored", "block_hashes": [hash, ...], "parent_block_hash": hash | nil,
//!                    "token_ids": [id, ...], "block_size": n, "lora_id": id or nil, "medium": nil, "lora_name": nil}
//!                   ["BlockStored", [hash, ...], parent | nil, [id, ...], n, nil, nil, nil]
//! BlockRemoved:     {"type": "BlockRemoved", "block_hashes": [hash, ...], "medium": nil}
//!                   ["BlockRemoved", [hash, ...], nil]
//! AllBlocksCleared: {"type": "AllBlocksCleared"}  /  ["AllBlocksCleared"]
//! ```
//! Fields with defaults (`extra_keys`, `group_idx`, …) are left out, as msgspec's
//! `omit_defaults` does. Hashes are unsigned 64-bit integers. `medium` is nil: the engine's
//! one KV pool (vLLM writes "GPU" for its device pool; consumers read nil as their default tier).

use novainfer_core::{BlockHash, KvEvent};
use rmp::encode;

/// How events are laid out inside a batch (`--kv-events-encoding`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Encoding {
    /// Maps with a `type` key: vLLM's current encoding.
    #[default]
    Map,
    /// Arrays with the tag first: vLLM's older encoding.
    Array,
}

/// The batch's msgpack bytes. `ts` is seconds since the Unix epoch.
pub fn encode_batch(ts: f64, events: &[KvEvent], encoding: Encoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 16 * events.len());
    // Writing into a Vec cannot fail.
    let _ = write_batch(&mut out, ts, events, encoding);
    out
}

/// Starts an event of `fields` fields (the tag included) and writes its tag.
fn start_event(
    out: &mut Vec<u8>,
    encoding: Encoding,
    tag: &str,
    fields: u32,
) -> Result<(), encode::ValueWriteError> {
    match encoding {
        Encoding::Map => {
            encode::write_map_len(out, fields)?;
            encode::write_str(out, "type")?;
        }
        Encoding::Array => {
            encode::write_array_len(out, fields)?;
        }
    }
    encode::write_str(out, tag)
}

/// A field's name, in the map encoding.
fn key(out: &mut Vec<u8>, encoding: Encoding, name: &str) -> Result<(), encode::ValueWriteError> {
    match encoding {
        Encoding::Map => encode::write_str(out, name),
        Encoding::Array => Ok(()),
    }
}

fn write_batch(
    out: &mut Vec<u8>,
    ts: f64,
    events: &[KvEvent],
    encoding: Encoding,
) -> Result<(), encode::ValueWriteError> {
    encode::write_array_len(out, 3)?;
    encode::write_f64(out, ts)?;
    encode::write_array_len(out, len(events.len()))?;
    for event in events {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
            } => {
                start_event(out, encoding, "BlockStored", 8)?;
                key(out, encoding, "block_hashes")?;
                write_hashes(out, block_hashes)?;
                key(out, encoding, "parent_block_hash")?;
                match parent {
                    Some(h) => {
                        encode::write_uint(out, h.0)?;
                    }
                    None => nil(out)?,
                }
                key(out, encoding, "token_ids")?;
                encode::write_array_len(out, len(token_ids.len()))?;
                for &t in token_ids {
                    encode::write_uint(out, u64::from(t))?;
                }
                key(out, encoding, "block_size")?;
                encode::write_uint(out, *block_size as u64)?;
                key(out, encoding, "lora_id")?;
                match lora_id {
                    Some(id) => {
                        encode::write_uint(out, *id)?;
                    }
                    None => nil(out)?,
                }
                // The engine's one pool; adapter names are not known in the core.
                for name in ["medium", "lora_name"] {
                    key(out, encoding, name)?;
                    nil(out)?;
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                start_event(out, encoding, "BlockRemoved", 3)?;
                key(out, encoding, "block_hashes")?;
                write_hashes(out, block_hashes)?;
                key(out, encoding, "medium")?;
                nil(out)?;
            }
            KvEvent::AllBlocksCleared => start_event(out, encoding, "AllBlocksCleared", 1)?,
        }
    }
    // data_parallel_rank: one engine per server.
    encode::write_uint(out, 0)?;
    Ok(())
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[BlockHash]) -> Result<(), encode::ValueWriteError> {
    encode::write_array_len(out, len(hashes.len()))?;
    for h in hashes {
        encode::write_uint(out, h.0)?;
    }
    Ok(())
}

fn nil(out: &mut Vec<u8>) -> Result<(), encode::ValueWriteError> {
    encode::write_nil(out).map_err(encode::ValueWriteError::InvalidMarkerWrite)
}

/// msgpack array lengths are u32; a step never records 4 billion events.
fn len(n: usize) -> u32 {
    u32::try_from(n).expect("more than u32::MAX KV events in one step: this is a bug")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_events_carry_their_type_and_field_names() {
        let events = vec![
            KvEvent::BlockRemoved {
                block_hashes: vec![BlockHash(7)],
            },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_batch(1.5, &events, Encoding::Map);
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x92);
        want.extend_from_slice(&[0x83, 0xa4]);
        want.extend_from_slice(b"type");
        want.push(0xac);
        want.extend_from_slice(b"BlockRemoved");
        want.push(0xac);
        want.extend_from_slice(b"block_hashes");
        want.extend_from_slice(&[0x91, 0x07, 0xa6]);
        want.extend_from_slice(b"medium");
        want.push(0xc0);
        want.extend_from_slice(&[0x81, 0xa4]);
        want.extend_from_slice(b"type");
        want.push(0xb0);
        want.extend_from_slice(b"AllBlocksCleared");
        want.push(0x00);
        assert_eq!(bytes, want);
    }

    #[test]
    fn a_batch_is_vllms_array_layout() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![BlockHash(u64::MAX), BlockHash(5)],
                parent: None,
                token_ids: vec![1, 300],
                block_size: 1,
                lora_id: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![BlockHash(7)],
            },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_batch(1.5, &events, Encoding::Array);
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93); // three events
        want.extend_from_slice(&[0x98, 0xab]);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x92, 0xcf]);
        want.extend_from_slice(&u64::MAX.to_be_bytes());
        want.push(0x05);
        want.push(0xc0); // no parent
        want.extend_from_slice(&[0x92, 0x01, 0xcd, 0x01, 0x2c]); // [1, 300]
        want.extend_from_slice(&[0x01, 0xc0, 0xc0, 0xc0]);
        want.extend_from_slice(&[0x93, 0xac]);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0x07, 0xc0]);
        want.extend_from_slice(&[0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        want.push(0x00); // data_parallel_rank
        assert_eq!(bytes, want);
    }
}
