"""The cost model's shape helpers, cost sums and measured default cost."""

import pytest
import tensorflow as tf

from tfpipe import cost_model
from tfpipe import layers


def test_shape_helpers_on_nested_shapes():
  nested = {'a': (None, 3), 'b': [(2,), (4, 5)]}
  assert cost_model.LeafShapes(nested) == [(None, 3), (2,), (4, 5)]
  assert cost_model.LeafShapes(tf.TensorShape([2, 3])) == [(2, 3)]
  assert cost_model.NumElements(nested, batch_size=2) == 6 + 2 + 20
  assert cost_model.NumElements((None, 3)) == 3
  assert cost_model.NumElements(()) == 1
  doubled = cost_model.MapShapes(lambda s: s + (2,), nested)
  assert doubled == {'a': (None, 3, 2), 'b': [(2, 2), (4, 5, 2)]}
  assert isinstance(doubled['b'], list)
  pair = cost_model.MapShapes(lambda s: s[1:], ((1, 2), (3, 4)))
  assert pair == ((2,), (4,))
  with pytest.raises(TypeError, match='Not a shape'):
    cost_model.MapShapes(lambda s: s, {'a': 'oops'})
  assert cost_model.BatchDim(nested) is None
  assert cost_model.BatchDim([(8, 3), (9,)]) == 8
  assert cost_model.BatchDim(()) is None


def test_sum_costs():
  total = cost_model.SumCosts([
      cost_model.CostMeta((None, 4), 10.0, 3, 8.0),
      cost_model.CostMeta((None, 2), 5.0, 1, 4.0)])
  assert total == cost_model.CostMeta((None, 2), 15.0, 4, 12.0)
  assert cost_model.SumCosts([]).output_shape is None


def test_measured_cost_of_a_dense_layer():
  layer = layers.FCLayer.Params().Set(name='fc', input_dims=4,
                                      output_dims=3).Instantiate()
  cost = cost_model.MeasuredCost(layer, (8, 4))
  assert cost.num_params == 4 * 3 + 3
  assert cost.output_shape == (8, 3)
  assert cost.flops == pytest.approx(2.0 * 15 * 8 * 4 / 4)
  assert cost.activation_bytes == 4.0 * 8 * 3
