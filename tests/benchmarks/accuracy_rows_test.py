"""benchmarks/accuracy_rows.py: a configuration's row, merged over runs."""

import types

import pytest

from benchmarks import accuracy_rows

MIB = accuracy_rows.MIB


def _Run(peaks_mib, micro_batches=4, seconds=10.0):
  pipeline = types.SimpleNamespace(num_partitions=2,
                                   num_micro_batches=micro_batches,
                                   schedule='1f1b', remat_policy='always')
  return accuracy_rows.NewRow('mlp', pipeline, [v * MIB for v in peaks_mib],
                              seconds)


class _Peak:

  def __init__(self, mib):
    self.peak_bytes = mib * MIB

  def Describe(self):
    return f'{self.peak_bytes / MIB:.1f} MiB at F0.0'


def test_one_run_is_its_own_row():
  rows = []
  row, complete = accuracy_rows.AddRun(rows, _Run([10.0, 20.0]))
  assert complete and rows == [row] and 'measured_runs' not in row
  assert row['measured_mib'] == [10.0, 20.0] and row['num_cells'] == 2


def test_repeated_runs_make_one_row_of_each_devices_median():
  rows = []
  results = [accuracy_rows.AddRun(rows, _Run(peaks), repeats=3)
             for peaks in ([10.0, 30.0], [14.0, 20.0], [11.0, 26.0])]
  assert [complete for _, complete in results] == [False, False, True]
  [row] = rows
  assert row['measured_runs'] == [[10.0, 30.0], [14.0, 20.0], [11.0, 26.0]]
  assert row['measured_mib'] == [11.0, 26.0]
  assert row['seconds'] == 30.0
  # The next configuration, or the same one once complete, starts a row.
  accuracy_rows.AddRun(rows, _Run([1.0, 2.0], micro_batches=8), repeats=3)
  accuracy_rows.AddRun(rows, _Run([1.0, 2.0], micro_batches=8), repeats=3)
  accuracy_rows.AddRun(rows, _Run([1.0, 2.0], micro_batches=8), repeats=3)
  accuracy_rows.AddRun(rows, _Run([3.0, 4.0], micro_batches=8), repeats=3)
  assert [len(r['measured_runs']) for r in rows] == [3, 3, 1]


def test_the_worst_error_is_against_the_measured_peaks_and_is_flagged():
  row = _Run([10.0, 20.0])
  accuracy_rows.SetPrediction(row, [_Peak(10.5), _Peak(16.0)])
  assert row['predicted_mib'] == [10.5, 16.0]
  assert row['worst_error'] == pytest.approx(-0.2)
  assert row['predicted_at'][1] == '16.0 MiB at F0.0'
  line = accuracy_rows.FormatRow(row, tolerance=0.15)
  assert line.startswith('| mlp ') and '-20.0% |  <-- outside' in line
  assert '<-- outside' not in accuracy_rows.FormatRow(row, tolerance=0.25)


def test_a_merged_row_says_how_far_its_devices_moved():
  rows = []
  for peaks in ([10.0, 20.0], [12.0, 20.0]):
    row, _ = accuracy_rows.AddRun(rows, _Run(peaks), repeats=2)
  accuracy_rows.SetPrediction(row, [_Peak(11.0), _Peak(20.0)])
  assert row['measured_mib'] == [11.0, 20.0]
  assert row['worst_error'] == pytest.approx(0.0)
  assert accuracy_rows.FormatRow(row, 0.15).endswith(
      '(median of 2 runs; a device moved up to 20%)')
