"""Tests of recorded pipeline timelines (tfpipe.timeline).

A recorded step must be a faithful picture of the schedule: every action once,
each device's actions in the schedule's order without overlap, and no action
starting before the actions it needs have ended.
"""

import os

import pytest
import tensorflow as tf

from tfpipe import gpipe
from tfpipe import layers
from tfpipe import timeline
from tfpipe.gpipe import schedule as schedule_lib

# Cross-device start/end timestamps wait on the same tensor, not on each
# other (see Timeline.OrderViolations), so allow scheduler jitter.
_CROSS_DEVICE_SLACK_S = 0.02


def _Pipe(num_cells, num_micro_batches, schedule='gpipe', remat='always'):
  layer_params = [
      layers.FCLayer.Params().Set(name=f'fc{i}', input_dims=16, output_dims=16)
      for i in range(2 * num_cells)]
  cells = gpipe.PartitionSequentialLayers(layer_params, num_cells,
                                          input_shape=(None, 16))
  p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches,
      devices=[f'/CPU:{k}' for k in range(num_cells)], remat_policy=remat,
      schedule=schedule)
  return p.Instantiate()


def _Loss(y, unused_targets):
  return tf.reduce_mean(tf.square(y))


@pytest.fixture(scope='module', params=[('gpipe', 'always'), ('1f1b', 'never'),
                                        ('zb_h1', 'never')])
def recorded(request):
  schedule, remat = request.param
  pipe = _Pipe(3, 4, schedule, remat)
  x = tf.random.stateless_normal([8, 16], seed=[1, 2])
  return timeline.RecordStep(pipe, x, None, _Loss)


def test_every_action_once(recorded):
  s = recorded.schedule
  kinds = [schedule_lib.FORWARD, schedule_lib.BACKWARD] + (
      [schedule_lib.WEIGHT] if s.splits_backward else [])
  expected = {schedule_lib.Action(kind, m, k) for kind in kinds
              for m in range(s.num_micro_batches) for k in range(s.num_cells)}
  listed = [a for acts in s.device_actions for a in acts]
  assert len(listed) == len(set(listed)) == len(expected)
  assert set(recorded.start_times) == expected
  assert set(recorded.end_times) == expected
  for a in expected:
    assert 0.0 <= recorded.start_times[a] <= recorded.end_times[a]


def test_device_order_is_kept(recorded):
  for d in range(recorded.num_devices):
    acts = recorded.schedule.device_actions[d]
    for prev, a in zip(acts, acts[1:]):
      assert recorded.start_times[a] >= recorded.end_times[prev]


def test_dependencies_are_respected(recorded):
  assert not recorded.OrderViolations(_CROSS_DEVICE_SLACK_S)


def test_bubble_and_prediction(recorded):
  assert 0.0 <= recorded.bubble_fraction < 1.0
  assert 0.0 <= recorded.predicted.bubble_fraction < 1.0
  assert len(recorded.forward_costs) == recorded.schedule.num_cells
  assert all(c > 0 for c in recorded.forward_costs + recorded.backward_costs)
  summary = recorded.Summary()
  assert 'measured' in summary and 'predicted' in summary
  d = recorded.AsDict()
  kinds = 3 if recorded.schedule.splits_backward else 2
  assert len(d['actions']) == kinds * 3 * 4
  assert len(d['weight_costs_s']) == (3 if kinds == 3 else 0)


def test_text_has_one_row_per_device(recorded):
  rows = recorded.Text().splitlines()
  assert len(rows) == recorded.num_devices
  for d, row in enumerate(rows):
    assert row.startswith(f'dev{d}')
    assert 'F' in row and 'B' in row
  assert len(recorded.PredictedText().splitlines()) == recorded.num_devices


def test_png_is_written(recorded, tmp_path):
  pytest.importorskip('matplotlib')
  path = os.path.join(tmp_path, 'timeline.png')
  recorded.SavePng(path)
  with open(path, 'rb') as f:
    head = f.read(8)
  assert head == b'\x89PNG\r\n\x1a\n'
  assert os.path.getsize(path) > 1000


def test_from_action_times_names_missing_actions():
  s = gpipe.GPipeSchedule(2, 2)
  with pytest.raises(ValueError, match='No recorded time'):
    timeline.FromActionTimes(s, {schedule_lib.Action('F', 0, 0): (0.0, 1.0)})


def test_from_action_times_on_simulated_times():
  s = gpipe.GPipeSchedule(3, 4)
  sim = gpipe.Simulate(s)
  times = {a: (sim.start_times[a] + 100.0, sim.end_times[a] + 100.0)
           for a in sim.start_times}
  tl = timeline.FromActionTimes(s, times)
  assert tl.bubble_fraction == pytest.approx(sim.bubble_fraction)
  assert tl.predicted.makespan == pytest.approx(sim.makespan)
  assert tl.forward_costs == pytest.approx([1.0] * 3)
  assert tl.backward_costs == pytest.approx([2.0] * 3)


def test_weight_actions_get_their_own_costs_in_the_prediction():
  s = gpipe.schedule.ZeroBubbleH1Schedule(2, 4)
  sim = gpipe.Simulate(s, [1.0, 1.0], [1.5, 1.5], weight_costs=[0.5, 0.5])
  tl = timeline.FromActionTimes(s, {a: (sim.start_times[a], sim.end_times[a])
                                    for a in sim.start_times})
  assert tl.backward_costs == pytest.approx([1.5, 1.5])
  assert tl.weight_costs == pytest.approx([0.5, 0.5])
  assert tl.predicted.makespan == pytest.approx(sim.makespan)
  assert 'per-cell W ms' in tl.Summary()
  assert 'W3' in tl.Text()
