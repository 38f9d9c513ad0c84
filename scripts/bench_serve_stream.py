"""Decode tokens/s as a streaming gRPC client sees it, through a running `tpserve serve`.

    python bench_serve_stream.py SERVER PROMPTS.json NEW

Streams one greedy generation of NEW + 1 tokens (EOS ignored) for the first prompt's token ids
with `tpserve generate --json` (a real gRPC client), stamps each token line as it arrives, and
prints {"tokens_per_second": NEW / (last arrival - first arrival), "new_ids": [...]}: the first
token comes from the prefill, the NEW after it are decode steps, as in bench_llamacpp.py's
decode. Standard library only.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

TPSERVE = Path(__file__).resolve().parent.parent / "target" / "release" / "tpserve"


def main(server, prompts, new):
    prompt = json.load(open(prompts))[0]
    command = [str(TPSERVE), "generate", "--server", server, "--prompt-ids", ",".join(map(str, prompt)),
               "--max-tokens", str(new + 1), "--temperature", "0", "--ignore-eos", "--json"]
    arrivals, ids = [], []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1) as client:
        for line in client.stdout:
            event = json.loads(line)
            if "token_id" in event:
                arrivals.append(time.perf_counter())
                ids.append(event["token_id"])
    if client.returncode != 0 or len(ids) != new + 1:
        sys.exit(f"tpserve generate exited with {client.returncode} after {len(ids)} of {new + 1} tokens")
    print(json.dumps({"tokens_per_second": new / (arrivals[-1] - arrivals[0]), "new_ids": ids}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
