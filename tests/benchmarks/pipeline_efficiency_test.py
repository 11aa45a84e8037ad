"""benchmarks/pipeline_efficiency.py: a tiny run of each mode.

The grpc modes start K worker processes on 127.0.0.1 inside a loopback-only
network namespace and must stop them, whatever happens.
"""
# bazel: tags=manual

import json

import pytest

from tests.benchmarks import script_runner

_TINY = ['--num_layers=2', '--dim=16', '--batch=16', '--micro_batches=1,2',
         '--reps=1']


@pytest.mark.parametrize('mode', ['threads', 'grpc_graph', 'grpc_threads'])
def test_each_mode_reports_the_speedup_against_the_ideal(tmp_path, mode):
  out = tmp_path / 'eff.json'
  proc = script_runner.Run('benchmarks.pipeline_efficiency', f'--mode={mode}',
                           *_TINY, f'--output_json={out}', timeout=300)
  payload = json.loads(out.read_text())
  runs = [r for r in payload['results'] if 'num_micro_batches' in r]
  assert [r['num_micro_batches'] for r in runs] == [1, 2]
  assert all(r['median_s'] > 0 for r in runs)
  assert runs[1]['ideal_speedup'] == pytest.approx(4 / 3)
  executor = 'threads' if mode != 'grpc_graph' else 'graph'
  assert f'executor={executor}' in proc.stdout
  assert 'bubble' in proc.stdout
