"""`--mode=inspect_model`: how an experiment's model is cut across devices.

Computed from params and the layers' cost models only (nothing is built or
run), so it is cheap and shows the partitioner's balance before committing
devices to a long run. Its cost grows with the number of layers, not with
K times the layers: the cut is an O(K N log N) search, equal blocks are
costed once, and a cell's run of numbered layers prints as one range
(`block_0..block_12`).
"""

import re

from tfpipe.trainer import task as task_lib


def _Human(value):
  for unit in ('', 'K', 'M', 'G', 'T'):
    if abs(value) < 1000:
      return f'{value:.3g}{unit}'
    value /= 1000.0
  return f'{value:.3g}P'


def LayerRanges(names, min_run=3):
  """Layer names, with runs of `min_run` or more numbered ones as a range.

  ['emb', 'block_0', 'block_1', 'block_2', 'logits'] gives
  'emb, block_0..block_2, logits': a cell of 200 blocks stays one line.
  """
  parts = []
  i = 0
  while i < len(names):
    m = re.fullmatch(r'(.*?)(\d+)', names[i])
    j = i + 1
    if m:
      prefix, first = m.group(1), int(m.group(2))
      while j < len(names) and names[j] == f'{prefix}{first + j - i}':
        j += 1
    if j - i >= min_run:
      parts.append(f'{names[i]}..{names[j - 1]}')
    else:
      parts.extend(names[i:j])
    i = j
  return ', '.join(parts)


# The table's columns: (header, width, how a row's dict is shown). A new
# column is one more entry.
def _Columns(total_flops):
  return [
      ('cell', -8, lambda r: r['cell']),
      ('device', -10, lambda r: r['device']),
      ('params', 9, lambda r: f'{r["params"]:,}'),
      ('fwd flops/mb', 13, lambda r: _Human(r['flops'])),
      ('share', 6, lambda r: f'{r["flops"] / (total_flops or 1.0):.1%}'),
      ('out MB/mb', 9, lambda r: f'{r["output_bytes"] / 2**20:.3f}'),
  ]


def _Cells(columns, values):
  return ' '.join(f'{v:<{-w}}' if w < 0 else f'{v:>{w}}'
                  for (_, w, _), v in zip(columns, values))


def ModelTable(p, cells=None):
  """A text table: per cell, device, parameter count, cost and its layers.

  Args:
    p: the experiment params.
    cells: the cells' params if already cut (task.PartitionCells), so the
      trainer cuts the model once.
  """
  tp = p.task
  model = tp.model.Instantiate()
  devices = task_lib.PipelineDevices(tp.pipeline)
  if cells is None:
    cells = task_lib.PartitionCells(tp, model)
  micro_batch = max(1, p.input.batch_size // tp.pipeline.num_micro_batches)
  input_shape = (micro_batch,) + tuple(model.InputShape()[1:])
  rows = task_lib.DescribeCells(cells, devices, input_shape)
  total_params = sum(r['params'] for r in rows)
  total_flops = sum(r['flops'] for r in rows)
  columns = _Columns(total_flops)
  lines = [
      f'Model {p.model}: {len(rows)} cell(s), '
      f'{tp.pipeline.num_micro_batches} micro-batch(es) of {micro_batch} '
      f'examples, schedule={tp.pipeline.schedule}, '
      f'balance={tp.pipeline.balance}, remat={tp.pipeline.remat_policy}',
      _Cells(columns, [c[0] for c in columns]) + '  layers',
  ]
  for r in rows:
    lines.append(_Cells(columns, [show(r) for _, _, show in columns]) +
                 '  ' + LayerRanges(r['layers']))
  totals = {'cell': 'total', 'device': '', 'params': f'{total_params:,}',
            'fwd flops/mb': _Human(total_flops)}
  lines.append(_Cells(columns[:4], [totals[c[0]] for c in columns[:4]]))
  return '\n'.join(lines)
