"""Tests of MultiHeadAttention and TransformerLayer against NumPy."""

import re

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import layers


def _Softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _NumpyAttention(atten, x, num_heads, causal):
  """softmax(Q K^T / sqrt(d)) V per head, with the layer's weights."""
  w = {n: getattr(atten, n).numpy() for n in (
      'w_q', 'w_k', 'w_v', 'w_o', 'b_q', 'b_k', 'b_v', 'b_o')}
  b, t, _ = x.shape
  hidden = w['w_q'].shape[1]
  d = hidden // num_heads

  def Heads(y):
    return y.reshape(b, t, num_heads, d).transpose(0, 2, 1, 3)
  q = Heads(x @ w['w_q'] + w['b_q'])
  k = Heads(x @ w['w_k'] + w['b_k'])
  v = Heads(x @ w['w_v'] + w['b_v'])
  logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
  if causal:
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -1e9)
  ctx = (_Softmax(logits) @ v).transpose(0, 2, 1, 3).reshape(b, t, hidden)
  return ctx @ w['w_o'] + w['b_o']


def _RandomizeBiases(layer, seed):
  rng = np.random.RandomState(seed)
  for v in layer.trainable_weights:
    if v.path.split('/')[-1].startswith('b'):
      v.assign(rng.randn(*v.shape).astype(np.float32) * 0.1)


@pytest.mark.parametrize('causal', [False, True])
def test_attention_matches_numpy(causal):
  p = layers.MultiHeadAttention.Params().Set(
      name='atten', input_dim=6, num_heads=2, hidden_dim=8, causal=causal,
      random_seed=0)
  atten = p.Instantiate()
  _RandomizeBiases(atten, 1)
  x = np.random.RandomState(2).randn(2, 5, 6).astype(np.float32)
  got = atten(x)
  np.testing.assert_allclose(got.numpy(), _NumpyAttention(atten, x, 2, causal),
                             rtol=1e-4, atol=1e-5)
  meta = layers.MultiHeadAttention.FPropMeta(p, (None, 5, 6))
  assert meta.output_shape == (None,) + tuple(got.shape[1:])
  assert meta.num_params == sum(
      int(np.prod(v.shape)) for v in atten.trainable_weights)


def test_causal_attention_ignores_the_future():
  atten = layers.MultiHeadAttention.Params().Set(
      name='atten', input_dim=4, num_heads=2, causal=True).Instantiate()
  x = np.random.RandomState(0).randn(1, 6, 4).astype(np.float32)
  y = x.copy()
  y[:, 3:] += 5.0
  np.testing.assert_allclose(atten(x).numpy()[:, :3], atten(y).numpy()[:, :3],
                             rtol=1e-5, atol=1e-6)


def test_attention_dropout_is_deterministic_per_step_seed():
  atten = layers.MultiHeadAttention.Params().Set(
      name='atten', input_dim=4, num_heads=1,
      atten_dropout_prob=0.5).Instantiate()
  x = np.random.RandomState(0).randn(2, 6, 4).astype(np.float32)
  with base_layer.StepSeed(tf.constant([5, 6])):
    a = atten(x, training=True).numpy()
    b = atten(x, training=True).numpy()
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, atten(x, training=False).numpy())


def test_transformer_matches_composition():
  p = layers.TransformerLayer.Params().Set(
      name='xformer', input_dim=8, num_heads=2, hidden_dim=16, causal=True,
      activation='relu', random_seed=4)
  layer = p.Instantiate()
  _RandomizeBiases(layer, 5)
  rng = np.random.RandomState(6)
  for ln in (layer.atten_ln, layer.ffn_ln):
    ln.scale.assign(1.0 + 0.1 * rng.randn(8).astype(np.float32))
    ln.bias.assign(0.1 * rng.randn(8).astype(np.float32))
  x = rng.randn(2, 5, 8).astype(np.float32)

  def Ln(ln, y):
    m = y.mean(-1, keepdims=True)
    v = y.var(-1, keepdims=True)
    return (y - m) / np.sqrt(v + 1e-6) * ln.scale.numpy() + ln.bias.numpy()

  h = x + _NumpyAttention(layer.atten, Ln(layer.atten_ln, x), 2, True)
  ffn = np.maximum(
      Ln(layer.ffn_ln, h) @ layer.ffn_in.w.numpy() + layer.ffn_in.b.numpy(), 0)
  want = h + ffn @ layer.ffn_out.w.numpy() + layer.ffn_out.b.numpy()
  got = layer(x)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)

  meta = layers.TransformerLayer.FPropMeta(p, (None, 5, 8))
  assert meta.output_shape == (None,) + tuple(got.shape[1:])
  assert meta.num_params == sum(
      int(np.prod(v.shape)) for v in layer.trainable_weights)
  assert meta.flops > layers.MultiHeadAttention.FPropMeta(
      layer.atten.p, (None, 5, 8)).flops


def test_transformer_variables_on_device():
  with tf.device('/CPU:3'):
    layer = layers.TransformerLayer.Params().Set(
        name='xformer', input_dim=4, num_heads=1, hidden_dim=8).Instantiate()
  assert layer.weights
  assert all(v.value.device.endswith('CPU:3') for v in layer.weights)


@pytest.mark.parametrize('num_heads, message', [
    (3, 'atten: num_heads=3 does not divide the attention width 8'),
    (-4, 'atten: num_heads must be an int > 0; received num_heads=-4.'),
    (0, 'atten: num_heads must be an int > 0; received num_heads=0.')])
def test_a_head_count_that_cannot_split_the_width_is_refused_by_the_cost_model(
    num_heads, message):
  # -4 divided 8 and passed, then failed at the first step (sqrt of -2).
  p = layers.MultiHeadAttention.Params().Set(
      name='atten', input_dim=8, num_heads=num_heads)
  with pytest.raises(ValueError, match=re.escape(message)):
    p.target_cls.FPropMeta(p, (None, 4, 8))  # Before anything is built.
  with pytest.raises(ValueError, match=re.escape(message)):
    p.Instantiate()
