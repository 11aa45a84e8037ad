"""Finding out which device ran out of memory, wherever it is.

When an allocation fails, TensorFlow knows exactly what happened: its C++
log says `OOM when allocating tensor with shape[512,512] and type float on
/job:worker/replica:0/task:1/device:CPU:0` (and which op asked). But the
error a pipelined step raises is often another one: a multi-device graph
that fails on one device is cancelled on the others, and the caller gets
whichever status arrived first, typically `CancelledError: RecvAsync is
cancelled`, in one process as from worker processes. So this module looks
in three places:

* the error chain (`FindInError`): enough when the failing call ran on one
  device (executor='threads', a variable's creation);
* this process's own C++ log (`StderrWatch`): TensorFlow's warnings are
  read from fd 2 through a pipe; the out-of-memory records are kept and the
  other warnings hidden, as TF_CPP_MIN_LOG_LEVEL=2 would (`KeepWarnings`
  lowers it to 1 before TensorFlow starts);
* each worker's log, which a watch of the worker's own keeps in a file its
  controller reads (tfpipe.out_of_memory_reports).

A capped CPU allocator's refusal does not always end in an error: some
TensorFlow kernels (oneDNN's convolutions, the eager conversion of a
constant) use the tensor they could not get and crash the process at once.
The allocator's own warning is then the last thing the process logs, with
no 'OOM when allocating' record after it. So the reader runs in its own
process, which outlives the crash long enough to write what the pipe still
holds, and a refusal left unpaired when the log ends becomes a record of
its own (`crashed`), which `on_crash` gets. Nor does a refusal always end
in an out-of-memory error: a tensor sent by another process that its
worker cannot allocate fails as 'Unable to parse tensor proto'. So every
refusal is kept as soon as it is logged, and a reader takes the record
that says the most (`MostTelling`).
"""

import collections
import math
import os
import re
import select
import signal
import sys
import threading
import time

LOG_LEVEL_ENV = 'TF_CPP_MIN_LOG_LEVEL'
# Exit status of a run that stopped because a device ran out of memory (or
# that --plan=auto found nothing that fits), having said so. 1 is every
# other stop, 3 a lost worker. Here, without TensorFlow, for the launcher.
EXIT_OUT_OF_MEMORY = 4

_OOM = re.compile(r'OOM when allocating tensor with shape\[([^\]]*)\] and '
                  r'type (\w+) on (\S+) by allocator (\S+)')
# The op's name is empty for an allocation made outside any op (an eager
# constant's conversion).
_RAN_OUT = re.compile(r'ran out of memory trying to allocate (\S+) .*?'
                      r'requested by op ?(\S*)')
_ALLOCATOR = re.compile(r'Allocator \((\S+)\) ran out of memory')
# The allocator's count of a request, as TensorFlow writes it ('4B',
# '256.0KiB', '4.00MiB').
_HUMAN_BYTES = re.compile(r'([\d.]+)([KMGT])?i?B')
_DTYPE_BYTES = {'float': 4, 'double': 8, 'half': 2, 'bfloat16': 2,
                'int8': 1, 'uint8': 1, 'bool': 1, 'int16': 2, 'int32': 4,
                'int64': 8, 'uint32': 4, 'uint64': 8, 'complex64': 8,
                'complex128': 16}
# A C++ warning record: absl's "W0000 00:00:..." or TensorFlow's older
# "2024-01-02 03:04:05.678901: W ...".
_WARNING = re.compile(r'^(W\d{4} \d+:\d+:\d+\.\d+\s+\d+ \S+:\d+\] |'
                      r'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: W \S+:\d+\] )')
# Any C++ log record's first line.
_RECORD = re.compile(r'^([IWEF]\d{4} \d+:\d+:\d+\.\d+\s+\d+ \S+:\d+\] |'
                     r'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+:\d+\] )')
