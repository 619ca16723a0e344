#!/usr/bin/env python3
"""Variants of a Mooncake-format trace, to test an eviction policy off the trace it was tuned on.

    python3 scripts/trace_variants.py TRACE.jsonl OUT_DIR

Writes, in the same format (`timestamp`, `input_length`, `output_length`, `hash_ids`):

- `second_half.jsonl`: the requests after the first half, timestamps shifted to start at 0
  (conversations cut at the middle lose their earlier turns);
- `half_conversations_a.jsonl` / `..._b.jsonl`: the two halves of the conversations, split by a
  hash of each request's second block id (the first block is the shared system prompt, so a
  conversation's turns share the second): half the load at the same per-conversation timing;
- `doubled.jsonl`: the trace with a second copy of every conversation interleaved (its block
  ids past the trace's largest, the shared first block kept): twice the load, the same timing;
- `no_system_prompt.jsonl`: every request without its first block (no shared prefix; the
  conversations start at the root).

Every variant is a deterministic function of the input.
"""

import json
import os
import sys


def conversation_half(r):
    ids = r["hash_ids"]
    key = ids[1] if len(ids) > 1 else ids[0]
    return (key * 0x9E3779B1 >> 7) & 1


def write(path, reqs):
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    print(f"{path}: {len(reqs)} requests")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    with open(src) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    half = reqs[len(reqs) // 2 :]
    t0 = half[0]["timestamp"]
    write(os.path.join(out, "second_half.jsonl"), [dict(r, timestamp=r["timestamp"] - t0) for r in half])
    for side, name in [(0, "a"), (1, "b")]:
        write(
            os.path.join(out, f"half_conversations_{name}.jsonl"),
            [r for r in reqs if conversation_half(r) == side],
        )
    top = max(i for r in reqs for i in r["hash_ids"]) + 1
    doubled = []
    for r in reqs:
        doubled.append(r)
        ids = r["hash_ids"]
        copy = ids[:1] + [i + top for i in ids[1:]]
        doubled.append(dict(r, hash_ids=copy))
    write(os.path.join(out, "doubled.jsonl"), doubled)
    bare = []
    for r in reqs:
        if len(r["hash_ids"]) > 1 and r["input_length"] > 512:
            bare.append(dict(r, input_length=r["input_length"] - 512, hash_ids=r["hash_ids"][1:]))
    write(os.path.join(out, "no_system_prompt.jsonl"), bare)


if __name__ == "__main__":
    main()
