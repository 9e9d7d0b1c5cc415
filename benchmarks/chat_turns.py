"""What the prefix caches save on a multi-turn chat, against any running disaggregated server.

    scripts/serve &                                   # the demo pair, disaggregated, on the CPU
    .venv/bin/python benchmarks/chat_turns.py         # then this, from the repository root

Each turn sends the whole conversation so far (a long system prompt, then every earlier question and answer) and
reads the server's own counters around it: the prompt tokens the prefill replica took from its prefix cache
(``cached``, from the response's usage) and what the KV transfer to the decode replica moved, against the pages the
decode replica already held from earlier turns (``reused pages``, not READ). One request at a time, so each delta
is that turn's. Greedy, so the run repeats.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import httpx

COUNTERS = ("dflash_kv_transfer_bytes_total", "dflash_kv_transfer_reused_pages_total")


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for name in COUNTERS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="dflash-demo")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-chars", type=int, default=3000, help="the system prompt: this much of README.md")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    system = (Path(__file__).resolve().parents[1] / "README.md").read_text()[:args.system_chars]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize the two commands."}]
    print("| turn | prompt tokens | cached (prefill) | transfer MiB | reused pages (decode) |")
    print("|---|---|---|---|---|")
    for turn in range(1, args.turns + 1):
        before = counters(args.url)
        r = httpx.post(f"{args.url}/v1/chat/completions", timeout=300,
                       json={"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
                             "temperature": 0})
        r.raise_for_status()
        body = r.json()
        after = counters(args.url)
        moved, reused = (after[name] - before[name] for name in COUNTERS)
        usage = body["usage"]
        print(f"| {turn} | {usage['prompt_tokens']} | {usage['prompt_tokens_details']['cached_tokens']} | "
              f"{moved / 2**20:.2f} | {reused:.0f} |")
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And what about point {turn + 1}?"}]


if __name__ == "__main__":
    main()
