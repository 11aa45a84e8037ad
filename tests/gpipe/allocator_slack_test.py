"""Tests of gpipe.allocator_slack: what a fresh device holds after its build.

Protected property: what a fresh one-region allocator (a GPU's, a capped
worker's) holds after the trainer's build is predicted to the byte,
allocator slack included (an MLP's 1024x1024 layers with Adam hold 16.8 MiB
for 12.9 MiB of variables and slots: a slot takes an initializer's hole
whole).
"""

import os
import subprocess
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


_FRESH_BUILD = r'''
from tfpipe import memory_limit
assert memory_limit.OpenOneRegion()
import tensorflow as tf
from tests.gpipe import allocator_slack_test
allocator_slack_test.MlpParams().task.Instantiate()
print('HELD', tf.config.experimental.get_memory_info('CPU:0')['current'])
'''


def MlpParams():
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  p = model_registry.GetParams('mlp.SmallMlp', 'Train')
  p.task.model.Set(hidden_dim=1024, num_hidden_layers=2)
  p.task.pipeline.Set(num_partitions=1, num_micro_batches=1)
  return p


def test_a_fresh_devices_build_is_predicted_with_the_allocator_slack():
  """The trainer's build on a fresh capped process (one region, as a GPU)
  holds what the profile predicts: variables, slots and the slack that
  BuildSlack measured; without the slack the prediction was 23% short."""
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  env = memory_limit.CappedEnv(128)
  env.update(PYTHONPATH=_REPO_ROOT, TF_CPP_MIN_LOG_LEVEL='3')
  proc = subprocess.run([sys.executable, '-c', _FRESH_BUILD], cwd=_REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=240,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  held = int(proc.stdout.split('HELD')[-1])
  [cell] = memory_report.Profile(memory_report.ProfileRequest(
      MlpParams(), micro_batch_sizes=[8]), in_subprocess=True)
  m = cell.At(8)
  tensors = m.variable_bytes + m.optimizer_bytes + m.other_variable_bytes
  assert abs(tensors + m.allocator_slack_bytes - held) <= 0.01 * held, (
      held, tensors, m.allocator_slack_bytes)


def test_a_gpus_slack_is_measured_on_one_region_even_from_a_growing_profile(
    monkeypatch):
  """The slack subprocess of a GPU profile must see a fresh GPU's allocator
  (one region of its memory), not the growing one the profiling process
  asked for: a growing allocator holds no slack, and the H200 grid then
  under-predicted every MLP K=4 device by the 4 MiB it holds."""
  from tfpipe.gpipe import memory_profile  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv(memory_profile.GPU_GROWTH_ENV, 'true')
  monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
  gpu = memory_report.ProfileRequest(MlpParams(), micro_batch_sizes=[8],
                                     device='/GPU:0')
  slack = memory_profile.SubprocessEnv(gpu, 'slack', memory_mb=64)
  assert memory_profile.GPU_GROWTH_ENV not in slack
  assert slack.get('CUDA_VISIBLE_DEVICES') != ''
  assert slack['TF_CPU_BFC_MEM_LIMIT_IN_MB'] == '64'
  # The profile itself grows (it must not take the whole GPU), unless it is
  # asked for one region of its own size (gpu_memory_mb), as a run's GPU is.
  assert memory_profile.SubprocessEnv(gpu, 'profile')[
      memory_profile.GPU_GROWTH_ENV] == 'true'
  gpu.gpu_memory_mb = 2048
  assert memory_profile.GPU_GROWTH_ENV not in memory_profile.SubprocessEnv(
      gpu, 'profile')
  # On the CPU the slack process sees no GPU at all.
  cpu = memory_report.ProfileRequest(MlpParams(), micro_batch_sizes=[8])
  assert memory_profile.SubprocessEnv(cpu, 'slack', 64)[
      'CUDA_VISIBLE_DEVICES'] == ''
