#!/usr/bin/env python3
"""Interleaved CPU benchmark of two tpserve binaries (a change's before and after) on the tiny
fixtures, where per-op overhead weighs most: `eval-shard` at TP 1, one thread, greedy.

Each round runs every variant back to back, in alternating order, so a round's ratios to
`before` share the machine's load at that moment; the table gives the medians of the tokens/s
and of those paired ratios. The third variant is `after` with TPSERVE_TENSOR_OPS_ON_CPU=1 (the
GPU's tensor-op forms on the CPU). Every variant must produce before's greedy ids.

    cargo build --release && cp target/release/tpserve /tmp/tpserve-after   # and a before build
    python3 scripts/bench_ab.py /tmp/tpserve-before /tmp/tpserve-after [rounds] [fixtures]
"""
import json, os, random, statistics, subprocess, sys, tempfile

before, after = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 31
fixtures = sys.argv[4].split(",") if len(sys.argv) > 4 else ["qwen3_5_dense", "qwen3_5_moe", "qwen3_moe"]
variants = [
    ("before", before, {}),
    ("after", after, {}),
    ("after, tensor ops on CPU", after, {"TPSERVE_TENSOR_OPS_ON_CPU": "1"}),
]
tmp = tempfile.mkdtemp()
random.seed(7)
# Prompts of one and several 64-token blocks, with and without a shorter last block.
prompts = [[random.randrange(3, 448) for _ in range(n)] for n in (300, 64, 517, 40, 200)]
json.dump(prompts, open(f"{tmp}/prompts.json", "w"))
results = {}
for round_ in range(rounds):
    for fixture in fixtures:
        for name, binary, env in variants if round_ % 2 == 0 else variants[::-1]:
            out = f"{tmp}/out.json"
            subprocess.run(
                [binary, "eval-shard", "--model", f"tests/fixtures/{fixture}", "--rank", "0", "--world-size", "1",
                 "--rendezvous", f"unix://{tmp}/comm.sock", "--prompts", f"{tmp}/prompts.json", "--max-new", "300",
                 "--threads", "1", "--suppress", "2", "--out", out],
                check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            report = json.load(open(out))
            results.setdefault((fixture, name), []).append((
                report["prefill_tokens"] / report["prefill_seconds"],
                report["decode_tokens"] / report["decode_seconds"],
                [p["new_ids"] for p in report["prompts"]],
            ))
    print(f"round {round_ + 1} of {rounds} done", file=sys.stderr, flush=True)

print("| fixture | build | prefill tokens/s | vs before | decode tokens/s | vs before |")
print("|---|---|---|---|---|---|")
for fixture in fixtures:
    base = results[(fixture, "before")]
    for name, _, _ in variants:
        rows = results[(fixture, name)]
        median = lambda i: statistics.median(r[i] for r in rows)
        ratio = lambda i: statistics.median(r[i] / b[i] for r, b in zip(rows, base))
        print(f"| {fixture} | {name} | {median(0):.0f} | {ratio(0):.3f} | {median(1):.0f} | {ratio(1):.3f} |")
        if any(r[2] != b[2] for r, b in zip(rows, base)):
            print(f"FAIL: {fixture}, {name}: greedy ids differ from before's", file=sys.stderr)
            sys.exit(1)
