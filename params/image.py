"""Image classifiers on synthetic grating images: conv nets and AmoebaNet-D.

The class sets a grating's orientation and frequency and every example has a
random phase plus noise, so the network must learn oriented filters; batch
norm makes these the configurations that exercise the pipeline's deferred
moving-statistics updates. The AmoebaNet-D configurations are the GPipe
paper's image model (models/amoebanet.py): a tiny one that trains on CPU,
and the paper's shapes, sized by the cost model without building them.
"""

from models import amoebanet
from models import conv_classifier
from params import recipes
from tfpipe import base_model_params
from tfpipe import model_registry
from tfpipe.trainer import input_generator
from tfpipe.trainer import task


class _GratingClassifier(base_model_params.SingleTaskModelParams):
  """The grating input and the task around an image model, shared below."""

  def Train(self):
    return input_generator.SyntheticImageInput.Params().Set(
        name='train', batch_size=self.BATCH_SIZE, seed=0,
        image_size=self.IMAGE_SIZE, channels=3, num_classes=self.NUM_CLASSES)

  def _Task(self, model_cls, **model):
    """Task params of a `model_cls` (an ImageClassifier) set from the input."""
    p = task.BaseTask.Params()
    p.name = 'image'
    p.model = model_cls.Params().Set(
        image_size=self.IMAGE_SIZE, channels=3, num_classes=self.NUM_CLASSES,
        **model)
    return p


@model_registry.RegisterSingleTaskModel
class TinyConvClassifier(_GratingClassifier):
  """16x16 images, width 8, one block per stage; 2 partitions x 4 micro-batches."""

  IMAGE_SIZE = 16
  NUM_CLASSES = 10
  BASE_WIDTH = 8
  BLOCKS_PER_STAGE = [1, 1]
  BATCH_SIZE = 32
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4
  MAX_STEPS = 400
  LEARNING_RATE = 3e-3
  WARMUP_STEPS = 50

  def Task(self):
    p = self._Task(conv_classifier.ConvClassifier, base_width=self.BASE_WIDTH,
                   blocks_per_stage=self.BLOCKS_PER_STAGE)
    recipes.SetPipelinedCosineTraining(
        p, self, decay_steps=self.MAX_STEPS, save_interval_steps=100,
        log_interval_steps=50)
    p.eval.Set(num_batches=8)
    return p


@model_registry.RegisterSingleTaskModel
class SmallConvClassifier(TinyConvClassifier):
  """32x32 images, width 16, two blocks per stage; 4 partitions x 8 micro-batches."""

  IMAGE_SIZE = 32
  BASE_WIDTH = 16
  BLOCKS_PER_STAGE = [2, 2, 2]
  BATCH_SIZE = 64
  NUM_PARTITIONS = 4
  NUM_MICRO_BATCHES = 8
  MAX_STEPS = 2000
  LEARNING_RATE = 1e-3


@model_registry.RegisterSingleTaskModel
class LargeConvClassifier(TinyConvClassifier):
  """64x64 images, width 64, a ResNet-34-like depth: 8 GPU cells."""

  IMAGE_SIZE = 64
  BASE_WIDTH = 64
  BLOCKS_PER_STAGE = [3, 4, 6, 3]
  BATCH_SIZE = 256
  NUM_PARTITIONS = 8
  NUM_MICRO_BATCHES = 32
  MAX_STEPS = 20000
  LEARNING_RATE = 1e-3


@model_registry.RegisterSingleTaskModel
class TinyAmoebaNetD(_GratingClassifier):
  """AmoebaNet-D(3, 16) on 16x16 gratings with the small-image stem; trains on CPU.

  Five cells (one normal cell per stack and the two reduction cells) in 2
  partitions x 2 micro-batches. Most of a short run is tracing the cells'
  many small ops, which grows with M; batch norm's moving averages use a
  short memory (decay 0.9) so that they have settled for eval after 100
  steps.
  """

  IMAGE_SIZE = 16
  NUM_CLASSES = 10
  NUM_LAYERS = 3
  NUM_FILTERS = 16
  IMAGENET_STEM = False
  BATCH_NORM_DECAY = 0.9
  BATCH_SIZE = 32
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 2
  MAX_STEPS = 100
  LEARNING_RATE = 3e-3
  WARMUP_STEPS = 10

  def Task(self):
    p = self._Task(amoebanet.AmoebaNetD, num_layers=self.NUM_LAYERS,
                   num_filters=self.NUM_FILTERS,
                   imagenet_stem=self.IMAGENET_STEM,
                   batch_norm_decay=self.BATCH_NORM_DECAY)
    recipes.SetPipelinedCosineTraining(p, self, save_interval_steps=100,
                                       log_interval_steps=25)
    p.eval.Set(num_batches=8)
    return p


@model_registry.RegisterSingleTaskModel
class AmoebaNetD(TinyAmoebaNetD):
  """AmoebaNet-D(18, 256) at 224x224, 1000 classes: torchgpipe's speed benchmark.

  122,470,120 parameters (GPipe's Table 2 model; torchgpipe benchmarks the
  same (L, D) on 8 GPUs). The synthetic gratings stand in for ImageNet, as
  torchgpipe's fake 224x224 tensors do: this configuration measures the
  pipeline, not accuracy. For ImageNet, return a TFRecordInput from Train().
  """

  IMAGE_SIZE = 224
  NUM_CLASSES = 1000
  NUM_LAYERS = 18
  NUM_FILTERS = 256
  IMAGENET_STEM = True
  BATCH_NORM_DECAY = 0.99
  BATCH_SIZE = 128
  NUM_PARTITIONS = 4
  NUM_MICRO_BATCHES = 32
  MAX_STEPS = 10000
  LEARNING_RATE = 1e-3
  WARMUP_STEPS = 500


@model_registry.RegisterSingleTaskModel
class AmoebaNetD557M(AmoebaNetD):
  """AmoebaNet-D(18, 512) at 480x480: the shape of GPipe's 557M-parameter model.

  How (L, D) was derived: the paper's ImageNet model (its Section 4 and the
  top point of its Figure 1a) is AmoebaNet-B(18, 512) with 557M parameters
  and 480x480 inputs. AmoebaNet-B is a different evolved cell, not built
  here, so this configuration keeps what sets the pipeline's costs, the same
  L=18 normal cells of D=512 filters and the 480x480 input, with AmoebaNet-D
  cells: 481,268,200 parameters (the cost model's count, equal to the built
  variables). AmoebaNet-D would need D=552 (558.7M) to reach 557M.
  """

  IMAGE_SIZE = 480
  NUM_FILTERS = 512
  BATCH_SIZE = 64
  NUM_PARTITIONS = 4
  NUM_MICRO_BATCHES = 16


# Train the tiny conv classifier:
#   python -m tfpipe.trainer --model=image.TinyConvClassifier --logdir=/tmp/image
# The larger ones:
#   python -m tfpipe.trainer --model=image.SmallConvClassifier --logdir=/tmp/image_small
#   python -m tfpipe.trainer --model=image.LargeConvClassifier --logdir=/tmp/image_large --run_locally=gpu
# AmoebaNet-D: the tiny one on CPU, the paper's shapes on GPUs:
#   python -m tfpipe.trainer --model=image.TinyAmoebaNetD --logdir=/tmp/amoeba_tiny
#   python -m tfpipe.trainer --model=image.AmoebaNetD --logdir=/tmp/amoeba --run_locally=gpu
#   python -m tfpipe.trainer --model=image.AmoebaNetD557M --logdir=/tmp/amoeba_557m --run_locally=gpu
