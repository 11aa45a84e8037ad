"""benchmarks/largest_model.py: its trials, on capped processes.

A search runs many trials; a test runs single ones (the same subprocess
the search starts): a small model trains one step in a capped process
(naive-1) and on two capped worker processes (pipeline-2), reporting each
device's peak within the budget; a budget too small is reported as out of
memory, not as a crash (checked on the naive trial, whose process is
cheaper; the pipelined trials report it through the same code).
--predict_only runs the memory model alone, as a user sizing a budget would.
"""
# bazel: tags=manual

import json
import re
import shutil

import pytest

from benchmarks import trial_workers
from tests import quiet_test
from tests.benchmarks import script_runner

_TINY = ['--family=transformer', '--size=1', '--batch=4', '--dim=16',
         '--seq=8']


def _StartTrial(*args, capped_mib=None):
  """One trial's process; naive-1's capped as the search caps it
  (largest_model.Trial), pipelined trials' workers by --budget_mib."""
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  env = memory_limit.CappedEnv(capped_mib)
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  return quiet_test.Started('-m', 'benchmarks.largest_model', *_TINY, *args,
                            timeout=240, env=env)


def _TrialResult(started):
  """The trial's TRIAL dict."""
  proc = started.Result()
  lines = [l for l in proc.stdout.splitlines() if l.startswith('TRIAL ')]
  assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
  return json.loads(lines[0][len('TRIAL '):])


_AMOEBANET_NAIVE_TRIAL = """
import json
from absl import flags
from benchmarks import largest_model
flags.FLAGS(['largest_model'])
print('RESULT ' + json.dumps(largest_model.Trial('naive-1', 'amoebanet', 3)))
"""


@pytest.fixture(name='trials', scope='module')
def fixture_trials():
  """The trials the tests check, started together: {name: started}."""
  trials = {
      'fits': _StartTrial('--trial=naive-1', '--budget_mib=64', capped_mib=64),
      # One activation of this size alone (16 x 128 x 256 floats) is 2 MiB.
      'too_small': _StartTrial('--trial=naive-1', '--budget_mib=1',
                               '--dim=256', '--seq=128', '--batch=16',
                               capped_mib=1),
  }
  trials['predicted'] = quiet_test.Started(
      '-m', 'benchmarks.largest_model', '--predict_only',
      '--families=transformer', '--configs=naive-1,pipeline-2', '--batch=4',
      '--dim=16', '--seq=8', '--budget_mib=6', timeout=240)
  # As the search runs it (largest_model.Trial: the family's environment).
  trials['amoebanet'] = quiet_test.Started('-c', _AMOEBANET_NAIVE_TRIAL,
                                           timeout=240)
  if shutil.which('unshare'):
    trials['pipelined'] = _StartTrial('--trial=pipeline-2', '--budget_mib=64',
                                      '--layer_counts=2,3')
  yield trials
  for started in trials.values():
    started.Kill()


def test_naive_trial_trains_within_the_budget_or_is_out_of_memory(trials):
  result = _TrialResult(trials['fits'])
  assert result['fits'], result
  assert 0 < result['peaks'][0] <= 64 * 2**20
  assert result['params'] > 0
  too_small = _TrialResult(trials['too_small'])
  assert not too_small['fits']
  assert too_small['out_of_memory'], too_small


def test_a_trial_that_died_is_out_of_memory_only_after_a_refusal():
  # AmoebaNet-D's naive-1 at L=6 in 32 MiB died on a failed check
  # (tensor.cc: uint8 expected, got float) right after its allocator's
  # refusals, which its log (warnings kept) shows.
  from tests import out_of_memory_test  # pylint: disable=g-import-not-at-top
  crashed = trial_workers.DiedResult(
      -6, out_of_memory_test.RAN_OUT_LINE + '\nF0000 tensor.cc:896] Check '
      'failed: dtype() == expected_dtype (1 vs. 4) uint8 expected, got float',
      30.04)
  assert crashed['fits'] is False and crashed['out_of_memory'] is True
  assert crashed['seconds'] == 30.0
  assert crashed['error'].startswith(
      'the trial died (exit status -6) after its allocator refused 1.00MiB')
  full = trial_workers.DiedResult(
      -11, out_of_memory_test.RAN_OUT_LINE + '\n' + out_of_memory_test.OOM_LINE,
      1)
  assert 'a tensor of shape [512,512] (float)' in full['error']
  other = trial_workers.DiedResult(-11, 'Fatal Python error: Segmentation '
                                   'fault\nmore', 1)
  assert other['out_of_memory'] is False
  assert other['error'] == ('the trial died (exit status -11), no allocation '
                            'refused: Fatal Python error: Segmentation fault')


