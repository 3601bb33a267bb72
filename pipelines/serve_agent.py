#!/usr/bin/env python3
"""A GSM8K agent with the Python tool, written against any OpenAI-compatible server with the
`openai` client; against `tandem serve` its episodes are recorded as trajectories and collected
as a batch that `score`, `ref-logprob`, `advantage` and `update` train on (docs/SERVING.md).

Questions come as JSON lines in GSM8K's own format ({"question": ..., "answer": "... #### 72"}).
Each question gets --n episodes; an episode is a conversation: the model may call the `python`
tool (run by `tandem tool python`, the sandboxed tool of docs/AGENTS.md), sees its output and
answers with "#### N". The reward is 1 for the right number, else 0.

    python3 pipelines/serve_agent.py --base-url http://127.0.0.1:8000/v1 --model tiny \
        --questions gsm8k.jsonl --n 4 --collect step-0
"""

import argparse
import json
import re
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

SYSTEM = ("Solve the problem. You may run Python with the python tool. "
          "End with the final answer as '#### N'.")


class PythonTool:
    """`tandem tool python` over JSON lines: its schema first, then one answer per request."""

    def __init__(self, tandem):
        self.proc = subprocess.Popen([tandem, "tool", "python"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.schema = json.loads(self.proc.stdout.readline())
        self.lock = threading.Lock()
        self.next_id = 0

    def call(self, arguments):
        with self.lock:
            self.next_id += 1
            req = {"id": self.next_id, "name": "python", "arguments": arguments}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())["content"]


def answer_of(text):
    m = re.findall(r"####\s*(-?[\d,\.]+)", text or "")
    return m[-1].replace(",", "").rstrip(".") if m else None


def post(base, key, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def episode(client, args, tool, trajectory, question):
    """One conversation; returns the last assistant text."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    text = ""
    for _ in range(args.max_turns):
        r = client.chat.completions.create(
            model=args.model, messages=messages, tools=[tool.schema],
            temperature=args.temperature, max_tokens=args.max_tokens,
            extra_headers={"X-Trajectory-Id": trajectory})
        msg = r.choices[0].message
        # Sent back as it came: the server checks the next prompt extends this one.
        messages.append(msg.model_dump(exclude_none=True))
        text = msg.content or ""
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            result = tool.call(json.loads(call.function.arguments or "{}"))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", required=True, help="the served model's name (/v1/models)")
    ap.add_argument("--questions", required=True, help="GSM8K JSON lines")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--n", type=int, default=4, help="episodes per question")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=512, help="per turn")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tandem", default="tandem", help="the tandem binary (runs the Python tool)")
    ap.add_argument("--collect", default=None,
                    help="then collect the trajectories as COLLECT_DIR/NAME.parquet")
    args = ap.parse_args()

    with open(args.questions) as f:
        rows = [json.loads(line) for line in f if line.strip()][:args.limit]
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    server = args.base_url.rstrip("/").removesuffix("/v1")
    tool = PythonTool(args.tandem)

    def run(job):
        i, k = job
        truth = answer_of(rows[i]["answer"])
        tid = f"q{i}-s{k}"
        text = episode(client, args, tool, tid, rows[i]["question"])
        reward = float(answer_of(text) == truth)
        post(server, args.api_key, f"/trajectories/{tid}/reward",
             {"reward": reward, "ground_truth": truth, "data_source": "openai/gsm8k"})
        return reward

    jobs = [(i, k) for i in range(len(rows)) for k in range(args.n)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        rewards = list(pool.map(run, jobs))
    print(f"{len(rewards)} episodes, accuracy {sum(rewards) / max(len(rewards), 1):.3f}",
          file=sys.stderr)
    if args.collect:
        print(json.dumps(post(server, args.api_key, "/trajectories/collect",
                              {"name": args.collect})))


if __name__ == "__main__":
    main()
