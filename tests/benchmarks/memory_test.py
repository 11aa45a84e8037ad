"""benchmarks/memory.py: the CPU table, the per-device (GPU) path, --device.

The GPU mode measures each logical GPU's own allocator. Its code path
(PerDeviceMain) runs here on logical CPU devices, whose entries all read the
one shared BFC allocator: that checks the per-device bookkeeping and the
per-device GPipe prediction, not the figures.
"""
# bazel: tags=manual

import json

import pytest

from tests import quiet_test
from tests.benchmarks import script_runner

_TINY = ['--num_layers=2', '--num_cells=2', '--batch=4', '--seq=8',
         '--dim=16', '--micro_batches=2']

_PER_DEVICE = r'''
import os, sys
os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
from absl import flags
from benchmarks import bench_lib, memory
flags.FLAGS(sys.argv)
memory.PerDeviceMain(bench_lib.SplitCpu(2), device_type='CPU')
'''


@pytest.fixture(name='runs', scope='module')
def fixture_runs(tmp_path_factory):
  """The three runs the tests check, started together: {name: (run, json)}."""
  tmp = tmp_path_factory.mktemp('memory')
  yield from script_runner.KillAfter({
      'cpu': script_runner.StartWritingJson('benchmarks.memory',
                                            tmp / 'cpu.json', *_TINY),
      'per_device': (quiet_test.Started(
          '-c', _PER_DEVICE, *_TINY,
          f'--output_json={tmp / "per_device.json"}', timeout=240),
                     tmp / 'per_device.json'),
      'gpu': (script_runner.StartGpuMode('benchmarks.memory', *_TINY), None),
  })


def test_cpu_table_compares_each_configuration_with_the_formula(runs):
  run, out = runs['cpu']
  script_runner.Finished(run)
  results = json.loads(out.read_text())['results']
  assert len(results) == 1 + 7  # Keras, then 7 configurations at M=2.
  assert all(r['peak_bytes'] > 0 and r['predicted_bytes'] > 0
             for r in results)
  tape = json.loads(out.read_text())['tape_path']
  assert [r['num_micro_batches'] for r in tape] == [2]
  assert all(r['tape_peak_bytes'] > 0 and r['train_step_peak_bytes'] > 0
             for r in tape)


def test_per_device_path_reports_every_device_and_its_prediction(runs):
  run, out = runs['per_device']
  proc = run.Result()
  assert proc.returncode == 0, proc.stderr[-3000:]
  payload = json.loads(out.read_text())
  assert payload['device_type'] == 'CPU'
  assert len(payload['results']) == 7
  for r in payload['results']:
    assert sorted(r['peak_bytes_per_device']) == ['CPU:0', 'CPU:1']
    predicted = r['predicted_bytes_per_device']
    assert sorted(predicted) == ['CPU:0', 'CPU:1']
    assert all(v > 0 for v in predicted.values())
    assert r['max_over_min'] >= 1.0
  assert 'on 2 logical CPU devices; peak = bytes one step adds on each' in (
      proc.stdout)


def test_gpu_mode_without_a_gpu_names_the_flag(runs):
  script_runner.AssertGpuModeRefused(runs['gpu'][0])
