"""Multi-process tests: the launcher, workers on loopback, failure and resume.

Each launch starts real TensorFlow processes (~10 s each on 2 cores), so the
tests are few and each checks several things: the losses of cells on
different workers equal the single-process run; a worker killed mid-training
stops the controller within the watchdog's bound with an error naming the
task and its address; a restart resumes from the checkpoint with the losses
of an uninterrupted run; R=2 replicas x K=2 stages on 4 workers train like
one pipeline; no process outlives its launcher, nor does a worker's empty
out-of-memory report, and a SIGTERM or SIGINT to
the launcher's pid stops the whole job with status 128 + signal (SIGINT at
once; SIGTERM after the controller has saved its step, which a restart
resumes from, and within --stop_grace_s). The launcher keeps every server
in a loopback-only network namespace.
"""
# bazel: deps=//params,//tfpipe:launcher,//tfpipe/trainer:__main__

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests import multihost_test
from tests import quiet_test
from tfpipe import cluster_spec
from tfpipe import multihost
from tfpipe import out_of_memory_reports
from tfpipe.trainer import train_loop

_STEP_RE = re.compile(r'^step (\d+)/\d+ loss=(\S+)')
_STARTED_RE = re.compile(r'^launcher: (?:started (.*) )?pid=(\d+)')
_CLUSTER_RE = re.compile(r'^launcher: pid=\d+ cluster (\S+)')
_LAUNCH_TIMEOUT_S = 240
_DETECTION_BOUND_S = 30
# Seconds from a signal to the launcher until it and every child are gone.
_STOP_BOUND_S = 8
# Steps of the baseline and of the resumed run: room for the first run to
# be stopped well before the end, and steps after the restore to compare.
# A checkpoint (every 5 steps) costs about half a second.
_STEPS = 30


def _Losses(lines):
  losses = {}
  for line in lines:
    m = _STEP_RE.match(line)
    if m:
      losses[int(m.group(1))] = float(m.group(2))
  return losses


@pytest.fixture(scope='module')
def baseline(tmp_path_factory):
  """{step: loss} of _STEPS steps of the tiny LM in this process (K=2, R=1)."""
  p = multihost_test.TinyTaskParams(1, ['/CPU:0', '/CPU:1'])
  p.task.train.Set(max_steps=_STEPS, log_interval_steps=1,
                   save_interval_steps=100)
  lines = []
  train_loop.Trainer(p, str(tmp_path_factory.mktemp('baseline')),
                     log=lines.append).Train()
  return _Losses(lines)


