"""Fresh TensorFlow processes without TensorFlow's import: a fork server.

A memory profile needs a process whose allocator has held nothing else
(gpipe.memory_profile), so the planner starts one per cell, remat mode and
micro-batch size: dozens for one `--plan=auto`. Importing TensorFlow takes
about 3 s of CPU, most of each such process. The fork server is a process
that has imported TensorFlow (and the profile's modules) and never run an
op, so its runtime, allocators and thread pools do not exist yet; each
request is a child forked from it, which starts them fresh, under the
request's environment, as a new process would. Forked, a profile process
starts in milliseconds.

What a child inherits is only what an import leaves: the environment
variables that TensorFlow reads at import (its log level, oneDNN, the
visible GPUs) must be the server's, so a server serves the requests whose
environment equals its own but for the variables read when the runtime
starts (`RUNTIME_VARIABLES`: the allocator's, the thread pools'); another
environment gets a server of its own. A GPU's driver must not be opened
before a fork, so servers run with no GPU visible (CUDA_VISIBLE_DEVICES=''):
requests for a GPU run as plain subprocesses.

The server forks from one thread and reads requests as lines of JSON on
its stdin; when its stdin closes (its client ended, however) it kills its
children and exits. `TFPIPE_FORK_SERVER=0` turns it off: each request is
then `python -m module args`.
"""

import atexit
import importlib
import itertools
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from tfpipe import process_exit

ENABLE_ENV = 'TFPIPE_FORK_SERVER'
# Read by TensorFlow when its runtime starts (the first op, or device set-up),
# not at import: a child may set them.
RUNTIME_VARIABLES = frozenset([
    'TF_CPU_ALLOCATOR_USE_BFC', 'TF_CPU_BFC_MEM_LIMIT_IN_MB',
    'TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS',
    'TF_FORCE_GPU_ALLOW_GROWTH'])
# Imported by the server before it forks: what profile processes run.
PRELOAD = ('tfpipe.gpipe.memory_profile', 'tfpipe.gpipe.allocator_slack',
           'tfpipe.layers')
_START_TIMEOUT_S = 180


def Run(module, args, env, timeout_s):
  """Runs `module`'s `_Main([module, *args])` in a fresh process with
  environment `env`; a subprocess.CompletedProcess with its exit status and
  text output. A child of a fork server where `env` allows one (no GPU
  visible, the server enabled), else `python -m module args`.

  Raises subprocess.TimeoutExpired after timeout_s (the process is killed).
  """
  server = _ServerFor(env)
  if server is not None:
    try:
      return server.Run(module, args, env, timeout_s)
    except _ServerLost:  # Run it as a plain subprocess, and the next too.
      with _lock:
        _servers[_Key(env)] = None
  return subprocess.run([sys.executable, '-m', module, *args], env=env,
                        capture_output=True, text=True, timeout=timeout_s,
                        check=False)


def Close():
  """Stops this process's servers (and any child they still run)."""
  with _lock:
    servers = list(_servers.values())
    _servers.clear()
  for server in servers:
    if server is not None:
      server.Close()


class _ServerLost(Exception):
  """The server ended or could not start: run as a plain subprocess."""


_lock = threading.Lock()
_servers = {}  # key of an environment -> _Server, or None if it failed


def _Key(env):
  return frozenset((k, v) for k, v in env.items()
                   if k not in RUNTIME_VARIABLES)


def _ServerFor(env):
  if env.get(ENABLE_ENV, os.environ.get(ENABLE_ENV, '1')) == '0':
    return None
  if env.get('CUDA_VISIBLE_DEVICES') != '' or not hasattr(os, 'fork'):
    return None
  key = _Key(env)
  with _lock:
    if key not in _servers:
      try:
        _servers[key] = _Server(dict(key))  # Without RUNTIME_VARIABLES.
      except (OSError, _ServerLost):
        _servers[key] = None
    return _servers[key]


