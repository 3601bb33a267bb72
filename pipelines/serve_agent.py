#!/usr/bin/env python3
"""A GSM8K agent with the Python tool, written against any OpenAI-compatible server with the
`openai` client; against `tandem serve` its episodes are recorded as trajectories and collected
as a batch that `score`, `ref-logprob`, `advantage` and `update` train on (docs/SERVING.md).

Each question gets --n episodes; an episode is a conversation: the model may call the `python`
tool (run by `tandem tool python`, the sandboxed tool of docs/AGENTS.md), sees its output and
answers with "#### N". The reward posted is 1 for the right number, else 0.

By hand, on GSM8K's own JSON lines ({"question": ..., "answer": "... #### 72"}):

    python3 pipelines/serve_agent.py --base-url http://127.0.0.1:8000/v1 --model tiny \
        --questions gsm8k.jsonl --n 4 --collect step-0

As a pipeline's rollout (`[rollout] agent = "cmd:python3 pipelines/serve_agent.py"`): without
--questions it plays the step's prompts ($TANDEM_PROMPTS_JSONL, their `prompt` messages as the
rollout stage renders them) by the spec's settings from the environment: $TANDEM_N,
$TANDEM_TEMPERATURE, $TANDEM_MAX_TOKENS (per turn), $TANDEM_SYSTEM_PROMPT, $TANDEM_MAX_TURNS,
$TANDEM_MAX_TOOL_CALLS, $TANDEM_MAX_RESPONSE_TOKENS, $TANDEM_TOOL_CONCURRENCY,
$TANDEM_TOOL_TIMEOUT and the `tandem` binary $TANDEM_BIN; a flag given overrides its variable.
Episodes are named PROMPT_UID-K, and the runner collects them.
"""

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

SYSTEM = ("Solve the problem. You may run Python with the python tool. "
          "End with the final answer as '#### N'.")

# Tokens the chat template wraps one tool result in, at most (Qwen's tool turn: the end of the
# assistant turn, `<|im_start|>user\n<tool_response>\n…\n</tool_response><|im_end|>\n` and the
# next assistant header take about 15).
RESULT_WRAP_TOKENS = 24

# The server samples a batch's requests in one engine pass per distinct set of parameters,
# max_tokens included: a later turn cut short by the response budget asks a multiple of this
# many tokens, so that such turns share a few passes.
ROOM_STEP = 128


class PythonTool:
    """A pool of `tandem tool python` processes speaking JSON lines: the schema first, then one
    answer per request; a call takes a free process, so `size` calls run at once."""

    def __init__(self, tandem, size, timeout):
        cmd = [tandem, "tool", "python", "--timeout", str(timeout)]
        self.procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True) for _ in range(size)]
        self.schema = json.loads(self.procs[0].stdout.readline())
        for p in self.procs[1:]:
            p.stdout.readline()
        self.free = queue.Queue()
        for p in self.procs:
            self.free.put(p)

    def call(self, arguments):
        p = self.free.get()
        try:
            p.stdin.write(json.dumps({"id": 1, "name": "python", "arguments": arguments}) + "\n")
            p.stdin.flush()
            return json.loads(p.stdout.readline())["content"]
        finally:
            self.free.put(p)


def answer_of(text):
    m = re.findall(r"####\s*(-?[\d,\.]+)", text or "")
    return m[-1].replace(",", "").rstrip(".") if m else None


