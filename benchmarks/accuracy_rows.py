"""memory_model_accuracy's rows: one configuration's measured and predicted
peak per device, merged over repeated runs, and how a row is printed.

A row is what the benchmark's JSON stores and what --predict_from reads
back, so this module is plain Python: it never runs TensorFlow.
"""

import statistics

MIB = 2.0**20

HEADER = [
    '| model          | K | M | sched | remat       | measured MiB per '
    'device     | predicted MiB per device    | worst  |',
    '|----------------|---|---|-------|-------------|----------------'
    '------------|-----------------------------|--------|']

_CONFIGURATION = ('model', 'num_cells', 'num_micro_batches', 'schedule',
                  'remat_policy')


def NewRow(model, pipeline, measured_bytes, seconds):
  """One measured run's row: the configuration of `pipeline` (the task's
  pipeline params) and each device's peak, in MiB."""
  return {'model': model, 'num_cells': pipeline.num_partitions,
          'num_micro_batches': pipeline.num_micro_batches,
          'schedule': pipeline.schedule,
          'remat_policy': pipeline.remat_policy,
          'measured_mib': [round(v / MIB, 2) for v in measured_bytes],
          'seconds': round(seconds, 1)}


def Key(row):
  """The configuration a row measured."""
  return tuple(row[name] for name in _CONFIGURATION)


def AddRun(rows, run, repeats=1):
  """Appends `run` (a NewRow) to `rows`, or, with `repeats` > 1, merges it
  into the last row when that is the same configuration with fewer runs.

  A merged row keeps every run in `measured_runs`; its peaks are each
  device's median of them (one run's peaks are one draw of the allocator's
  chunks) and its seconds their sum. Returns (the row it went into, whether
  all its runs are in).
  """
  if repeats == 1:
    rows.append(run)
    return run, True
  last = rows[-1] if rows else None
  if (last is not None and Key(last) == Key(run) and
      len(last['measured_runs']) < repeats):
    last['measured_runs'].append(run['measured_mib'])
    last['measured_mib'] = [round(statistics.median(v), 2)
                            for v in zip(*last['measured_runs'])]
    last['seconds'] = round(last['seconds'] + run['seconds'], 1)
    row = last
  else:
    row = dict(run, measured_runs=[run['measured_mib']])
    rows.append(row)
  return row, len(row['measured_runs']) == repeats


def _WorstError(predicted, measured):
  return max((pr / me - 1 for pr, me in zip(predicted, measured)), key=abs)


def SetPrediction(row, peaks):
  """Adds the memory model's DevicePeaks, and the worst error against the
  row's measured peaks, to `row`.

  A row of several runs also gets `largest_error`: the worst error against
  each device's largest run, the peak a hard limit must hold (the median
  is what the model aims at; an allocator's chunks can put one run well
  above it).
  """
  predicted = [d.peak_bytes / MIB for d in peaks]
  row['predicted_mib'] = [round(v, 2) for v in predicted]
  row['predicted_at'] = [d.Describe() for d in peaks]
  row['worst_error'] = _WorstError(predicted, row['measured_mib'])
  runs = row.get('measured_runs')
  if runs and len(runs) > 1:
    row['largest_error'] = _WorstError(predicted,
                                       [max(v) for v in zip(*runs)])
  else:
    row.pop('largest_error', None)


def FormatRow(row, tolerance):
  """The row as a line of HEADER's table, marked where it misses."""
  measured = ' '.join(f'{v:6.1f}' for v in row['measured_mib'])
  predicted = ' '.join(f'{v:6.1f}' for v in row['predicted_mib'])
  flag = '' if abs(row['worst_error']) <= tolerance else '  <-- outside'
  runs = row.get('measured_runs')
  if runs and len(runs) > 1:
    spread = max(max(v) / min(v) - 1 for v in zip(*runs) if min(v) > 0)
    flag += (f'  (median of {len(runs)} runs; a device moved up to '
             f'{spread:.0%}')
    if 'largest_error' in row:
      flag += f"; against the largest {100 * row['largest_error']:+.1f}%"
    flag += ')'
  return (f"| {row['model']:<14} | {row['num_cells']} | "
          f"{row['num_micro_batches']} | {row['schedule']:<5} | "
          f"{row['remat_policy']:<11} | {measured:<27} | {predicted:<27} | "
          f"{100 * row['worst_error']:+6.1f}% |{flag}")


def Summary(rows, tolerance):
  """The count of rows within `tolerance` on every device, and, when rows
  were measured several times, the count against each device's largest
  run."""
  within = sum(abs(r['worst_error']) <= tolerance for r in rows)
  text = (f'{within} of {len(rows)} configurations within '
          f'{100 * tolerance:.0f}% on every device')
  repeated = [r for r in rows if 'largest_error' in r]
  if repeated:
    largest = sum(abs(r['largest_error']) <= tolerance for r in repeated)
    under = sum(r['largest_error'] < -tolerance for r in repeated)
    text += (f' ({largest} of {len(repeated)} against each device\'s '
             f'largest run, {under} under it)')
  return text
