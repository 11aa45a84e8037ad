"""Tests of gpipe.memory_model: each device's peak from its action list.

Protected properties, on synthetic cells with round numbers: the resident
part is variables, accumulators and slots; GPipe without remat keeps every
micro-batch's activations at once and 1F1B only K-k of them (so its first
device needs the most); remat keeps the inputs only and pays the recompute
in B's working set; the last cell's fused F+B keeps nothing; an input
gradient measured within a backward is not counted twice, and a received
input that no backward reads is not kept; inputs and gradients received
ahead of their actions are counted; the peak's breakdown adds up; profiles interpolate affinely between sizes;
several processes' profiles of a cell give each quantity's median; and a
schedule the walk does not model is refused by name.
"""

import dataclasses

import pytest

from tfpipe.gpipe import memory_model
from tfpipe.gpipe import schedule as schedule_lib

MIB = 2**20


def _Cell(n, is_last=False, variables=MIB):
  """A cell whose activations are n MiB per kept micro-batch, etc."""
  return memory_model.CellMemory(
      micro_batch_size=n, variable_bytes=variables,
      optimizer_bytes=2 * variables, input_bytes=n * MIB // 8,
      input_gradient_bytes=n * MIB // 8, output_bytes=n * MIB // 8,
      output_gradient_bytes=n * MIB // 8,
      kept={'always': 0, 'never': n * MIB},
      forward_peak={'always': n * MIB // 2, 'never': n * MIB},
      backward_peak={'always': 2 * n * MIB, 'never': n * MIB},
      fused_peak=2 * n * MIB, update_peak=MIB, is_last=is_last)


def _Profiles(num_cells, sizes=(1, 8)):
  return [memory_model.CellProfile([_Cell(n, k == num_cells - 1)
                                    for n in sizes])
          for k in range(num_cells)]


def _Peaks(num_cells, schedule, m, remat, batch=16):
  return memory_model.PredictPeaks(
      _Profiles(num_cells),
      memory_model.StepConfig(schedule, m, batch, remat))


def test_resident_part_is_variables_accumulators_and_slots():
  peak = _Peaks(1, 'gpipe', 2, 'always')[0]
  assert (peak.variable_bytes, peak.accumulator_bytes,
          peak.optimizer_bytes) == (MIB, MIB, 2 * MIB)
  assert peak.gradient_bytes == 0


def test_one_micro_batch_has_no_accumulators_and_keeps_each_gradient():
  # accumulators.ONLY: a B's weight gradients are its working set's, then
  # live until the update; no buffer exists.
  peak = _Peaks(1, 'gpipe', 1, 'always')[0]
  assert peak.accumulator_bytes == 0
  # One cell: F and B run as one call, whose working set is the largest.
  assert peak.action == 'F0.0'
  assert peak.peak_bytes == 3 * MIB + 2 * 16 * MIB
  first, second = _Peaks(2, 'gpipe', 1, 'never')
  assert first.action == 'B0.0' and first.gradient_bytes == 0
  # Resident, F0.0's kept activations, then B's working set and the
  # gradient it received; no accumulators.
  assert first.peak_bytes == 3 * MIB + 16 * MIB + 16 * MIB + 16 * MIB // 8
  # The update: the resident part, every gradient and its working set.
  small = [memory_model.CellProfile([
      dataclasses.replace(_Cell(n, k == 1), backward_peak={'never': 0},
                          fused_peak=0, forward_peak={'never': 0},
                          kept={'never': 0}, input_bytes=0, output_bytes=0,
                          input_gradient_bytes=0, output_gradient_bytes=0,
                          update_peak=3 * MIB)
      for n in (1, 8)]) for k in range(2)]
  update = memory_model.PredictPeaks(
      small, memory_model.StepConfig('gpipe', 1, 16, 'never'))[0]
  assert update.action == 'update'
  assert update.gradient_bytes == MIB
  assert update.peak_bytes == 3 * MIB + MIB + 3 * MIB


def test_gpipe_without_remat_keeps_every_micro_batch():
  peaks = _Peaks(2, 'gpipe', 4, 'never')  # n = 4 per micro-batch.
  first = peaks[0]
  assert first.in_flight == 4
  assert first.kept_bytes == 4 * 4 * MIB
  assert first.action == 'B3.0'


def test_1f1b_keeps_k_minus_k_micro_batches():
  peaks = _Peaks(4, '1f1b', 8, 'never')  # n = 2.
  in_flight = [p.in_flight for p in peaks]
  sched = schedule_lib.OneFOneBSchedule(4, 8)
  # The walk's peak is at a B, after which one micro-batch is freed.
  assert in_flight[:3] == [m for m in schedule_lib.MaxInFlight(sched)][:3]
  assert peaks[0].peak_bytes > peaks[1].peak_bytes > peaks[2].peak_bytes
  assert max(p.peak_bytes for p in peaks) < max(
      p.peak_bytes for p in _Peaks(4, 'gpipe', 8, 'never'))


def test_remat_keeps_inputs_and_pays_the_recompute_in_backward():
  never = _Peaks(2, 'gpipe', 4, 'never')[0]
  always = _Peaks(2, 'gpipe', 4, 'always')[0]
  assert always.kept_bytes < never.kept_bytes
  assert always.kept_bytes == 0  # Cell 0's inputs are the batch's slices.
  # The recompute's B, and the output gradient it received.
  assert always.transient_bytes == 2 * 4 * MIB + 4 * MIB // 8
  device1 = _Peaks(2, 'gpipe', 4, 'always')[1]
  # Cell 1 keeps its received inputs (n/8 MiB each) until its B.
  assert device1.kept_bytes <= 4 * (4 * MIB // 8)


def test_an_input_gradient_profiled_in_the_backward_is_not_added_again():
  """A cell that is not first hands back its input gradient. Profiled
  computing it, B's working set holds it where it is made; a profile
  without it (a first cell's, an older one) gets its bytes added."""
  def Device1(included):
    cells = [memory_model.CellProfile([dataclasses.replace(
        _Cell(n, k == 2), includes_input_gradient=included and k > 0)
                                       for n in (1, 8)]) for k in range(3)]
    assert cells[1].At(4).includes_input_gradient == included
    return memory_model.PredictPeaks(
        cells, memory_model.StepConfig('gpipe', 1, 16, 'always'))[1]
  without, within = Device1(False), Device1(True)
  assert without.action == within.action == 'B0.1'
  # The received gradient and B's working set; the input gradient (16/8
  # MiB at n=16) only when the profile did not measure it.
  assert within.transient_bytes == 2 * MIB + 2 * 16 * MIB
  assert without.transient_bytes == within.transient_bytes + 2 * MIB


def test_a_received_input_that_no_backward_reads_is_freed():
  """Without remat, a forward keeps its input only if its record holds
  it (kept_input); re-materialized, always. A profile that did not say
  (kept_input empty) keeps it all."""
  def Device1(remat, kept_input):
    cells = [memory_model.CellProfile([dataclasses.replace(
        _Cell(n, k == 2), kept_input=kept_input(n)) for n in (1, 8)])
             for k in range(3)]
    return memory_model.PredictPeaks(
        cells, memory_model.StepConfig('gpipe', 4, 16, remat))[1]
  held = lambda n: {'always': n * MIB // 8, 'never': n * MIB // 8}
  freed = lambda n: {'always': n * MIB // 8, 'never': 0}
  unknown = lambda n: {}
  # n = 4: each input is 0.5 MiB; four micro-batches in flight at B3.1.
  assert Device1('never', held).kept_bytes == 4 * (4 * MIB + MIB // 2)
  assert Device1('never', unknown).kept_bytes == 4 * (4 * MIB + MIB // 2)
  assert Device1('never', freed).kept_bytes == 4 * 4 * MIB
  assert Device1('always', freed).kept_bytes == Device1(
      'always', held).kept_bytes == 4 * (MIB // 2)


def test_except_last_keeps_only_the_last_micro_batch():
  peaks = _Peaks(3, 'gpipe', 4, 'except_last')
  assert peaks[0].kept_bytes <= 4 * MIB + 3 * (4 * MIB // 8)


def test_breakdown_adds_up_and_reads_well():
  for peak in _Peaks(3, '1f1b', 4, 'never'):
    parts = (peak.variable_bytes + peak.accumulator_bytes +
             peak.optimizer_bytes + peak.other_bytes + peak.slack_bytes +
             peak.batch_bytes + peak.gradient_bytes + peak.kept_bytes +
             peak.ahead_bytes + peak.transient_bytes)
    assert parts == pytest.approx(peak.peak_bytes)
    assert peak.Describe().startswith(f'{peak.peak_bytes / MIB:.1f} MiB at ')
  lines = memory_model.PeakTable(_Peaks(2, 'gpipe', 1, 'never'),
                                 budget_bytes=30 * MIB)
  assert 'does not fit' in lines[0] and 'cell 0' in lines[0]


def test_the_allocator_slack_is_held_for_the_whole_step():
  """A fresh device's build can hold more than its tensors (the allocator
  slack, allocator_slack.BuildSlack): it raises every moment of the step,
  so every device's peak, by exactly its cells' slack, and is named."""
  step = memory_model.StepConfig('1f1b', 4, 16, 'always')
  without = memory_model.PredictPeaks(_Profiles(2), step)
  profiles = [memory_model.CellProfile([
      dataclasses.replace(_Cell(n, k == 1), allocator_slack_bytes=3 * MIB)
      for n in (1, 8)]) for k in range(2)]
  with_slack = memory_model.PredictPeaks(profiles, step)
  for a, b in zip(without, with_slack):
    assert b.peak_bytes - a.peak_bytes == 3 * MIB
    assert b.slack_bytes == 3 * MIB and 'allocator slack 3.0' in b.Describe()
  # Not a per-micro-batch part: interpolated sizes keep it.
  assert profiles[0].At(4).allocator_slack_bytes == 3 * MIB


def test_profiles_interpolate_affinely_and_keep_resident_fields():
  profile = memory_model.CellProfile([_Cell(2), _Cell(10)])
  middle = profile.At(6)
  assert middle.kept['never'] == pytest.approx(6 * MIB)
  assert middle.variable_bytes == MIB
  assert profile.At(20).kept['never'] == pytest.approx(20 * MIB)
  assert profile.At(1).forward_peak['always'] == pytest.approx(MIB / 2)
  restored = memory_model.CellProfile.FromDict(profile.ToDict())
  assert restored.At(6) == middle


def test_the_median_profile_takes_each_quantity_apart():
  """Each field's median over the profiles, at every size: one process's
  high backward and another's high forward do not make one high cell."""
  def Run(forward, backward, kept):
    cells = [_Cell(n) for n in (1, 8)]
    for cell in cells:
      cell.forward_peak['always'] = forward * MIB
      cell.backward_peak['never'] = backward * MIB
      cell.kept['never'] = kept * cell.micro_batch_size * MIB
    return memory_model.CellProfile(cells)

  median = memory_model.MedianProfile(
      [Run(9, 1, 3), Run(1, 2, 1), Run(2, 9, 2)])
  assert median.sizes == [1, 8]
  at8 = median.At(8)
  assert at8.forward_peak == {'always': 2 * MIB, 'never': 8 * MIB}
  assert at8.backward_peak == {'always': 16 * MIB, 'never': 2 * MIB}
  assert at8.kept['never'] == 16 * MIB
  assert at8.variable_bytes == MIB and not at8.is_last
  only = Run(1, 1, 1)
  assert memory_model.MedianProfile([only]) is only


def test_uneven_micro_batches_and_bad_settings():
  assert memory_model.MicroBatchSizes(10, 4) == [3, 3, 2, 2]
  with pytest.raises(ValueError, match="schedule='zb_h1'"):
    _Peaks(2, 'zb_h1', 4, 'always')
  with pytest.raises(ValueError, match='batch_size=2 is smaller'):
    _Peaks(2, 'gpipe', 4, 'always', batch=2)


def test_interleaved_placement_sums_a_devices_cells():
  step = memory_model.StepConfig('interleaved_1f1b', 4, 8, 'always',
                                 device_of_cell=[0, 1, 0, 1])
  peaks = memory_model.PredictPeaks(_Profiles(4), step)
  assert [p.cells for p in peaks] == [[0, 2], [1, 3]]
  assert peaks[0].variable_bytes == 2 * MIB


def _PerAction(count, schedule, m, device, num_cells=2, n=4):
  """The device's action names, and `count`'s bytes at each of them in
  tensors of n/8 MiB (a boundary tensor of _Cell(n))."""
  step = memory_model.StepConfig(schedule, m, n * m, 'always')
  sched = memory_model.MakeSchedule(step, num_cells)
  cells = _Profiles(num_cells)
  per_action = count(sched, device, lambda k, size: cells[k].At(size),
                     [n] * m)
  return [str(a) for a in sched.device_actions[device]], [
      x / (n * MIB // 8) for x in per_action]


def _Ahead(*args):
  return _PerAction(memory_model._ReceivedAhead, *args)  # pylint: disable=protected-access


def test_inputs_are_received_ahead_of_their_forward_as_the_order_allows():
  """One graph's receives pull each activation as soon as it is made, so a
  device can hold the inputs of forwards still to come: each counts from
  the first of its actions that the schedule does not order before the
  producer's forward (in inputs of 0.5 MiB here)."""
  # GPipe: nothing on device 1 precedes device 0's forwards, so every later
  # micro-batch's input may be there at F0.1 already.
  names, ahead = _Ahead('gpipe', 4, 1)
  assert names[:4] == ['F0.1', 'F1.1', 'F2.1', 'F3.1']
  assert ahead == [3, 2, 1, 0, 0, 0, 0, 0]
  # 1F1B: F2.0 comes after B0.0, which waits for B0.1 (device 1's second
  # action), so micro-batch 2's input may arrive from the third on.
  names, ahead = _Ahead('1f1b', 4, 1)
  assert names == ['F0.1', 'B0.1', 'F1.1', 'B1.1', 'F2.1', 'B2.1', 'F3.1',
                   'B3.1']
  assert ahead == [1, 1, 1, 1, 1, 1, 0, 0]
  # One micro-batch has no input ahead.
  assert _Ahead('gpipe', 1, 1)[1] == [0, 0]


def test_a_gradient_is_received_during_the_action_before_its_backward():
  """The neighbour's backward hands the gradient on as soon as it is made,
  so the device may hold it while it runs the action before the backward
  that reads it (the schedule permitting): counted there, and only there
  (counting every gradient the schedule allows over-predicted GPipe's
  first devices; benchmarks/RESULTS.md)."""
  names, ahead = _Ahead('1f1b', 4, 0)
  assert names == ['F0.0', 'F1.0', 'B0.0', 'F2.0', 'B1.0', 'F3.0', 'B2.0',
                   'B3.0']
  assert ahead == [0, 1, 0, 1, 0, 1, 1, 0]
  # GPipe: during each backward but the last, the next one's gradient.
  names, ahead = _Ahead('gpipe', 4, 0)
  assert names[3:5] == ['F3.0', 'B3.0']
  assert ahead == [0, 0, 0, 0, 1, 1, 1, 0]
  # Not during F3.0: B3.1, which makes B3.0's gradient, follows it. So one
  # micro-batch has none ahead; nor does the last device (its backward
  # starts from the loss).
  assert _Ahead('gpipe', 1, 0)[1] == [0, 0]
  assert _Ahead('gpipe', 4, 1)[1][4:] == [0, 0, 0, 0]


def _HeldToSend(*args):
  return _PerAction(memory_model._HeldToSend, *args)  # pylint: disable=protected-access


def test_a_sender_holds_a_gradient_until_its_taker_is_due():
  """The runtime sends a gradient on only once its taker has ended the
  action before the one before its backward (dispatch.HandOver), so the
  sender holds it through its later actions that the schedule does not
  order after that one (in input gradients of 0.5 MiB here)."""
  # GPipe: B1.1's gradient waits for B3.0, which B0.1 need not follow.
  names, held = _HeldToSend('gpipe', 4, 1)
  assert names[4:] == ['B3.1', 'B2.1', 'B1.1', 'B0.1']
  assert held == [0, 0, 0, 0, 0, 0, 0, 1]
  # 1F1B: each later forward of device 1 follows its taker's due action.
  assert _HeldToSend('1f1b', 4, 1)[1] == [0] * 8
  # The first device sends nothing; nor does one micro-batch.
  assert _HeldToSend('gpipe', 4, 0)[1] == [0] * 8
  assert _HeldToSend('gpipe', 1, 1)[1] == [0, 0]


def test_a_peak_holds_the_inputs_received_ahead_of_it():
  """1F1B on two devices: the last device runs each micro-batch as one
  fused call, and while it does, the next micro-batch's 4 MiB input may
  already be there (every call but the last)."""
  cells = [memory_model.CellProfile([dataclasses.replace(
      _Cell(4, k == 1), input_bytes=4 * MIB, fused_peak=MIB,
      includes_input_gradient=k > 0)])
           for k in range(2)]
  step = memory_model.StepConfig('1f1b', 4, 16, 'always')
  last = memory_model.PredictPeaks(cells, step)[1]
  resident = 2 * MIB + 2 * MIB  # Variables, accumulators, Adam's slots.
  assert last.peak_bytes == resident + 4 * MIB + MIB + 4 * MIB
  assert last.ahead_bytes == 4 * MIB and last.action == 'F0.1'
  assert 'received ahead 4.0' in last.Describe()
