"""benchmarks/largest_model.py: its trials, on capped processes.

A search runs many trials; a test runs single ones (the same subprocess
the search starts): a small model trains one step in a capped process
(naive-1) and on two capped worker processes (pipeline-2), reporting each
device's peak within the budget; a budget too small is reported as out of
memory, not as a crash.
"""
# bazel: tags=manual

import json
import shutil

import pytest

from tests.benchmarks import script_runner

_TINY = ['--family=transformer', '--size=1', '--batch=4', '--dim=16',
         '--seq=8']


def _Trial(*args):
  proc = script_runner.Run('benchmarks.largest_model', *_TINY, *args,
                           timeout=240)
  [line] = [l for l in proc.stdout.splitlines() if l.startswith('TRIAL ')]
  return json.loads(line[len('TRIAL '):])


def test_naive_trial_trains_within_the_budget():
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  result = _Trial('--trial=naive-1', '--budget_mib=64')
  assert result['fits'], result
  assert 0 < result['peaks'][0] <= 64 * 2**20
  assert result['params'] > 0
  assert memory_limit.LIMIT_ENV  # The trial process's own cap.


@pytest.mark.skipif(not shutil.which('unshare'),
                    reason='needs unshare (util-linux) for loopback servers')
def test_pipelined_trial_on_capped_workers_and_out_of_memory():
  fits = _Trial('--trial=pipeline-2', '--budget_mib=64', '--layer_counts=2,3')
  assert fits['fits'], fits
  assert len(fits['peaks']) == 2 and max(fits['peaks']) <= 64 * 2**20
  too_small = _Trial('--trial=pipeline-2', '--budget_mib=1', '--dim=128',
                     '--seq=64', '--layer_counts=2,3')
  assert not too_small['fits']
  assert too_small['out_of_memory'], too_small
