"""Encoder-decoder Transformers on the generated translation-like task.

The task (see input_generator.TranslationTaskInput) maps a source sentence
through a lexicon, swaps adjacent words and writes some words as two tokens,
so the decoder must attend to the right source word at every step; chance
token accuracy is below 1/16. Accuracy is over every target token and EOS,
with the previous target tokens given (teacher forcing).

TransformerNmt is the GPipe paper's T(6, 8192, 16): 6 encoder and 6 decoder
layers, feed-forward size 8192, 16 heads and model dim 1024 (the paper fixes
it), with a 64k vocabulary: 408,209,920 parameters, the paper's "400M".
"""

from models import transformer_nmt
from params import recipes
from tfpipe import base_model_params
from tfpipe import model_registry
from tfpipe.trainer import input_generator
from tfpipe.trainer import task


@model_registry.RegisterSingleTaskModel
class TinyTransformerNmt(base_model_params.SingleTaskModelParams):
  """T(2, 128, 4) of width 64 on 3-8 word sentences; 2 partitions x 4 micro-batches."""

  NUM_WORDS = 16
  MIN_LENGTH = 3
  MAX_LENGTH = 8
  MODEL_DIM = 64
  NUM_LAYERS = 2
  NUM_HEADS = 4
  HIDDEN_DIM = 128
  DROPOUT_PROB = 0.0
  BATCH_SIZE = 64
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4
  MAX_STEPS = 400
  LEARNING_RATE = 5e-3
  WARMUP_STEPS = 50

  def _Input(self):
    return input_generator.TranslationTaskInput.Params().Set(
        num_words=self.NUM_WORDS, min_length=self.MIN_LENGTH,
        max_length=self.MAX_LENGTH)

  def Train(self):
    return self._Input().Set(name='train', batch_size=self.BATCH_SIZE, seed=0)

  def Task(self):
    task_input = self._Input().Instantiate()
    p = task.BaseTask.Params()
    p.name = 'mt'
    p.model = transformer_nmt.TransformerNmt.Params().Set(
        vocab_size=task_input.vocab_size,
        source_length=task_input.source_length,
        target_length=task_input.target_length, model_dim=self.MODEL_DIM,
        num_layers=self.NUM_LAYERS, num_heads=self.NUM_HEADS,
        hidden_dim=self.HIDDEN_DIM, dropout_prob=self.DROPOUT_PROB)
    recipes.SetPipelinedCosineTraining(p, self, save_interval_steps=200,
                                       log_interval_steps=50,
                                       clip_gradient_norm=1.0)
    p.eval.Set(interval_steps=200, num_batches=8)
    return p


@model_registry.RegisterSingleTaskModel
class TransformerNmt(TinyTransformerNmt):
  """The paper's T(6, 8192, 16), model dim 1024, 64k vocabulary (408M parameters).

  The generated task is scaled to the paper's vocabulary (31,998 words a
  language: 64,000 ids) and to sentences of up to 63 words, so the shapes
  and costs are the paper's; for real translation, return a TFRecordInput
  of your wordpiece ids from Train().
  """

  NUM_WORDS = 31998
  MIN_LENGTH = 8
  MAX_LENGTH = 63
  MODEL_DIM = 1024
  NUM_LAYERS = 6
  NUM_HEADS = 16
  HIDDEN_DIM = 8192
  DROPOUT_PROB = 0.1
  BATCH_SIZE = 256
  NUM_PARTITIONS = 4
  NUM_MICRO_BATCHES = 16
  MAX_STEPS = 100000
  LEARNING_RATE = 1e-3
  WARMUP_STEPS = 4000


# Train the tiny translation model:
#   python -m tfpipe.trainer --model=mt.TinyTransformerNmt --logdir=/tmp/mt
# The paper's T(6, 8192, 16):
#   python -m tfpipe.trainer --model=mt.TransformerNmt --logdir=/tmp/mt_big --run_locally=gpu
