"""AmoebaNet-D(L, D), the GPipe paper's image model, as a list of cells.

    stem -> [2 reduction cells] -> L/3 normal cells -> reduction cell
         -> L/3 normal cells -> reduction cell -> L/3 normal cells -> head

L is the number of normal cells and D the number of filters of the first
normal cells; each reduction cell doubles the filters and halves the
resolution. With the ImageNet stem (a stride-2 3x3 conv to D/4 channels and
two reduction cells to D/2 and D) a 224x224 image reaches the head at 7x7.
Small images use the CIFAR-style stem instead: a stride-1 3x3 conv to D
channels and no stem reduction cells.

Each cell is one entry of the layer list and passes (output, previous
output) to the next (see tfpipe/layers/amoeba.py), so the pipeline cuts
between cells, as GPipe does. The parameter count depends only on (L, D) and
the number of classes: the head pools globally, so the image size changes
the cost and the activations but not the weights.

Parameter counts with 1000 classes, from the cost model (equal to the built
variables; see tests/models/amoebanet_test.py), against GPipe's Table 1 and
torchgpipe's benchmark README, which use the same (L, D):

    (L, D)      here           GPipe paper   torchgpipe
    (18, 208)    81,505,540     82M           81.5M
    (18, 416)   319,024,120     318M          319.0M
    (18, 544)   542,734,840     542M          542.7M
    (36, 544) 1,055,832,376     1.05B         1.06B
    (72, 512) 1,844,858,344     1.8B          1.84B
    (18, 256)   122,470,120     -             -     (torchgpipe's speed benchmark)
    (18, 512)   481,268,200     557M (AmoebaNet-B, see params/image.py)
"""

from models import conv_classifier
from tfpipe.layers import amoeba


class AmoebaNetD(conv_classifier.ImageClassifier):
  """AmoebaNet-D(L, D) over NHWC float images; targets are int class ids."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'amoebanet'
    p.image_size = 224
    p.num_classes = 1000
    p.Define('num_layers', 18, 'L: number of normal cells, a multiple of 3 '
             '(L/3 before, between and after the two reduction cells).')
    p.Define('num_filters', 256, 'D: filters of each node of the first normal '
             'cells; doubled by each reduction cell.')
    p.Define('imagenet_stem', True, 'Stride-2 stem and two stem reduction '
             'cells (224x224 ImageNet); False: a stride-1 stem for small '
             'images.')
    p.Define('dropout_prob', 0.0, 'Dropout probability before the logits.')
    p.Define('batch_norm_decay', 0.99, 'Momentum of the moving statistics of '
             'every batch norm; lower it for short runs.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if p.num_layers < 3 or p.num_layers % 3:
      raise ValueError(f'{p.name}: num_layers (L) must be a positive multiple '
                       f'of 3; received num_layers={p.num_layers}.')
    multiple = 8 if p.imagenet_stem else 2
    if p.num_filters < 2 * multiple or p.num_filters % multiple:
      raise ValueError(
          f'{p.name}: num_filters (D) must be a multiple of {multiple} and at '
          f'least {2 * multiple} (imagenet_stem={p.imagenet_stem}); received '
          f'num_filters={p.num_filters}.')

  def LayerParamsList(self):
    p = self.p
    state = {'channels': p.num_filters // 4 if p.imagenet_stem else
                         p.num_filters}
    stem_channels = state['channels']
    result = [amoeba.ReluConvBn.Params().Set(
        name='stem', in_channels=p.channels, out_channels=stem_channels,
        kernel=(3, 3), stride=(2, 2) if p.imagenet_stem else (1, 1),
        relu=False, batch_norm_decay=p.batch_norm_decay)]
    state.update(prev=stem_channels, prev_prev=stem_channels,
                 reduction_prev=False)

    def Cell(name, reduction):
      if reduction:
        state['channels'] *= 2
      cell = amoeba.AmoebaCell.Params().Set(
          name=name, prev_channels=state['prev'],
          prev_prev_channels=state['prev_prev'], channels=state['channels'],
          reduction=reduction, reduction_prev=state['reduction_prev'],
          batch_norm_decay=p.batch_norm_decay)
      state.update(prev_prev=state['prev'], reduction_prev=reduction,
                   prev=amoeba.CellOutputChannels(reduction,
                                                  state['channels']))
      return cell

    if p.imagenet_stem:  # D/4 -> D/2 -> D.
      result += [Cell('stem_reduction_0', True), Cell('stem_reduction_1', True)]
    per_stack = p.num_layers // 3
    for stack in range(3):
      if stack:
        result.append(Cell(f'reduction_{stack - 1}', True))
      result += [Cell(f'normal_{stack}_{i}', False) for i in range(per_stack)]
    result.append(amoeba.ClassifierHead.Params().Set(
        name='head', in_channels=state['prev'], num_classes=p.num_classes,
        dropout_prob=p.dropout_prob))
    return result