class _Launch:
  """A launcher subprocess whose output lines are read on a thread."""

  def __init__(self, logdir, num_workers, max_steps, extra=()):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    env.pop('TF_CONFIG', None)
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'tfpipe.launcher',
         f'--num_workers={num_workers}', f'--timeout_s={_LAUNCH_TIMEOUT_S}',
         '--', f'--logdir={logdir}', '--model=lm.TinyTransformerLm',
         f'--model_params_override={multihost_test.TINY_LM}',
         f'--max_steps={max_steps}', '--log_interval_steps=1',
         '--save_interval_steps=5', '--run_locally=cpu', *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    self.lines = []
    self.pids = {}
    self._queue = queue.Queue()
    threading.Thread(target=self._Read, daemon=True).start()

  def _Read(self):
    for line in self.proc.stdout:
      line = line.rstrip('\n')
      m = _STARTED_RE.match(line)
      if m:
        self.pids[m.group(1) or 'launcher'] = int(m.group(2))
      self.lines.append(line)
      self._queue.put(line)
    self._queue.put(None)

  def WaitForLine(self, pattern, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      try:
        line = self._queue.get(timeout=1)
      except queue.Empty:
        continue
      if line is None:
        break
      if re.search(pattern, line):
        return line
    self.Kill()
    pytest.fail(f'no line matching {pattern!r}; output:\n' +
                '\n'.join(self.lines[-40:]))

  def Wait(self, timeout_s=_LAUNCH_TIMEOUT_S):
    try:
      return self.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      self.Kill()
      pytest.fail('launcher did not exit; output:\n' +
                  '\n'.join(self.lines[-40:]))

  def Kill(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout=15)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(timeout=15)

  def AssertNoProcessLeft(self):
    deadline = time.monotonic() + 10
    alive = list(self.pids.values())
    while alive and time.monotonic() < deadline:
      alive = [pid for pid in alive if _Alive(pid)]
      time.sleep(0.2)
    assert not alive, f'processes left behind: {alive} of {self.pids}'

  def AssertNoReportLeft(self):
    """Workers that never ran out of memory leave no report in /tmp."""
    [spec] = [m.group(1) for m in map(_CLUSTER_RE.match, self.lines) if m]
    jobs = cluster_spec.ParseClusterJobs(spec)
    left = [path for k, address in enumerate(jobs[cluster_spec.WORKER_JOB])
            if os.path.exists(path := out_of_memory_reports.ReportPath(
                cluster_spec.WORKER_JOB, k, address))]
    assert not left, f'reports left behind: {left}'

  def Text(self):
    return '\n'.join(self.lines)


def _Alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def _AssertMatches(losses, baseline):
  assert losses, 'no step losses were printed'
  for step, loss in losses.items():
    np.testing.assert_allclose(loss, baseline[step], rtol=1e-5,
                               err_msg=f'step {step}')


def _ResumeToTheEnd(logdir, baseline):
  """Launches a run on `logdir` to _STEPS, checks that its losses are the
  baseline's from the restored step on; returns that step."""
  second = _Launch(logdir, num_workers=2, max_steps=_STEPS)
  try:
    assert second.Wait() == 0, second.Text()
  finally:
    second.Kill()
  second.AssertNoProcessLeft()
  restored = re.search(r'Restored \S+ckpt-(\d+) at step (\d+)',
                       second.Text())
  assert restored, second.Text()
  assert restored.group(1) == restored.group(2)
  resumed = _Losses(second.lines)
  assert min(resumed) == int(restored.group(1)) + 1
  assert max(resumed) == _STEPS
  _AssertMatches(resumed, baseline)
  return int(restored.group(1))


def test_killed_worker_stops_the_controller_and_a_restart_resumes(tmp_path, baseline):
  logdir = tmp_path / 'lm'
  first = _Launch(logdir, num_workers=2, max_steps=100000)
  try:
    first.WaitForLine(r'^step 7/', _LAUNCH_TIMEOUT_S)
    victim = next(name for name in first.pids if 'task:1 at' in name)
    address = victim.rsplit(' at ', 1)[1]
    os.kill(first.pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    code = first.Wait(_DETECTION_BOUND_S + 15)
    detection_s = time.monotonic() - killed_at
  finally:
    first.Kill()
  first.AssertNoProcessLeft()
  assert code == multihost.EXIT_WORKER_LOST, first.Text()
  assert detection_s <= _DETECTION_BOUND_S, detection_s
  assert (f'Worker /job:worker/task:1 at {address} is unreachable'
          in first.Text()), first.Text()
  assert 'device mesh: 1 replica(s) x 2 cell(s)' in first.Text()
  assert '/job:worker/replica:0/task:1/device:CPU:0' in first.Text()
  losses = _Losses(first.lines)
  assert max(losses) < _STEPS - 5, (
      'the first run went too far to test a resume')
  _AssertMatches(losses, baseline)

  _ResumeToTheEnd(logdir, baseline)


def test_replicas_times_stages_on_four_workers(tmp_path, baseline):
  launch = _Launch(tmp_path / 'lm', num_workers=4, max_steps=6,
                   extra=['--num_replicas=2'])
  try:
    assert launch.Wait() == 0, launch.Text()
  finally:
    launch.Kill()
  launch.AssertNoProcessLeft()
  launch.AssertNoReportLeft()
  text = launch.Text()
  # Five TensorFlow processes (4 workers, the controller), and none of their
  # C++ start-up log.
  assert quiet_test.StartupLines(text) == [], text
  assert 'device mesh: 2 replica(s) x 2 cell(s)' in text
  assert '[1] /job:worker/replica:0/task:3/device:CPU:0' in text
  losses = _Losses(launch.lines)
  assert sorted(losses) == list(range(1, 7))
  _AssertMatches(losses, baseline)
  checkpoints = os.listdir(tmp_path / 'lm' / train_loop.CHECKPOINT_DIR)
  assert 'ckpt-6.index' in checkpoints



@pytest.mark.parametrize('to_every_process', [False, True],
                         ids=['to-the-launcher', 'to-every-process'])
def test_sigterm_while_training_saves_the_step_and_a_restart_resumes(
    tmp_path, baseline, to_every_process):
  # Schedulers and preemptions send SIGTERM, then SIGKILL after a grace
  # period: Kubernetes to the container's first process (the launcher),
  # SLURM to every process of the job. The controller finishes its step and
  # saves it while the workers (which hold the variables) still serve; then
  # every process stops, with the status of a SIGTERM. Before, the job was
  # killed at once and lost every step since its last periodic checkpoint.
  logdir = tmp_path / 'lm'
  first = _Launch(logdir, num_workers=2, max_steps=100000)
  try:
    first.WaitForLine(r'^step 7/', _LAUNCH_TIMEOUT_S)
    if to_every_process:
      for pid in first.pids.values():
        os.kill(pid, signal.SIGTERM)
    else:
      first.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = first.Wait(_STOP_BOUND_S + 30)
    stop_s = time.monotonic() - sent
    alive = [pid for pid in first.pids.values() if _Alive(pid)]
  finally:
    first.Kill()
  text = first.Text()
  assert code == 128 + signal.SIGTERM, text
  assert stop_s <= _STOP_BOUND_S, stop_s
  assert not alive, f'processes left behind: {alive} of {first.pids}'
  assert ('launcher: SIGTERM received; the controller saves a checkpoint '
          'after its step') in text, text
  stopped = re.search(r'SIGTERM received: stopped after step (\d+); '
                      r'\S+ckpt-(\d+) holds it', text)
  assert stopped and stopped.group(1) == stopped.group(2), text
  stopped = int(stopped.group(1))
  losses = _Losses(first.lines)
  assert max(losses) == stopped < _STEPS - 5, text
  _AssertMatches(losses, baseline)

  if not to_every_process:  # A checkpoint resumes alike, whoever saved it.
    assert _ResumeToTheEnd(logdir, baseline) == stopped


@pytest.mark.parametrize('sig, when', [
    (signal.SIGINT, r'^step 2/'),
    (signal.SIGTERM, r'^launcher: started worker')],
                         ids=['SIGINT-while-training', 'SIGTERM-at-start'])
def test_a_signal_to_the_launchers_pid_stops_the_job(tmp_path, sig, when):
  # `timeout`, schedulers and subprocess.terminate() signal this pid. It was
  # unshare's, which ignored the signal: the job trained on and exited 0.
  # SIGINT stops at once; so does SIGTERM before the controller trains.
  launch = _Launch(tmp_path / 'lm', num_workers=2, max_steps=100000)
  try:
    launch.WaitForLine(when, _LAUNCH_TIMEOUT_S)
    assert launch.pids['launcher'] == launch.proc.pid
    launch.proc.send_signal(sig)
    sent = time.monotonic()
    code = launch.Wait(_STOP_BOUND_S + 30)
    stop_s = time.monotonic() - sent
    alive = [pid for pid in launch.pids.values() if _Alive(pid)]
  finally:
    launch.Kill()
  assert code == 128 + sig, launch.Text()
  assert stop_s <= _STOP_BOUND_S, stop_s
  assert not alive, f'processes left behind: {alive} of {launch.pids}'
  assert f'launcher: {sig.name} received;' in launch.Text()


def _RunScript(code):
  """`python -c code` from the repository root, finished."""
  return subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True,
      timeout=60,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_SIGNAL_IN_AN_AT_FORK_CALLBACK = r"""
import os, signal, subprocess, sys
from absl import flags
from tfpipe import launcher
from tfpipe import local_cluster
flags.FLAGS(['launcher'])
launcher.StopOnSignals()
fired = []
def SignalOnce():
  if not fired:
    fired.append(True)
    signal.raise_signal(signal.SIGINT)
os.register_at_fork(after_in_parent=SignalOnce)
children = local_cluster.ChildProcesses('launcher')
try:
  # The launcher's children have a preexec_fn, so Popen runs the callbacks.
  child = children.Start('sleeper', [sys.executable, '-c',
                                     'import time; time.sleep(20)'])
  sys.exit(launcher._Supervise(child, []))
finally:
  children.Close()
"""


def test_a_signal_whose_exit_python_dropped_still_stops_the_job():
  # A SIGINT that lands while Popen forks runs the handler inside an at-fork
  # callback, whose exceptions Python prints and drops: in CI the job
  # trained on. The handler also records the signal, which the waits check.
  proc = _RunScript(_SIGNAL_IN_AN_AT_FORK_CALLBACK)
  assert 'Exception ignored' in proc.stderr, proc.stderr  # It was dropped.
  assert proc.returncode == 128 + signal.SIGINT, proc.stderr
  assert proc.stderr.count('launcher: SIGINT received') == 1, proc.stderr


_CONTROLLER_IGNORING_SIGTERM = r"""
import signal, subprocess, sys, time
from absl import flags
from tfpipe import launcher
from tfpipe import local_cluster
flags.FLAGS(['launcher', '--stop_grace_s=1'])
launcher.StopOnSignals()
children = local_cluster.ChildProcesses('launcher')
try:
  launcher._controller = child = children.Start('controller', [
      sys.executable, '-c', 'import signal, sys, time; '
      'signal.signal(signal.SIGTERM, signal.SIG_IGN); '
      'print("ignoring", flush=True); time.sleep(60)'],
      stdout=subprocess.PIPE, text=True)
  assert child.stdout.readline() == 'ignoring\n'
  start = time.monotonic()
  signal.raise_signal(signal.SIGTERM)
  try:
    launcher._Supervise(child, [])
  finally:
    print(f'stopped after {time.monotonic() - start:.1f}s', flush=True)
finally:
  children.Close()
"""


def test_a_controller_that_does_not_stop_within_the_grace_is_killed():
  # The grace period bounds the wait: a scheduler's SIGKILL must not find the
  # job still running.
  proc = _RunScript(_CONTROLLER_IGNORING_SIGTERM)
  assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
  assert 'launcher: SIGTERM received; the controller saves' in proc.stderr
  assert ('the controller did not stop within --stop_grace_s=1s; killing '
          'the job') in proc.stderr, proc.stderr
  waited = float(re.search(r'stopped after ([\d.]+)s', proc.stdout).group(1))
  assert 1.0 <= waited < 5.0, proc.stdout


def test_the_launcher_starts_without_loading_tensorflow():
  # It re-executes itself and supervises; loading TensorFlow would cost
  # seconds per launch and its C++ start-up log.
  code = ('import sys; import tfpipe.launcher; '
          'assert "tensorflow" not in sys.modules, sorted(sys.modules)')
  subprocess.run([sys.executable, '-c', code], check=True, timeout=60,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(
                     __file__))))

