"""Tests of gpipe.planner, on synthetic layer profiles with round numbers.

Protected properties: every device of a plan fits its budget, less the
headroom asked for; a model that does not fit one device is split over
more, and the cut balances what the devices hold; faster is preferred where
both fit; nothing fitting is said before anything runs, with the smallest
memory that would fit, headroom included (and that memory does fit); the
step time counts the bubble on concurrent devices and every action on
devices that run one at a time; a cell of several layers adds what they
keep (an inner input only if a backward reads it).
"""

import dataclasses

import pytest

from tfpipe.gpipe import memory_model
from tfpipe.gpipe import plan_devices
from tfpipe.gpipe import planner

MIB = 2**20


def _Layer(n, is_last=False, variables=4 * MIB, seconds=0.01):
  return memory_model.CellMemory(
      micro_batch_size=n, variable_bytes=variables,
      optimizer_bytes=2 * variables, input_bytes=n * MIB // 16,
      input_gradient_bytes=n * MIB // 16, output_bytes=n * MIB // 16,
      output_gradient_bytes=n * MIB // 16,
      kept={'always': 0, 'never': n * MIB // 4},
      forward_peak={'always': n * MIB // 8, 'never': n * MIB // 4},
      backward_peak={'always': n * MIB // 2, 'never': n * MIB // 4},
      fused_peak=n * MIB // 2, update_peak=MIB, is_last=is_last,
      forward_s=seconds * n, backward_s={'always': 3 * seconds * n,
                                         'never': 2 * seconds * n},
      fused_s=3 * seconds * n, update_s=0.001)


def _Profiles(num_layers=8):
  layers = [memory_model.CellProfile([_Layer(1), _Layer(16)])
            for _ in range(num_layers)]
  last = memory_model.CellProfile([_Layer(1, True), _Layer(16, True)])
  return planner.LayerProfiles(layers, last)


def test_combined_layers_add_what_they_keep():
  one = _Layer(4)
  three = planner.CombineLayers([one, one, _Layer(4, True)])
  assert three.variable_bytes == 12 * MIB
  # Their own activations and the two inputs passed between them.
  assert three.kept['never'] == 3 * MIB + 2 * (4 * MIB // 16)
  assert three.kept['always'] == 0
  assert three.backward_peak['always'] > one.backward_peak['always']
  assert three.is_last
  # An inner input that the next layer's backward does not read is not
  # kept (its profile's kept_input); the cell's own input follows its first
  # layer's.
  freed = dataclasses.replace(one, kept_input={'always': MIB // 4,
                                               'never': 0},
                              includes_input_gradient=True)
  cell = planner.CombineLayers([one, freed, _Layer(4, True)])
  assert cell.kept['never'] == 3 * MIB + 4 * MIB // 16
  assert not cell.includes_input_gradient and cell.kept_input == {}
  assert planner.CombineLayers([freed, one]).kept_input['never'] == 0
  assert planner.CombineLayers([freed, one]).includes_input_gradient


def test_a_cells_allocator_slack_is_its_largest_layers():
  """The holes one layer's build leaves are taken by the next layer's
  tensors: a cell holds about one layer's slack, not their sum."""
  layers = [dataclasses.replace(_Layer(4), allocator_slack_bytes=s * MIB)
            for s in (1, 3, 2)]
  assert planner.CombineLayers(layers).allocator_slack_bytes == 3 * MIB


def test_a_model_too_big_for_one_device_is_split_to_fit():
  # 8 layers x 4 MiB x 4 (variable, accumulator, two slots) = 128 MiB.
  devices = planner.Devices(count=4, memory_bytes=48 * MIB, concurrent=True)
  plans = planner.CandidatePlans(_Profiles(), devices, batch_size=16)
  assert all(p.num_partitions >= 4 for p in plans)
  for plan in plans:
    assert plan.max_peak_bytes <= 48 * MIB
    assert sum(plan.layer_counts) == 8
  best = planner.Explain(plans, devices)
  assert best.layer_counts == [2, 2, 2, 2]
  text = best.Describe()
  assert 'Plan: 4 partition(s)' in text and 'why:' in text
  assert '[1, 2, 3] partition(s) fit in no configuration' in text


def test_fastest_fitting_plan_is_first():
  devices = planner.Devices(count=2, memory_bytes=1024 * MIB,
                            concurrent=False)
  plans = planner.CandidatePlans(_Profiles(), devices, batch_size=16)
  times = [p.step_time_s for p in plans]
  assert times == sorted(times)
  # Devices that take turns: the pipeline buys nothing, recomputing costs.
  best = plans[0]
  assert best.remat_policy == 'never'
  assert best.num_micro_batches == 1


def test_nothing_fits_names_the_smallest_memory_that_does():
  devices = planner.Devices(count=2, memory_bytes=16 * MIB)
  with pytest.raises(planner.NoPlanError,
                     match=r'smallest per-device memory that would fit is '
                     r'\d+ MiB') as raised:
    planner.CandidatePlans(_Profiles(), devices, batch_size=16)
  smallest = raised.value.smallest_memory_bytes
  assert smallest > 16 * MIB
  enough = planner.Devices(count=2, memory_bytes=smallest + 1)
  assert planner.CandidatePlans(_Profiles(), enough, batch_size=16)


def test_a_plan_leaves_the_headroom_free():
  """With a headroom, no predicted peak of any plan passes the plannable
  share of the budget, and plans that would reach into it are dropped."""
  tight = planner.CandidatePlans(
      _Profiles(), planner.Devices(count=4, memory_bytes=48 * MIB),
      batch_size=16)
  devices = planner.Devices(count=4, memory_bytes=48 * MIB, headroom=0.25)
  assert devices.plannable_bytes == 36 * MIB
  plans = planner.CandidatePlans(_Profiles(), devices, batch_size=16)
  assert plans and all(p.max_peak_bytes <= 36 * MIB for p in plans)
  # Some plan fits 48 MiB only by reaching into the headroom, and is gone.
  assert any(p.max_peak_bytes > 36 * MIB for p in tight)
  assert len(plans) < len(tight)
  text = planner.Explain(plans, devices).Describe()
  assert 'each within 36.0 MiB (48 MiB less a 25% headroom)' in text


def test_nothing_fits_counts_the_headroom_in_the_memory_it_names():
  devices = planner.Devices(count=2, memory_bytes=16 * MIB, headroom=0.2)
  with pytest.raises(planner.NoPlanError,
                     match=r'smallest per-device memory that would fit is '
                     r'\d+ MiB \(a predicted peak of [\d.]+ MiB and the 20% '
                     r'headroom\)') as raised:
    planner.CandidatePlans(_Profiles(), devices, batch_size=16)
  smallest = raised.value.smallest_memory_bytes
  with pytest.raises(planner.NoPlanError) as without:
    planner.CandidatePlans(_Profiles(), planner.Devices(count=2,
                                                        memory_bytes=16 * MIB),
                           batch_size=16)
  assert smallest == pytest.approx(
      without.value.smallest_memory_bytes / 0.8)
  enough = planner.Devices(count=2, memory_bytes=smallest + 1, headroom=0.2)
  assert planner.CandidatePlans(_Profiles(), enough, batch_size=16)


def _CellsOf(plan, profiles):
  """The plan's cells as cells (memory_model.CellProfile), as Refine takes."""
  cells, start = [], 0
  for count in plan.layer_counts:
    cells.append(memory_model.CellProfile(
        [profiles.Range(start, start + count, n) for n in (1, 16)]))
    start += count
  return cells


def test_a_plan_whose_cells_reach_into_the_headroom_is_dropped():
  profiles = _Profiles()
  devices = planner.Devices(count=4, memory_bytes=48 * MIB)
  plan = planner.CandidatePlans(profiles, devices, batch_size=16)[0]
  refined = planner.Refine(plan, _CellsOf(plan, profiles), devices, 16)
  assert refined is not None
  # A headroom that leaves just less than the plan's largest peak.
  just_under = planner.Devices(
      count=4, memory_bytes=48 * MIB,
      headroom=1 - 0.99 * refined.max_peak_bytes / (48 * MIB))
  assert planner.Refine(plan, _CellsOf(plan, profiles), just_under,
                        16) is None


def test_step_time_counts_the_bubble_or_every_action():
  cells = [_Layer(4), _Layer(4, True)]
  step = memory_model.StepConfig('gpipe', 4, 16, 'always')
  concurrent, parts = planner.StepTime(cells, step, planner.Devices(2, 1e12))
  assert parts['bubble'] > 0
  serial, _ = planner.StepTime(cells, step,
                               planner.Devices(2, 1e12, concurrent=False))
  assert serial > concurrent
  slow = planner.Devices(2, 1e12, bandwidth_bytes_per_s=1e6, latency_s=0.01)
  with_transfers, parts = planner.StepTime(cells, step, slow)
  assert parts['transfers'] > 0 and with_transfers > concurrent


def test_a_boundary_carries_an_activation_on_and_its_gradient_back():
  cells = [_Layer(4), _Layer(4, True)]
  link = planner.Devices(2, 1e12, bandwidth_bytes_per_s=1e6, latency_s=0.01)
  one_way = 0.01 + (4 * MIB // 16) / 1e6
  for schedule in ('gpipe', '1f1b'):  # 1F1B fuses the last cell's F and B.
    step = memory_model.StepConfig(schedule, 4, 16, 'always')
    _, parts = planner.StepTime(cells, step, link)
    assert parts['transfers'] == pytest.approx(2 * 4 * one_way / 2)
    _, serial = planner.StepTime(cells, step, dataclasses.replace(
        link, concurrent=False))
    assert serial['transfers'] == pytest.approx(2 * 4 * one_way)


def _LayerSending(output_bytes):
  layer = _Layer(4)
  layer.output_bytes = layer.output_gradient_bytes = output_bytes
  return layer


def test_on_a_slow_link_the_cut_falls_where_little_crosses():
  # Four equal layers; the second hands on 64 MiB, the others 1 KiB.
  sends = [1024, 64 * MIB, 1024, 1024]
  layers = [memory_model.CellProfile([_LayerSending(b)]) for b in sends]
  last = memory_model.CellProfile([_Layer(4, True)])
  for layer, before in zip(layers[1:] + [last], sends):
    layer.by_size[4].input_bytes = before
    layer.by_size[4].input_gradient_bytes = before
  profiles = planner.LayerProfiles(layers, last)

  def Cut(devices):
    [plan] = [p for p in planner.CandidatePlans(
        profiles, devices, batch_size=4, num_partitions=[2],
        micro_batches=[1], remat_policies=['never'], schedules=['gpipe'])]
    return plan
  # Free transfers: the compute-balanced cut, through the 64 MiB.
  assert Cut(planner.Devices(2, 1e12)).layer_counts == [2, 2]
  slow = planner.Devices(2, 1e12, bandwidth_bytes_per_s=1e8)
  plan = Cut(slow)
  assert plan.layer_counts != [2, 2]
  # And it is the faster step on that link.
  balanced = [profiles.Range(0, 2, 4), profiles.Range(2, 4, 4)]
  step = memory_model.StepConfig('gpipe', 1, 4, 'never')
  assert plan.step_time_s < planner.StepTime(balanced, step, slow)[0]


def test_memory_balanced_cut_balances_the_peaks():
  step = memory_model.StepConfig('1f1b', 8, 8, 'always')
  counts, cells, peaks = planner.MemoryBalancedCut(_Profiles(), 2, step)
  assert counts == [4, 4] and len(cells) == 2
  assert max(p.peak_bytes for p in peaks) < 1.2 * min(
      p.peak_bytes for p in peaks)
  assert planner.MemoryBalancedCut(_Profiles(2), 4, step) is None


@pytest.mark.parametrize('concurrent', [True, False])
def test_remote_workers_pay_the_step_calls_and_transfer_latency(concurrent):
  cells = [_Layer(4), _Layer(4, True)]
  step = memory_model.StepConfig('gpipe', 4, 16, 'always')
  local = planner.Devices(2, 1e12, concurrent=concurrent)
  remote = planner.RemoteWorkers(local)
  local_s, _ = planner.StepTime(cells, step, local)
  remote_s, parts = planner.StepTime(cells, step, remote)
  assert parts['per step'] > 2 * plan_devices.REMOTE_STEP_FUNCTION_CALL_S
  assert parts['transfers'] > 0
  assert remote_s > local_s + parts['per step']
  # A step spanning more workers costs the controller more; a plan of two
  # cells on four workers spans two.
  more = planner.RemoteWorkers(planner.Devices(4, 1e12, concurrent=concurrent))
  _, more_parts = planner.StepTime(cells, step, more)
  assert more_parts['per step'] == parts['per step']
  _, replicated = planner.StepTime(cells, step, more, num_replicas=2)
  assert replicated['per step'] > parts['per step']
  # Workers on the controller's host send at loopback speed.
  assert remote.bandwidth_bytes_per_s is None
  assert planner.RemoteWorkers(local, same_host=True).bandwidth_bytes_per_s


def test_devices_beyond_those_computing_at_once_take_turns():
  cells = [_Layer(4), _Layer(4), _Layer(4), _Layer(4, True)]
  step = memory_model.StepConfig('gpipe', 4, 16, 'never')
  all_at_once, _ = planner.StepTime(cells, step, planner.Devices(4, 1e12))
  one_at_a_time, parts = planner.StepTime(
      cells, step, planner.Devices(4, 1e12, computing_at_once=1))
  # One at a time, a step lasts at least every action and every update.
  busy = parts['compute'] * len(cells)
  updates = sum(c.update_s for c in cells)
  assert parts['taking turns'] > 0 and parts['update'] == updates
  assert one_at_a_time >= busy + updates > all_at_once
  two, _ = planner.StepTime(cells, step,
                            planner.Devices(4, 1e12, computing_at_once=2))
  assert all_at_once < two < one_at_a_time
  # As many as there are devices: no turns to take.
  same, parts = planner.StepTime(cells, step,
                                 planner.Devices(4, 1e12, computing_at_once=4))
  assert same == all_at_once and 'taking turns' not in parts


def test_replicas_taking_turns_pay_for_every_replica():
  cells = [_Layer(4), _Layer(4, True)]
  step = memory_model.StepConfig('gpipe', 4, 16, 'never')
  one, _ = planner.StepTime(cells, step, planner.Devices(
      4, 1e12, computing_at_once=1), num_replicas=1)
  two, parts = planner.StepTime(cells, step, planner.Devices(
      4, 1e12, computing_at_once=1, latency_s=0.01), num_replicas=2)
  assert parts['gradient sum'] == 0.01
  assert two >= 2 * (one - parts['per step']) + parts['gradient sum']
