"""benchmarks/overhead.py: a tiny run of every configuration, and --device.

The GPU mode shares this code path: only the devices differ
(bench_lib.LocalDevices), so a tiny CPU run checks the step functions, and
--device=gpu on a machine without a GPU must stop with the flag named.
"""
# bazel: tags=manual

import json

from tests.benchmarks import script_runner

_TINY = ['--models=transformer', '--num_layers=2', '--num_cells=2',
         '--num_micro_batches=2', '--batch=4', '--seq=4', '--dim=16',
         '--reps=1']


def test_tiny_run_times_every_configuration_quietly(tmp_path):
  out = tmp_path / 'overhead.json'
  proc = script_runner.Run('benchmarks.overhead', *_TINY,
                           f'--output_json={out}')
  result = json.loads(out.read_text())['results'][0]
  assert result['device_type'] == 'CPU'
  assert sorted(result['median_s']) == sorted([
      'keras', 'floor_m2', 'floor_m2_remat', 'pipe_k1_m1',
      'pipe_k1_m1_remat', 'pipe_k2_m1_remat', 'pipe_k2_m2',
      'pipe_k2_m2_remat', 'pipe_k2_m2_remat_threads'])
  assert all(t > 0 for t in result['median_s'].values())
  assert 'K=2 on 4 logical CPU devices' in proc.stdout


def test_gpu_mode_without_a_gpu_names_the_flag():
  script_runner.AssertGpuModeRefused('benchmarks.overhead', *_TINY)
