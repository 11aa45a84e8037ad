"""Tests of tfpipe.memory_limit: the environment of a capped CPU process.

Protected properties: a capped process gets the BFC allocator and exactly
the limit asked for, the limit is read back from an environment, an
environment without BFC has no limit (TensorFlow would ignore it), and a
bad limit is refused naming the value.
"""

import pytest

from tfpipe import memory_limit


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
