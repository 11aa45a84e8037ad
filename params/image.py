"""Residual conv classifiers on synthetic grating images.

The class sets a grating's orientation and frequency and every example has a
random phase plus noise, so the network must learn oriented filters; batch
norm makes these the configurations that exercise the pipeline's deferred
moving-statistics updates.
"""

from models import conv_classifier
from tfpipe import base_model_params
from tfpipe import model_registry
from tfpipe.trainer import input_generator
from tfpipe.trainer import task


@model_registry.RegisterSingleTaskModel
class TinyConvClassifier(base_model_params.SingleTaskModelParams):
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

  def Train(self):
    return input_generator.SyntheticImageInput.Params().Set(
        name='train', batch_size=self.BATCH_SIZE, seed=0,
        image_size=self.IMAGE_SIZE, channels=3, num_classes=self.NUM_CLASSES)

  def Task(self):
    p = task.BaseTask.Params()
    p.name = 'image'
    p.model = conv_classifier.ConvClassifier.Params().Set(
        image_size=self.IMAGE_SIZE, channels=3, num_classes=self.NUM_CLASSES,
        base_width=self.BASE_WIDTH, blocks_per_stage=self.BLOCKS_PER_STAGE)
    p.pipeline.Set(num_partitions=self.NUM_PARTITIONS,
                   num_micro_batches=self.NUM_MICRO_BATCHES)
    p.train.Set(learning_rate=self.LEARNING_RATE, max_steps=self.MAX_STEPS,
                save_interval_steps=100, log_interval_steps=50)
    p.train.lr_schedule.Set(warmup_steps=50, decay='cosine',
                            decay_steps=self.MAX_STEPS, min_ratio=0.05)
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


# Train the tiny conv classifier:
#   python -m tfpipe.trainer --model=image.TinyConvClassifier --logdir=/tmp/image
# The larger ones:
#   python -m tfpipe.trainer --model=image.SmallConvClassifier --logdir=/tmp/image_small
#   python -m tfpipe.trainer --model=image.LargeConvClassifier --logdir=/tmp/image_large --run_locally=gpu
