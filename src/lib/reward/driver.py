"""tandem's bridge to verl-style Python reward functions (run by `score --reward python:FILE.py[:FUNC]`).

Usage: python3 -c "$(cat driver.py)" FILE.py FUNC KWARGS_JSON (tandem passes the source with -c:
no file is written for it).

Reads one JSON request per line on stdin ({"data_source", "solution_str", "ground_truth",
"extra_info"}), calls FUNC(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**KWARGS) as verl's reward manager does, and writes one JSON line per request: a number, or an
object whose "score" is the score and whose other values are kept as verl keeps them in
reward_extra_info: numbers (and booleans) become sub-scores, strings, None, lists and dicts
are passed on (tandem writes them as text columns). Anything the reward code prints goes to
stderr, so it cannot corrupt the answers. An exception ends the run with its traceback on
stderr; tandem reports it with the row it was scoring.
"""

import asyncio
import importlib.util
import inspect
import json
import numbers
import os
import sys


def load(path, name):
    path = os.path.abspath(path)
    # Like `python -m verl...` run from the working directory: the reward file's folder and the
    # current directory are importable.
    for p in (os.getcwd(), os.path.dirname(path)):
        if p not in sys.path:
            sys.path.insert(0, p)
    spec = importlib.util.spec_from_file_location(f"custom_module_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        sys.exit(f"tandem: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        sys.exit(f"tandem: {path} has no function named {name!r}")
    return fn


def number(v):
    """A float for numbers, numpy/torch scalars and bools; None for anything else."""
    if isinstance(v, (str, bytes)):
        return None
    if isinstance(v, numbers.Real):
        return float(v)
    try:
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            return number(v.item())
    except Exception:
        return None
    return None


def other(value):
    """A non-numeric value of a returned dict as JSON: strings and None as they are, lists and
    dicts (numpy arrays through tolist) when JSON holds them, anything else as its repr."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if hasattr(value, "tolist"):
        value = value.tolist()
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return repr(value)


def plain(result):
    """The JSON-ready answer for one row (validation of the score is tandem's job)."""
    if isinstance(result, dict):
        out = {}
        for key, value in result.items():
            v = number(value)
            out[str(key)] = v if v is not None else other(value)
        return out
    v = number(result)
    if v is not None:
        return v
    # verl's default_compute_score takes the first element of a list or tuple.
    if isinstance(result, (list, tuple)) and result:
        v = number(result[0])
        if v is not None:
            return v
    return result if isinstance(result, (str, type(None))) else repr(result)


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: python3 -c DRIVER_SOURCE FILE.py FUNC KWARGS_JSON")
    path, name, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    # The answers travel on the original stdout; fd 1 (and sys.stdout) now point at stderr so
    # that prints of the reward code, from Python or from C, cannot mix with them.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8", newline="\n")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fn = load(path, name)
    loop = asyncio.new_event_loop() if inspect.iscoroutinefunction(fn) else None
    requests = open(sys.stdin.fileno(), "r", encoding="utf-8", closefd=False)
    for line in requests:
        if not line.strip():
            continue
        req = json.loads(line)
        extra_info = req.get("extra_info")
        if not isinstance(extra_info, dict):
            extra_info = {}
        # What verl's NaiveRewardManager adds for a single-turn rollout.
        extra_info.setdefault("num_turns", None)
        extra_info.setdefault("rollout_reward_scores", {})
        call = dict(
            data_source=req.get("data_source"),
            solution_str=req.get("solution_str"),
            ground_truth=req.get("ground_truth"),
            extra_info=extra_info,
        )
        call.update(kwargs)
        result = fn(**call)
        if loop is not None:
            result = loop.run_until_complete(result)
        answers.write(json.dumps(plain(result)) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
