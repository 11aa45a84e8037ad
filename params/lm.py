"""Transformer LMs: the synthetic sequence-reversal task and real text.

The task (see input_generator.SequenceTaskInput) scores only the tokens after
the separator, which a model gets right only by attending to the right source
position, so token accuracy measures real learning: chance is 1/14.
TinyTransformerLm is the project's default experiment: 2 pipeline partitions
on 2 CPU cores, it reaches >= 95% token accuracy in a few minutes.
StdlibCharLm is a byte-level LM on the .py files of Python's standard
library, which every installation ships; it reports bits per character.
"""

from models import char_lm
from models import transformer_lm
from params import recipes
from tfpipe import base_model_params
from tfpipe import model_registry
from tfpipe.trainer import input_generator
from tfpipe.trainer import task


@model_registry.RegisterSingleTaskModel
class TinyTransformerLm(base_model_params.SingleTaskModelParams):
  """2 blocks of width 64, reverse 8 tokens; 2 partitions x 4 micro-batches."""

  VOCAB_SIZE = 16
  LENGTH = 8
  MODEL_DIM = 64
  NUM_LAYERS = 2
  NUM_HEADS = 4
  HIDDEN_DIM = 128
  BATCH_SIZE = 64
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4
  MAX_STEPS = 300
  LEARNING_RATE = 3e-3
  WARMUP_STEPS = 50

  def Train(self):
    return input_generator.SequenceTaskInput.Params().Set(
        name='train', batch_size=self.BATCH_SIZE, seed=0,
        vocab_size=self.VOCAB_SIZE, length=self.LENGTH, task='reverse')

  def Task(self):
    p = task.BaseTask.Params()
    p.name = 'lm'
    p.model = transformer_lm.TransformerLm.Params().Set(
        vocab_size=self.VOCAB_SIZE, sequence_length=2 * self.LENGTH,
        model_dim=self.MODEL_DIM, num_layers=self.NUM_LAYERS,
        num_heads=self.NUM_HEADS, hidden_dim=self.HIDDEN_DIM)
    recipes.SetPipelinedCosineTraining(p, self, save_interval_steps=100,
                                       log_interval_steps=50,
                                       clip_gradient_norm=1.0)
    p.eval.Set(interval_steps=100, num_batches=8)
    return p


@model_registry.RegisterSingleTaskModel
class SmallTransformerLm(TinyTransformerLm):
  """4 blocks of width 128, reverse 16 tokens; 4 partitions x 8 micro-batches."""

  VOCAB_SIZE = 32
  LENGTH = 16
  MODEL_DIM = 128
  NUM_LAYERS = 4
  NUM_HEADS = 4
  HIDDEN_DIM = 512
  BATCH_SIZE = 64
  NUM_PARTITIONS = 4
  NUM_MICRO_BATCHES = 8
  MAX_STEPS = 3000
  LEARNING_RATE = 1e-3
  WARMUP_STEPS = 300


@model_registry.RegisterSingleTaskModel
class LargeTransformerLm(TinyTransformerLm):
  """24 blocks of width 1024 (~300M params): a GPU-scale pipeline of 8 cells."""

  VOCAB_SIZE = 1024
  LENGTH = 128
  MODEL_DIM = 1024
  NUM_LAYERS = 24
  NUM_HEADS = 16
  HIDDEN_DIM = 4096
  BATCH_SIZE = 128
  NUM_PARTITIONS = 8
  NUM_MICRO_BATCHES = 32
  MAX_STEPS = 20000
  LEARNING_RATE = 3e-4
  WARMUP_STEPS = 2000

  def Task(self):
    p = super().Task()
    p.model.dropout_prob = 0.1
    p.pipeline.remat_policy = 'always'
    return p


@model_registry.RegisterSingleTaskModel
class StdlibCharLm(base_model_params.SingleTaskModelParams):
  """A byte-level Transformer LM on the Python standard library's own sources.

  Real text with no download: the .py files of the running Python
  (input_generator.PythonSourceTextInput), about 5% of them (chosen by a
  hash of their paths) held out for eval, which reports bits per character
  on 64-byte windows of the held-out files. Measured on 2 shared CPU cores:
  2.86 bits/char after the 250 steps (80-90 s), 2.13 after 1000 steps.
  """

  SEQUENCE_LENGTH = 64
  MODEL_DIM = 128
  NUM_LAYERS = 2
  NUM_HEADS = 4
  HIDDEN_DIM = 512
  BATCH_SIZE = 64
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4
  MAX_STEPS = 250
  LEARNING_RATE = 1e-2
  WARMUP_STEPS = 25

  def Train(self):
    return input_generator.PythonSourceTextInput.Params().Set(
        name='train', batch_size=self.BATCH_SIZE, seed=0, split='train',
        sequence_length=self.SEQUENCE_LENGTH)

  def Test(self):
    p = super().Test()
    p.split = 'eval'
    return p

  def Task(self):
    p = task.BaseTask.Params()
    p.name = 'char_lm'
    p.model = char_lm.CharTransformerLm.Params().Set(
        sequence_length=self.SEQUENCE_LENGTH, model_dim=self.MODEL_DIM,
        num_layers=self.NUM_LAYERS, num_heads=self.NUM_HEADS,
        hidden_dim=self.HIDDEN_DIM)
    recipes.SetPipelinedCosineTraining(p, self, save_interval_steps=100,
                                       log_interval_steps=50,
                                       clip_gradient_norm=1.0)
    p.eval.Set(num_batches=16)
    return p


# Train the default (tiny) model:
#   python -m tfpipe.trainer --model=lm.TinyTransformerLm --logdir=/tmp/lm
# The larger ones:
#   python -m tfpipe.trainer --model=lm.SmallTransformerLm --logdir=/tmp/lm_small
#   python -m tfpipe.trainer --model=lm.LargeTransformerLm --logdir=/tmp/lm_large --run_locally=gpu
# The character-level LM on the standard library's sources:
#   python -m tfpipe.trainer --model=lm.StdlibCharLm --logdir=/tmp/char_lm
