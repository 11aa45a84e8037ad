"""Tests of tfpipe.trainer.stop_signal: SIGTERM asks the train loop to stop.

Protected properties: within the block SIGTERM only records the request
(the process goes on), with the exit status of a process that SIGTERM
ended; the previous handler is back after the block; a second SIGTERM ends
the process at once, unless it comes so soon that it repeats the first
(SLURM and the launcher both deliver it); off the main thread the block
changes nothing. The train loop's use of it (the step finished and saved,
then a resume with the same losses) is tested in train_loop_test.py, the
trainer's and the launcher's exit status in trainer_test.py and
launcher_test.py.
"""

import os
import signal
import subprocess
import sys
import threading

from tfpipe.trainer import stop_signal


def test_sigterm_is_recorded_and_the_previous_handler_restored():
  previous = signal.getsignal(signal.SIGTERM)
  with stop_signal.StopRequest() as stop:
    assert stop.signum is None and stop.exit_status == 0
    signal.raise_signal(signal.SIGTERM)  # The process goes on.
    assert stop.signum == signal.SIGTERM
    assert stop.name == 'SIGTERM'
    assert stop.exit_status == 143
  assert signal.getsignal(signal.SIGTERM) is previous


def test_off_the_main_thread_nothing_is_installed():
  before = signal.getsignal(signal.SIGTERM)
  seen = []

  def Run():
    with stop_signal.StopRequest() as stop:
      seen.append(signal.getsignal(signal.SIGTERM))
      seen.append(stop.signum)
  thread = threading.Thread(target=Run)
  thread.start()
  thread.join()
  assert seen == [before, None]


_SECOND_SIGTERM = r"""
import signal, sys, time
from tfpipe.trainer import stop_signal
with stop_signal.StopRequest() as stop:
  signal.raise_signal(signal.SIGTERM)
  print('first recorded', stop.signum == signal.SIGTERM, flush=True)
  signal.raise_signal(signal.SIGTERM)  # From the launcher too: the same.
  print('duplicate ignored', flush=True)
  time.sleep(stop_signal.DUPLICATE_WINDOW_S + 0.2)
  signal.raise_signal(signal.SIGTERM)
  time.sleep(5)
  print('still running', flush=True)
"""


def test_a_second_sigterm_ends_the_process_at_once_unless_it_repeats_the_first():
  # SLURM signals every process of a step: the trainer gets SIGTERM from it
  # and from the launcher, which forwards its own; that is one request.
  proc = subprocess.run(
      [sys.executable, '-c', _SECOND_SIGTERM], capture_output=True, text=True,
      timeout=60,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(
          os.path.abspath(__file__)))))
  assert proc.stdout == 'first recorded True\nduplicate ignored\n', (
      proc.stdout + proc.stderr)
  assert proc.returncode == -signal.SIGTERM, proc.stderr
