"""benchmarks/executor_choice.py: a tiny sweep times both executors per width.

What the table's "auto picks" column claims is checked against
ChooseExecutor itself, so the reported pick is the one a user gets.
"""
# bazel: tags=manual

import json

from tests.benchmarks import script_runner
from tfpipe.gpipe import dispatch

_DIMS = [16, 32]


def test_tiny_sweep_times_both_executors_and_reports_auto(tmp_path):
  out = tmp_path / 'executor_choice.json'
  proc = script_runner.Run(
      'benchmarks.executor_choice', f'--dims={",".join(map(str, _DIMS))}',
      '--batch=8', '--num_layers=2', '--reps=1', f'--output_json={out}')
  payload = json.loads(out.read_text())
  results = payload['results']
  assert [r['dim'] for r in results] == _DIMS
  for r in results:
    assert r['graph_s'] > 0 and r['threads_s'] > 0, r
    assert r['forward_flops_per_action'] > 0, r
    assert len(set(r['devices'])) == 2, r
    assert r['auto'] == dispatch.ChooseExecutor(
        r['devices'], r['forward_flops_per_action']), r
  assert payload['threads_min_forward_flops'] == (
      dispatch.THREADS_MIN_FORWARD_FLOPS)
  assert payload['environment']['cpu_count']
  assert 'K=2, M=4 on 2 logical CPU devices' in proc.stdout
  assert ('THREADS_MIN_FORWARD_FLOPS = '
          f'{dispatch.THREADS_MIN_FORWARD_FLOPS:.3g}') in proc.stdout
