"""Partitioning: flattening, optimal contiguous cuts, each balance method."""

import itertools

import keras
import numpy as np
import pytest

from tfpipe import layers
from tfpipe.gpipe import cell as cell_lib
from tfpipe.gpipe import partition


def _BruteForceBest(costs, k):
  best = float('inf')
  n = len(costs)
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0,) + cuts + (n,)
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    best = min(best, worst)
  return best


@pytest.mark.parametrize('seed', range(6))
@pytest.mark.parametrize('k', [1, 2, 3, 4])
def test_block_partition_is_optimal(seed, k):
  rng = np.random.default_rng(seed)
  costs = list(rng.integers(1, 20, size=9).astype(float))
  sizes = partition.BlockPartition(costs, k)
  assert len(sizes) == k and sum(sizes) == 9 and min(sizes) >= 1
  bounds = np.cumsum([0] + sizes)
  worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
  assert worst == pytest.approx(_BruteForceBest(costs, k))


def _QuadraticBlockPartition(costs, k):
  """The O(K N^2) dynamic program, scanning every cut: the reference."""
  n = len(costs)
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  best = np.full((k + 1, n + 1), np.inf)
  cut = np.zeros((k + 1, n + 1), np.int64)
  best[0][0] = 0.0
  for j in range(1, k + 1):
    for i in range(j, n - (k - j) + 1):
      for s in range(j - 1, i):
        value = max(best[j - 1][s], prefix[i] - prefix[s])
        if value < best[j][i]:
          best[j][i], cut[j][i] = value, s
  sizes, i = [], n
  for j in range(k, 0, -1):
    sizes.append(int(i - cut[j][i]))
    i = cut[j][i]
  return sizes[::-1]


