"""benchmarks/overhead.py: a tiny run of every configuration, and --device.

The GPU mode shares this code path: only the devices differ
(bench_lib.LocalDevices), so a tiny CPU run checks the step functions, and
--device=gpu on a machine without a GPU must stop with the flag named.
"""
# bazel: tags=manual

import json

import pytest

from tests.benchmarks import script_runner

_TINY = ['--models=transformer', '--num_layers=2', '--num_cells=2',
         '--num_micro_batches=2', '--batch=4', '--seq=4', '--dim=16',
         '--reps=1']


@pytest.fixture(name='runs', scope='module')
def fixture_runs(tmp_path_factory):
  """The tiny run and --device=gpu, started together: {name: (run, json)}."""
  tmp = tmp_path_factory.mktemp('overhead')
  yield from script_runner.KillAfter({
      'tiny': script_runner.StartWritingJson('benchmarks.overhead',
                                             tmp / 'overhead.json', *_TINY),
      'gpu': (script_runner.StartGpuMode('benchmarks.overhead', *_TINY), None),
  })


def test_tiny_run_times_every_configuration_quietly(runs):
  run, out = runs['tiny']
  proc = script_runner.Finished(run)
  result = json.loads(out.read_text())['results'][0]
  assert result['device_type'] == 'CPU'
  assert sorted(result['median_s']) == sorted([
      'keras', 'floor_m2', 'floor_m2_remat', 'pipe_k1_m1',
      'pipe_k1_m1_remat', 'pipe_k2_m1_remat', 'pipe_k2_m2',
      'pipe_k2_m2_remat', 'pipe_k2_m2_remat_threads'])
  assert all(t > 0 for t in result['median_s'].values())
  assert 'K=2 on 4 logical CPU devices' in proc.stdout


def test_gpu_mode_without_a_gpu_names_the_flag(runs):
  script_runner.AssertGpuModeRefused(runs['gpu'][0])
