"""Schedules are data: completeness, dependencies, simulation and printing."""

import dataclasses

import pytest

from tfpipe.gpipe import schedule as schedule_lib
from tfpipe.gpipe.schedule import Action


@pytest.mark.parametrize('name', sorted(schedule_lib.SCHEDULES))
@pytest.mark.parametrize('num_cells,num_micro_batches',
                         [(1, 1), (2, 1), (2, 3), (4, 4), (4, 8), (8, 16),
                          (3, 2)])
def test_schedules_are_complete_and_deadlock_free(name, num_cells,
                                                  num_micro_batches):
  sched = schedule_lib.MakeSchedule(name, num_cells, num_micro_batches)
  order = schedule_lib.Validate(sched)
  kinds = 3 if name == 'zb_h1' else 2
  assert len(order) == kinds * num_cells * num_micro_batches
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


@pytest.mark.parametrize('name', sorted(schedule_lib.SCHEDULES))
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


# ---- zero bubble (ZB-H1) -----------------------------------------------------


@pytest.mark.parametrize('num_cells,num_micro_batches',
                         [(2, 8), (4, 16), (8, 32)])
def test_zb_h1_has_a_third_of_1f1b_idle_time_and_at_most_0_4_its_bubble(
    num_cells, num_micro_batches):
  """Qi et al.: (K-1)(F+B-W) idle against 1F1B's (K-1)(F+B+W), F=B=W=1."""
  one_f_one_b = schedule_lib.Simulate(
      schedule_lib.OneFOneBSchedule(num_cells, num_micro_batches))
  zero = schedule_lib.Simulate(
      schedule_lib.ZeroBubbleH1Schedule(num_cells, num_micro_batches))
  # Same work: 1F1B's B is ZB-H1's B and W together (2 against 1 + 1).
  assert zero.idle_time == pytest.approx(one_f_one_b.idle_time / 3)
  assert zero.makespan == pytest.approx(3 * num_micro_batches + num_cells - 1)
  assert zero.bubble_fraction <= 0.4 * one_f_one_b.bubble_fraction


def test_zb_h1_keeps_the_peak_micro_batches_in_flight_of_1f1b():
  """B keeps what W needs, so a micro-batch is in flight until its W."""
  for k, m in [(4, 8), (4, 16), (2, 8)]:
    peak_1f1b = max(schedule_lib.MaxInFlight(schedule_lib.OneFOneBSchedule(
        k, m)))
    zero = schedule_lib.MaxInFlight(schedule_lib.ZeroBubbleH1Schedule(k, m))
    assert max(zero) == peak_1f1b == k
  # Not until B: counted until B, the last device would hold only one.
  sched = schedule_lib.ZeroBubbleH1Schedule(4, 8)
  until_b = dataclasses.replace(sched, device_actions=[
      [a for a in acts if a.kind != 'W'] for acts in sched.device_actions])
  assert schedule_lib.MaxInFlight(until_b) == [4, 3, 2, 1]


def test_zb_h1_delays_device_k_weight_gradients_by_k_micro_batches():
  sched = schedule_lib.ZeroBubbleH1Schedule(2, 4)
  assert [str(a) for a in sched.device_actions[0]] == [
      'F0.0', 'F1.0', 'B0.0', 'W0.0', 'F2.0', 'B1.0', 'W1.0', 'F3.0', 'B2.0',
      'W2.0', 'B3.0', 'W3.0']
  assert [str(a) for a in sched.device_actions[1]] == [
      'F0.1', 'B0.1', 'F1.1', 'B1.1', 'W0.1', 'F2.1', 'B2.1', 'W1.1', 'F3.1',
      'B3.1', 'W2.1', 'W3.1']
  assert sched.splits_backward
  assert not schedule_lib.OneFOneBSchedule(2, 4).splits_backward


def test_weight_gradient_waits_for_its_backward():
  assert schedule_lib.Dependencies(Action('W', 3, 1), 4) == [
      Action('B', 3, 1)]
  sched = schedule_lib.ZeroBubbleH1Schedule(2, 2)
  acts = list(sched.device_actions[1])
  w0, b0 = acts.index(Action('W', 0, 1)), acts.index(Action('B', 0, 1))
  acts[w0], acts[b0] = acts[b0], acts[w0]
  early_w = dataclasses.replace(sched, device_actions=[
      sched.device_actions[0], acts])
  with pytest.raises(schedule_lib.ScheduleError, match='deadlocks'):
    schedule_lib.Validate(early_w)
  missing_w = dataclasses.replace(sched, device_actions=[
      sched.device_actions[0], [a for a in acts if a != Action('W', 1, 1)]])
  with pytest.raises(schedule_lib.ScheduleError, match=r"missing \['W1.1'\]"):
    schedule_lib.Validate(missing_w)


def test_simulate_charges_b_and_w_their_own_costs():
  sched = schedule_lib.ZeroBubbleH1Schedule(1, 2)
  default = schedule_lib.Simulate(sched)  # F = B = W = 1.
  assert default.makespan == pytest.approx(6.0)
  costed = schedule_lib.Simulate(sched, [1.0], [2.0], weight_costs=[0.5])
  assert costed.makespan == pytest.approx(2 * 3.5)
  with pytest.raises(ValueError, match='one weight cost per cell'):
    schedule_lib.Simulate(sched, weight_costs=[1.0, 2.0])


