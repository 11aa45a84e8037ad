"""Micro-batch splitting: uneven sizes, nested structures, exact weights."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.gpipe import microbatch


def test_uneven_split_sizes_differ_by_at_most_one():
  assert microbatch.SplitSizes(10, 3) == [4, 3, 3]
  assert microbatch.SplitSizes(16, 4) == [4, 4, 4, 4]
  assert microbatch.SplitSizes(7, 7) == [1] * 7
  assert microbatch.SplitSizes(10, 1, micro_batch_size=4) == [4, 4, 2]


def test_split_and_merge_round_trip_nested():
  x = {'a': tf.reshape(tf.range(30.), [10, 3]),
       'b': (tf.range(10), tf.ones([10, 2, 2]))}
  micro, sizes, batch = microbatch.Split(x, 3)
  assert sizes == [4, 3, 3] and batch == 10
  assert micro[1]['b'][0].numpy().tolist() == [4, 5, 6]
  merged = microbatch.Merge(micro)
  tf.nest.map_structure(np.testing.assert_array_equal, merged, x)


def test_split_along_other_batch_dim():
  x = tf.reshape(tf.range(24.), [2, 12])
  micro, sizes, _ = microbatch.Split(x, 4, batch_dim=1)
  assert sizes == [3, 3, 3, 3] and micro[0].shape == (2, 3)
  np.testing.assert_array_equal(microbatch.Merge(micro, batch_dim=1), x)


def test_weights_make_means_exact():
  losses = tf.random.stateless_uniform([11], seed=[1, 2])
  micro, sizes, batch = microbatch.Split(losses, 4)
  weights = microbatch.Weights(sizes, batch)
  total = sum(w * tf.reduce_mean(m) for w, m in zip(weights, micro))
  np.testing.assert_allclose(total, tf.reduce_mean(losses), rtol=1e-6)


def test_dynamic_batch_in_tf_function():
  @tf.function(input_signature=[tf.TensorSpec([None, 2])])
  def SplitMerge(x):
    micro, sizes, _ = microbatch.Split(x, 3)
    return microbatch.Merge(micro), tf.stack(sizes)
  x = tf.reshape(tf.range(14.), [7, 2])
  merged, sizes = SplitMerge(x)
  np.testing.assert_array_equal(merged, x)
  assert sizes.numpy().tolist() == [3, 2, 2]
  with pytest.raises(tf.errors.InvalidArgumentError, match='smaller than'):
    SplitMerge(tf.ones([2, 2]))


def test_batch_smaller_than_micro_batches_is_a_clear_error():
  with pytest.raises(ValueError, match='fewer than num_micro_batches=4'):
    microbatch.Split(tf.ones([3, 2]), 4)


def test_mismatched_batch_sizes_name_the_inputs():
  with pytest.raises(ValueError, match="'a': 4.*'b': 5|a: 4, b: 5"):
    microbatch.Split({'a': tf.ones([4, 1]), 'b': tf.ones([5, 1])}, 2)


def test_scalar_input_cannot_be_split():
  with pytest.raises(ValueError, match='batch_dim=0'):
    microbatch.Split(tf.constant(1.0), 2)


def test_micro_batch_size_needs_static_batch():
  with pytest.raises(ValueError, match='micro_batch_size'):
    microbatch.NumMicroBatches(None, micro_batch_size=4)
  assert microbatch.NumMicroBatches(10, micro_batch_size=4) == 3
