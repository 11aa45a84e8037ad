"""benchmarks/memory_model_accuracy.py at a tiny size: one configuration.

The grid itself is a benchmark (benchmarks/RESULTS.md); this runs its whole
path once (profiling, fresh workers, the trainer's step, each worker's
peak, the prediction, the JSON) and checks the prediction is close.
"""
# bazel: tags=manual

import json
import shutil

import pytest

from tests import quiet_test
from tests.benchmarks import script_runner


@pytest.mark.skipif(not shutil.which('unshare'),
                    reason='needs unshare (util-linux) for loopback servers')
def test_each_configuration_is_measured_and_predicted(tmp_path):
  out = tmp_path / 'accuracy.json'
  proc = script_runner.Run(
      'benchmarks.memory_model_accuracy', '--models=mlp', '--num_cells=2',
      '--micro_batches=2', '--remat_policies=always', '--schedules=1f1b',
      '--measured_steps=1', '--repeats=3', '--profile_runs=1',
      f'--output_json={out}', timeout=300)
  rows = json.loads(out.read_text())['rows']
  assert [(r['num_cells'], r['num_micro_batches']) for r in rows] == [(2, 2)]
  for row in rows:
    assert len(row['measured_mib']) == len(row['predicted_mib']) == 2
    assert min(row['measured_mib']) > 0
    assert abs(row['worst_error']) < 0.3, row
    # Three runs on fresh workers; the row's peaks are their medians, and
    # its error is against those.
    runs = row['measured_runs']
    assert len(runs) == 3 and all(len(run) == 2 for run in runs)
    assert row['measured_mib'] == [sorted(v)[1] for v in zip(*runs)]
    assert row['worst_error'] == pytest.approx(max(
        (p / m - 1 for p, m in zip(row['predicted_mib'], row['measured_mib'])),
        key=abs), abs=0.005)
  assert proc.stdout.count('(median of 3 runs') == 1, proc.stdout
  # Profiled in the one remat mode the grid reads: each is processes.
  assert json.loads(out.read_text())['profiles']['mlp']['2'][0][
      'measurements'][0]['backward_peak'].keys() == {'always'}
  # Each configuration's workers are stopped only once the next one's are
  # connected: stopped first, each logged a gRPC error as the context moved.
  assert 'Unable to close remote context' not in proc.stderr, proc.stderr


_IN_PROCESS = r'''
import json, os, sys
os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
from absl import flags
from benchmarks import bench_lib
from benchmarks import memory_model_accuracy as accuracy
flags.FLAGS(['accuracy', '--models=mlp', '--num_cells=2',
             '--micro_batches=2', '--remat_policies=always',
             '--schedules=1f1b', '--measured_steps=1'])
rows = []
profiles = accuracy.RunModelInProcess('mlp', bench_lib.SplitCpu(3), rows,
                                      lambda line: None)
print(json.dumps({'rows': rows, 'profiles': profiles}))
'''


def test_in_process_path_profiles_on_a_spare_device_and_reads_each():
  """--device=gpu's path (profile on devices[-1], the step on devices[:K],
  each device's allocator read), run on three logical CPU devices: they
  share one allocator, so only the path and the row's shape are checked
  here."""
  proc = quiet_test.RunPython('-c', _IN_PROCESS, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  [row] = result['rows']
  assert (row['num_cells'], row['num_micro_batches']) == (2, 2)
  assert len(row['measured_mib']) == len(row['predicted_mib']) == 2
  assert min(row['measured_mib']) > 0 and min(row['predicted_mib']) > 0
  assert list(result['profiles']) == ['2']


def test_logical_gpu_memory_needs_the_gpu_device():
  for flag in ('--logical_gpu_memory_mb', '--gpu_profile_memory_mb'):
    proc = script_runner.Run('benchmarks.memory_model_accuracy',
                             f'{flag}=100', expect_ok=False, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert (f'{flag} sets the memory of logical GPUs; it needs --device=gpu'
            in proc.stderr)
    assert 'Traceback' not in proc.stderr
  # Where the GPU is profiled in this process, the flag would change nothing.
  proc = script_runner.Run('benchmarks.memory_model_accuracy', '--device=gpu',
                           '--noprocess_per_configuration',
                           '--gpu_profile_memory_mb=100', expect_ok=False,
                           timeout=120)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert ('--gpu_profile_memory_mb sets the GPU profile of '
          '--process_per_configuration') in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_gpu_device_is_refused_without_a_gpu():
  script_runner.AssertGpuModeRefused('benchmarks.memory_model_accuracy',
                                     '--models=mlp', '--num_cells=2')


def test_repeats_needs_capped_workers_that_measure():
  for args, words in (
      (['--device=gpu'], '--repeats measures each configuration on fresh '
       'capped workers: it needs --device=cpu'),
      (['--predict_from=/nonexistent.json'], '--repeats measures again; '
       '--predict_from only predicts the stored rows')):
    proc = script_runner.Run('benchmarks.memory_model_accuracy',
                             '--repeats=2', *args, expect_ok=False,
                             timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert words in proc.stderr, proc.stderr[-2000:]
    assert 'Traceback' not in proc.stderr
