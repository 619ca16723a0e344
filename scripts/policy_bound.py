#!/usr/bin/env python3
"""How much of the LRU -> Belady gap an online eviction policy can close on a Mooncake trace,
given how well anything it can see predicts which conversations come back (issue #17).

On a multi-turn trace nearly every hit beyond the shared system prompt is a conversation coming
back, hundreds of requests later. Belady knows which ones come back; an online policy must
predict it. This script measures both sides of that:

1. the best return predictor that the features an online policy could see give: turns behind
   the request, its blocks, its new blocks, the requests since the previous turn and since the
   conversation began, the prompt's last partial block, the output length (which `cache-sim`
   does not even see). A gradient-boosted classifier, cross-fitted on the two halves of the
   trace (so fitted offline, on the trace itself: an upper bound on what learning online from
   the trace's prefix gives). Reported as ROC AUC;
2. what a predictor of a given quality buys: a block-level replay of `kvserve cache-sim` (same
   order, same page-aligned match and insert, one cache of `capacity` blocks; it reproduces
   cache-sim's LRU and Belady to 0.01 points) with a hold-time policy driven by the score,
   key = last access + H * score^k (the policy family that worked best with the real labels),
   for predictors of rising AUC made by adding noise to the true answer, and for the fitted
   predictor of step 1. Each row prints the share of the gap closed at each capacity.

Usage: python3 scripts/policy_bound.py [TRACE] [--caps 2000,5000,10000]
(needs numpy and scikit-learn; page size 512, as the trace's blocks; capacities in blocks.)
"""

import argparse
import bisect
import collections
import heapq
import json

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score

PAGE = 512


