"""Tests of tfpipe.memory_limit: the environment of a capped CPU process.

Protected properties: a capped process gets the BFC allocator and exactly
the limit asked for, the limit is read back from an environment, an
environment without BFC has no limit (TensorFlow would ignore it), a
bad limit is refused naming the value, and a capped process can hold its
whole limit in tensors, as an accelerator of that memory can.
"""

import os
import subprocess
import sys

import pytest

from tfpipe import memory_limit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_capped_environment_has_bfc_and_the_limit():
  env = memory_limit.CappedEnv(64, environ={'PATH': '/bin',
                                            memory_limit.LIMIT_ENV: '1'})
  assert env[memory_limit.BFC_ENV] == 'true'
  assert env[memory_limit.LIMIT_ENV] == '64'
  assert env['PATH'] == '/bin'
  assert memory_limit.LimitMb(env) == 64
  assert memory_limit.UsesBfc(env)


def test_no_limit_keeps_the_counting_allocator_only():
  env = memory_limit.CappedEnv(None, environ={memory_limit.LIMIT_ENV: '8'})
  assert memory_limit.UsesBfc(env)
  assert memory_limit.LIMIT_ENV not in env
  assert memory_limit.LimitMb(env) is None


def test_a_limit_without_bfc_is_no_limit():
  assert memory_limit.LimitMb({memory_limit.LIMIT_ENV: '8'}) is None
  assert memory_limit.LimitMb({memory_limit.BFC_ENV: '1',
                               memory_limit.LIMIT_ENV: 'x'}) is None


@pytest.mark.parametrize('bad', [0, -3, 1.5, True, '64'])
def test_a_bad_limit_names_the_value(bad):
  with pytest.raises(ValueError, match=f'device_memory_mb={bad!r}'):
    memory_limit.CappedEnv(bad)


def _RunInProcess(program, memory_mb):
  """`python -c program` in a fresh process capped at memory_mb (None: the
  counting allocator alone): its CompletedProcess."""
  env = memory_limit.CappedEnv(memory_mb)
  env['PYTHONPATH'] = ROOT
  env['TF_CPP_MIN_LOG_LEVEL'] = '3'
  return subprocess.run([sys.executable, '-c', program], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        check=False)


_TWENTY_VARIABLES = r'''
from tfpipe import memory_limit
import tensorflow as tf
opened = memory_limit.OpenOneRegion()
again = memory_limit.OpenOneRegion()
peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
held = [tf.Variable(tf.zeros([256, 1024])) for _ in range(20)]  # 1 MiB each
print(opened, again, peak, len(held), flush=True)
'''


def test_a_capped_process_holds_its_whole_limit_as_a_gpu_does():
  """A CPU capped at 21 MiB is an accelerator of 21 MiB: twenty variables
  of 1 MiB fit. On the allocator as it grows by regions, 17 fitted (each
  region's tail went to waste) and the eighteenth crashed the process. It
  is done once, before the first tensor, and leaves no peak behind."""
  result = _RunInProcess(_TWENTY_VARIABLES, 21)
  assert result.returncode == 0, result.stderr[-2000:]
  # The reservation is not a peak of the process's tensors.
  assert result.stdout.split() == ['True', 'False', '0', '20'], result.stdout


def test_an_uncapped_process_keeps_its_allocator_as_it_is():
  result = _RunInProcess(
      'from tfpipe import memory_limit; print(memory_limit.OpenOneRegion())',
      None)
  assert result.stdout.split() == ['False'], result.stderr[-2000:]


def test_a_cap_above_half_the_host_only_counts():
  """A cap larger than the host could hold is not taken at start: the
  process would be killed for memory it never uses."""
  result = _RunInProcess(
      'from tfpipe import memory_limit\n'
      'memory_limit._HostBytes = lambda: 40 * 2**20  # 21 > 40 / 2\n'
      'print(memory_limit.OpenOneRegion())', 21)
  assert result.stdout.split() == ['False'], result.stderr[-2000:]
