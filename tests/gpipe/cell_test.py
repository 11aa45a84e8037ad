"""Tests of FeatureExtractionLayer, the pipeline cell.

Protected properties: a cell is a SequentialLayer (same params, same
computation, flattened by the partitioner); building it under a device
scope puts every variable there, including those of lazily-built Keras
layers; its cost model is the chained sum of its children's; and its
sub-layers are saved by `tf.train.Checkpoint`.
"""

import keras
import numpy as np
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import layers
from tfpipe.gpipe import cell as cell_lib
from tfpipe.gpipe import partition


def _Fc(name, i, o):
  return layers.FCLayer.Params().Set(name=name, input_dims=i, output_dims=o,
                                     random_seed=7)


def _Dense(name, units):
  return layers.KerasLayer.Params().Set(
      name=name, cls=keras.layers.Dense, args=dict(units=units))


def _Cell(sub):
  return cell_lib.FeatureExtractionLayer.Params().Set(name='cell', sub=sub)


def test_cell_is_a_sequential_layer():
  assert issubclass(cell_lib.FeatureExtractionLayer, layers.SequentialLayer)
  p = _Cell([_Fc('a', 4, 8), _Fc('b', 8, 3)])
  assert 'sub' in p and p.target_cls is cell_lib.FeatureExtractionLayer
  cell = p.Instantiate()
  seq = layers.SequentialLayer.Params().Set(name='seq', sub=p.sub).Instantiate()
  x = tf.constant(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
  np.testing.assert_allclose(cell(x).numpy(), seq(x).numpy(), rtol=1e-6)
  assert [c.name for c in cell.sub] == ['a', 'b']


def test_building_under_a_device_scope_places_lazy_keras_layers_there():
  cell = _Cell([_Dense('d0', 8), _Dense('d1', 3)]).Instantiate()
  assert not cell.weights  # Keras layers build lazily ...
  with tf.device('/CPU:2'):
    cell.build((None, 4))  # ... so the cell builds them in its device scope.
  assert len(cell.weights) == 4
  for v in cell.weights:
    assert v.value.device.endswith('CPU:2'), (v.path, v.value.device)
  with tf.device('/CPU:5'):  # A call elsewhere does not move them.
    out = cell(tf.ones([2, 4]))
  assert out.shape == (2, 3)
  for v in cell.weights:
    assert v.value.device.endswith('CPU:2'), (v.path, v.value.device)


def test_instantiated_and_built_under_a_scope_everything_is_there():
  with tf.device('/CPU:6'):
    cell = _Cell([_Fc('fc', 4, 8), _Dense('dense', 3)]).Instantiate()
    cell.build((None, 4))
  assert len(cell.weights) == 4
  assert all(v.value.device.endswith('CPU:6') for v in cell.weights)


def test_fprop_meta_sums_the_chained_children():
  sub = [_Fc('fc', 4, 8), _Dense('dense', 3)]
  meta = cell_lib.FeatureExtractionLayer.FPropMeta(_Cell(sub), (5, 4))
  first = sub[0].target_cls.FPropMeta(sub[0], (5, 4))
  second = sub[1].target_cls.FPropMeta(sub[1], first.output_shape)
  assert first.output_shape == (5, 8)
  assert meta == base_layer.SumCosts([first, second])
  assert meta.output_shape == (5, 3)
  assert meta.num_params == (4 * 8 + 8) + (8 * 3 + 3)
  # Matches the variables the built cell really has.
  cell = _Cell(sub).Instantiate()
  cell.build((5, 4))
  assert meta.num_params == sum(int(np.prod(v.shape))
                                for v in cell.trainable_variables)
  assert tuple(cell.compute_output_shape((5, 4))) == (5, 3)
  empty = cell_lib.FeatureExtractionLayer.FPropMeta(_Cell([]), (5, 4))
  assert empty.output_shape == (5, 4) and empty.num_params == 0


def test_sequential_classes_are_flattened_by_the_partitioner():
  assert layers.SequentialLayer in cell_lib.SEQUENTIAL_CLASSES()
  cell_p = _Cell([_Fc('a', 4, 4), _Fc('b', 4, 4)])
  assert partition.IsSequentialParams(cell_p)
  assert not partition.IsSequentialParams(_Fc('c', 4, 4))

  class MyBlock(layers.SequentialLayer):
    pass

  block = MyBlock.Params().Set(name='block', sub=[_Fc('c', 4, 4)])
  flat = partition.FlattenSequentialLayers([cell_p, block, _Fc('d', 4, 4)])
  assert [p.name for p in flat] == ['a', 'b', 'c', 'd']
  # Re-partitioning cells (the partitioner's own output) is a no-op cut.
  cells = partition.PartitionSequentialLayers(flat, 2, balance=[2, 2])
  assert all(c.target_cls is cell_lib.FeatureExtractionLayer for c in cells)
  again = partition.PartitionSequentialLayers(cells, 2, balance=[2, 2])
  assert [[p.name for p in c.sub] for c in again] == [['a', 'b'], ['c', 'd']]


def test_checkpoint_saves_the_sub_layers(tmp_path):
  x = tf.ones([2, 4])
  saved = _Cell([_Fc('a', 4, 8), _Fc('b', 8, 3)]).Instantiate()
  other = _Cell([
      _Fc('a', 4, 8).Set(random_seed=8), _Fc('b', 8, 3).Set(random_seed=8)
  ]).Instantiate()
  assert not np.allclose(saved(x).numpy(), other(x).numpy())
  path = tf.train.Checkpoint(model=saved).write(str(tmp_path / 'ckpt'))
  tf.train.Checkpoint(model=other).read(path).assert_consumed()
  np.testing.assert_array_equal(other(x).numpy(), saved(x).numpy())
