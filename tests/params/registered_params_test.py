"""Every registered experiment builds valid params and documents its command."""

import os

import pytest

from tfpipe import model_registry
from tfpipe.trainer import task as task_lib

_NAMES = model_registry.ListModels()


@pytest.mark.parametrize('name', _NAMES)
def test_params_are_valid_and_cost_model_runs(name):
  p = model_registry.GetParams(name)
  task_lib.BaseTask.CheckParams(
      p.task, {'input.batch_size': p.input.batch_size,
               'eval_input.batch_size': p.eval_input.batch_size})
  model = p.task.model.Instantiate()
  cells = task_lib.PartitionCells(p.task, model)
  assert len(cells) == p.task.pipeline.num_partitions
  devices = [f'/CPU:{i}' for i in range(len(cells))]
  micro = p.input.batch_size // p.task.pipeline.num_micro_batches
  rows = task_lib.DescribeCells(cells, devices,
                                (micro,) + tuple(model.InputShape()[1:]))
  assert all(r['layers'] for r in rows)
  assert rows[-1]['output_shape'][0] == micro
  # Text round trip, as --model_params_override and params.txt use it.
  q = model_registry.GetParams(name)
  q.FromText(p.ToText())
  assert q == p


@pytest.mark.parametrize('name', _NAMES)
def test_config_file_ends_with_its_command(name):
  module = model_registry.GetClass(name).__module__
  path = os.path.join(os.path.dirname(__file__), '..', '..',
                      *module.split('.')) + '.py'
  with open(path) as f:
    text = f.read()
  assert f'python -m tfpipe.trainer --model={name} --logdir=' in text
  last = text.rstrip().splitlines()[-1]
  assert last.startswith('#   python -m tfpipe.trainer --model=')


def test_default_model_is_the_tiny_lm():
  assert 'lm.TinyTransformerLm' in _NAMES
  p = model_registry.GetParams('lm.TinyTransformerLm')
  assert p.task.pipeline.num_partitions == 2
