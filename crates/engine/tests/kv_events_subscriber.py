"""A KV event subscriber as a router would run one, with pyzmq and msgpack only.

Usage: kv_events_subscriber.py ENDPOINT REPLAY_ENDPOINT TOPIC [--late]

It connects a SUB socket (filtered on TOPIC) and a DEALER socket for replay, decodes every
batch (vLLM's KVEventBatch: msgspec's array-like msgpack), and rebuilds the set of cached block
hashes from BlockStored / BlockRemoved / AllBlocksCleared. Batches are applied in sequence
order: when a live batch arrives past the next expected number (missed batches, e.g. before the
subscription took effect), the missing ones are asked for on the replay socket. With --late it
asks for a replay from 0 at once, as a subscriber that joins a running server does.

Commands on stdin, one per line, answers on stdout as one JSON line each:
  sync N  -> wait (at most 60 s) until batches 0..N-1 are applied, then answer the state:
             {"applied", "blocks" (sorted), "live_seqs", "replayed_seqs", "errors"}
  replay S -> ask the replay socket for every batch from S on, without applying them; answer
             {"seqs": the sequence numbers it sent before END_SEQ} (at most 10 s)
  quit
"""

import json
import select
import sys
import time

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    def __init__(self, endpoint, replay_endpoint, topic):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.topic = topic.encode()
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.replay, zmq.POLLIN)
        self.next_seq = 0
        self.pending = {}
        self.blocks = set()
        self.live_seqs = []
        self.replayed_seqs = []
        self.replay_in_flight = False
        self.errors = []

    def request_replay(self, start):
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        self.replay_in_flight = True

    def poll(self, timeout_ms):
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is self.sub:
                frames = self.sub.recv_multipart()
                if len(frames) != 3 or frames[0] != self.topic or len(frames[1]) != 8:
                    self.errors.append(f"bad PUB message: {frames!r}"[:300])
                    continue
                seq = int.from_bytes(frames[1], "big")
                self.live_seqs.append(seq)
                self.offer(seq, frames[2])
                if seq > self.next_seq and not self.replay_in_flight:
                    self.request_replay(self.next_seq)
            else:
                frames = self.replay.recv_multipart()
                if len(frames) != 3 or frames[0] != b"":
                    self.errors.append(f"bad replay message: {frames!r}"[:300])
                    continue
                if frames[1] == END_SEQ:
                    if frames[2] != b"":
                        self.errors.append("END_SEQ with a payload")
                    self.replay_in_flight = False
                    continue
                seq = int.from_bytes(frames[1], "big")
                self.replayed_seqs.append(seq)
                self.offer(seq, frames[2])

    def offer(self, seq, payload):
        if seq >= self.next_seq:
            self.pending[seq] = payload
        while self.next_seq in self.pending:
            self.apply(self.pending.pop(self.next_seq))
            self.next_seq += 1

    def apply(self, payload):
        batch = msgpack.unpackb(payload)
        # [ts, events]: msgspec omits data_parallel_rank when it is None.
        if not (isinstance(batch, list) and len(batch) == 2 and isinstance(batch[0], float)):
            self.errors.append(f"bad batch: {batch!r}"[:300])
            return
        for ev in batch[1]:
            tag = ev[0]
            if tag == "BlockStored" and len(ev) == 7:
                hashes, parent, tokens, block_size, lora_id, medium = ev[1:]
                if len(tokens) != len(hashes) * block_size or lora_id is not None or medium is not None:
                    self.errors.append(f"bad BlockStored: {ev!r}"[:300])
                if parent is not None and parent not in self.blocks:
                    self.errors.append(f"BlockStored under an unknown parent {parent}")
                self.blocks.update(hashes)
            elif tag == "BlockRemoved" and len(ev) == 3:
                for h in ev[1]:
                    if h not in self.blocks:
                        self.errors.append(f"BlockRemoved of an unknown block {h}")
                    self.blocks.discard(h)
            elif tag == "AllBlocksCleared" and len(ev) == 1:
                self.blocks.clear()
            else:
                self.errors.append(f"unknown event: {ev!r}"[:300])

    def sync(self, n):
        deadline = time.monotonic() + 60
        while self.next_seq < n and time.monotonic() < deadline:
            self.poll(100)
            if self.next_seq < n and not self.replay_in_flight:
                # A gap, or nothing new arrives live (the last batches were missed): ask.
                self.request_replay(self.next_seq)
        return {
            "applied": self.next_seq,
            "blocks": sorted(self.blocks),
            "live_seqs": self.live_seqs,
            "replayed_seqs": self.replayed_seqs,
            "errors": self.errors,
        }


def replay_seqs(endpoint, start):
    """The sequence numbers a fresh DEALER gets for a replay from `start`, up to END_SEQ."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not dealer.poll(100):
            continue
        frames = dealer.recv_multipart()
        if frames[1] == END_SEQ:
            break
        seqs.append(int.from_bytes(frames[1], "big"))
    dealer.close(linger=0)
    return {"seqs": seqs}


def main():
    endpoint, replay_endpoint, topic = sys.argv[1:4]
    s = Subscriber(endpoint, replay_endpoint, topic)
    if "--late" in sys.argv[4:]:
        s.request_replay(0)
    print(json.dumps({"ready": True}), flush=True)
    while True:
        # Keep receiving while waiting for a command, so nothing queues up in the sockets.
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            s.poll(0)
            continue
        line = sys.stdin.readline()
        if not line or line.strip() == "quit":
            return
        cmd, arg = line.split()
        if cmd == "replay":
            print(json.dumps(replay_seqs(replay_endpoint, int(arg))), flush=True)
            continue
        assert cmd == "sync", line
        print(json.dumps(s.sync(int(arg))), flush=True)


if __name__ == "__main__":
    main()