# Further lines of a multi-line warning (an allocator's, a cancelled step's).
_CONTINUATION = re.compile(
    r'^(\s|Hint: |If the cause is memory fragmentation|Current allocation '
    r'summary follows|Additional GRPC error information|:UNKNOWN:Error '
    r'received|This could happen if the remote target)')
# Seconds a watch waits for the rest of a partial line.
_PARTIAL_WAIT_S = 0.1


class OutOfMemoryRecord(collections.namedtuple(
    'OutOfMemoryRecord', ['device', 'shape', 'dtype', 'allocator', 'op',
                          'requested', 'crashed'], defaults=[False])):
  """One failed allocation: where, of what, for which op (when known).

  A record whose shape and dtype are unknown ('?') is an allocator's
  refusal alone: kept as soon as it is logged, because no 'OOM when
  allocating' record need follow it (a tensor that arrives from another
  process and cannot be allocated fails as 'Unable to parse tensor proto').
  `crashed`: that refusal was the last thing the process logged (it crashed
  before any error was raised).
  """

  def Describe(self):
    parts = []
    if self.shape != '?':
      parts.append(f'a tensor of shape [{self.shape}] ({self.dtype})')
    if self.requested:
      parts.append(self.requested)
    if self.op:
      parts.append(f'for op {self.op}')
    return ', '.join(parts) or 'a tensor'

  @property
  def known(self):
    """Whether anything is known of the allocation besides its failure."""
    return self.shape != '?' or bool(self.requested)

  @property
  def num_bytes(self):
    """The failed request's bytes: the allocator's own count, else the
    tensor's shape times its element size; None if neither is known."""
    requested = _HUMAN_BYTES.fullmatch(self.requested or '')
    if requested:
      return int(float(requested.group(1)) *
                 1024**' KMGT'.index(requested.group(2) or ' '))
    size = _DTYPE_BYTES.get(self.dtype)
    if size is None or self.shape == '?':
      return None
    try:
      return size * math.prod(
          int(d) for d in self.shape.split(',') if d.strip())
    except ValueError:
      return None

  def SmallNextTo(self, limit_mb):
    """Whether the request is under 1% of a `limit_mb` MiB device: then the
    device was already full, and what filled it is the story, not this
    request (a 4-byte scalar can be the one refused)."""
    size = self.num_bytes
    return bool(limit_mb) and size is not None and (
        size < limit_mb * 2**20 / 100)


def LoggedRefusals(text):
  """Each allocator refusal ('ran out of memory trying to allocate') in a
  log, as its record alone: for a log that ended right after one, as a
  process's that crashed when a kernel got no memory."""
  return [_Refusal(line) for line in text.splitlines() if _RAN_OUT.search(line)]


def _Refusal(text):
  """The record of an allocator's refusal, as if the log ended after it
  (the device is the reporting worker's, filled in by whoever reads it)."""
  ran_out = _RAN_OUT.search(text)
  allocator = _ALLOCATOR.search(text)
  return OutOfMemoryRecord(
      device='', shape='?', dtype='?',
      allocator=allocator.group(1) if allocator else '',
      op=ran_out.group(2) if ran_out else '',
      requested=ran_out.group(1) if ran_out else '', crashed=True)


def MostTelling(records):
  """`records`, those that say the most first: a failed allocation's full
  record, then a refusal after which the process crashed, then a refusal
  alone (OutOfMemoryRecord)."""
  return sorted(records, key=lambda r: (r.shape == '?', not r.crashed))


def _Restated(record, last):
  """Whether `record` restates the failure just kept (`last`: [] or [the
  last record]): TensorFlow logs one failed allocation more than once (the
  op's failure, then each rendezvous that aborts with its status)."""
  return bool(last) and record[:4] == last[0][:4] and not record.op


