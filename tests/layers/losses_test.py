"""Tests of SoftmaxCrossEntropyLoss and the SoftmaxCrossEntropy layer."""

import numpy as np

from tfpipe import layers


def _NumpyXent(logits, labels):
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]


def _Data():
  rng = np.random.RandomState(0)
  logits = rng.randn(4, 3, 5).astype(np.float32)
  labels = rng.randint(0, 5, size=(4, 3)).astype(np.int32)
  return logits, labels


def test_loss_and_accuracy_match_numpy():
  logits, labels = _Data()
  loss, acc = layers.SoftmaxCrossEntropyLoss(logits, labels)
  np.testing.assert_allclose(loss.numpy(), _NumpyXent(logits, labels).mean(),
                             rtol=1e-5)
  np.testing.assert_allclose(acc.numpy(),
                             (logits.argmax(-1) == labels).mean(), rtol=1e-6)


def test_weighted_loss():
  logits, labels = _Data()
  weights = np.random.RandomState(1).rand(4, 3).astype(np.float32)
  weights[0] = 0.0
  loss, acc = layers.SoftmaxCrossEntropyLoss(logits, labels, weights)
  xent = _NumpyXent(logits, labels)
  np.testing.assert_allclose(loss.numpy(),
                             (xent * weights).sum() / weights.sum(), rtol=1e-5)
  correct = (logits.argmax(-1) == labels).astype(np.float32)
  np.testing.assert_allclose(acc.numpy(),
                             (correct * weights).sum() / weights.sum(),
                             rtol=1e-5)


def test_soft_labels_equal_one_hot():
  logits, labels = _Data()
  one_hot = np.eye(5, dtype=np.float32)[labels]
  hard, _ = layers.SoftmaxCrossEntropyLoss(logits, labels)
  soft, _ = layers.SoftmaxCrossEntropyLoss(logits, one_hot)
  np.testing.assert_allclose(soft.numpy(), hard.numpy(), rtol=1e-6)


def test_loss_layer():
  logits, labels = _Data()
  p = layers.SoftmaxCrossEntropy.Params().Set(name='xent')
  layer = p.Instantiate()
  want = _NumpyXent(logits, labels).mean()
  np.testing.assert_allclose(layer((logits, labels)).numpy(), want, rtol=1e-5)
  np.testing.assert_allclose(
      layer({'logits': logits, 'labels': labels}).numpy(), want, rtol=1e-5)
  weights = np.ones((4, 3), np.float32)
  np.testing.assert_allclose(layer((logits, labels, weights)).numpy(), want,
                             rtol=1e-5)
  meta = layers.SoftmaxCrossEntropy.FPropMeta(p, ((None, 3, 5), (None, 3)))
  assert meta.output_shape == () == tuple(layer((logits, labels)).shape)
  assert meta.num_params == 0
