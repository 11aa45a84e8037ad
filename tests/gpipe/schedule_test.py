"""Schedules are data: completeness, dependencies, simulation and printing."""

import pytest

from tfpipe.gpipe import schedule as schedule_lib
from tfpipe.gpipe.schedule import Action


@pytest.mark.parametrize('name', ['gpipe', '1f1b'])
@pytest.mark.parametrize('num_cells,num_micro_batches',
                         [(1, 1), (2, 1), (2, 3), (4, 4), (4, 8), (8, 16),
                          (3, 2)])
def test_schedules_are_complete_and_deadlock_free(name, num_cells,
                                                  num_micro_batches):
  sched = schedule_lib.MakeSchedule(name, num_cells, num_micro_batches)
  order = schedule_lib.Validate(sched)
  assert len(order) == 2 * num_cells * num_micro_batches
  position = {a: i for i, a in enumerate(order)}
  for a in order:
    for dep in schedule_lib.Dependencies(a, num_cells):
      assert position[dep] < position[a], (a, dep)
  for acts in sched.device_actions:
    assert [position[a] for a in acts] == sorted(position[a] for a in acts)


@pytest.mark.parametrize('num_cells,num_micro_batches',
                         [(2, 1), (2, 8), (4, 4), (4, 16), (8, 32), (3, 7)])
def test_gpipe_bubble_matches_formula(num_cells, num_micro_batches):
  sched = schedule_lib.GPipeSchedule(num_cells, num_micro_batches)
  sim = schedule_lib.Simulate(sched)
  assert sim.bubble_fraction == pytest.approx(
      schedule_lib.IdealBubbleFraction(num_cells, num_micro_batches))
  # Equal costs f=1, b=2: makespan (M+K-1)(f+b).
  assert sim.makespan == pytest.approx(
      (num_micro_batches + num_cells - 1) * 3.0)


def test_1f1b_has_the_same_bubble_and_fewer_micro_batches_in_flight():
  gpipe = schedule_lib.GPipeSchedule(4, 16)
  one_f_one_b = schedule_lib.OneFOneBSchedule(4, 16)
  assert schedule_lib.Simulate(one_f_one_b).makespan == pytest.approx(
      schedule_lib.Simulate(gpipe).makespan)
  assert schedule_lib.MaxInFlight(gpipe) == [16, 16, 16, 16]
  assert schedule_lib.MaxInFlight(one_f_one_b) == [4, 3, 2, 1]


def test_1f1b_order_of_first_stage():
  sched = schedule_lib.OneFOneBSchedule(3, 4)
  assert [str(a) for a in sched.device_actions[0]] == [
      'F0.0', 'F1.0', 'F2.0', 'B0.0', 'F3.0', 'B1.0', 'B2.0', 'B3.0']
  assert [str(a) for a in sched.device_actions[2]] == [
      'F0.2', 'B0.2', 'F1.2', 'B1.2', 'F2.2', 'B2.2', 'F3.2', 'B3.2']


def test_unequal_costs_slowest_cell_sets_the_pace():
  sched = schedule_lib.GPipeSchedule(2, 8)
  sim = schedule_lib.Simulate(sched, forward_costs=[1.0, 3.0],
                              backward_costs=[2.0, 6.0])
  # The slow cell is busy 8 * 9 = 72 plus its fill (1) and drain (2).
  assert sim.makespan == pytest.approx(75.0)


@pytest.mark.parametrize('name', ['gpipe', '1f1b'])
def test_round_robin_placement_merges_cells_without_deadlock(name):
  sched = schedule_lib.MakeSchedule(name, 4, 6, device_of_cell=[0, 1, 0, 1])
  assert sched.num_devices == 2
  schedule_lib.Validate(sched)
  for d, acts in enumerate(sched.device_actions):
    assert {a.cell % 2 for a in acts} == {d}


def test_validate_rejects_deadlock_duplicates_and_missing():
  sched = schedule_lib.GPipeSchedule(2, 2)
  broken = schedule_lib.Schedule(
      'broken', 2, 2, [0, 1],
      [list(reversed(sched.device_actions[0])), sched.device_actions[1]])
  with pytest.raises(schedule_lib.ScheduleError, match='deadlocks'):
    schedule_lib.Validate(broken)
  dup = schedule_lib.Schedule('dup', 2, 2, [0, 1], [
      sched.device_actions[0] + [Action('F', 0, 0)], sched.device_actions[1]])
  with pytest.raises(schedule_lib.ScheduleError, match='repeats'):
    schedule_lib.Validate(dup)
  missing = schedule_lib.Schedule('missing', 2, 2, [0, 1], [
      sched.device_actions[0][:-1], sched.device_actions[1]])
  with pytest.raises(schedule_lib.ScheduleError, match='missing'):
    schedule_lib.Validate(missing)
  wrong_device = schedule_lib.Schedule('wrong', 2, 2, [0, 1], [
      sched.device_actions[1], sched.device_actions[0]])
  with pytest.raises(schedule_lib.ScheduleError, match='placed on device'):
    schedule_lib.Validate(wrong_device)


def test_unknown_schedule_and_bad_counts_are_named():
  with pytest.raises(ValueError, match="schedule='zigzag'"):
    schedule_lib.MakeSchedule('zigzag', 2, 2)
  with pytest.raises(ValueError, match='num_micro_batches=0'):
    schedule_lib.GPipeSchedule(2, 0)


def test_text_timeline_has_a_row_per_device_and_every_action():
  sched = schedule_lib.GPipeSchedule(3, 4)
  text = schedule_lib.TextTimeline(sched)
  rows = text.splitlines()
  assert len(rows) == 3
  for d, row in enumerate(rows):
    assert row.startswith(f'dev{d}')
    for m in range(4):
      assert f'F{m}' in row and f'B{m}' in row
  # Device 2 starts later than device 0 (the pipeline fill).
  assert rows[2].index('F0') > rows[0].index('F0')


def test_forward_only_schedule():
  sched = schedule_lib.OneFOneBSchedule(3, 5).ForwardOnly()
  order = schedule_lib.Validate(sched, forward_only=True)
  assert len(order) == 15 and all(a.kind == 'F' for a in order)
  sim = schedule_lib.Simulate(sched)
  assert sim.makespan == pytest.approx(5 + 3 - 1)