def test_text_timeline_prints_weight_actions():
  text = schedule_lib.TextTimeline(schedule_lib.ZeroBubbleH1Schedule(2, 3))
  for m in range(3):
    assert f'W{m}' in text.splitlines()[0] and f'W{m}' in text.splitlines()[1]


# ---- interleaved 1F1B --------------------------------------------------------


@pytest.mark.parametrize('num_devices,num_micro_batches',
                         [(2, 8), (4, 8), (4, 16), (2, 5)])
def test_interleaving_two_cells_per_device_halves_the_fill_and_drain(
    num_devices, num_micro_batches):
  """v=2 chunks of the same model, against 1F1B with one cell per device."""
  one_f_one_b = schedule_lib.Simulate(
      schedule_lib.OneFOneBSchedule(num_devices, num_micro_batches),
      forward_costs=[2.0] * num_devices)
  interleaved = schedule_lib.Simulate(schedule_lib.InterleavedOneFOneBSchedule(
      2 * num_devices, num_micro_batches,
      schedule_lib.RoundRobin(2 * num_devices, num_devices)))
  assert interleaved.idle_time == pytest.approx(one_f_one_b.idle_time / 2,
                                                rel=0.35)
  assert interleaved.bubble_fraction <= 0.6 * one_f_one_b.bubble_fraction


def test_interleaved_order_of_the_first_device():
  sched = schedule_lib.InterleavedOneFOneBSchedule(4, 4, [0, 1, 0, 1])
  assert sched.num_devices == 2
  # Forwards go round by round (2 micro-batches) through cell 0, then cell 2;
  # backwards through cell 2, then cell 0. Warm-up: (v-1) rounds plus
  # 2(D-d-1) forwards = 4; then one forward, one backward.
  assert [str(a) for a in sched.device_actions[0]] == [
      'F0.0', 'F1.0', 'F0.2', 'F1.2', 'F2.0', 'B0.2', 'F3.0', 'B1.2', 'F2.2',
      'B0.0', 'F3.2', 'B1.0', 'B2.2', 'B3.2', 'B2.0', 'B3.0']


@pytest.mark.parametrize('num_devices', [1, 2, 3, 4])
@pytest.mark.parametrize('cells_per_device', [1, 2, 3])
def test_interleaved_is_deadlock_free_for_every_micro_batch_count(
    num_devices, cells_per_device):
  num_cells = num_devices * cells_per_device
  for m in range(1, 3 * num_devices + 2):
    sched = schedule_lib.InterleavedOneFOneBSchedule(
        num_cells, m, schedule_lib.RoundRobin(num_cells, num_devices))
    assert len(schedule_lib.Validate(sched)) == 2 * num_cells * m


def test_interleaved_with_one_cell_per_device_is_1f1b():
  assert (schedule_lib.InterleavedOneFOneBSchedule(4, 8).device_actions ==
          schedule_lib.OneFOneBSchedule(4, 8).device_actions)


def test_interleaved_needs_round_robin_placement():
  with pytest.raises(ValueError, match=r'cell k on device k % D.*'
                     r'round_robin_placement=True'):
    schedule_lib.InterleavedOneFOneBSchedule(4, 4, [0, 0, 1, 1])
  with pytest.raises(ValueError, match='multiple of the number of devices'):
    schedule_lib.InterleavedOneFOneBSchedule(3, 4, [0, 1, 0])
  assert schedule_lib.VirtualStages(6, [0, 1, 2, 0, 1, 2]) == (3, 2)


def test_text_timeline_shows_an_instant_action():
  """A recorded action can take no measurable time (ZB-H1's B on the first
  cell has no input gradient to compute); it must still be drawn, not
  overwritten by the action after it."""
  sched = schedule_lib.MakeSchedule('zb_h1', 2, 3)
  start, end = {}, {}
  for acts in sched.device_actions:
    t = 0.0
    for a in acts:
      duration = 0.0 if (a.kind, a.cell) == ('B', 0) else 1.0
      start[a], end[a] = t, t + duration
      t += duration
  dev0 = schedule_lib.TextTimeline(sched, start_times=start,
                                   end_times=end).splitlines()[0]
  assert dev0.count('B') == 3 and dev0.count('W') == 3, dev0


@pytest.mark.parametrize('name,num_cells,placement', [
    ('gpipe', 3, None), ('1f1b', 4, None), ('zb_h1', 3, None),
    ('interleaved_1f1b', 4, [0, 1, 0, 1])])
def test_latest_ancestors_are_what_every_timing_runs_first(
    name, num_cells, placement):
  """The vector clock of an action names, per device, the last action that
  the schedule's dependencies and device orders put before it: checked
  against the transitive closure, computed the slow way."""
  sched = schedule_lib.MakeSchedule(name, num_cells, 5, placement)
  clocks = schedule_lib.LatestAncestors(sched)
  assert schedule_lib.LatestAncestors(sched) is clocks  # Computed once.
  where = {a: (d, i) for d, acts in enumerate(sched.device_actions)
           for i, a in enumerate(acts)}
  direct = {a: set(schedule_lib.Dependencies(a, num_cells)) for a in where}
  for a, (d, i) in where.items():
    if i:
      direct[a].add(sched.device_actions[d][i - 1])

  def Ancestors(a, seen):
    for b in direct[a]:
      if b not in seen:
        seen.add(b)
        Ancestors(b, seen)
    return seen
  for a in where:
    ancestors = Ancestors(a, set()) | {a}
    expected = [max([where[b][1] for b in ancestors if where[b][0] == d],
                    default=-1) for d in range(sched.num_devices)]
    assert clocks[a] == expected, a
