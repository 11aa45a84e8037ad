"""SIGTERM stops a training run at the end of its step, with a checkpoint.

Schedulers and preemptible machines end a job with SIGTERM, then SIGKILL
after a grace period (Kubernetes' default is 30 s, as is SLURM's KillWait;
a preemptible cloud VM gets about 30 s). Ended at once, a run loses every
step since its last periodic checkpoint (task.train.save_interval_steps).
So while the train loop runs, SIGTERM only records the request
(`StopRequest`); the loop finishes the step it is in, saves a checkpoint of
it and stops, and the trainer exits with 143 (128 + SIGTERM), the status of
a process that SIGTERM ended. The same command then resumes from that step,
with the losses of a run that never stopped.

Outside the loop (building the model, restoring) SIGTERM keeps its default
action: nothing is lost there that the last checkpoint does not hold. A
second SIGTERM ends the process at once, for whoever cannot wait for the
step; a checkpoint it was writing then never counts (checkpoint_keeper
reads each one back before it does). One that comes within
`DUPLICATE_WINDOW_S` of the first is the same request delivered twice:
SLURM signals every process of a job step, so the controller gets SIGTERM
from it and again from the launcher, which forwards its own.
SIGINT (Ctrl-C) is unchanged: a KeyboardInterrupt. A program that calls
`Trainer.Train()` itself gets the same behaviour; its own SIGTERM handler
is set aside during the loop and put back after it.

The launcher forwards its SIGTERM to the controller and keeps the workers,
which hold the variables, serving until the controller has saved
(tfpipe.launcher, --stop_grace_s).
"""

import signal
import threading
import time

# A second SIGTERM this soon after the first repeats it (module docstring).
# Measured between the handler's runs, not the deliveries: the handler runs
# when the main thread is back in Python, and a TensorFlow call (the step,
# the checkpoint's save) can hold it for seconds on a busy machine. With 2 s,
# SLURM's SIGTERM and the launcher's copy, delivered together, ended a
# controller at once in a CI run on 2 busy cores, before it had saved.
DUPLICATE_WINDOW_S = 10.0


class StopRequest:
  """Within the block, SIGTERM asks the loop to stop: `signum` is then set.

  Only the main thread can handle signals; elsewhere (a test's thread) the
  block changes nothing and `signum` stays None.
  """

  def __init__(self, signals=(signal.SIGTERM,)):
    self._signals = tuple(signals)
    self._previous = {}
    self._received_at = None
    self.signum = None

  def _OnSignal(self, signum, unused_frame):
    now = time.monotonic()
    if self.signum is not None:
      if now - self._received_at < DUPLICATE_WINDOW_S:
        return  # The same request, delivered twice.
      # A second one: its default action, now.
      signal.signal(signum, signal.SIG_DFL)
      signal.raise_signal(signum)
      return
    self.signum = signum
    self._received_at = now

  @property
  def name(self):
    return signal.Signals(self.signum).name if self.signum else None

  @property
  def exit_status(self):
    """128 + the signal's number, as for a process that it ended."""
    return 128 + self.signum if self.signum else 0

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in self._signals:
        self._previous[sig] = signal.signal(sig, self._OnSignal)
    return self

  def __exit__(self, *unused_exc):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous.clear()
    return False