def post(base, key, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def episode(client, args, tool, trajectory, messages):
    """One conversation from `messages`, within the rollout stage's limits: --max-turns
    assistant turns (the last one's calls are not run), --max-tool-calls calls, --max-tokens new
    tokens a turn and --max-response-tokens in all (sampled and tool results together, as the
    server counts them). Returns the last assistant text."""
    messages = list(messages)
    text, calls, first, used, pending = "", 0, None, 0, 0
    for turn in range(args.max_turns):
        room = args.max_response_tokens - used - pending
        if room >= args.max_tokens:
            room = args.max_tokens
        elif first is not None:  # a first turn's room is every episode's
            room -= room % ROOM_STEP
        if room <= 0:
            break
        r = client.chat.completions.create(
            model=args.model, messages=messages, tools=[tool.schema],
            temperature=args.temperature, max_tokens=room,
            extra_headers={"X-Trajectory-Id": trajectory})
        choice = r.choices[0]
        # The server's token ids (beside the OpenAI fields): the response so far is everything
        # after the first prompt.
        prompt_ids = getattr(r, "prompt_token_ids", None) or []
        first = len(prompt_ids) if first is None else first
        used = len(prompt_ids) - first + len(getattr(choice, "token_ids", None) or [])
        pending = 0
        msg = choice.message
        # Sent back as it came: the server checks the next prompt extends this one.
        messages.append(msg.model_dump(exclude_none=True))
        text = msg.content or ""
        if (not msg.tool_calls or choice.finish_reason == "length" or turn + 1 >= args.max_turns
                or calls >= args.max_tool_calls or used >= args.max_response_tokens):
            break
        for call in msg.tool_calls[:min(args.max_tool_calls - calls, args.max_parallel_calls)]:
            calls += 1
            try:
                result = tool.call(json.loads(call.function.arguments or "{}"))
            except json.JSONDecodeError as e:
                result = f"error: the call's arguments are not JSON: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            # Not counted by the server before the next request: bounded by its bytes (a
            # token is at least one byte) and the template's wrapping.
            pending += len(result.encode()) + RESULT_WRAP_TOKENS
    return text


def env_default(name, kind, fallback):
    value = os.environ.get(name)
    return kind(value) if value not in (None, "") else fallback


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    e = env_default
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"),
                    help="e.g. http://127.0.0.1:8000/v1 [$OPENAI_BASE_URL]")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--model", default=os.environ.get("TANDEM_MODEL"),
                    help="the served model's name (/v1/models) [$TANDEM_MODEL]")
    ap.add_argument("--questions", default=None,
                    help="GSM8K JSON lines [the pipeline step's prompts: $TANDEM_PROMPTS_JSONL]")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--n", type=int, default=e("TANDEM_N", int, 4), help="episodes per question")
    ap.add_argument("--temperature", type=float, default=e("TANDEM_TEMPERATURE", float, 1.0))
    ap.add_argument("--system-prompt", default=e("TANDEM_SYSTEM_PROMPT", str, SYSTEM),
                    help="added before a prompt that has no system message of its own")
    ap.add_argument("--max-tokens", type=int, default=e("TANDEM_MAX_TOKENS", int, 512),
                    help="new tokens of one turn at most")
    ap.add_argument("--max-response-tokens", type=int,
                    default=e("TANDEM_MAX_RESPONSE_TOKENS", int, 1 << 30),
                    help="response tokens at most, tool results included")
    ap.add_argument("--max-turns", type=int, default=e("TANDEM_MAX_TURNS", int, 4))
    ap.add_argument("--max-tool-calls", type=int, default=e("TANDEM_MAX_TOOL_CALLS", int, 8))
    ap.add_argument("--max-parallel-calls", type=int,
                    default=e("TANDEM_MAX_PARALLEL_CALLS", int, 1 << 30))
    ap.add_argument("--tool-concurrency", type=int, default=e("TANDEM_TOOL_CONCURRENCY", int, 16),
                    help="tool calls running at once")
    ap.add_argument("--tool-timeout", type=float, default=e("TANDEM_TOOL_TIMEOUT", float, 10.0))
    ap.add_argument("--concurrency", type=int, default=None,
                    help="episodes in flight at once [all of them]")
    ap.add_argument("--tandem", default=e("TANDEM_BIN", str, "tandem"),
                    help="the tandem binary (runs the Python tool) [$TANDEM_BIN, else on PATH]")
    ap.add_argument("--collect", default=None,
                    help="then collect the trajectories as COLLECT_DIR/NAME.parquet")
    args = ap.parse_args()
    for flag in ("base_url", "model"):
        if not getattr(args, flag):
            ap.error(f"--{flag.replace('_', '-')} is required outside a pipeline step")
    tools = json.loads(os.environ.get("TANDEM_TOOLS", '["python"]'))
    if tools != ["python"]:
        ap.error(f"$TANDEM_TOOLS = {tools}: this agent offers the python tool only")
    return args


def load_jobs(args):
    """(trajectory id, ground truth, messages) of every episode to play."""
    if args.questions:
        with open(args.questions) as f:
            rows = [json.loads(line) for line in f if line.strip()][:args.limit]
        return [(f"q{i}-s{k}", answer_of(r["answer"]), [{"role": "user", "content": r["question"]}],
                 True) for i, r in enumerate(rows) for k in range(args.n)]
    path = os.environ.get("TANDEM_PROMPTS_JSONL")
    if not path:
        sys.exit("serve_agent.py: give --questions, or run it as a pipeline's [rollout] agent")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:args.limit]
    # The runner gives the collected rows their prompt's ground truth: post only the reward.
    return [(f"{r['prompt_uid']}-{k}", r.get("ground_truth"), r["prompt"], False)
            for r in rows for k in range(args.n)]


def main():
    args = parse_args()
    jobs = load_jobs(args)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=3600)
    server = args.base_url.rstrip("/").removesuffix("/v1")
    tool = PythonTool(args.tandem, args.tool_concurrency, args.tool_timeout)

    def run(job):
        tid, truth, messages, post_truth = job
        if not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": args.system_prompt}] + list(messages)
        text = episode(client, args, tool, tid, messages)
        reward = float(answer_of(text) == truth)
        body = {"reward": reward}
        if post_truth:
            body.update(ground_truth=truth, data_source="openai/gsm8k")
        post(server, args.api_key, f"/trajectories/{tid}/reward", body)
        return reward

    with ThreadPoolExecutor(args.concurrency or max(len(jobs), 1)) as pool:
        rewards = list(pool.map(run, jobs))
    print(f"{len(rewards)} episodes, accuracy {sum(rewards) / max(len(rewards), 1):.3f}",
          file=sys.stderr)
    if args.collect:
        print(json.dumps(post(server, args.api_key, "/trajectories/collect",
                              {"name": args.collect})))


if __name__ == "__main__":
    main()