def ParseRecords(text):
  """The OutOfMemoryRecords in TensorFlow log or error text, in order.

  An allocator's 'ran out of memory ... requested by op X' line names the
  op of the 'OOM when allocating' record that follows it.
  """
  records, pending = [], None
  for line in text.splitlines():
    ran_out = _RAN_OUT.search(line)
    if ran_out:
      pending = ran_out
      continue
    oom = _OOM.search(line)
    if oom:
      records.append(OutOfMemoryRecord(
          device=oom.group(3), shape=oom.group(1), dtype=oom.group(2),
          allocator=oom.group(4),
          op=pending.group(2) if pending else '',
          requested=pending.group(1) if pending else ''))
      pending = None
  return records


def IsOutOfMemoryError(error):
  """True if `error` or an error it was raised from failed to allocate."""
  return bool(FindInError(error)) or any(
      type(e).__name__ == 'ResourceExhaustedError' for e in _Chain(error))


def _Chain(error):
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def FindInError(error):
  """The OutOfMemoryRecords named anywhere in an exception's chain."""
  records = []
  for e in _Chain(error):
    for record in ParseRecords(str(e)):
      if record not in records:
        records.append(record)
  return records


_hidden = [False]


def KeepWarnings(show_all):
  """Makes TensorFlow log its warnings (out-of-memory records are ones).

  Call before TensorFlow is imported. A TF_CPP_MIN_LOG_LEVEL the user set
  wins; with `show_all` (--verbosity=1) everything is shown anyway.

  Returns:
    Whether a StderrWatch should hide the other warnings (the user did not
    ask for them); WarningsHidden() says it again later.
  """
  if show_all or LOG_LEVEL_ENV in os.environ:
    return _hidden[0]
  os.environ[LOG_LEVEL_ENV] = '1'
  _hidden[0] = True
  return True


def WarningsHidden():
  """Whether KeepWarnings turned on warnings the user did not ask for."""
  return _hidden[0]