def test_amoebanet_naive_one_trains_in_its_budget_on_any_cpu(trials):
  # GPipe's naive-1 model (L=3) in the family's 32 MiB, as on the machine the
  # table was measured on. Where TensorFlow runs without oneDNN by default
  # (CPUs without AVX-512), its own convolution gradients take a
  # cache-sized scratch buffer and L=3 ran out of memory in 32, 40 and 48
  # MiB; the family's processes run oneDNN's kernels
  # (benchmarks/model_environment.py), unless the user set the variable.
  proc = trials['amoebanet'].Result()
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
  result = json.loads(lines[0][len('RESULT '):])
  assert result['fits'], result
  assert 0 < result['peaks'][0] <= 32 * 2**20


@pytest.mark.skipif(not shutil.which('unshare'),
                    reason='needs unshare (util-linux) for loopback servers')
def test_pipelined_trial_on_capped_workers(trials):
  # Out of memory on capped workers is reported by the same code as in the
  # naive trial (out_of_memory.FindInError; its worker errors are tested
  # in tests/out_of_memory_test.py and tests/trainer/auto_plan_test.py).
  fits = _TrialResult(trials['pipelined'])
  assert fits['fits'], fits
  assert len(fits['peaks']) == 2 and max(fits['peaks']) <= 64 * 2**20


def test_predict_only_prints_each_configuration_and_its_devices(trials):
  proc = trials['predicted'].Result()
  assert proc.returncode == 0, proc.stderr[-3000:]
  sizes = dict(re.findall(r'^transformer (\S+): predicted (\d+) \(',
                          proc.stdout, re.M))
  assert set(sizes) == {'naive-1', 'pipeline-2'}, proc.stdout
  # Two devices of 6 MiB hold more blocks than plain Keras in one.
  assert int(sizes['pipeline-2']) > int(sizes['naive-1']) >= 1, proc.stdout
  devices = re.findall(r'^  device (\d): ([\d.]+) MiB at ', proc.stdout, re.M)
  assert [d for d, _ in devices] == ['0', '1'], proc.stdout
  assert all(float(mib) <= 6 for _, mib in devices), proc.stdout
  assert 'TRIAL' not in proc.stdout  # No trial ran.


def test_a_vocabulary_too_small_is_refused_naming_the_flag():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(
      [sys.executable, '-m', 'benchmarks.largest_model', '--predict_only',
       '--vocab=2'], cwd=script_runner.ROOT, capture_output=True, text=True,
      timeout=120, check=False)
  assert proc.returncode != 0
  assert '--vocab must be 0' in proc.stderr, proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr


_WATCH = r'''
import json, sys, time
from benchmarks import trial_workers


class Record:
  def Describe(self):
    return '256.0KiB, for op Conv2DBackpropFilter'


class Workers:
  devices = ['/job:worker/task:0', '/job:worker/task:1']

  def __init__(self, exits_after_s, refused=True):
    self.exits_at = (time.monotonic() + exits_after_s
                     if exits_after_s is not None else None)
    self.refused = refused

  def Exited(self):
    if self.exits_at is not None and time.monotonic() >= self.exits_at:
      return [(1, -6)]
    return []

  def Refusals(self, k):
    return [Record()] if self.refused and k == 1 else []


def Steps():
  raise ValueError('Socket closed')


results = []
for exits_after_s, refused in ((0.3, True), (None, True), (None, False)):
  try:
    trial_workers.StepsWatchingWorkers(Steps, Workers(exits_after_s, refused),
                                       settle_s=1.0)
  except Exception as e:  # pylint: disable=broad-except
    results.append([type(e).__name__, str(e),
                    len(getattr(e, 'refusals', []))])
print(json.dumps(results))
'''


def test_a_worker_out_of_memory_is_named_even_when_the_step_fails_first():
  # A worker that oneDNN kills fails the controller's step ("Socket closed")
  # before its exit is seen; the trial then said only that, and did not
  # count it as out of memory. A worker that lives on but refused memory
  # (a received tensor it could not allocate: "Unable to parse tensor
  # proto") is named too; a step that fails with no refusal is its own
  # error.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, '-c', _WATCH], cwd=script_runner.ROOT,
                        capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  died, refused, other = json.loads(proc.stdout.splitlines()[-1])
  assert died == ['WorkerDied', 'worker 1 died (exit status -6) after its '
                  'allocator refused 256.0KiB, for op Conv2DBackpropFilter', 1]
  assert refused == ['WorkerOutOfMemory', 'worker 1\'s allocator refused '
                     '256.0KiB, for op Conv2DBackpropFilter', 1]
  assert other == ['ValueError', 'Socket closed', 0]
