"""Where out-of-memory records are kept, so that a crash loses none.

A StderrWatch (tfpipe.out_of_memory) reads a process's TensorFlow log; here
its records go to a file, from a reader process forked before TensorFlow
starts, which outlives the process it watches (`RecordFile`):

* a worker's report, at a fixed path on its host (`WorkerReport`,
  `ReportPath`). Its controller reads it through TensorFlow itself, a
  `ReadFile` op placed on the worker's device (`AskWorkers`) that reads
  the file the worker holds open (`REPORT_FD`), so it works across hosts
  with no channel besides the cluster's own; or, once the
  worker no longer answers (it crashed right after its allocator refused
  memory), from this host's disk (`LocalReport`), where a launcher's
  workers run.
* a single process's, in a private temporary file (`ProcessWatch`): read
  by the process's own diagnosis of an error, and, if the process crashes
  after a refusal, the reader says so itself.

A report's fixed path is in /tmp, where anyone can write, so it is opened
only as a regular file of this user, never through a link
(`_OpenOwnFile`). A report that holds no record is removed when its log
ends (by its reader) or when its workers are gone (`RemoveReports`, by a
launcher, whose SIGKILL to a worker's process group ends the reader too),
so a run that never ran out of memory leaves nothing in /tmp. One that
holds records goes too once its controller has said it ran out of memory
(a launcher's, exit status EXIT_OUT_OF_MEMORY); otherwise it stays, as the
evidence, and the launcher names it.
"""

import atexit
import json
import os
import re
import stat
import sys
import tempfile
import time

from tfpipe import out_of_memory


def ReportPath(job, task, address):
  """Where a worker writes its out-of-memory records, on its own host.

  A fixed name in a directory anyone can write to, so the report is opened
  only as a regular file of this user, never through a link
  (_OpenOwnFile): another user's file or link there leaves the worker
  without a report, and cannot make a controller claim out of memory (the
  controller reads the file the worker holds open, REPORT_FD, not the
  name).
  """
  port = address.rsplit(':', 1)[-1]
  return f'/tmp/tfpipe-oom-{job}-{task}-{port}.jsonl'


def _OpenOwnFile(path, flags):
  """os.open(path, flags) of a regular file this user owns, never through
  a symbolic link (created 0600 with O_CREAT).

  Raises:
    OSError: a link, not a regular file, or another user's.
  """
  fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
      raise OSError(f'{path} is not a regular file of this user')
  except BaseException:
    os.close(fd)
    raise
  return fd


