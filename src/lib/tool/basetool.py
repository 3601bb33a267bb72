"""tandem's bridge to verl-style tool classes (run by `rollout --tool NAME=python:FILE.py:CLASS`).

Usage: python3 -c "$(cat basetool.py)" FILE.py CLASS (tandem passes the source with -c: no file
is written for it).

Loads CLASS from FILE.py (as a module of its package when its folder has an __init__.py, so
that relative imports work) and makes one instance: `CLASS(config={}, tool_schema=None)` for the
parameters its constructor has (verl's BaseTool takes both), else `CLASS()`. Prints the tool's
OpenAI function schema as the first line: `get_openai_tool_schema()` (a dict, or a pydantic
model as verl returns) or a `schema` attribute (a dict, or a method returning one). Then
reads one JSON request per line, `{"id", "name", "arguments", "kwargs"}`, and for each calls
`create(instance_id, **create_kwargs)`, `execute(instance_id, arguments, **execute_kwargs)` and
`release(instance_id, **release_kwargs)` (the row's arguments for the tool, verl's
`tools_kwargs`, from the request's `kwargs`; each method may be async; create and release may
be absent), and answers `{"id", "content"}` with what
execute returned: a string, an object with a `text` attribute (verl's ToolResponse), or a
tuple whose first element is one of those (verl's `(response, reward, metrics)`; reward and
metrics are not used). An exception answers `{"id", "error"}` and its traceback goes to
stderr; the program keeps serving. Anything the tool prints goes to stderr, so it cannot mix
with the answers.
"""

import asyncio
import importlib.util
import inspect
import json
import os
import sys
import traceback


def package_module(path):
    """(root, dotted name) of a file inside a package (its folder has __init__.py), else None."""
    root, parts = os.path.dirname(path), [os.path.splitext(os.path.basename(path))[0]]
    while os.path.isfile(os.path.join(root, "__init__.py")):
        parts.insert(0, os.path.basename(root))
        root = os.path.dirname(root)
    return (root, ".".join(parts)) if len(parts) > 1 else None


def load(path, name):
    path = os.path.abspath(path)
    for p in (os.getcwd(), os.path.dirname(path)):
        if p not in sys.path:
            sys.path.insert(0, p)
    in_package = package_module(path)
    if in_package:
        # Imported under its package's name, so that its relative imports (verl's
        # `from .base_tool import BaseTool`) resolve.
        sys.path.insert(0, in_package[0])
        module = importlib.import_module(in_package[1])
    else:
        spec = importlib.util.spec_from_file_location(f"tandem_tool_{abs(hash(path))}", path)
        if spec is None or spec.loader is None:
            sys.exit(f"tandem: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    cls = getattr(module, name, None)
    if cls is None or not inspect.isclass(cls):
        sys.exit(f"tandem: {path} has no class named {name!r}")
    return cls


def instantiate(cls):
    params = inspect.signature(cls).parameters
    kwargs = {}
    if "config" in params:
        kwargs["config"] = {}
    if "tool_schema" in params:
        kwargs["tool_schema"] = None
    return cls(**kwargs)


def plain(value):
    """A dict from a dict or a pydantic model."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_unset=True, exclude_none=True)
    if hasattr(value, "dict") and not isinstance(value, dict):
        return value.dict(exclude_none=True)
    return value


def schema_of(tool):
    if hasattr(tool, "get_openai_tool_schema"):
        return plain(tool.get_openai_tool_schema())
    schema = getattr(tool, "schema", None)
    if schema is None:
        sys.exit("tandem: the tool has neither get_openai_tool_schema() nor a schema attribute")
    return plain(schema() if callable(schema) else schema)


def text_of(result):
    if isinstance(result, tuple) and result:
        result = result[0]
    if isinstance(result, str):
        return result
    text = getattr(result, "text", None)
    if isinstance(text, str):
        return text
    return json.dumps(result) if isinstance(result, (dict, list)) else str(result)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: python3 -c BASETOOL_SOURCE FILE.py CLASS")
    # The answers travel on the original stdout; fd 1 and sys.stdout now point at stderr.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8", newline="\n")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    tool = instantiate(load(sys.argv[1], sys.argv[2]))
    loop = asyncio.new_event_loop()

    def call(method, *args, **kwargs):
        result = method(*args, **kwargs)
        return loop.run_until_complete(result) if inspect.isawaitable(result) else result

    answers.write(json.dumps(schema_of(tool)) + "\n")
    answers.flush()
    for line in open(sys.stdin.fileno(), "r", encoding="utf-8", closefd=False):
        if not line.strip():
            continue
        request = json.loads(line)
        rid = request.get("id")
        kwargs = request.get("kwargs") or {}
        try:
            instance = str(rid)
            if hasattr(tool, "create"):
                created = call(tool.create, instance, **(kwargs.get("create_kwargs") or {}))
                # verl's create returns the id, or (id, response) in newer versions.
                created = created[0] if isinstance(created, tuple) else created
                instance = created if created is not None else instance
            try:
                result = call(tool.execute, instance, request.get("arguments") or {}, **(kwargs.get("execute_kwargs") or {}))
                answer = {"id": rid, "content": text_of(result)}
            finally:
                if hasattr(tool, "release"):
                    call(tool.release, instance, **(kwargs.get("release_kwargs") or {}))
        except Exception as e:
            traceback.print_exc()
            answer = {"id": rid, "error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
