"""Tests of `--mode=inspect_model`'s table (tfpipe.trainer.model_inspect).

Protected properties: the table shows the configuration that will run
(cells, micro-batch size, schedule, balance, remat), one row per cell with
its device and its layers in order, parameter counts that add up to the
model's, flop shares that add up to 100%, and the devices the pipeline
would really use; too many partitions fail the same way training would.
"""

import re

import pytest

from tfpipe import model_registry
from tfpipe.trainer import model_inspect

# TinyMlp: 16 -> 32 x 4 hidden -> 4 classes.
_TINY_MLP_PARAMS = (16 * 32 + 32) + 3 * (32 * 32 + 32) + (32 * 4 + 4)


def _Params(**pipeline):
  p = model_registry.GetParams('mlp.TinyMlp')
  p.task.pipeline.Set(**pipeline)
  return p


def _Rows(table):
  return [line.split() for line in table.splitlines()
          if re.match(r'cell\d', line)]


def test_table_describes_each_cell():
  p = _Params(num_partitions=2, num_micro_batches=4, balance=[2, 3])
  table = model_inspect.ModelTable(p)
  header = table.splitlines()[0]
  assert header.startswith('Model mlp.TinyMlp: 2 cell(s), 4 micro-batch(es) '
                           'of 8 examples')
  assert 'schedule=gpipe' in header and 'balance=[2, 3]' in header
  assert 'remat=always' in header
  rows = _Rows(table)
  assert [r[:2] for r in rows] == [['cell0', '/CPU:0'], ['cell1', '/CPU:1']]
  assert [' '.join(r[6:]) for r in rows] == ['fc_0, fc_1', 'fc_2, fc_3, logits']
  params = [int(r[2].replace(',', '')) for r in rows]
  assert params == [(16 * 32 + 32) + (32 * 32 + 32),
                    2 * (32 * 32 + 32) + (32 * 4 + 4)]
  assert sum(params) == _TINY_MLP_PARAMS
  shares = [float(r[4].rstrip('%')) for r in rows]
  assert sum(shares) == pytest.approx(100.0, abs=0.2)
  total = table.splitlines()[-1].split()
  assert total[0] == 'total' and total[1] == f'{_TINY_MLP_PARAMS:,}'


def test_table_shows_configured_devices_and_schedule():
  p = _Params(num_partitions=3, num_micro_batches=2, schedule='1f1b',
              devices=['/CPU:5', '/CPU:6', '/CPU:7'])
  table = model_inspect.ModelTable(p)
  assert '2 micro-batch(es) of 16 examples, schedule=1f1b' in table
  rows = _Rows(table)
  assert [r[1] for r in rows] == ['/CPU:5', '/CPU:6', '/CPU:7']
  assert sum(int(r[2].replace(',', '')) for r in rows) == _TINY_MLP_PARAMS


def test_too_many_partitions_fails_like_training():
  with pytest.raises(ValueError, match='num_partitions x num_replicas = 16 devices'):
    model_inspect.ModelTable(_Params(num_partitions=16))


@pytest.mark.parametrize('value,text', [
    (0, '0'), (999, '999'), (1234, '1.23K'), (1.5e6, '1.5M'), (2e9, '2G'),
    (3e12, '3T'), (4e15, '4P')])
def test_human_units(value, text):
  assert model_inspect._Human(value) == text  # pylint: disable=protected-access


def test_runs_of_numbered_layers_print_as_ranges():
  names = ['emb', 'pos_emb'] + [f'block_{i}' for i in range(5)] + [
      'final_ln', 'logits']
  assert model_inspect.LayerRanges(names) == (
      'emb, pos_emb, block_0..block_4, final_ln, logits')
  # Two in a row, a gap in the numbers, or another prefix stay listed.
  assert model_inspect.LayerRanges(['fc_2', 'fc_3', 'logits']) == (
      'fc_2, fc_3, logits')
  assert model_inspect.LayerRanges(['b1', 'b2', 'b4', 'b5', 'b6', 'c7']) == (
      'b1, b2, b4..b6, c7')


def _PipelineTransformer(num_partitions):
  """GPipe Table 1, Pipeline-128: 1663 blocks of d=2048, FFN 8192."""
  p = model_registry.GetParams('lm.LargeTransformerLm')
  p.task.model.Set(num_layers=1663, model_dim=2048, hidden_dim=8192,
                   num_heads=32, vocab_size=32000)
  p.task.pipeline.Set(num_partitions=num_partitions,
                      devices=['/CPU:0'] * num_partitions)
  return p


def test_gpipe_pipeline_128_transformer_at_k_128():
  table = model_inspect.ModelTable(_PipelineTransformer(128))
  rows = _Rows(table)
  assert len(rows) == 128
  assert ' '.join(rows[0][6:]) == 'emb, pos_emb, block_0..block_12'
  assert ' '.join(rows[-1][6:]).endswith('block_1662, final_ln, logits')
  # GPipe reports 83.9B parameters for this model.
  total = table.splitlines()[-1].split()
  assert total[1] == '83,877,438,720'
  shares = [float(r[4].rstrip('%')) for r in rows]
  assert max(shares) < 1.2 * 100 / 128  # Balanced by flops.


def test_equal_blocks_are_costed_once(monkeypatch):
  # What keeps inspect_model fast at any size: the cost model runs once per
  # distinct layer, not once per layer and cell.
  from tfpipe import layers  # pylint: disable=g-import-not-at-top
  calls = []
  original = layers.TransformerLayer.FPropMeta.__func__

  def Counting(cls, p, input_shape):
    calls.append(p.name)
    return original(cls, p, input_shape)
  monkeypatch.setattr(layers.TransformerLayer, 'FPropMeta',
                      classmethod(Counting))
  model_inspect.ModelTable(_PipelineTransformer(8))
  # One call for the cut (batch 1) and one for the table (a micro-batch).
  assert len(calls) == 2, len(calls)