@pytest.mark.parametrize('seed', range(40))
def test_block_partition_takes_the_quadratic_programs_cut(seed):
  # Small integer costs with zeros give many ties: the fast search must
  # break them as the full scan does (earliest cut points).
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 30))
  costs = list(rng.integers(0, 4, size=n).astype(float))
  for k in sorted({min(k, n) for k in (1, 2, 3, n // 2 or 1, n)}):
    assert partition.BlockPartition(costs, k) == _QuadraticBlockPartition(
        costs, k), (costs, k)


def test_block_partition_of_a_1663_layer_model_into_128_cells():
  # GPipe's Pipeline-128 Transformer: embeddings, 1663 equal blocks, softmax.
  costs = [5.0, 1.0] + [3.0] * 1663 + [0.1, 7.0]
  sizes = partition.BlockPartition(costs, 128)
  assert len(sizes) == 128 and sum(sizes) == len(costs) and min(sizes) >= 1
  bounds = np.cumsum([0] + sizes)
  worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
  # 13 blocks a cell (39) leave 4 blocks over (the ends hold 11 and 10), so
  # the optimum has cells of 14 blocks.
  assert worst == 42.0


def test_block_partition_errors():
  with pytest.raises(ValueError, match='num_partitions=4'):
    partition.BlockPartition([1.0, 2.0], 4)
  with pytest.raises(ValueError, match='num_partitions=0'):
    partition.BlockPartition([1.0, 2.0], 0)
  with pytest.raises(ValueError, match='>= 0'):
    partition.BlockPartition([1.0, -2.0], 1)


def _Fc(name, i, o):
  return layers.FCLayer.Params().Set(name=name, input_dims=i, output_dims=o)


def test_flatten_nested_sequential_layers():
  inner = layers.SequentialLayer.Params().Set(
      name='inner', sub=[_Fc('b', 4, 4), _Fc('c', 4, 4)])
  outer = layers.SequentialLayer.Params().Set(
      name='outer', sub=[_Fc('a', 4, 4), inner])
  flat = partition.FlattenSequentialLayers([outer, _Fc('d', 4, 4)])
  assert [p.name for p in flat] == ['a', 'b', 'c', 'd']


def test_balance_by_params_puts_the_big_layer_alone():
  params = [_Fc('small0', 4, 4), _Fc('small1', 4, 4), _Fc('big', 4, 256),
            _Fc('small2', 256, 4)]
  cells = partition.PartitionSequentialLayers(params, 3, balance='params')
  assert [[p.name for p in c.sub] for c in cells] == [
      ['small0', 'small1'], ['big'], ['small2']]
  assert all(c.target_cls is cell_lib.FeatureExtractionLayer for c in cells)
  assert [c.name for c in cells] == ['cell0', 'cell1', 'cell2']


def test_balance_by_flops_sees_spatial_cost_params_do_not():
  # Same parameter count, but the first conv runs on a 4x larger image.
  conv = lambda n, s: layers.Conv2DLayer.Params().Set(
      name=n, filter_shape=(3, 3, 4, 4), filter_stride=(s, s))
  params = [conv('c0', 1), conv('c1', 2), conv('c2', 1), conv('c3', 1)]
  by_flops = partition.PartitionSequentialLayers(
      params, 2, balance='flops', input_shape=(None, 16, 16, 4))
  assert [len(c.sub) for c in by_flops] == [1, 3]
  by_params = partition.PartitionSequentialLayers(params, 2, balance='params',
                                                  input_shape=(None, 16, 16, 4))
  assert [len(c.sub) for c in by_params] == [2, 2]


def test_balance_by_memory_uses_activation_size():
  params = [_Fc('wide', 8, 512), _Fc('narrow0', 512, 8), _Fc('narrow1', 8, 8),
            _Fc('narrow2', 8, 8)]
  costs = partition.ComputeCosts(params, 'memory', input_shape=(32, 8))
  assert costs[0] > costs[2] and costs[0] > costs[3]
  cells = partition.PartitionSequentialLayers(params, 2, balance='memory',
                                              input_shape=(32, 8))
  assert sum(len(c.sub) for c in cells) == 4


def test_balance_by_time_profiles_each_layer():
  params = [_Fc('tiny', 32, 32), _Fc('huge', 32, 2048), _Fc('back', 2048, 32),
            _Fc('tiny2', 32, 32)]
  times = partition.ProfileLayerTimes(params, (64, 32), repeats=3)
  assert len(times) == 4 and all(t > 0 for t in times)
  cells = partition.PartitionSequentialLayers(params, 2, balance='time',
                                              input_shape=(64, 32))
  assert sum(len(c.sub) for c in cells) == 4


def test_balance_by_time_profiles_an_embedding_and_the_softmax_tied_to_it():
  """The embedding's gradient is sparse; the softmax reads its table."""
  params = [layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=11,
                                               embedding_dim=8),
            _Fc('mid', 8, 8),
            layers.FCLayer.Params().Set(name='softmax', input_dims=8,
                                        output_dims=11, tied_embedding='emb')]
  times = partition.ProfileLayerTimes(params, (4, 5), input_dtype='int32',
                                      repeats=1)
  assert len(times) == 3 and all(t > 0 for t in times)


def test_explicit_balance_and_its_errors():
  params = [_Fc(f'l{i}', 4, 4) for i in range(5)]
  cells = partition.PartitionSequentialLayers(params, 2, balance=[1, 4])
  assert [len(c.sub) for c in cells] == [1, 4]
  with pytest.raises(ValueError, match=r'balance=\[2, 2\]'):
    partition.PartitionSequentialLayers(params, 2, balance=[2, 2])
  with pytest.raises(ValueError, match="balance='speed'"):
    partition.PartitionSequentialLayers(params, 2, balance='speed',
                                        input_shape=(1, 4))
  with pytest.raises(ValueError, match='input_shape'):
    partition.PartitionSequentialLayers(params, 2, balance='flops')
  with pytest.raises(ValueError, match='empty'):
    partition.PartitionSequentialLayers([], 2)


def test_keras_layers_are_costed_through_the_wrapper():
  params = [layers.KerasLayer.Params().Set(
      name='dense', cls=keras.layers.Dense, args=dict(units=16)),
            _Fc('fc', 16, 4)]
  metas = partition.LayerCosts(params, (None, 8))
  assert metas[0].output_shape == (None, 16)
  assert metas[0].num_params == 8 * 16 + 16