class StderrWatch:
  """Reads this process's fd 2 through a pipe, keeping TensorFlow's
  out-of-memory records.

  Every line is written on to the real stderr as soon as it arrives, except
  TensorFlow's C++ warnings when `hide_warnings` (they would not have
  printed at the default log level). Stop() puts fd 2 back and writes out
  whatever is left, so nothing printed before it is lost.

  The pipe is read on a thread (Start) or by a forked process (StartInChild),
  which outlives this one: if the log ends, without Stop(), right after an
  allocator's refusal, the process crashed, and `on_crash` gets the record.
  """

  def __init__(self, hide_warnings=True, on_record=None, on_crash=None,
               on_end=None):
    self.hide_warnings = hide_warnings
    self.records = []
    self._on_record = on_record
    self._on_crash = on_crash
    self._on_end = on_end  # Called once the log has ended, by its reader.
    self._saved = None
    self._thread = None
    self._child = None
    self._read = None
    self._lock = threading.Lock()
    self._pending_op = ''
    self._hiding = False
    self._stopped = False

  @property
  def active(self):
    return self._saved is not None

  def Start(self):
    """Points fd 2 at the pipe; returns self. Does nothing without fd 2."""
    pipe = _OpenPipe()
    if pipe is None:
      return self
    saved, read, write = pipe
    os.dup2(write, 2)
    os.close(write)
    self._saved, self._read = saved, read
    self._thread = threading.Thread(target=self._Pump, daemon=True,
                                    name='tfpipe-stderr-watch')
    self._thread.start()
    return self

  def StartInChild(self):
    """Like Start, but the pipe is read by a forked process of its own.

    That process outlives this one's crash: it gets the rest of the pipe,
    then end of file, and exits. Records reach only `on_record` (Records()
    here stays empty). Call it before any thread starts (before
    TensorFlow), as fork() requires. Returns whether it started.
    """
    if not CanFork():
      return False
    pipe = _OpenPipe()
    if pipe is None:
      return False
    saved, read, write = pipe
    pid = os.fork()
    if pid == 0:  # The reader.
      try:
        os.close(write)
        # It ends with the pipe, not with a Ctrl-C meant for its worker, nor
        # with a SIGTERM sent to every process of a job (SLURM's), which a
        # trainer answers by saving its step first (trainer/stop_signal.py).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._saved, self._read = saved, read
        self._Pump()
      finally:
        os._exit(0)  # pylint: disable=protected-access
    os.close(read)
    os.dup2(write, 2)
    os.close(write)
    self._saved, self._child = saved, pid
    return True

  def Stop(self):
    """Puts fd 2 back and writes out what the pipe still holds."""
    if self._saved is None:
      return
    _Flush()
    if self._child is not None:
      try:
        os.write(2, _STOPPED)  # The reader's sign that nothing crashed.
      except OSError:
        pass
    else:
      self._stopped = True  # The reading thread's: this process lives on.
    os.dup2(self._saved, 2)  # Closes the pipe's last write end.
    if self._child is not None:
      _WaitFor(self._child, 5.0)
      self._child = None
    else:
      self._thread.join(timeout=5.0)
    os.close(self._saved)
    self._saved = None

  def __enter__(self):
    return self.Start()

  def __exit__(self, *unused_exc):
    self.Stop()

  def _Pump(self):
    buffer = b''
    while True:
      ready, _, _ = select.select([self._read], [], [],
                                  _PARTIAL_WAIT_S if buffer else None)
      if not ready:  # A partial line waited long enough: write it out.
        self._Write(buffer)
        buffer = b''
        continue
      chunk = os.read(self._read, 65536)
      if not chunk:
        break
      buffer += chunk
      *lines, buffer = buffer.split(b'\n')
      for line in lines:
        self._Line(line + b'\n')
    if buffer:
      self._Line(buffer)
    if self._pending_op and not self._stopped:
      # A refusal, then nothing: the process crashed.
      record = _Refusal(self._pending_op)
      self._Keep(record)
      self._pending_op = ''
      if self._on_crash:
        self._on_crash(record)
    os.close(self._read)
    if self._on_end:
      self._on_end()

  def _Keep(self, record):
    with self._lock:
      self.records.append(record)
    if self._on_record:
      self._on_record(record)

  def _Line(self, raw):
    if raw.endswith(_STOPPED):  # Also after a partial line of its own.
      self._stopped = True
      self._Write(raw[:-len(_STOPPED)])
      return
    text = raw.decode('utf-8', 'replace')
    ran_out = _RAN_OUT.search(text)
    if ran_out:
      self._pending_op = text
      self._Keep(_Refusal(text)._replace(crashed=False))
    elif _OOM.search(text):
      for record in ParseRecords(self._pending_op + text):
        if not _Restated(record, self.records[-1:]):
          self._Keep(record)
      self._pending_op = ''
    if self.hide_warnings:
      if _WARNING.match(text):
        self._hiding = True
        return
      if self._hiding and not _RECORD.match(text) and _CONTINUATION.match(
          text):
        return
      self._hiding = False
    self._Write(raw)

  def _Write(self, data):
    saved = self._saved
    if saved is None or not data:
      return
    try:
      os.write(saved, data)
    except OSError:
      pass

  def Records(self):
    with self._lock:
      return list(self.records)


# What Stop() writes last, for a reader process: the log ends cleanly.
_STOPPED = b'\0tfpipe: stderr watch stopped\n'


def CanFork():
  """Whether a reader process can be forked safely: before TensorFlow (and
  any other thread) starts. In a process already running TensorFlow, such
  as a test calling the trainer's main, the watch reads on a thread."""
  return (hasattr(os, 'fork') and 'tensorflow' not in sys.modules and
          threading.active_count() == 1)


def _WaitFor(pid, timeout_s):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      if os.waitpid(pid, os.WNOHANG)[0]:
        return
    except ChildProcessError:
      return
    time.sleep(0.01)


def _OpenPipe():
  """(a dup of fd 2, the read end, the write end) of a new pipe, with
  Python's buffers flushed; None without an fd 2."""
  try:
    saved = os.dup(2)
  except OSError:
    return None
  read, write = os.pipe()
  _Flush()
  return saved, read, write


def _Flush():
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (AttributeError, ValueError, OSError):
      pass
