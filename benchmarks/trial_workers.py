"""A trial's steps on capped workers, watched for a worker that runs out.

Table 1's trials (benchmarks/largest_model.py) count a size as not fitting
when a device runs out of memory. On capped CPU workers that is not always
an error on the controller: a worker may crash, or live on and fail the
step with an error that never says memory. These watch the workers while
the steps run and name the worker and what its allocator refused.
"""

import re
import threading
import time


class WorkerDied(Exception):
  """A capped worker exited during a trial; `refusals`: the allocations its
  allocator refused first (then it ran out of memory and crashed)."""

  def __init__(self, message, refusals=()):
    super().__init__(message)
    self.refusals = list(refusals)


class WorkerOutOfMemory(Exception):
  """A step failed, no worker exited, and a worker's allocator refused
  memory (`refusals`). The controller's error then need not say so: a
  worker that cannot allocate a received tensor fails the step with
  "Unable to parse tensor proto" (AmoebaNet-D pipeline-2, L=30)."""

  def __init__(self, message, refusals=()):
    super().__init__(message)
    self.refusals = list(refusals)


def StepsWatchingWorkers(steps, workers, settle_s=2.0):
  """Runs `steps`; raises WorkerDied as soon as a worker exits.

  A capped process does not always fail an allocation with an error:
  AmoebaNet's trials crashed (a segmentation fault in plain Keras, an abort
  in a worker; benchmarks/RESULTS.md) where the same naive trial with
  TensorFlow's oneDNN kernels off (TF_ENABLE_ONEDNN_OPTS=0) fails with
  ResourceExhaustedError, and the controller then waited for the dead
  worker until the trial's timeout. A crash is out of memory when the
  worker's report (CappedWorkers.Refusals) holds a refused allocation.
  The step can also fail first, from the controller's side ("Socket
  closed"), before the worker's exit is seen: a failed step waits up to
  `settle_s` for a worker's exit, and then reports that instead; if none
  exited but one refused memory, WorkerOutOfMemory says so.
  """
  outcome = []

  def Run():
    try:
      steps()
      outcome.append(None)
    except Exception as e:  # pylint: disable=broad-except
      outcome.append(e)
  thread = threading.Thread(target=Run, daemon=True)
  thread.start()
  while thread.is_alive():
    thread.join(0.5)
    exited = workers.Exited()
    if exited and thread.is_alive():
      raise WorkerDiedError(workers, exited)
  if outcome[0] is not None:
    deadline = time.monotonic() + settle_s
    exited = workers.Exited()
    while not exited and time.monotonic() < deadline:
      time.sleep(0.1)
      exited = workers.Exited()
    if exited:
      raise WorkerDiedError(workers, exited) from outcome[0]
    refused = {k: workers.Refusals(k) for k in range(len(workers.devices))}
    refused = {k: records for k, records in refused.items() if records}
    if refused:
      raise WorkerOutOfMemory('; '.join(
          f'worker {k}\'s allocator refused {records[0].Describe()}'
          for k, records in refused.items()),
          [r for records in refused.values() for r in records]) from outcome[0]
    raise outcome[0]


def WorkerDiedError(workers, exited):
  """WorkerDied for the workers `exited` ([(task, status)]): what each one's
  allocator refused first, if anything."""
  refusals = {k: workers.Refusals(k) for k, _ in exited}
  return WorkerDied('; '.join(
      f'worker {k} died (exit status {status})' + (
          f' after its allocator refused {refusals[k][0].Describe()}'
          if refusals[k] else ', no allocation refused')
      for k, status in exited), [r for k in refusals for r in refusals[k]])


def DiedResult(status, stderr, seconds):
  """The TRIAL dict of a trial that died before it could report.

  A capped process may crash when a kernel is refused memory (a failed
  check on the tensor it did not get): then the allocator's refusal in its
  log says it was out of memory. A death without one still counts as not
  fitting, but says that no allocation was refused.
  """
  from tfpipe import out_of_memory  # pylint: disable=g-import-not-at-top
  records = (out_of_memory.ParseRecords(stderr) or
             out_of_memory.LoggedRefusals(stderr))
  if records:
    return {'fits': False, 'out_of_memory': True, 'seconds': round(seconds, 1),
            'error': f'the trial died (exit status {status}) after its '
                     f'allocator refused {records[0].Describe()}'}
  lines = stderr.strip().splitlines() or ['no output']
  fatal = next((l for l in lines if re.search(
      r'Fatal Python error|ResourceExhausted|OOM when|Check failed', l)),
               lines[-1])
  return {'fits': False, 'out_of_memory': False, 'seconds': round(seconds, 1),
          'error': f'the trial died (exit status {status}), no allocation '
                   f'refused: {fatal.strip()[:300]}'}
