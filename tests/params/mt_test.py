"""Tests of the translation configs: they train from the command line, paper size."""

# bazel: size=medium

from tests.params import command_line
from tfpipe import model_registry


command_line.Declare('mt.TinyTransformerNmt', '--model=mt.TinyTransformerNmt',
                     '--max_steps=2')


def test_tiny_translation_model_trains_from_the_command_line():
  stdout = command_line.Stdout('mt.TinyTransformerNmt')
  assert 'step 2/2 loss=' in stdout
  assert 0.0 <= command_line.FinalEval(stdout)['accuracy'] <= 1.0


def test_paper_transformer_is_t_6_8192_16():
  p = model_registry.GetParams('mt.TransformerNmt')
  model = p.task.model.Instantiate()
  m = model.p
  assert (m.num_layers, m.hidden_dim, m.num_heads, m.model_dim) == (
      6, 8192, 16, 1024)
  assert m.vocab_size == 64000
  assert model.NumParams() == 408_209_920


def test_tiny_model_matches_its_task():
  p = model_registry.GetParams('mt.TinyTransformerNmt')
  task_input = p.input.Instantiate()
  assert p.task.model.vocab_size == task_input.vocab_size
  assert p.task.model.source_length == task_input.source_length
  assert p.task.model.target_length == task_input.target_length