class RecordFile:
  """A StderrWatch whose records go to a file of this user's, from a reader
  process of its own where one can be forked (StartInChild), so that a
  crash loses nothing; else from a thread."""

  def __init__(self, path, hide_warnings=True, on_crash=None,
               who='this worker'):
    self.path = path
    self._wrote = False
    try:
      fd = _OpenOwnFile(self.path, os.O_WRONLY | os.O_CREAT)
      os.ftruncate(fd, 0)  # A record of an earlier run would mislead.
      os.close(fd)
    except OSError as e:
      print(f'tfpipe: {who} writes no out-of-memory report ({e}).',
            file=sys.stderr, flush=True)
      self.path = None
    self.watch = out_of_memory.StderrWatch(
        hide_warnings, on_record=self._Write, on_crash=on_crash,
        on_end=self._Ended)
    self._in_child = False

  def _Write(self, record):
    if not self.path:
      return
    line = json.dumps({**record._asdict(), 'time': time.time()}) + '\n'
    try:
      # Made again if it went while empty (RemoveReports).
      fd = _OpenOwnFile(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
      try:
        os.write(fd, line.encode('utf-8'))
        self._wrote = True
      finally:
        os.close(fd)
    except OSError:
      pass

  def _Ended(self):
    """The log ended (in its reader): a report without records goes."""
    if self.path and not self._wrote:
      _RemoveOwn(self.path)

  def Start(self):
    """Starts watching; a watch on a thread writes out what it holds at
    exit."""
    self._in_child = bool(self.path) and self.watch.StartInChild()
    if not self._in_child:
      self.watch.Start()
      atexit.register(self.watch.Stop)
    return self

  def Records(self):
    if not self._in_child:
      return self.watch.Records()
    try:
      fd = _OpenOwnFile(self.path, os.O_RDONLY)
    except OSError:
      return []
    with open(fd, encoding='utf-8', errors='replace') as f:
      return _ParseReport(f.read())

  def Stop(self):
    self.watch.Stop()


# The descriptor on which a worker holds its report open, for its
# controller to read as /proc/self/fd/REPORT_FD through a ReadFile op that
# the worker runs (AskWorkers): the file the worker made, whatever the name
# leads to by then. High, so that nothing a process opens at start has it.
REPORT_FD = 1017


class WorkerReport(RecordFile):
  """A worker's RecordFile, at ReportPath on its host, held open on
  REPORT_FD."""

  def __init__(self, job, task, address, hide_warnings=True):
    super().__init__(ReportPath(job, task, address), hide_warnings)
    if self.path:
      _HoldOpen(self.path)


def _HoldOpen(path):
  """Holds the report at `path` (checked: a regular file of this user's)
  open on REPORT_FD, if that descriptor is free."""
  try:
    os.fstat(REPORT_FD)
    return  # Taken: the controller finds no report, never another file.
  except OSError:
    pass
  try:
    fd = _OpenOwnFile(path, os.O_RDONLY)
  except OSError:
    return
  os.dup2(fd, REPORT_FD, inheritable=False)
  os.close(fd)


class ProcessWatch(RecordFile):
  """A single process's RecordFile, in a private temporary file: its
  Records() serve this process's diagnosis of an error, and `on_crash`
  (called in the reader) says what a crash after a refusal was, since the
  process itself cannot."""

  def __init__(self, hide_warnings=True, on_crash=None):
    fd, path = tempfile.mkstemp(prefix='tfpipe-oom-', suffix='.jsonl')
    os.close(fd)

    def Crashed(record):
      if on_crash:
        on_crash(record)
      _Remove(path)
    super().__init__(path, hide_warnings, on_crash=Crashed,
                     who='this process')

  def _Ended(self):
    # Only this process read it, while it ran: whatever it holds goes.
    if self.path:
      _Remove(self.path)

  def Stop(self):
    super().Stop()
    if self.path:
      _Remove(self.path)


def _Remove(path):
  try:
    os.remove(path)
  except OSError:
    pass


def _RemoveOwn(path, only_empty=True):
  """Removes `path` if it is a regular file of this user's (a link or
  another user's file stays), and with `only_empty` if it is empty. A
  worker that still writes to it makes it again with its next record.
  Returns whether a file of this user's with records stays."""
  try:
    st = os.lstat(path)
  except OSError:
    return False
  if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
    return False
  if st.st_size == 0 or not only_empty:
    _Remove(path)
    return False
  return True


def RemoveReports(jobs, keep_records=True):
  """Removes the reports of the workers of `jobs` ({job: [address]}) on
  this host, once they are gone, and returns the paths of those kept: with
  `keep_records`, those that hold records, as the only evidence of a run
  whose controller did not say it ran out of memory; without, none (a
  controller or benchmark has read them)."""
  from tfpipe import cluster_spec  # pylint: disable=g-import-not-at-top
  kept = []
  for job, addresses in jobs.items():
    if job == cluster_spec.CONTROLLER_JOB:
      continue
    for task, address in enumerate(addresses):
      path = ReportPath(job, task, address)
      if _RemoveOwn(path, only_empty=keep_records):
        kept.append(path)
  return kept


def RemoveAfterRun(jobs, exit_status):
  """RemoveReports once a launcher's controller has exited with
  `exit_status` (None: it never did): reports with records go too when it
  said it ran out of memory (EXIT_OUT_OF_MEMORY), whose error said what
  they hold. Returns the paths kept, for the launcher to name."""
  return RemoveReports(
      jobs, keep_records=exit_status != out_of_memory.EXIT_OUT_OF_MEMORY)


def StartWorkerReport(job, task, cluster_spec_text, show_all,
                      environ=None):
  """A worker's WorkerReport, started before TensorFlow (None if this
  process is not a worker of a cluster spec or TF_CONFIG).

  Reads the spec without TensorFlow, so that the log level can still be
  lowered (KeepWarnings).
  """
  from tfpipe import cluster_spec  # pylint: disable=g-import-not-at-top
  environ = os.environ if environ is None else environ
  try:
    if cluster_spec_text:
      jobs = cluster_spec.ParseClusterJobs(cluster_spec_text)
    else:
      config = json.loads(environ.get('TF_CONFIG') or '{}')
      jobs = config.get('cluster') or {}
      job = job or (config.get('task') or {}).get('type')
      task = (config.get('task') or {}).get('index') if task is None else task
    address = jobs[job][task or 0]
  except (KeyError, IndexError, TypeError, ValueError):
    return None
  if job == cluster_spec.CONTROLLER_JOB:
    return None
  hide = out_of_memory.KeepWarnings(show_all)
  return WorkerReport(job, task or 0, address, hide_warnings=hide).Start()


def _WorkerDevice(job, task):
  return f'/job:{job}/replica:0/task:{task}/device:CPU:0'


def _Tasks(workers):
  """(job, task, address) of [(task name '/job:worker/task:1', address)]."""
  result = []
  for name, address in workers:
    match = re.fullmatch(r'/job:([^/]+)/task:(\d+)', name)
    if match:
      result.append((match.group(1), int(match.group(2)), address))
  return result


def AskWorkers(workers, since=None):
  """{task name: [OutOfMemoryRecord]} of the workers that reported any
  since `since` (a time.time(); a worker may have served an earlier run).

  Reads each worker's report with a ReadFile op on that worker, of the
  file the worker holds open (REPORT_FD), not of the report's name, which
  anyone on its host could have made a link or a file of theirs: a worker
  that does not answer, or has no report, adds nothing.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  found = {}
  for job, task, _ in _Tasks(workers):
    try:
      with tf.device(_WorkerDevice(job, task)):
        text = tf.io.read_file(f'/proc/self/fd/{REPORT_FD}')
      text = text.numpy().decode('utf-8', 'replace')
    except (tf.errors.OpError, ValueError):
      continue
    records = _ParseReport(text, since)
    if records:
      found[f'/job:{job}/task:{task}'] = records
  return found


def LocalReport(task_name, address, since=0.0):
  """The records a worker wrote since `since` (a time.time()), read from
  this host's disk: for a worker that no longer answers, when it ran on
  this host (a launcher's). [] if this host has no such report."""
  tasks = _Tasks([(task_name, address)])
  if not tasks:
    return []
  job, task, _ = tasks[0]
  try:
    fd = _OpenOwnFile(ReportPath(job, task, address), os.O_RDONLY)
  except OSError:
    return []
  with open(fd, encoding='utf-8', errors='replace') as f:
    return _ParseReport(f.read(), since)


def _ParseReport(text, since=None):
  records = []
  for line in text.splitlines():
    try:
      values = json.loads(line)
      written = values.pop('time', None)
      record = out_of_memory.OutOfMemoryRecord(**values)
    except (ValueError, TypeError):
      continue
    if since is None or (written or 0) >= since:
      records.append(record)
  return records
