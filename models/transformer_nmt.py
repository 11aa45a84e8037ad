"""The GPipe paper's encoder-decoder Transformer, T(L, H, A), as a list of layers.

    embedding -> L encoder layers -> L decoder layers -> final LN + logits

T(L, H, A) in the paper is a Transformer with L encoder and L decoder
layers, feed-forward hidden size H and A attention heads; the model dim is
fixed to 1024 there. Every decoder layer attends to the encoder output, so
the layers pass a dict that carries it (see tfpipe/layers/seq2seq.py) and the
partitioner can cut anywhere, even between two decoder layers.

The input is one int tensor [batch, S + T]: the source sentence's S ids
(PAD=0 after its end), then the decoder's T input ids (the target shifted
right behind a start id); the first layer unpacks it. Targets are [batch, T]
ids, -1 where there is nothing to predict.

The loss is the mean over sentences of each sentence's mean token
cross-entropy, and the accuracy likewise. Taken per sentence, they do not
depend on how the batch is split into micro-batches, so a pipelined step
computes exactly the plain model's loss; a token mean over each micro-batch
would not be, because micro-batches hold different numbers of tokens.

The source and target share one embedding table (one multilingual
vocabulary, as the paper's 64k wordpieces); the softmax has its own weights,
because a pipeline cannot share a variable between its first and last cell.
"""

import tensorflow as tf

import models
from tfpipe.layers import seq2seq


class TransformerNmt(models.BaseModel):
  """Encoder-decoder Transformer over int ids; targets of -1 carry no loss."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'nmt'
    p.Define('vocab_size', 32, 'Number of token ids (source and target).')
    p.Define('source_length', 16, 'Length of the source id sequences.')
    p.Define('target_length', 16, 'Length of the decoder input and targets.')
    p.Define('model_dim', 64, 'Width of the embeddings and the layers.')
    p.Define('num_layers', 2, 'L: number of encoder layers, and of decoder '
             'layers.')
    p.Define('num_heads', 4, 'A: attention heads of every attention.')
    p.Define('hidden_dim', 256, 'H: hidden size of the feed-forward nets.')
    p.Define('dropout_prob', 0.0, 'Dropout probability of the embeddings, '
             'attention weights and residual branches.')
    p.Define('shared_embedding', True, 'One embedding table for source and '
             'target ids.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if p.num_layers < 1:
      raise ValueError(f'{p.name}: num_layers must be >= 1; received '
                       f'num_layers={p.num_layers}.')

  def LayerParamsList(self):
    p = self.p
    block = dict(input_dim=p.model_dim, num_heads=p.num_heads,
                 hidden_dim=p.hidden_dim, atten_dropout_prob=p.dropout_prob,
                 residual_dropout_prob=p.dropout_prob)
    result = [seq2seq.Seq2SeqEmbedding.Params().Set(
        name='emb', vocab_size=p.vocab_size, embedding_dim=p.model_dim,
        source_length=p.source_length, shared_embedding=p.shared_embedding,
        dropout_prob=p.dropout_prob)]
    result += [seq2seq.TransformerEncoderLayer.Params().Set(
        name=f'encoder_{i}', final_layer_norm=(i == p.num_layers - 1), **block)
               for i in range(p.num_layers)]
    result += [seq2seq.TransformerDecoderLayer.Params().Set(
        name=f'decoder_{i}', **block) for i in range(p.num_layers)]
    result.append(seq2seq.DecoderLogits.Params().Set(
        name='logits', input_dim=p.model_dim, vocab_size=p.vocab_size))
    return result

  def InputShape(self):
    return (None, self.p.source_length + self.p.target_length)

  def InputDtype(self):
    return 'int32'

  def Loss(self, outputs, targets):
    return TokenSums(outputs, targets)


def TokenSums(logits, targets):
  """Token cross-entropy and correct tokens, summed, and the token count.

  Returned as (loss_sum, num_tokens, {'accuracy': num_correct}): the
  pipeline adds the sums of every micro-batch and divides by the total
  token count once, so the loss and accuracy are means over the batch's
  scored tokens however padding falls across micro-batches.

  Args:
    logits: float [batch, length, vocab].
    targets: int [batch, length], -1 where there is no target.
  """
  targets = tf.cast(targets, tf.int32)
  weights = tf.cast(targets >= 0, tf.float32)
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.maximum(targets, 0), logits=tf.cast(logits, tf.float32))
  correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                             targets), tf.float32)
  return (tf.reduce_sum(xent * weights), tf.reduce_sum(weights),
          {'accuracy': tf.reduce_sum(correct * weights)})
