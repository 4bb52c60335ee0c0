"""KV-cache events as vLLM publishes them (issue 15, part 2), against the real server on the tiny model.

A pyzmq subscriber receives the `[topic, 8-byte big-endian sequence number, msgpack batch]` messages of a
real workload, decodes vLLM's array layout, rebuilds every block hash from the event's token ids with the
prefix index's own function (xxh3-64, fixed seed, over parent hash, token count, tokens, extra keys), and
mirrors the cache; a late subscriber gets the same batches from the replay socket.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import msgpack
import pytest
import xxhash
import zmq

from server_process import ServerProcess
from test_server import http, post_json

HASH_SEED = 0x4E6F7661496E6665  # "NovaInfe", crates/novainfer-core/src/prefix_hash.rs
BLOCK = 16
TOPIC = b"kv@pod-0@tiny"


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """The prefix index's hash of one full block (BlockKey::hash, no extra keys)."""
    data = b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")
    data += len(tokens).to_bytes(8, "little") + struct.pack(f"<{len(tokens)}I", *tokens)
    data += (0).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FIELDS = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                           "lora_name"],
          "BlockRemoved": ["block_hashes", "medium"],
          "AllBlocksCleared": []}


def as_array(event) -> list:
    """An event in vLLM's older tag-first array form; a map (vLLM's current form) must have exactly vLLM's keys."""
    if isinstance(event, list):
        return event
    tag = event["type"]
    assert sorted(event) == sorted(["type", *FIELDS[tag]]), event
    return [tag, *(event[f] for f in FIELDS[tag])]


class Mirror:
    """A router's view of one replica's prefix cache, built from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[int]] = {}
        self.stored = self.removed = 0

    def apply(self, payload: bytes) -> None:
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        for event in map(as_array, events):
            tag = event[0]
            if tag == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium, lora_name = event[1:]
                assert block_size == BLOCK and len(tokens) == BLOCK * len(hashes)
                assert (lora_id, medium, lora_name) == (None, None, None)
                assert parent is None or parent in self.blocks, "a block's parent is stored before it"
                for i, h in enumerate(hashes):
                    chunk = tokens[i * BLOCK:(i + 1) * BLOCK]
                    assert h == block_hash(parent, chunk), "hash rebuilt from token_ids"
                    assert h not in self.blocks, "stored twice without a removal"
                    self.blocks[h] = chunk
                    parent = h
                self.stored += len(hashes)
            elif tag == "BlockRemoved":
                hashes, medium = event[1:]
                for h in hashes:
                    assert self.blocks.pop(h, None) is not None, "removed a block never stored"
                self.removed += len(hashes)
            else:
                assert event == ["AllBlocksCleared"], event
                self.blocks.clear()


def receive(sub: zmq.Socket, quiet: float = 1.0) -> list[tuple[int, bytes]]:
    """(seq, payload) of every message until none arrives for `quiet` seconds."""
    out = []
    while sub.poll(int(quiet * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC
        out.append((int.from_bytes(seq, "big"), payload))
    return out


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER: [b"", start seq] → [b"", seq, payload]... then seq -1."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(30_000), "replay never ended"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return out
            out.append((seq, payload))
    finally:
        dealer.close(linger=0)


def completion(server, prompt: str, max_tokens: int = 24) -> None:
    status, _, body = post_json(server, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                            "max_tokens": max_tokens, "temperature": 0,
                                                            "ignore_eos": True})
    assert status == 200, body


@pytest.fixture
def ports():
    return free_port(), free_port()


def serve(tiny_models, pub: int, rep: int, *extra: str) -> ServerProcess:
    """A server publishing events on `pub`, replaying on `rep`; `extra` server flags."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{rep}", "topic": TOPIC.decode(), "buffer_steps": 100_000}
    # A small pool (64 blocks of 16 tokens) so that the workload evicts.
    return ServerProcess(["--model", str(tiny_models["f32"]), "--served-model-name", "tiny",
                          "--kv-cache-bytes", str(1 << 18), "--kv-events-config", json.dumps(config), *extra])


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_subscriber_rebuilds_the_cache_and_a_late_one_replays(tiny_models, ports, encoding):
    pub, rep = ports
    with serve(tiny_models, pub, rep, "--kv-events-encoding", encoding) as server:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(f"tcp://127.0.0.1:{pub}")
        time.sleep(0.5)  # ZMQ's slow joiner: a gap would still be repaired from the replay below
        try:
            shared = "A system prompt that every session of this test shares, long enough for blocks. " * 3
            prompts = [shared + f"session {i} asks something different {i * 7}" for i in range(6)]
            # Distinct long prompts fill the small pool and make it evict older blocks.
            prompts += [f"{i} unrelated filler text number {i} " * 12 for i in range(12)]
            threads = [threading.Thread(target=completion, args=(server, p)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            live = receive(sub)
        finally:
            sub.close(linger=0)
        assert live, "no events"
        seqs = [s for s, _ in live]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        # The late subscriber asks for everything from sequence 0: contiguous, and byte-equal to what the
        # live one got.
        replayed = replay(f"tcp://127.0.0.1:{rep}", 0)
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert set(live) <= set(replayed)
        mirror = Mirror()
        for _, payload in replayed:
            mirror.apply(payload)
            kind = type(msgpack.unpackb(payload)[1][0])
            assert kind is (dict if encoding == "map" else list), kind
        assert mirror.stored > 0 and mirror.removed > 0, (mirror.stored, mirror.removed)

        # The shared prompt's first block is what the index holds for those tokens: the mirror has it
        # unless it was evicted (then the mirror saw its removal).
        status, _, body = post_json(server, "/tokenize", {"model": "tiny", "prompt": prompts[0]})
        first = json.loads(body)["tokens"][:BLOCK]
        h0 = block_hash(None, first)
        assert h0 in mirror.blocks or any(
            e[0] == "BlockRemoved" and h0 in e[1] for _, p in replayed for e in map(as_array, msgpack.unpackb(p)[1]))

        # Replay from the middle starts there.
        middle = len(replayed) // 2
        assert [s for s, _ in replay(f"tcp://127.0.0.1:{rep}", middle)] == list(range(middle, len(replayed)))

        text = http(server, "GET", "/metrics")[2].decode()
        assert f'novainfer:kv_events_published_total{{model_name="tiny"}} {len(replayed)}' in text
        assert 'novainfer:kv_events_dropped_total{model_name="tiny"} 0' in text


def test_a_subscriber_that_never_reads_does_not_stall_the_engine(tiny_models, ports):
    pub, rep = ports
    with serve(tiny_models, pub, rep) as server:
        ctx = zmq.Context.instance()
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(f"tcp://127.0.0.1:{pub}")
        try:
            time.sleep(0.3)
            for i in range(8):
                completion(server, f"{i} a prompt of some length to fill blocks {i} " * 8, max_tokens=32)
            server.wait_idle("tiny")
        finally:
            stuck.close(linger=0)
        text = http(server, "GET", "/metrics")[2].decode()
        assert "novainfer:kv_events_dropped_total" in text


def test_bad_kv_events_configs_fail_at_start(tiny_models):
    base = ["--model", str(tiny_models["f32"]), "--served-model-name", "tiny"]
    for config, needle in [('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                           ('{"enable_kv_cache_events": true, "buffer_step": 3}', "buffer_step"),
                           ("not json", "kv-events-config")]:
        with pytest.raises(RuntimeError, match=needle):
            ServerProcess([*base, "--kv-events-config", config], timeout=30)
