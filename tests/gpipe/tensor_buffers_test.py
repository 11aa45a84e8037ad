"""Tests of gpipe.tensor_buffers: the bytes a set of eager tensors holds.

Protected properties, which make a profile's "kept" bytes the same in every
run: a buffer shared by several tensors (an Identity's output, a variable's
read value) is counted once; buffers that existed before are left out, and
those of given addresses can be counted alone (what of a forward's input
its record holds); each buffer is rounded up to the allocator's 256-byte
grain; values that hold no buffer count nothing.
"""

import tensorflow as tf

from tfpipe.gpipe import tensor_buffers


def test_a_shared_buffer_is_counted_once():
  x = tf.random.normal([64, 16])  # 4 KiB.
  y = tf.identity(x)
  assert tensor_buffers.BufferAddress(y) == tensor_buffers.BufferAddress(x)
  assert tensor_buffers.HeldBytes([x, y, x]) == 64 * 16 * 4
  assert tensor_buffers.HeldBytes([x, x + 1.0]) == 2 * 64 * 16 * 4


def test_buffers_that_existed_before_are_left_out():
  v = tf.Variable(tf.zeros([32, 32]))
  x = tf.ones([8, 32])
  existing = tensor_buffers.Addresses([x, tf.convert_to_tensor(v)])
  residuals = [x, tf.convert_to_tensor(v), x * 2.0]
  assert tensor_buffers.HeldBytes(residuals, existing) == 8 * 32 * 4


def test_only_the_buffers_at_given_addresses_can_be_counted():
  x, other = tf.ones([8, 32]), tf.ones([16, 32])
  inputs = tensor_buffers.Addresses([x, other])
  record = [tf.identity(x), x * 2.0]
  assert tensor_buffers.HeldBytes(record, among=inputs) == 8 * 32 * 4
  assert tensor_buffers.HeldBytes([x * 2.0], among=inputs) == 0


def test_each_buffer_is_rounded_to_the_allocators_grain():
  small = tf.constant([1.0, 2.0, 3.0])  # 12 bytes.
  odd = tf.zeros([65], tf.float32)  # 260 bytes.
  assert tensor_buffers.HeldBytes([small]) == 256
  assert tensor_buffers.HeldBytes([odd]) == 512
  assert tensor_buffers.LeafBytes(odd) == 260


def test_values_without_a_buffer_count_nothing():
  assert tensor_buffers.HeldBytes([None, 3, tf.zeros([0, 4])]) == 0
  assert tensor_buffers.HeldBytes([]) == 0
