"""tandem's Python sandbox, the part inside Python (run by tandem as
`python3 -I -B -X utf8 -c SOURCE [--no-processes]` in the call's own directory).

Reads the code to run from stdin, then installs an audit hook (PEP 578), the second layer
behind the kernel's (namespaces, Landlock, seccomp, rlimits; see tool/confine.rs):
- sockets other than AF_UNIX, and name lookups, raise PermissionError;
- opening a file for writing, and removing, renaming, linking or changing a path, raise
  PermissionError outside the working directory (and /dev/null);
- with --no-processes (the kernel cannot cap and reap processes here), starting a process
  raises PermissionError.
The hook sees what Python code does through Python; code that calls C directly (ctypes) is
stopped by the kernel's layers only.

Then runs the code as __main__; when its last statement is an expression, its value is
printed (as in a notebook or the REPL) unless it is None. An exception prints its traceback
without the frames of this file and exits with status 1.
"""

import ast
import os
import signal
import sys
import traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Events whose first argument is a path they change; os.rename, os.link and os.symlink
# change their second too.
PATH_EVENTS = {
    "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
    "os.chflags", "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod", "shutil.rmtree",
}
TWO_PATH_EVENTS = {"os.rename", "os.link", "os.symlink", "shutil.move", "shutil.copyfile"}
PROCESS_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.exec", "os.spawn",
    "subprocess.Popen", "pty.spawn", "os.startfile",
}
NETWORK_EVENTS = {
    "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
}


def main():
    source = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, "r", closefd=False)
    home = os.path.realpath(os.getcwd())
    no_processes = "--no-processes" in sys.argv[1:]
    sys.argv = ["<code>"]
    # -I leaves the working directory off sys.path: modules the code writes there import.
    sys.path.insert(0, home)

    def inside(path):
        if isinstance(path, int):
            return True  # an open descriptor: refused when it was opened
        path = os.path.realpath(os.path.join(home, os.fsdecode(path)))
        return path == home or path.startswith(home + os.sep) or path == os.devnull

    def refuse(what):
        raise PermissionError(f"tandem sandbox: {what} is not allowed")

    def hook(event, args):
        if event == "open":
            path, _mode, flags = args
            if flags & WRITE_FLAGS and path is not None and not inside(path):
                refuse(f"writing {os.fsdecode(path)!r} (outside the working directory)")
        elif event in PATH_EVENTS:
            if args and args[0] is not None and not inside(args[0]):
                refuse(f"{event} on {os.fsdecode(args[0])!r}")
        elif event in TWO_PATH_EVENTS:
            if len(args) > 1 and not (inside(args[0]) and inside(args[1])):
                refuse(f"{event} outside the working directory")
        elif event == "socket.__new__":
            import socket

            if args[1] != socket.AF_UNIX:
                refuse("network access")
        elif event in NETWORK_EVENTS:
            refuse("network access")
        elif no_processes and event in PROCESS_EVENTS:
            refuse("starting a process")

    # Python is the first process of its PID namespace, to which the kernel delivers no
    # signal it has no handler for: end as SIGXCPU (the CPU limit) would, in a way tandem
    # can tell (status 128 + SIGXCPU).
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))
    sys.addaudithook(hook)
    run(source)


def run(source):
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(source, "<code>")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as e:
        # Only the code's frames and the library's below them: not this file's (`<string>`,
        # the -c source), whose hook is where a refused operation raises.
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != "<string>"]
        text = "".join(traceback.format_list(frames)) if frames else ""
        if text:
            text = "Traceback (most recent call last):\n" + text
        text += "".join(traceback.format_exception_only(type(e), e))
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.exit(1)

main()
