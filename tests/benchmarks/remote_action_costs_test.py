"""benchmarks/remote_action_costs.py: the simulator's prediction from costs,
and a tiny run on two worker processes that must stop them.
"""
# bazel: tags=manual

import json

import pytest

from benchmarks import remote_action_costs
from tests.benchmarks import script_runner


def _Costs(f, fb, **overrides):
  costs = {'remote call, one worker': 0.0,
           'step function over both workers': 0.0,
           'transfer worker to worker': 0.0,
           'gradient accumulation, one cell': 0.0,
           'cell forward, micro-batch': f,
           'cell forward+backward, micro-batch': fb,
           'cell forward+backward, both workers at once': fb}
  costs.update(overrides)
  return costs


@pytest.mark.parametrize('k', [2, 4, 8])
def test_free_actions_predict_the_ideal_speedup(k):
  # Micro-batch costs that scale with its size, no overhead, no contention.
  costs = {m: _Costs(1.0 / m, 3.0 / m) for m in (1, 2, 8)}
  predicted = remote_action_costs.Predict(costs, k, num_layers=8)
  for m, (_, speedup) in predicted.items():
    assert speedup == pytest.approx(k * m / (m + k - 1))


def test_overheads_and_contention_lower_the_speedup():
  free = {m: _Costs(1.0 / m, 3.0 / m) for m in (1, 8)}
  costly = {1: _Costs(1.0, 3.0, **{
                'transfer worker to worker': 0.05,
                'cell forward+backward, both workers at once': 3.0 / 0.8}),
            8: _Costs(1.0 / 8, 3.0 / 8, **{
                'transfer worker to worker': 0.05,
                'gradient accumulation, one cell': 0.01,
                'cell forward+backward, both workers at once': 3.0 / 8 / 0.8})}
  ideal = remote_action_costs.Predict(free, 2, num_layers=8)[8][1]
  slowed = remote_action_costs.Predict(costly, 2, num_layers=8)[8][1]
  assert 1.0 < slowed < 0.8 * ideal


def test_tiny_run_reports_costs_and_predictions(tmp_path):
  out = tmp_path / 'costs.json'
  proc = script_runner.Run(
      'benchmarks.remote_action_costs', '--num_layers=4', '--dim=16',
      '--batch=16', '--micro_batches=2', '--reps=1',
      '--predict_num_cells=2,4', f'--output_json={out}', timeout=300)
  payload = json.loads(out.read_text())
  assert sorted(payload['costs_s']) == ['1', '2']
  assert all(v >= 0 for c in payload['costs_s'].values() for v in c.values())
  assert sorted(payload['predictions']) == ['2', '4']
  assert 'transfer via controller' in proc.stdout
