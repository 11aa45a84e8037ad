"""benchmarks/schedules.py: a tiny side-by-side run of every schedule."""
# bazel: tags=manual

import json

import pytest

from tests.benchmarks import script_runner

_TINY = ['--num_layers=4', '--dim=16', '--batch=32', '--num_micro_batches=4',
         '--reps=2']


@pytest.fixture(name='runs', scope='module')
def fixture_runs(tmp_path_factory):
  """The tiny run and one with an unknown schedule, started together:
  {name: (run, json)}."""
  tmp = tmp_path_factory.mktemp('schedules')
  yield from script_runner.KillAfter({
      'tiny': script_runner.StartWritingJson('benchmarks.schedules',
                                             tmp / 'schedules.json', *_TINY),
      'unknown': (script_runner.Start('benchmarks.schedules', *_TINY,
                                      '--schedules=gpipe,zigzag'), None),
  })


def test_every_schedule_is_timed_recorded_and_compared(runs):
  run, out = runs['tiny']
  proc = script_runner.Finished(run)
  payload = json.loads(out.read_text())
  results = {r['schedule']: r for r in payload['results']}
  assert sorted(results) == ['1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1']
  assert results['interleaved_1f1b']['num_cells'] == 4  # v=2 on K=2.
  assert results['zb_h1']['max_in_flight'] == [2, 2]
  assert len(results['zb_h1']['weight_costs_s']) == 2
  assert not results['1f1b']['weight_costs_s']
  for r in results.values():
    assert len(r['step_s']) == 2 and all(t > 0 for t in r['step_s'])
    assert 0.0 <= r['measured_bubble'] < 1.0
  assert 'predicted_saving_s' in payload['zero_bubble']
  assert 'ZB-H1 vs 1F1B' in proc.stdout


def test_unknown_schedule_is_named(runs):
  proc = script_runner.Finished(runs['unknown'][0], expect_ok=False)
  assert proc.returncode == 1
  assert "--schedules: unknown ['zigzag']" in proc.stderr
