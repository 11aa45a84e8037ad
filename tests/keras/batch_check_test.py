"""Tests of tfpipe.keras.batch_check: no batch below M reaches the pipeline.

A user relies on: fit, evaluate and predict refusing, before anything
trains, data whose batches (the last one of an epoch included, and the
validation batches) are smaller than num_micro_batches, with an error
naming batch_size and num_micro_batches; and a one-line error, not
TensorFlow's traceback, where the sizes are known only as the data runs.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.keras import batch_check


def test_batch_sizes_are_keras_slices_of_the_data():
  x = np.zeros((20, 6), np.float32)
  assert batch_check.BatchSizes(x, 8) == {
      8: 'batch_size=8',
      4: 'the last batch of 20 examples in batches of batch_size=8'}
  assert set(batch_check.BatchSizes({'a': x, 'b': x}, 10)) == {10}
  assert set(batch_check.BatchSizes([x], None)) == {20}  # One batch of 32.
  # fit's validation_split takes the last 25% off before batching.
  assert set(batch_check.BatchSizes(x, 4, 0.25)) == {4, 3}
  assert set(batch_check.BatchSizes(x, 4, 0.25, 'validation')) == {4, 1}
  data = tf.data.Dataset.from_tensor_slices(x)
  assert set(batch_check.BatchSizes(data.batch(8, drop_remainder=True))) == {8}
  assert batch_check.BatchSizes(data.batch(8)) is None  # Known as it runs.


@pytest.fixture(name='pipelined')
def _Pipelined():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name='a'),
                            keras.layers.Dense(3, name='b')], name='seq')
  pm = tfpipe.keras.pipeline(model, num_partitions=2, num_micro_batches=8,
                             devices=['/CPU:0', '/CPU:1'], balance='params')
  pm.compile(optimizer='adam', loss='mse')
  return pm


def _Data(n):
  rng = np.random.RandomState(0)
  return (rng.randn(n, 6).astype(np.float32),
          rng.randn(n, 3).astype(np.float32))


def test_fit_refuses_a_small_last_batch_before_anything_trains(pipelined):
  # The last batch of 4 used to fail after the epoch's first two trained,
  # as a 76-line InvalidArgumentError.
  x, y = _Data(20)
  before = [w.numpy() for w in pipelined.weights]
  with pytest.raises(ValueError) as e:
    pipelined.fit(x, y, batch_size=8, epochs=1, verbose=0)
  assert str(e.value) == (
      'seq_pipelined: fit would get a batch of 4 example(s) (the last batch '
      'of 20 examples in batches of batch_size=8), fewer than '
      'num_micro_batches=8: every micro-batch needs an example. Use a '
      'batch_size whose batches (the last one too) hold at least 8, drop the '
      'remainder (tf.data: batch(..., drop_remainder=True)), or pipeline '
      'with fewer micro-batches.')
  for b, a in zip(before, pipelined.weights):
    np.testing.assert_array_equal(a.numpy(), b)
  with pytest.raises(ValueError, match=r'fit would get a batch of 2 example.*'
                     'batch_size=6'):
    pipelined.fit(x, y, 6, 1, 0)  # Positional batch_size.
  with pytest.raises(ValueError, match="fit's validation would get a batch "
                     'of 4 example'):
    pipelined.fit(x, y, batch_size=10, verbose=0, validation_data=_Data(4))
  with pytest.raises(ValueError, match='evaluate would get a batch of 4'):
    pipelined.evaluate(x, y, batch_size=8, verbose=0)
  with pytest.raises(ValueError, match='predict would get a batch of 4'):
    pipelined.predict(x, batch_size=16, verbose=0)
  pipelined.fit(x, y, batch_size=10, epochs=1, verbose=0)  # 10 and 10: fine.


def test_sizes_known_only_as_the_data_runs_fail_in_one_line(pipelined):
  x, y = _Data(20)
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
  with pytest.raises(ValueError) as e:
    pipelined.fit(data, epochs=1, verbose=0, shuffle=False)
  assert str(e.value) == (
      'seq_pipelined: The batch is smaller than num_micro_batches=8; use a '
      'larger batch or fewer micro-batches. (a batch whose size is known only '
      'as the data runs, e.g. the last one of a tf.data batch() without '
      'drop_remainder=True).')
  assert e.value.__cause__ is None and e.value.__suppress_context__