class _Server:
  """The client's end of one server process."""

  def __init__(self, env):
    self._proc = subprocess.Popen(
        [sys.executable, '-m', 'tfpipe.fork_server'], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)
    self._ids = itertools.count()
    self._write_lock = threading.Lock()
    self._waiting = {}  # request id -> queue.Queue of its messages
    self._ready = queue.Queue()
    threading.Thread(target=self._Read, daemon=True).start()
    try:
      ready = self._ready.get(timeout=_START_TIMEOUT_S)
    except queue.Empty:
      ready = None
    if not ready:
      self.Close()
      raise _ServerLost()

  def _Read(self):
    for line in self._proc.stdout:
      message = json.loads(line)
      if 'ready' in message:
        self._ready.put(message['ready'])
        continue
      waiting = self._waiting.get(message['id'])
      if waiting is not None:
        waiting.put(message)
    self._ready.put(False)
    for waiting in list(self._waiting.values()):
      waiting.put(None)

  def Run(self, module, args, env, timeout_s):
    request_id = next(self._ids)
    messages = self._waiting[request_id] = queue.Queue()
    with tempfile.TemporaryDirectory(prefix='tfpipe_fork_') as tmp:
      out, err = os.path.join(tmp, 'stdout'), os.path.join(tmp, 'stderr')
      request = {'id': request_id, 'module': module, 'args': list(args),
                 'env': dict(env), 'cwd': os.getcwd(), 'stdout': out,
                 'stderr': err}
      try:
        with self._write_lock:
          self._proc.stdin.write(json.dumps(request).encode() + b'\n')
          self._proc.stdin.flush()
        status = self._Wait(messages, timeout_s, module, args)
      except (OSError, ValueError) as e:  # The server's stdin is closed.
        raise _ServerLost() from e
      finally:
        del self._waiting[request_id]
      with open(out, errors='replace') as f, open(err,
                                                 errors='replace') as g:
        return subprocess.CompletedProcess(
            [module, *args], status, f.read(), g.read())

  def _Wait(self, messages, timeout_s, module, args):
    """The child's exit status; kills it after timeout_s."""
    deadline = time.monotonic() + timeout_s
    pid = None
    while True:
      try:
        message = messages.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        _KillOnTimeout(messages, pid)
        raise subprocess.TimeoutExpired([module, *args], timeout_s)
      if message is None:
        raise _ServerLost()
      if 'pid' in message:
        pid = message['pid']
      if 'status' in message:
        return message['status']

  def Close(self):
    try:
      self._proc.stdin.close()
    except OSError:
      pass
    try:
      self._proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()


def _Kill(pid):
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _KillOnTimeout(messages, pid, grace_s=30):
  """Kills a child past its timeout, even one whose pid the server has not
  reported yet, and waits for its status, so that its files are closed."""
  if pid is not None:
    _Kill(pid)
  end = time.monotonic() + grace_s
  while True:
    try:
      message = messages.get(timeout=max(0.0, end - time.monotonic()))
    except queue.Empty:
      return
    if message is None or 'status' in message:
      return
    if 'pid' in message:
      _Kill(message['pid'])


atexit.register(Close)


def _Send(message):
  os.write(1, json.dumps(message).encode() + b'\n')


def _Serve():
  """The server: imports, then forks a child per request line on stdin and
  reports its pid and its exit status on stdout."""
  try:
    from tfpipe import quiet  # pylint: disable=g-import-not-at-top
    quiet.ImportTensorFlow()
    for module in PRELOAD:
      importlib.import_module(module)
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    # A runtime started here would be shared by every child.
    ready = context.context()._context_handle is None  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    ready = False
  _Send({'ready': ready})
  if not ready:
    os._exit(1)
  children = {}  # pid -> request id
  pending = b''
  while True:
    readable, _, _ = select.select([0], [], [], 0.05 if children else None)
    if readable:
      data = os.read(0, 1 << 16)
      if not data:  # The client is gone: so are its requests.
        for pid in children:
          _Kill(pid)
        os._exit(0)
      pending += data
      while b'\n' in pending:
        line, pending = pending.split(b'\n', 1)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
          _Child(request)
        children[pid] = request['id']
        _Send({'id': request['id'], 'pid': pid})
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      _Send({'id': children.pop(pid),
             'status': os.waitstatus_to_exitcode(status)})


def _Child(request):
  """A forked child: the request's output files, directory, environment
  and argv, then its module's _Main. Never returns."""
  code = 1
  inherited = process_exit.AutographModuleNames()
  try:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request['stdout']), (2, request['stderr'])):
      os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    sys.argv = [request['module'], *request['args']]
    importlib.import_module(request['module'])._Main(sys.argv)  # pylint: disable=protected-access
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    # os._exit skips the handler that removes the files of the functions
    # autograph converted; the server's own stay its.
    process_exit.RemoveAutographFiles(keep=inherited)
    os._exit(code)


if __name__ == '__main__':
  _Serve()
