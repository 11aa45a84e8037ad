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
  # Against each device's largest run (12.0 and 20.0): 11.0 is 8.3% under.
  assert row['largest_error'] == pytest.approx(11.0 / 12.0 - 1)
  assert accuracy_rows.FormatRow(row, 0.15).endswith(
      '(median of 2 runs; a device moved up to 20%; against the largest '
      '-8.3%)')


def test_one_run_has_no_largest_error():
  row = _Run([10.0, 20.0])
  row['largest_error'] = 0.5  # From an earlier prediction of the row.
  accuracy_rows.SetPrediction(row, [_Peak(10.0), _Peak(20.0)])
  assert 'largest_error' not in row
  assert accuracy_rows.Summary([row], 0.15) == (
      '1 of 1 configurations within 15% on every device')


def test_the_summary_counts_rows_against_their_largest_run():
  rows = []
  # Within 15% of the medians (11.0 / 20.0) but 25% under the largest
  # first device (16.0): a hard limit set from the prediction is exceeded.
  for peaks in ([10.0, 20.0], [11.0, 20.0], [16.0, 20.0]):
    row, _ = accuracy_rows.AddRun(rows, _Run(peaks), repeats=3)
  accuracy_rows.SetPrediction(row, [_Peak(12.0), _Peak(20.0)])
  assert row['worst_error'] == pytest.approx(12.0 / 11.0 - 1)
  assert row['largest_error'] == pytest.approx(-0.25)
  # A second configuration, within 15% of both.
  for peaks in ([10.0, 20.0], [10.0, 20.0], [10.5, 21.0]):
    other, _ = accuracy_rows.AddRun(rows, _Run(peaks, micro_batches=8),
                                    repeats=3)
  accuracy_rows.SetPrediction(other, [_Peak(10.0), _Peak(20.0)])
  assert accuracy_rows.Summary(rows, 0.15) == (
      "2 of 2 configurations within 15% on every device (1 of 2 against "
      "each device's largest run, 1 under it)")
  assert accuracy_rows.Summary(rows, 0.30).startswith(
      "2 of 2 configurations within 30% on every device (2 of 2 against")
