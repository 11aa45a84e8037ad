"""benchmarks/largest_model.py: one trial of each kind, and the GPU mode's checks.

A search runs many trials; a test runs single trials (the same subprocess
the search starts), with Adam as on the GPU, and checks the GPU mode's
defaults (GPipe Table 1's Transformer) and the check that K logical GPUs of
--budget_mib fit the GPU, which run before any trial.
"""
# bazel: tags=manual

import json
import os
import subprocess
import sys

from tests.benchmarks import script_runner

_TRIAL = ['--device=cpu', '--budget_mib=48', '--num_micro_batches=2',
          '--batch=4', '--seq=8', '--dim=16', '--heads=2', '--optimizer=adam']


def _TrialResult(proc):
  lines = [l for l in proc.stdout.splitlines() if l.startswith('TRIAL ')]
  assert len(lines) == 1, proc.stdout
  return json.loads(lines[0][len('TRIAL '):])


def test_naive_and_pipelined_trials_train_and_report_their_peak():
  naive = _TrialResult(script_runner.Run(
      'benchmarks.largest_model', '--trial=naive', '--layers=2',
      '--trial_cells=1', '--executor=graph', *_TRIAL))
  pipelined = _TrialResult(script_runner.Run(
      'benchmarks.largest_model', '--trial=pipeline', '--layers=2',
      '--trial_cells=2', '--executor=graph', *_TRIAL))
  # The same two layers either way; Adam's slots are not trainable.
  assert naive['params'] == pipelined['params'] > 0
  assert naive['peak'] > 0 and pipelined['peak'] > 0
  assert naive['device'] == pipelined['device'] == 'CPU'


_GPU_ARGS = r'''
import json, sys
from absl import flags
from benchmarks import largest_model
flags.FLAGS(sys.argv)
largest_model.ResolveDefaults(flags.FLAGS, 'GPU')
out = {n: flags.FLAGS[n].value for n in largest_model.DEFAULTS}
split = largest_model.CheckGpuPlan(1, 81559, 8, out['budget_mib'])
out['split'] = [list(split.counts), split.memory_limit_mb]
try:
  largest_model.CheckGpuPlan(1, 40536, 8, out['budget_mib'])
except ValueError as e:
  out['a100_40gb'] = str(e)
import tensorflow as tf
oom = tf.errors.ResourceExhaustedError(None, None, 'OOM when allocating')
try:
  try:
    raise oom
  except tf.errors.ResourceExhaustedError as e:
    raise RuntimeError('cell 3 failed') from e
except RuntimeError as e:
  wrapped = e
out['oom'] = [largest_model.IsOutOfMemory(e) for e in
              (oom, wrapped, ValueError('shapes differ'))]
print(json.dumps(out))
'''


def test_gpu_mode_defaults_checks_and_out_of_memory():
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  proc = subprocess.run([sys.executable, '-c', _GPU_ARGS, '--num_cells=8'],
                        cwd=script_runner.ROOT, env=env, capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert (out['dim'], out['heads'], out['batch'], out['seq']) == (
      2048, 16, 32, 256)
  assert (out['budget_mib'], out['optimizer'], out['executor']) == (
      8192.0, 'adam', 'auto')
  assert out['split'] == [[8], 8192]
  # Running out of a logical GPU's limit means "does not fit", also when the
  # threads executor re-raises it from a device thread; other errors fail.
  assert out['oom'] == [True, True, False]
  assert out['a100_40gb'].startswith(
      'pipeline-8 (--num_cells): --budget_mib=8192 x 8 logical GPUs per GPU '
      '= 65536 MiB, more than the 40536 MiB a GPU has.')


def test_gpu_mode_without_a_gpu_names_the_flag():
  script_runner.AssertGpuModeRefused('benchmarks.largest_model')
