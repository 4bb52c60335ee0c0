//! vLLM's msgpack encoding of a `KVEventBatch` (msgspec `array_like` structs, tagged events):
//!
//! ```text
//! batch:            [ts: float64, [event, ...], data_parallel_rank: 0]
//! BlockStored:      ["BlockStored", [hash, ...], parent_hash | nil, [token_id, ...], block_size,
//!                    lora_id: nil, medium: nil, lora_name: nil]
//! BlockRemoved:     ["BlockRemoved", [hash, ...], medium: nil]
//! AllBlocksCleared: ["AllBlocksCleared"]
//! ```
//! Hashes are unsigned 64-bit integers. `medium` is nil: the engine's one KV pool (vLLM
//! writes "GPU" for its device pool; consumers read nil as their default tier).

use novainfer_core::{BlockHash, KvEvent};
use rmp::encode;

/// The batch's msgpack bytes. `ts` is seconds since the Unix epoch.
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 16 * events.len());
    // Writing into a Vec cannot fail.
    let _ = write_batch(&mut out, ts, events);
    out
}

fn write_batch(
    out: &mut Vec<u8>,
    ts: f64,
    events: &[KvEvent],
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
            } => {
                encode::write_array_len(out, 8)?;
                encode::write_str(out, "BlockStored")?;
                write_hashes(out, block_hashes)?;
                match parent {
                    Some(h) => {
                        encode::write_uint(out, h.0)?;
                    }
                    None => nil(out)?,
                }
                encode::write_array_len(out, len(token_ids.len()))?;
                for &t in token_ids {
                    encode::write_uint(out, u64::from(t))?;
                }
                encode::write_uint(out, *block_size as u64)?;
                for _ in 0..3 {
                    // lora_id, medium, lora_name
                    nil(out)?;
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                encode::write_array_len(out, 3)?;
                encode::write_str(out, "BlockRemoved")?;
                write_hashes(out, block_hashes)?;
                nil(out)?;
            }
            KvEvent::AllBlocksCleared => {
                encode::write_array_len(out, 1)?;
                encode::write_str(out, "AllBlocksCleared")?;
            }
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
    fn a_batch_is_vllms_array_layout() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![BlockHash(u64::MAX), BlockHash(5)],
                parent: None,
                token_ids: vec![1, 300],
                block_size: 1,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![BlockHash(7)],
            },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_batch(1.5, &events);
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
