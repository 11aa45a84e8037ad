"""benchmarks/pipeline_efficiency.py: a tiny run of each mode.

The grpc modes start K worker processes on 127.0.0.1 inside a loopback-only
network namespace and must stop them, whatever happens, and say nothing on
stderr when they do (no TensorFlow errors about the stopped workers).
"""
# bazel: tags=manual

import json

import pytest

from tests.benchmarks import script_runner

_TINY = ['--num_layers=2', '--dim=16', '--batch=16', '--micro_batches=1,2',
         '--reps=1']
_MODES = ['threads', 'grpc_graph', 'grpc_threads']


@pytest.fixture(name='runs', scope='module')
def fixture_runs(tmp_path_factory):
  """A tiny run of each mode, started together: {mode: (run, json)}."""
  tmp = tmp_path_factory.mktemp('pipeline_efficiency')
  yield from script_runner.KillAfter({
      mode: script_runner.StartWritingJson(
          'benchmarks.pipeline_efficiency', tmp / f'{mode}.json',
          f'--mode={mode}', *_TINY, timeout=300) for mode in _MODES})


@pytest.mark.parametrize('mode', _MODES)
def test_each_mode_reports_the_speedup_against_the_ideal(runs, mode):
  run, out = runs[mode]
  proc = script_runner.Finished(run)
  payload = json.loads(out.read_text())
  runs = [r for r in payload['results'] if 'num_micro_batches' in r]
  assert [r['num_micro_batches'] for r in runs] == [1, 2]
  assert all(r['median_s'] > 0 for r in runs)
  assert runs[1]['ideal_speedup'] == pytest.approx(4 / 3)
  executor = 'threads' if mode != 'grpc_graph' else 'graph'
  assert f'executor={executor}' in proc.stdout
  assert 'bubble' in proc.stdout
  assert proc.stderr.strip() == '', proc.stderr[-2000:]
