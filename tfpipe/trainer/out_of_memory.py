"""Out of memory, said plainly: which device, which cells, what to change.

When a device runs out of memory, TensorFlow's error rarely says so (see
tfpipe.out_of_memory: the step usually fails with `RecvAsync is
cancelled`). The trainer wraps the run in a `Diagnosis`, which finds the
failed allocation (in the error, in this process's own TensorFlow log, or
in the workers' reports) and turns it into one `ERROR:` line:

    Out of memory on /job:worker/replica:0/task:1/device:CPU:0, which runs
    cell1 (block_2, block_3, logits): it could not allocate a tensor of
    shape [64,32,512] (float). Its limit is 24 MiB; the memory model
    predicted 31.2 MiB for it (at B3.1: ...). To fit, try more partitions
    (--num_partitions=4), ... or --plan=auto. The last good checkpoint,
    .../ckpt-20, is kept.

and exit status EXIT_OUT_OF_MEMORY. Nothing is saved from the failed step,
so the last good checkpoint is untouched (the train loop saves only after
a step succeeds).
"""

import os
import re
import threading
import time

from tfpipe import device_names
from tfpipe import memory_limit
from tfpipe import out_of_memory
from tfpipe import out_of_memory_reports

EXIT_OUT_OF_MEMORY = out_of_memory.EXIT_OUT_OF_MEMORY
MIB = 2**20
# Seconds the memory model's prediction may take in the message about a
# crashed worker (multihost.EXPLAIN_TIMEOUT_S bounds the whole message).
PREDICT_WITHIN_S = 20.0


# After a refused request under 1% of the limit: the request is not what
# to shrink.
_ALREADY_FULL = ('That request is small next to the limit: the device was '
                 'already full.')


class OutOfMemoryStop(Exception):
  """A device ran out of memory; the message says which and what to do."""

  exit_status = EXIT_OUT_OF_MEMORY


def LastGood(path, checkpoint_dir=None):
  """The sentence about the checkpoints a stopped run leaves.

  Args:
    path: the newest good checkpoint the run knew of, if any.
    checkpoint_dir: where to look when the run stopped before knowing.
  """
  if path:
    return f'The last good checkpoint, {path}, is kept.'
  numbers = []
  if checkpoint_dir and os.path.isdir(checkpoint_dir):
    numbers = [int(m.group(1)) for m in (
        re.fullmatch(r'ckpt-(\d+)\.index', name)
        for name in os.listdir(checkpoint_dir)) if m]
  if numbers:
    return (f'The checkpoints in {checkpoint_dir} (the newest '
            f'ckpt-{max(numbers)}) were not touched.')
  return 'No checkpoint was written or changed.'


def _TaskOf(name):
  """('worker', 1) of '/job:worker/replica:0/task:1/device:CPU:0' or
  '/job:worker/task:1'; None for a name without both."""
  job = re.search(r'/job:([^/]+)', name)
  task = re.search(r'/task:(\d+)', name)
  return (job.group(1), int(task.group(1))) if job and task else None


def Advice(pipeline_p, num_devices=None, plan_headroom=None):
  """What would lower a device's peak, given the pipeline's settings.

  `plan_headroom`: the headroom --plan=auto left, if it chose the settings;
  the memory model then under-predicted this device by more than that, and
  the fix is a plan with more room, not a hand-made one.
  """
  if plan_headroom is not None:
    more = min(0.9, round(plan_headroom + 0.1, 2))
    return (f'The plan left {plan_headroom:.0%} of each device free '
            f'(--plan_headroom), which was not enough here: a larger one '
            f'(--plan_headroom={more:g}) makes --plan=auto choose a plan '
            'with more room, or give more memory or devices.')
  k = pipeline_p.num_partitions
  ideas = []
  if num_devices is None or num_devices > k * pipeline_p.num_replicas:
    ideas.append(f'more partitions (--num_partitions={2 * k})')
  if pipeline_p.remat_policy != 'always':
    ideas.append('--remat_policy=always')
  ideas.append(f'more micro-batches (--num_micro_batches='
               f'{2 * pipeline_p.num_micro_batches})')
  if pipeline_p.schedule == 'gpipe' and pipeline_p.remat_policy != 'always':
    ideas.append('--schedule=1f1b')
  if pipeline_p.balance != 'memory':
    ideas.append('--balance=memory')
  ideas.append('--plan=auto with --device_memory_mb')
  return 'To fit, try ' + ', '.join(ideas[:-1]) + ', or ' + ideas[-1] + '.'


