"""Ending a process at once without leaving TensorFlow's temporary files.

A controller of remote workers ends with `os._exit`: tearing down a cluster
context can hang, and nothing is left to save. But `os._exit` skips the
`atexit` handlers, and autograph writes every function it converts to a
file in the temporary directory (`__autograph_generated_file*.py`) that
such a handler removes. So every trainer run on a cluster, and every
benchmark that ends this way, left its converted functions behind: 5,557 of
them in this project's machine's /tmp after a few days of tests and
benchmarks.

Only the process that made the files may remove them: a forked child (the
out-of-memory reader, a child before exec) shares the parent's modules and
must end with a plain `os._exit`, or remove only those it made itself (the
fork server's children: `RemoveAutographFiles(keep=)`).
"""

import os
import sys
import threading

# The prefix of autograph's files and of their modules' names.
AUTOGRAPH_PREFIX = '__autograph_generated_file'


def AutographModuleNames():
  """The names of the autograph modules this process has loaded."""
  return {name for name in sys.modules if name.startswith(AUTOGRAPH_PREFIX)}


def RemoveAutographFiles(keep=()):
  """Removes the files of the autograph modules this process loaded, but
  those named in `keep` (a forked child's parent's)."""
  for name in AutographModuleNames() - set(keep):
    path = getattr(sys.modules.get(name), '__file__', None)
    if path and os.path.basename(path).startswith(AUTOGRAPH_PREFIX):
      try:
        os.remove(path)
      except OSError:
        pass  # Removed already, or never ours to remove.


def ExitNow(status):
  """Flushes the output, removes autograph's files and ends the process
  with `status`, skipping every other exit handler and thread."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  RemoveAutographFiles()
  os._exit(status)  # pylint: disable=protected-access


def ExitAfter(seconds, before_exit=None):
  """Starts a watchdog: after `seconds`, says so, calls `before_exit` (to
  stop what would outlive the process) and ExitNow(3). For a run that
  must end even when TensorFlow hangs; it imports nothing, so it can start
  before TensorFlow does."""
  def Fire():
    print(f'watchdog: run exceeded {seconds:g}s; stopping.', flush=True)
    if before_exit:
      before_exit()
    ExitNow(3)
  watchdog = threading.Timer(seconds, Fire)
  watchdog.daemon = True
  watchdog.start()
  return watchdog
