"""`--mode=inspect_model`: how an experiment's model is cut across devices.

Computed from params and the layers' cost models only (nothing is built or
run), so it is cheap and shows the partitioner's balance before committing
devices to a long run.
"""

from tfpipe.trainer import task as task_lib


def _Human(value):
  for unit in ('', 'K', 'M', 'G', 'T'):
    if abs(value) < 1000:
      return f'{value:.3g}{unit}'
    value /= 1000.0
  return f'{value:.3g}P'


def ModelTable(p):
  """A text table: per cell, device, parameter count, cost and its layers."""
  tp = p.task
  model = tp.model.Instantiate()
  devices = task_lib.PipelineDevices(tp.pipeline)
  cells = task_lib.PartitionCells(tp, model)
  micro_batch = max(1, p.input.batch_size // tp.pipeline.num_micro_batches)
  input_shape = (micro_batch,) + tuple(model.InputShape()[1:])
  rows = task_lib.DescribeCells(cells, devices, input_shape)
  total_params = sum(r['params'] for r in rows)
  total_flops = sum(r['flops'] for r in rows)
  lines = [
      f'Model {p.model}: {len(rows)} cell(s), '
      f'{tp.pipeline.num_micro_batches} micro-batch(es) of {micro_batch} '
      f'examples, schedule={tp.pipeline.schedule}, '
      f'balance={tp.pipeline.balance}, remat={tp.pipeline.remat_policy}',
      f'{"cell":<8} {"device":<10} {"params":>9} {"fwd flops/mb":>13} '
      f'{"share":>6} {"out MB/mb":>9}  layers',
  ]
  for r in rows:
    share = r['flops'] / total_flops if total_flops else 0.0
    lines.append(
        f'{r["cell"]:<8} {r["device"]:<10} {r["params"]:>9,} '
        f'{_Human(r["flops"]):>13} {share:>6.1%} '
        f'{r["output_bytes"] / 2**20:>9.3f}  {", ".join(r["layers"])}')
  lines.append(f'{"total":<8} {"":<10} {total_params:>9,} '
               f'{_Human(total_flops):>13}')
  return '\n'.join(lines)
