"""Tests of tfpipe.trainer.device_memory: per-device peak memory in the log.

Protected properties: with the BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true
before TensorFlow starts) a CPU training run prints one shared
`peak_mem[CPU]=` entry in every progress line and writes
`memory/peak_bytes/CPU` to TensorBoard, both non-zero and equal; without it
(the default CPU allocator counts nothing) the line has no entry; remote
devices are never queried; the peak is reset every interval.
"""
# bazel: deps=//params,//tfpipe/trainer:__main__

import glob
import os
import re

import pytest
import tensorflow as tf

from tests import quiet_test
from tfpipe import memory_limit
from tfpipe.trainer import device_memory


def test_cpu_is_reported_once_and_only_with_bfc(monkeypatch):
  cpus = [f'/CPU:{i}' for i in range(4)]
  # Whether this process's CPU allocator really is BFC was fixed when
  # TensorFlow started (maybe by another test); the subprocess tests below
  # query the real allocator. Here: which devices are asked, and how often.
  monkeypatch.setattr(device_memory, '_Query',
                      lambda name: {'current': 0, 'peak': 0})
  monkeypatch.delenv(memory_limit.BFC_ENV, raising=False)
  assert device_memory.MemoryDevices(cpus) == []
  monkeypatch.setenv(memory_limit.BFC_ENV, 'true')
  assert device_memory.MemoryDevices(cpus) == [('CPU', 'CPU:0')]
  remote = ['/job:worker/replica:0/task:0/device:CPU:0']
  assert device_memory.MemoryDevices(remote) == []
  assert device_memory.PeakMemory([]).PeaksAndReset() == {}


def test_peaks_are_formatted_per_device():
  peaks = {'GPU:0': 3 * 2**30 // 2, 'GPU:1': 5 * 2**20, 'CPU': 2048}
  assert device_memory.FormatPeaks(peaks) == (
      'peak_mem[GPU:0]=1.50GiB peak_mem[GPU:1]=5.0MiB peak_mem[CPU]=2.0KiB')
  assert device_memory.SummaryScalars(peaks) == {
      'memory/peak_bytes/GPU_0': float(3 * 2**30 // 2),
      'memory/peak_bytes/GPU_1': float(5 * 2**20),
      'memory/peak_bytes/CPU': 2048.0}
  assert device_memory.FormatPeaks({}) == ''


_RESET_SCRIPT = """
import tensorflow as tf
from tfpipe import memory_limit
from tfpipe.trainer import device_memory
memory = device_memory.PeakMemory(['/CPU:0', '/CPU:1'])
big = tf.ones([8 * 2**20 // 4]) * 2.0
del big
first = memory.PeaksAndReset()['CPU']
small = tf.ones([2**20 // 4]) * 2.0
second = memory.PeaksAndReset()['CPU']
print(first, second)
"""


def _BfcEnv():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  env[memory_limit.BFC_ENV] = 'true'
  return env


@pytest.fixture(name='runs', scope='module')
def fixture_runs(tmp_path_factory):
  """The two BFC processes the tests below check, started together (each
  uses about a core): {name: (started, logdir)}."""
  logdir = tmp_path_factory.mktemp('bfc_run')
  runs = {
      'reset': (quiet_test.Started('-c', _RESET_SCRIPT, timeout=120,
                                   env=_BfcEnv()), None),
      'train': (quiet_test.Started(
          '-m', 'tfpipe.trainer', f'--logdir={logdir}',
          '--model=mlp.TinyMlp', '--max_steps=2', '--log_interval_steps=1',
          '--run_locally=cpu',
          '--model_params_override=task.eval.num_batches: 1',
          timeout=180, env=_BfcEnv()), logdir),
  }
  yield runs
  for started, _ in runs.values():
    started.Kill()


def test_peak_resets_each_interval(runs):
  out = runs['reset'][0].Result()
  assert out.returncode == 0, out.stderr
  first, second = map(int, out.stdout.split())
  assert first >= 16 * 2**20  # Two live 8 MiB tensors (ones and the product).
  assert 2**20 <= second < 8 * 2**20


def test_bfc_cpu_run_reports_its_peak_in_lines_and_tensorboard(runs):
  started, logdir = runs['train']
  out = started.Result()
  assert out.returncode == 0, out.stdout + out.stderr
  lines = [l for l in out.stdout.splitlines() if l.startswith('step ')]
  assert len(lines) == 2
  printed = {}
  for line in lines:
    m = re.search(r' peak_mem\[CPU\]=(\d+\.\d)(KiB|MiB)$', line)
    assert m, line
    assert 'peak_mem[CPU:' not in line  # One shared allocator, one entry.
    printed[int(line.split()[1].split('/')[0])] = (
        float(m.group(1)) * (2**10 if m.group(2) == 'KiB' else 2**20))
  written = {}
  for path in glob.glob(str(logdir / 'train' / 'events.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == 'memory/peak_bytes/CPU':
          written[event.step] = float(tf.make_ndarray(value.tensor))
  assert sorted(written) == [1, 2]
  for step, value in written.items():
    assert value > 0
    # The line rounds to 0.1 of its unit.
    assert abs(printed[step] - value) <= 0.05 * 2**20, (step, value)
