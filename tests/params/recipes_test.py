"""Tests of the shared training recipe of the registered experiments."""

from params import recipes
from tfpipe.trainer import task as task_lib


class _Config:
  NUM_PARTITIONS = 4
  NUM_MICRO_BATCHES = 8
  LEARNING_RATE = 1e-3
  MAX_STEPS = 1000
  WARMUP_STEPS = 100


def test_sets_layout_budget_and_a_cosine_after_warmup():
  p = recipes.SetPipelinedCosineTraining(
      task_lib.BaseTask.Params(), _Config(), log_interval_steps=7,
      clip_gradient_norm=1.0)
  assert (p.pipeline.num_partitions, p.pipeline.num_micro_batches) == (4, 8)
  assert (p.train.learning_rate, p.train.max_steps) == (1e-3, 1000)
  assert (p.train.log_interval_steps, p.train.clip_gradient_norm) == (7, 1.0)
  schedule = p.train.lr_schedule
  assert (schedule.warmup_steps, schedule.decay, schedule.decay_steps,
          schedule.min_ratio) == (100, 'cosine', 900, recipes.MIN_LR_RATIO)


def test_decay_steps_may_be_given():
  p = recipes.SetPipelinedCosineTraining(task_lib.BaseTask.Params(), _Config(),
                                         decay_steps=1000)
  assert p.train.lr_schedule.decay_steps == 1000
