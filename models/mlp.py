"""A multi-layer perceptron classifier as a list of FC layers.

The simplest pipelined model: each hidden layer is one list entry, so it is
the easiest place to check partitioning and pipelined training end to end.
"""

import models
from tfpipe import layers


class Mlp(models.BaseModel):
  """FC(relu) x num_hidden_layers -> FC logits; targets are int class ids."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'mlp'
    p.Define('input_dim', 16, 'Size of the input vectors.')
    p.Define('hidden_dim', 64, 'Width of each hidden layer.')
    p.Define('num_hidden_layers', 4, 'Number of hidden FC layers.')
    p.Define('num_classes', 4, 'Number of output classes.')
    p.Define('dropout_prob', 0.0, 'Dropout probability after each hidden layer.')
    return p

  def LayerParamsList(self):
    p = self.p
    result = []
    dim = p.input_dim
    for i in range(p.num_hidden_layers):
      result.append(layers.FCLayer.Params().Set(
          name=f'fc_{i}', input_dims=dim, output_dims=p.hidden_dim,
          activation='relu'))
      if p.dropout_prob > 0:
        result.append(layers.DropoutLayer.Params().Set(
            name=f'dropout_{i}', keep_prob=1.0 - p.dropout_prob))
      dim = p.hidden_dim
    result.append(layers.FCLayer.Params().Set(
        name='logits', input_dims=dim, output_dims=p.num_classes,
        activation='none'))
    return result

  def InputShape(self):
    return (None, self.p.input_dim)

  def Loss(self, outputs, targets):
    return ClassificationLoss(outputs, targets)


def ClassificationLoss(logits, labels):
  """Mean cross-entropy and accuracy of logits [batch, classes] vs int labels."""
  loss, accuracy = layers.SoftmaxCrossEntropyLoss(logits, labels)
  return loss, {'accuracy': accuracy}