def CrashedMessage(record):
  """The line for a single process that crashed right after its allocator
  refused memory (tfpipe.out_of_memory), said by the watch's reader process
  since this one no longer can: from the record and this process's
  environment alone."""
  limit = memory_limit.LimitMb()
  parts = [f'Out of memory in this process: it could not allocate '
           f'{record.Describe()}, and then crashed, as some TensorFlow '
           'kernels do when an allocation is refused, instead of failing '
           'the step.']
  if record.SmallNextTo(limit):
    parts.append(_ALREADY_FULL)
  if limit:
    parts.append(f'The process\'s limit is {limit} MiB '
                 f'({memory_limit.LIMIT_ENV}).')
  parts.append('To fit, try more partitions (--num_partitions), '
               '--remat_policy=always, more micro-batches '
               '(--num_micro_batches), --balance=memory, or --plan=auto '
               'with --device_memory_mb.')
  parts.append('A checkpoint is written only after a step succeeds, so '
               'those in the logdir are intact.')
  return ' '.join(parts)


class Diagnosis:
  """Turns a failed run's error into an OutOfMemoryStop, if it was one."""

  def __init__(self, p, devices, limit_mb=None, shared_limit=False,
               workers=None, watch=None, predict=None, last_good=None,
               plan_headroom=None):
    """Args:
      p: the experiment params.
      devices: the pipeline's R*K device names (replica-major).
      limit_mb: each device's limit, if known.
      shared_limit: the devices share one allocator (logical CPU devices of
        this process), whose limit is limit_mb.
      workers: [(task name, address)] of a controller's workers, to ask.
      watch: this process's out_of_memory.StderrWatch, if any.
      predict: fn() -> [memory_model.DevicePeak] of the step (may be slow;
        called only after an out-of-memory error).
      last_good: fn() -> the sentence about the last good checkpoint.
      plan_headroom: the headroom --plan=auto left, if it made the plan.
    """
    self.p = p
    self.plan_headroom = plan_headroom
    self.devices = list(devices)
    self.limit_mb = limit_mb
    self.shared_limit = shared_limit
    self.workers = workers
    self.watch = watch
    self._predict = predict
    self._last_good = last_good
    self.since = time.time()  # A worker's records from before are stale.

  def Records(self, error):
    """The failed allocations behind `error` (empty if it was not one)."""
    records = out_of_memory.FindInError(error)
    if not records and self.watch is not None:
      records = self.watch.Records()
    if not records and self.workers:
      # A worker out of memory may not answer the question (its reply needs
      # memory): one on this host is read from the disk instead.
      answers = out_of_memory_reports.AskWorkers(self.workers, self.since)
      for task_name, address in self.workers:
        found = answers.get(task_name) or out_of_memory_reports.LocalReport(
            task_name, address, self.since)
        records.extend(self._OnTask(record, task_name) for record in found)
    if not records and out_of_memory.IsOutOfMemoryError(error):
      records = [out_of_memory.OutOfMemoryRecord('', '?', '?', '', '', '')]
    return out_of_memory.MostTelling(records)

  def _OnTask(self, record, task_name):
    """`record`, with the device of task `task_name` where it names none (a
    refusal alone names none: the worker's own log does not say which)."""
    if record.device:
      return record
    on_task = sorted({d for d in self.devices
                      if _TaskOf(d) == _TaskOf(task_name)})
    return record._replace(
        device=on_task[0] if len(on_task) == 1 else task_name)

  def Stop(self, error, stop_errors=()):
    """What stops the run for `error`: an OutOfMemoryStop if a device ran out
    of memory, else `error` itself if it is one of `stop_errors`, else None.

    Memory is asked first, since an allocation refused during a restore
    reads as a checkpoint that does not fit (checkpoint_keeper wraps any
    restore error), whose advice would be wrong.
    """
    stop = self.Check(error)
    if stop is None and isinstance(error, stop_errors):
      stop = error
    return stop

  def Check(self, error):
    """An OutOfMemoryStop describing `error`, or None if it was not one."""
    records = self.Records(error)
    if not records:
      return None
    return OutOfMemoryStop(self.Message(records[0]))

  def ExplainLostWorker(self, task_name, address):
    """(message, EXIT_OUT_OF_MEMORY) if lost worker `task_name` ran out of
    memory, by its report on this host's disk; else None.

    A capped worker can crash right after its allocator refuses memory
    (tfpipe.out_of_memory): the controller then sees a worker that stopped
    answering, and only the report it left says why.
    """
    records = out_of_memory.MostTelling(
        out_of_memory_reports.LocalReport(task_name, address, self.since))
    if not records:
      return None
    record = self._OnTask(records[0], task_name)
    message = self.Message(record, crashed=record.crashed and (
        f'{task_name} at {address}'), predict_within_s=PREDICT_WITHIN_S)
    return message, EXIT_OUT_OF_MEMORY

  def _Cells(self, device):
    """(cell index, 'cell1 (a, b)') of the cell on the device, or None."""
    k_cells = self.p.task.pipeline.num_partitions
    for slot, name in enumerate(self.devices):
      try:
        same = device_names.SameDevice(name, device)
      except ValueError:
        same = False
      if same:
        k = slot % k_cells
        return k, f'cell{k} ({", ".join(self._LayerNames(k))})'
    return None

  def _LayerNames(self, k):
    from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
    try:
      cells = task_lib.PartitionCells(self.p.task,
                                      self.p.task.model.Instantiate())
      return [layer.name for layer in cells[k].sub]
    except (ValueError, IndexError, AttributeError):
      return ['?']

  def Message(self, record, crashed=None, predict_within_s=None):
    """The error's text; `crashed` names the worker process that crashed
    after the failed allocation, if one did. With `predict_within_s`, a
    prediction that takes longer is left out."""
    pp = self.p.task.pipeline
    device = record.device or 'a device'
    found = self._Cells(record.device) if record.device else None
    if self.shared_limit:
      where = (f'Out of memory in this process, whose '
               f'{len(set(self.devices))} logical devices share one '
               'allocator')
      if found:
        where += f' (on {device}, which runs {found[1]})'
    else:
      where = f'Out of memory on {device}'
      if found:
        where += f', which runs {found[1]}'
    parts = [where + (f': it could not allocate {record.Describe()}.'
                      if record.known else '.')]
    if record.SmallNextTo(self.limit_mb):
      parts.append(_ALREADY_FULL)
    if crashed:
      parts.append(f'Its worker process ({crashed}) then crashed, as some '
                   'TensorFlow kernels do when an allocation is refused, '
                   'instead of failing the step.')
    limit = ''
    if self.limit_mb:
      limit = (f'Its limit is {self.limit_mb} MiB' if not self.shared_limit
               else f'The process\'s limit is {self.limit_mb} MiB '
               f'({memory_limit.LIMIT_ENV})')
    prediction = self._Prediction(found, predict_within_s)
    if limit and prediction:
      parts.append(f'{limit}; {prediction}.')
    elif limit or prediction:
      parts.append(f'{limit or prediction[0].upper() + prediction[1:]}.')
    parts.append(Advice(pp, plan_headroom=self.plan_headroom))
    if self._last_good:
      parts.append(self._last_good().strip())
    return ' '.join(parts)

  def _Prediction(self, found, within_s=None):
    if self._predict is None:
      return ''
    outcome = []

    def Predict():
      try:
        outcome.append(self._predict())
      except Exception as e:  # pylint: disable=broad-except
        outcome.append(e)
    thread = threading.Thread(target=Predict, daemon=True,
                              name='tfpipe-oom-predict')
    thread.start()
    thread.join(within_s)
    if not outcome:
      return ''
    peaks = outcome[0]
    if isinstance(peaks, Exception):
      return f'the memory model could not predict it ({type(peaks).__name__})'
    if self.shared_limit:
      total = sum(peak.peak_bytes for peak in peaks)
      return (f'the memory model predicted {total / MIB:.1f} MiB for its '
              f'{len(peaks)} devices together')
    if found is None:
      worst = max(peaks, key=lambda peak: peak.peak_bytes)
      return (f'the memory model\'s largest prediction is device '
              f'{worst.device}: {worst.Describe()}')
    k = found[0]
    peak = next((peak for peak in peaks if k in peak.cells), None)
    if peak is None:
      return ''
    return f'the memory model predicted {peak.Describe()}'
