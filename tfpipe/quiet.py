"""Quiet start-up: TensorFlow's C++ start-up log, hidden unless asked for.

Importing TensorFlow 2.21 writes about seven lines to stderr before a
program prints anything of its own:

  WARNING: All log messages before absl::InitializeLog() is called are ...
  I0000 ... port.cc:153] oneDNN custom operations are on. ...
  I0000 ... cudart_stub.cc:31] Could not find cuda drivers on your machine ...
  E0000 ... cuda_platform.cc:52] failed call to cuInit: ...
  I0000 ... cpu_feature_guard.cc:227] This TensorFlow binary is optimized ...
  To enable the following instructions: AVX2 AVX512F ..., in other operations ...

(some twice: two of TensorFlow's shared libraries each log them; a GPU
machine adds "Unable to register cuDNN factory" and the like). Most are
written before absl's logging is initialised, so TF_CPP_MIN_LOG_LEVEL does
not reach them. They can only be hidden at the file descriptor: while
TensorFlow is imported and its devices are set up, `QuietStderr` points fd 2
at a temporary file. Afterwards fd 2 is restored and every captured line
that is not a C++ log record is written back (a Python warning, anything
else). If the code inside raises, everything captured is written back.
Dropped records stay readable in `StartupLog()`, so that an error such as
"no GPU is visible" can quote TensorFlow's reason (a failed cuInit).

After start-up TF_CPP_MIN_LOG_LEVEL, set to 2 by default (errors only),
governs, so real errors still print. A crash inside the quiet region (a C++
abort) loses its message; rerun with --verbosity=1 to see it.

`--verbosity=1` or higher (absl's DEBUG) shows the whole start-up log and
TensorFlow's C++ INFO logs (TF_CPP_MIN_LOG_LEVEL=0 unless it is set in the
environment). `--verbosity=0` only brings back the Python INFO logs.

Used by the trainer, the launcher's workers and the benchmarks. This module
does not import TensorFlow until `ImportTensorFlow` is called.
"""

import contextlib
import os
import re
import sys
import tempfile

# --verbosity at or above which the start-up log is shown.
SHOW_VERBOSITY = 1

LOG_LEVEL_ENV = 'TF_CPP_MIN_LOG_LEVEL'

# An absl C++ log record ("I0000 00:00:1795437401.667369   25062 port.cc:153]
# ...") or TensorFlow's older format ("2024-01-02 03:04:05.678901: I
# tensorflow/core/... ] ...").
_CPP_RECORD = re.compile(
    r'^([IWEF]\d{4} \d+:\d+:\d+\.\d+\s+\d+ \S+:\d+\] |'
    r'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+:\d+\] )')
_ABSL_PREAMBLE = 'WARNING: All log messages before absl::InitializeLog()'
# Second line of cpu_feature_guard's record, the one multi-line start-up log.
_CONTINUATIONS = ('To enable the following instructions:',)
_ERROR_RECORD = re.compile(r'^(E\d{4} |\d{4}-\d\d-\d\d \S+: E )')

_startup_log = []
_active = [False]


def VerbosityFromArgv(argv=None):
  """The --verbosity (or -v) value in argv, or None if absent or not a number.

  For scripts that import TensorFlow before absl parses the flags.
  """
  argv = sys.argv if argv is None else argv
  value = None
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg == '--':
      break
    m = re.fullmatch(r'--?(?:verbosity|v)(?:=(.*))?', arg)
    if not m:
      continue
    text = m.group(1)
    if text is None:
      text = args[i + 1] if i + 1 < len(args) else ''
    try:
      value = int(text)
    except ValueError:
      value = None
  return value


def ShowStartupLog(verbosity):
  """True if `verbosity` (None: not given) asks for TensorFlow's start-up log."""
  return verbosity is not None and verbosity >= SHOW_VERBOSITY


def SetLogLevel(show):
  """Sets TF_CPP_MIN_LOG_LEVEL's default: 0 if `show`, else 2 (errors only).

  Must run before TensorFlow is imported; a value in the environment wins.
  """
  os.environ.setdefault(LOG_LEVEL_ENV, '0' if show else '2')


def IsStartupNoise(line):
  """True for a line of TensorFlow's C++ log (or absl's preamble to it)."""
  return bool(_CPP_RECORD.match(line) or line.startswith(_ABSL_PREAMBLE) or
              line.startswith(_CONTINUATIONS))


def StartupLog():
  """The C++ log lines QuietStderr has dropped in this process, in order."""
  return list(_startup_log)


def StartupErrors():
  """The dropped lines that were error records (e.g. a failed cuInit)."""
  return [line for line in _startup_log if _ERROR_RECORD.match(line)]


@contextlib.contextmanager
def QuietStderr(show=False):
  """Hides TensorFlow's C++ log records written to fd 2 inside the block.

  Args:
    show: do nothing (the caller asked for the start-up log).

  Yields nothing. Other captured output is written back when the block
  ends; all of it if the block raises.
  """
  if show or _active[0]:
    yield
    return
  try:
    saved = os.dup(2)
  except OSError:  # No fd 2 (e.g. closed by the parent): nothing to hide.
    yield
    return
  _active[0] = True
  capture = tempfile.TemporaryFile(mode='w+b')
  _FlushStreams()
  os.dup2(capture.fileno(), 2)
  failed = True
  try:
    yield
    failed = False
  finally:
    _FlushStreams()
    os.dup2(saved, 2)
    os.close(saved)
    _active[0] = False
    capture.seek(0)
    text = capture.read().decode('utf-8', errors='replace')
    capture.close()
    _WriteBack(text, everything=failed)


def _FlushStreams():
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (AttributeError, ValueError, OSError):
      pass


def _WriteBack(text, everything):
  kept = []
  for line in text.splitlines(keepends=True):
    if not everything and IsStartupNoise(line):
      _startup_log.append(line.rstrip('\n'))
    else:
      kept.append(line)
  if kept:
    os.write(2, ''.join(kept).encode('utf-8', errors='replace'))


def ImportTensorFlow(show=None, argv=None):
  """Imports TensorFlow quietly and returns it.

  Also lists the physical devices, which initialises CUDA (and logs a
  failed cuInit) inside the quiet region; the runtime itself is not started,
  so logical devices can still be configured.

  Args:
    show: show the start-up log; None: decide from --verbosity in argv.
    argv: the command line to read --verbosity from (default sys.argv).
  """
  if show is None:
    show = ShowStartupLog(VerbosityFromArgv(argv))
  SetLogLevel(show)
  with QuietStderr(show):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.list_physical_devices()
  return tf