def load(path):
    """Each request as (its full blocks, its prompt tokens), in trace order."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return rows, [(r["hash_ids"][: r["input_length"] // PAGE], r["input_length"]) for r in rows]


class Replay:
    """A radix tree of blocks (each block a node, the trace's hash ids its identity). A policy
    keys a node when it becomes an evictable leaf or is accessed while one; the smallest key is
    evicted first (a lazy heap)."""

    def __init__(self, capacity, key):
        self.capacity, self.key = capacity, key
        self.nodes, self.heap, self.used, self.version = {}, [], 0, 0

    def _push_if_leaf(self, block):
        node = self.nodes[block]
        if node["kids"] == 0:
            self.version += 1
            node["version"] = self.version
            heapq.heappush(self.heap, (self.key(block, node), self.version, block))

    def _evict(self, need, locked):
        held = []
        while need > 0:
            entry = heapq.heappop(self.heap)
            _, version, block = entry
            node = self.nodes.get(block)
            if node is None or node["version"] != version or node["kids"]:
                continue
            if block in locked:
                held.append(entry)
                continue
            del self.nodes[block]
            self.used -= 1
            need -= 1
            parent = node["parent"]
            if parent is not None:
                self.nodes[parent]["kids"] -= 1
                self._push_if_leaf(parent)
        for entry in held:
            heapq.heappush(self.heap, entry)

    def run(self, requests):
        hit = total = 0
        for i, (blocks, tokens) in enumerate(requests):
            total += tokens
            if len(blocks) > self.capacity:
                continue
            matched = 0
            while matched < len(blocks) and blocks[matched] in self.nodes:
                matched += 1
            hit += matched * PAGE
            for block in blocks[:matched]:
                self.nodes[block]["last"] = i
            if matched:
                self._push_if_leaf(blocks[matched - 1])
            need = self.used + len(blocks) - matched - self.capacity
            if need > 0:
                self._evict(need, set(blocks[:matched]))
            parent = blocks[matched - 1] if matched else None
            for block in blocks[matched:]:
                if parent is not None:
                    self.nodes[parent]["kids"] += 1
                self.nodes[block] = {"parent": parent, "kids": 0, "last": i, "version": 0}
                self.used += 1
                parent = block
            if matched < len(blocks):
                self._push_if_leaf(blocks[-1])
        return 100.0 * hit / total


def conversations(rows):
    """Per request: the earlier request it continues (the deepest one sharing a block past the
    first), and the blocks it shares with it."""
    last_owner, parent, shared = {}, [None] * len(rows), [0] * len(rows)
    for i, r in enumerate(rows):
        depth, owner = 0, None
        for j, block in enumerate(r["hash_ids"]):
            if block not in last_owner:
                break
            depth, owner = j + 1, last_owner[block]
        if depth >= 2:
            parent[i], shared[i] = owner, depth
        for block in r["hash_ids"]:
            last_owner[block] = i
    return parent, shared


def features(rows, parent, shared):
    turn, prev_gap, start = [0] * len(rows), [-1] * len(rows), list(range(len(rows)))
    for i, p in enumerate(parent):
        if p is not None:
            turn[i], prev_gap[i], start[i] = turn[p] + 1, i - p, start[p]
    continued = {p for p in parent if p is not None}
    x = []
    for i, r in enumerate(rows):
        blocks = len(r["hash_ids"])
        new = blocks - (shared[i] if parent[i] is not None else 0)
        x.append([turn[i], blocks, new, prev_gap[i], i - start[i],
                  r["input_length"] % PAGE, r["output_length"]])
    return np.array(x, float), np.array([i in continued for i in range(len(rows))])


def cross_fit(x, y):
    """Each half scored by a model fitted on the other half."""
    score, half = np.zeros(len(x)), len(x) // 2
    for fit, out in (((0, half), (half, len(x))), ((half, len(x)), (0, half))):
        model = HistGradientBoostingClassifier(max_iter=200, random_state=0)
        model.fit(x[fit[0]:fit[1]], y[fit[0]:fit[1]])
        score[out[0]:out[1]] = model.predict_proba(x[out[0]:out[1]])[:, 1]
    return score


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default="../shared/traces/mooncake_conversation.jsonl")
    ap.add_argument("--caps", default="2000,5000,10000", help="capacities in blocks")
    args = ap.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    rows, requests = load(args.trace)

    uses = collections.defaultdict(list)
    for i, (blocks, _) in enumerate(requests):
        for block in blocks:
            uses[block].append(i)

    def belady(block, node):
        # Farthest next use first (a node is keyed when it is used, so after `last` is now).
        later = uses[block]
        k = bisect.bisect_right(later, node["last"])
        return -(later[k] if k < len(later) else 1 << 40)

    lru = [Replay(c, lambda b, n: n["last"]).run(requests) for c in caps]
    opt = [Replay(c, belady).run(requests) for c in caps]
    print("capacity (blocks):", caps)
    print("lru    ", " / ".join(f"{v:.2f} %" for v in lru))
    print("belady ", " / ".join(f"{v:.2f} %" for v in opt))

    def gap_closed(rates):
        return " / ".join(f"{100 * (r - l) / (b - l):5.1f}" for r, l, b in zip(rates, lru, opt))

    parent, shared = conversations(rows)
    x, y = features(rows, parent, shared)
    names = ["turn", "blocks", "new blocks", "previous gap", "conversation age",
             "partial block", "output length"]
    print("\nreturn predictors (cross-fitted on the trace's halves), ROC AUC:")
    for cols in ([0], [0, 1], [0, 1, 2, 3, 4], list(range(len(names)))):
        auc = roc_auc_score(y, cross_fit(x[:, cols], y))
        print(f"  {', '.join(names[c] for c in cols):70s} {auc:.3f}")
    fitted = cross_fit(x[:, [0, 1, 2, 3, 4]], y)

    def holds(score, hold, power):
        rank = score.argsort().argsort() / len(score)  # the score's quantile, in [0, 1)
        weight = rank**power
        return [Replay(c, lambda b, n: n["last"] + hold * weight[n["last"]]).run(requests)
                for c in caps]

    truth = y.astype(float)
    oracle = [Replay(c, lambda b, n: n["last"] + 100_000 * truth[n["last"]]).run(requests)
              for c in caps]
    print(f"\nthe true answer as a hold (key = last access + 100000 * returns): "
          f"{gap_closed(oracle)} % of the gap")

    print("\nkey = last access + H * quantile(score)^k; share of the LRU -> Belady gap closed (%):")
    print(f"  {'predictor':34s} {'AUC':>5s} {'H':>6s} {'k':>2s}  gap closed")
    rng = np.random.default_rng(1)
    predictors = [(f"true answer + noise sd {sd}", truth + rng.normal(0, sd, len(y)))
                  for sd in (0.5, 0.7, 1.0)]
    predictors.append(("fitted on online features", fitted))
    for name, score in predictors:
        auc = roc_auc_score(y, score)
        for hold in (1000, 3000, 10000):
            for power in (1, 4):
                print(f"  {name:34s} {auc:5.3f} {hold:6d} {power:2d}  "
                      f"{gap_closed(holds(score, hold, power))}", flush=True)


if __name__ == "__main__":
    main()
