"""The training recipe that the registered experiments share.

Every experiment here trains its pipeline the same way: the layout and the
step budget come from its class constants, and the learning rate warms up
linearly, then follows a cosine down to 5% of its peak. Setting that in one
place keeps the configurations to what differs between them (model, sizes,
intervals), and a change of recipe reaches all of them at once.
"""

# Floor of the cosine decay, as a fraction of the peak learning rate.
MIN_LR_RATIO = 0.05


def SetPipelinedCosineTraining(p, config, decay_steps=None, **train):
  """Sets `p.pipeline`, `p.train` and its cosine lr schedule from `config`.

  Args:
    p: task params (task.BaseTask.Params()).
    config: the experiment (a SingleTaskModelParams), whose NUM_PARTITIONS,
      NUM_MICRO_BATCHES, LEARNING_RATE, MAX_STEPS and WARMUP_STEPS are used.
    decay_steps: steps of the cosine decay; None: the steps after warmup, so
      the rate reaches its floor at MAX_STEPS.
    **train: further `p.train` fields (intervals, gradient clipping).

  Returns:
    p.
  """
  p.pipeline.Set(num_partitions=config.NUM_PARTITIONS,
                 num_micro_batches=config.NUM_MICRO_BATCHES)
  p.train.Set(learning_rate=config.LEARNING_RATE, max_steps=config.MAX_STEPS,
              **train)
  if decay_steps is None:
    decay_steps = config.MAX_STEPS - config.WARMUP_STEPS
  p.train.lr_schedule.Set(warmup_steps=config.WARMUP_STEPS, decay='cosine',
                          decay_steps=decay_steps, min_ratio=MIN_LR_RATIO)
  return p
