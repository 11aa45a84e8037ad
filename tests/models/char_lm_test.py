"""Tests of the char LM's bits-per-character metric."""

import math

import numpy as np
import pytest
import tensorflow as tf

from models import char_lm


def test_uniform_prediction_costs_eight_bits_per_ascii_char():
  logits = tf.zeros((2, 3, 256))
  targets = tf.constant([[104, 105, 10], [32, 33, -1]])
  assert float(char_lm.BitsPerChar(logits, targets)) == pytest.approx(8.0)


def test_continuation_bytes_add_bits_but_are_not_characters():
  """'é' is two bytes (0xC3 0xA9): 16 bits over 2 characters with 'a'."""
  logits = tf.zeros((1, 3, 256))
  targets = tf.constant([list('aé'.encode('utf-8'))])
  assert targets.shape == (1, 3)
  assert float(char_lm.BitsPerChar(logits, targets)) == pytest.approx(12.0)


def test_bits_follow_the_predicted_probability():
  logits = np.zeros((1, 2, 256), np.float32)
  logits[0, :, 65] = math.log(255.0)  # p('A') = 255 / 510 = 1/2.
  targets = tf.constant([[65, 66]])
  want = (1.0 + math.log2(510.0)) / 2
  assert float(char_lm.BitsPerChar(logits, targets)) == pytest.approx(
      want, rel=1e-5)


def test_model_reports_accuracy_and_bits_per_char():
  model = char_lm.CharTransformerLm.Params().Set(
      sequence_length=4, model_dim=8, num_layers=1, num_heads=2,
      hidden_dim=16).Instantiate()
  assert model.p.vocab_size == 256
  loss, metrics = model.Loss(tf.zeros((1, 2, 256)), tf.constant([[1, 2]]))
  assert float(loss) == pytest.approx(math.log(256.0), rel=1e-5)
  assert float(metrics['bits_per_char']) == pytest.approx(8.0)
  assert set(metrics) == {'accuracy', 'bits_per_char'}
