"""Tests of the LM configs: the char LM trains on the stdlib and reports bits/char."""

# bazel: size=medium

from tests.params import command_line
from tfpipe import model_registry


command_line.Declare('lm.StdlibCharLm', '--model=lm.StdlibCharLm',
                     '--max_steps=2',
                     '--model_params_override=task.eval.num_batches: 1')


def test_char_lm_trains_from_the_command_line():
  stdout = command_line.Stdout('lm.StdlibCharLm')
  assert 'step 2/2 loss=' in stdout
  final = command_line.FinalEval(stdout)
  # Two steps from random weights: close to 8 bits, a uniform byte's cost.
  assert 6.0 < final['bits_per_char'] < 10.0


def test_char_lm_evaluates_on_held_out_files():
  p = model_registry.GetParams('lm.StdlibCharLm')
  assert (p.input.split, p.eval_input.split) == ('train', 'eval')
  assert p.input.sequence_length == p.task.model.sequence_length
  assert p.task.model.vocab_size == 256
