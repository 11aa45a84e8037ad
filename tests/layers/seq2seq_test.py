"""Tests of the encoder-decoder layers: masking, what each stream carries, costs."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import layers


def _NumVariables(layer):
  return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)


def _Shapes(structure):
  return tf.nest.map_structure(lambda t: tuple(t.shape), structure)


def _State(batch=2, source=5, target=4, dim=8, seed=0):
  rng = np.random.RandomState(seed)
  paddings = np.zeros((batch, source), np.int32)
  paddings[0, 3:] = 1
  return {'encoded': tf.constant(rng.randn(batch, source, dim), tf.float32),
          'source_paddings': tf.constant(paddings),
          'decoded': tf.constant(rng.randn(batch, target, dim), tf.float32)}


def _Changed(state, key, index, value=5.0):
  array = state[key].numpy().copy()
  array[index] += value
  return dict(state, **{key: tf.constant(array)})


def test_attention_ignores_padded_memory():
  p = layers.MaskedAttention.Params().Set(name='atten', input_dim=8,
                                          num_heads=2, random_seed=1)
  atten = p.Instantiate()
  rng = np.random.RandomState(1)
  inputs = {'query': tf.constant(rng.randn(2, 3, 8), tf.float32),
            'memory': tf.constant(rng.randn(2, 5, 8), tf.float32),
            'memory_paddings': tf.constant([[0, 0, 0, 1, 1], [0] * 5])}
  out = atten(inputs)
  memory = inputs['memory'].numpy()
  memory[0, 3:] = 100.0  # Padding of example 0.
  np.testing.assert_allclose(atten(dict(inputs, memory=memory)), out,
                             rtol=1e-5, atol=1e-5)
  memory[1, 4] = 100.0  # A real position of example 1.
  assert not np.allclose(atten(dict(inputs, memory=memory))[1], out[1])
  meta = layers.MaskedAttention.FPropMeta(p, _Shapes(inputs))
  assert meta.output_shape == (2, 3, 8)
  assert meta.num_params == _NumVariables(atten)


def test_causal_attention_does_not_look_ahead():
  atten = layers.MaskedAttention.Params().Set(
      name='atten', input_dim=8, num_heads=2, causal=True,
      random_seed=2).Instantiate()
  query = np.random.RandomState(2).randn(1, 4, 8).astype(np.float32)
  out = atten({'query': query})
  changed = query.copy()
  changed[0, 2] += 3.0
  new = atten({'query': changed})
  np.testing.assert_allclose(new[0, :2], out[0, :2], rtol=1e-5, atol=1e-6)
  assert not np.allclose(new[0, 2:], out[0, 2:])


def test_encoder_layer_transforms_encoded_and_carries_the_rest():
  p = layers.TransformerEncoderLayer.Params().Set(
      name='enc', input_dim=8, num_heads=2, hidden_dim=16,
      final_layer_norm=True, random_seed=3)
  layer = p.Instantiate()
  state = _State()
  out = layer(state, training=False)
  np.testing.assert_array_equal(out['decoded'], state['decoded'])
  np.testing.assert_array_equal(out['source_paddings'],
                                state['source_paddings'])
  assert not np.allclose(out['encoded'], state['encoded'])
  # Padded source positions do not reach the real ones.
  padded = layer(_Changed(state, 'encoded', (0, 4)), training=False)
  np.testing.assert_allclose(padded['encoded'][0, :3], out['encoded'][0, :3],
                             rtol=1e-5, atol=1e-5)
  meta = layers.TransformerEncoderLayer.FPropMeta(p, _Shapes(state))
  assert meta.output_shape == _Shapes(out)
  assert meta.num_params == _NumVariables(layer)
  assert meta.activation_bytes == 4 * (2 * 5 * 8 + 2 * 5 + 2 * 4 * 8)


def test_decoder_layer_reads_the_encoder_output_and_only_the_past():
  p = layers.TransformerDecoderLayer.Params().Set(
      name='dec', input_dim=8, num_heads=2, hidden_dim=16, random_seed=4)
  layer = p.Instantiate()
  state = _State()
  out = layer(state, training=False)
  np.testing.assert_array_equal(out['encoded'], state['encoded'])
  future = layer(_Changed(state, 'decoded', (1, 2)), training=False)
  np.testing.assert_allclose(future['decoded'][1, :2], out['decoded'][1, :2],
                             rtol=1e-5, atol=1e-5)
  source = layer(_Changed(state, 'encoded', (1, 0)), training=False)
  assert not np.allclose(source['decoded'][1], out['decoded'][1])
  padded = layer(_Changed(state, 'encoded', (0, 3)), training=False)
  np.testing.assert_allclose(padded['decoded'][0], out['decoded'][0],
                             rtol=1e-5, atol=1e-5)
  meta = layers.TransformerDecoderLayer.FPropMeta(p, _Shapes(state))
  assert meta.output_shape == _Shapes(out)
  assert meta.num_params == _NumVariables(layer)


@pytest.mark.parametrize('shared', [True, False])
def test_embedding_unpacks_source_and_target(shared):
  p = layers.Seq2SeqEmbedding.Params().Set(
      name='emb', vocab_size=10, embedding_dim=6, source_length=3,
      shared_embedding=shared, random_seed=5)
  emb = p.Instantiate()
  ids = tf.constant([[4, 3, 0, 1, 7], [3, 3, 3, 3, 0]])
  state = emb(ids, training=False)
  np.testing.assert_array_equal(state['source_paddings'],
                                [[0, 0, 1], [0, 0, 0]])
  assert state['encoded'].shape == (2, 3, 6)
  assert state['decoded'].shape == (2, 2, 6)
  # The same id at the same position embeds the same in both examples.
  np.testing.assert_allclose(state['encoded'][0, 1], state['encoded'][1, 1])
  same = np.allclose(state['encoded'][1, 0] - state['decoded'][1, 0],
                     0.0, atol=1e-6)  # Id 3 at position 0 in both streams.
  assert same == shared
  meta = layers.Seq2SeqEmbedding.FPropMeta(p, (None, 5))
  assert meta.output_shape == {'encoded': (None, 3, 6),
                               'source_paddings': (None, 3),
                               'decoded': (None, 2, 6)}
  assert meta.num_params == _NumVariables(emb) == (1 if shared else 2) * 60
  with pytest.raises(ValueError, match='no target ids'):
    layers.Seq2SeqEmbedding.FPropMeta(p, (None, 3))


def test_logits_from_the_decoded_stream():
  p = layers.DecoderLogits.Params().Set(name='logits', input_dim=8,
                                        vocab_size=7, random_seed=6)
  layer = p.Instantiate()
  state = _State()
  logits = layer(state)
  assert logits.shape == (2, 4, 7)
  meta = layers.DecoderLogits.FPropMeta(p, _Shapes(state))
  assert meta.output_shape == (2, 4, 7)
  assert meta.num_params == _NumVariables(layer) == 8 * 7 + 7 + 2 * 8


def test_bad_params_name_the_param():
  with pytest.raises(ValueError, match='divisible by num_heads'):
    layers.MaskedAttention.Params().Set(name='a', input_dim=6,
                                        num_heads=4).Instantiate()
  with pytest.raises(ValueError, match='source_length must be > 0'):
    layers.Seq2SeqEmbedding.Params().Set(name='e', vocab_size=4,
                                         embedding_dim=4).Instantiate()
  with pytest.raises(ValueError, match='input_dim and hidden_dim'):
    layers.TransformerDecoderLayer.Params().Set(name='d',
                                                input_dim=4).Instantiate()
