"""MLP classifiers on a synthetic linear-teacher task.

The quickest experiments: useful to check a pipeline setup end to end (the
tests train TinyMlp with 1 and 4 partitions and compare the loss curves).
"""

from models import mlp
from tfpipe import base_model_params
from tfpipe import model_registry
from tfpipe.trainer import input_generator
from tfpipe.trainer import task


@model_registry.RegisterSingleTaskModel
class TinyMlp(base_model_params.SingleTaskModelParams):
  """4 hidden layers of width 32 on 16-d inputs; 2 partitions x 4 micro-batches."""

  INPUT_DIM = 16
  NUM_CLASSES = 4
  HIDDEN_DIM = 32
  NUM_HIDDEN_LAYERS = 4
  BATCH_SIZE = 32
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4
  MAX_STEPS = 300
  LEARNING_RATE = 3e-3

  def Train(self):
    return input_generator.SyntheticClassificationInput.Params().Set(
        name='train', batch_size=self.BATCH_SIZE, seed=0,
        input_dim=self.INPUT_DIM, num_classes=self.NUM_CLASSES)

  def Task(self):
    p = task.BaseTask.Params()
    p.name = 'mlp'
    p.model = mlp.Mlp.Params().Set(
        input_dim=self.INPUT_DIM, hidden_dim=self.HIDDEN_DIM,
        num_hidden_layers=self.NUM_HIDDEN_LAYERS, num_classes=self.NUM_CLASSES)
    p.pipeline.Set(num_partitions=self.NUM_PARTITIONS,
                   num_micro_batches=self.NUM_MICRO_BATCHES)
    p.train.Set(learning_rate=self.LEARNING_RATE, max_steps=self.MAX_STEPS,
                save_interval_steps=100, log_interval_steps=50)
    p.eval.Set(num_batches=8)
    return p


@model_registry.RegisterSingleTaskModel
class SmallMlp(TinyMlp):
  """8 hidden layers of width 256 on 64-d inputs; 4 partitions x 8 micro-batches."""

  INPUT_DIM = 64
  NUM_CLASSES = 10
  HIDDEN_DIM = 256
  NUM_HIDDEN_LAYERS = 8
  BATCH_SIZE = 128
  NUM_PARTITIONS = 4
  NUM_MICRO_BATCHES = 8
  MAX_STEPS = 2000


@model_registry.RegisterSingleTaskModel
class LargeMlp(TinyMlp):
  """32 hidden layers of width 4096 (~500M params): 8 GPU cells."""

  INPUT_DIM = 1024
  NUM_CLASSES = 100
  HIDDEN_DIM = 4096
  NUM_HIDDEN_LAYERS = 32
  BATCH_SIZE = 512
  NUM_PARTITIONS = 8
  NUM_MICRO_BATCHES = 32
  MAX_STEPS = 10000
  LEARNING_RATE = 3e-4


# Train the tiny MLP:
#   python -m tfpipe.trainer --model=mlp.TinyMlp --logdir=/tmp/mlp
# The larger ones:
#   python -m tfpipe.trainer --model=mlp.SmallMlp --logdir=/tmp/mlp_small
#   python -m tfpipe.trainer --model=mlp.LargeMlp --logdir=/tmp/mlp_large --run_locally=gpu
