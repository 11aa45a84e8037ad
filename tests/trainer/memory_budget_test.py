"""Tests of tfpipe.trainer.memory_budget: the trainer's memory flags.

Protected properties: the role is read without TensorFlow (a controller
watches nothing, a worker and a single process lower the log level to see
TensorFlow's out-of-memory warnings); --plan=auto asks for a budget and a
device count, naming the flags; the limit quoted by an out-of-memory error
is the capped process's own, shared by its logical devices.
"""

import os

from absl import flags
from absl.testing import flagsaver
import pytest

from tfpipe import memory_limit
from tfpipe import model_registry
from tfpipe import out_of_memory
from tfpipe.trainer import memory_budget
from tfpipe.trainer import trainer  # pylint: disable=unused-import

FLAGS = flags.FLAGS


@pytest.fixture(autouse=True)
def parsed_flags(monkeypatch):
  if not FLAGS.is_parsed():
    FLAGS(['trainer'])
  monkeypatch.delenv('TF_CONFIG', raising=False)
  monkeypatch.delenv(out_of_memory.LOG_LEVEL_ENV, raising=False)
  yield


@flagsaver.flagsaver(job='controller')
def test_a_controller_watches_nothing():
  watch = memory_budget.WatchThisProcess(FLAGS, False)
  assert watch.Records() == []
  assert out_of_memory.LOG_LEVEL_ENV not in os.environ


@flagsaver.flagsaver(job='worker', task=1,
                     cluster_spec='controller=127.0.0.1:1;worker=127.0.0.1:2,'
                     '127.0.0.1:3')
def test_a_worker_keeps_tensorflow_warnings_and_reports(tmp_path,
                                                        monkeypatch):
  paths = []
  monkeypatch.setattr(out_of_memory, 'ReportPath', lambda *args: (
      paths.append(args) or str(tmp_path / 'report.jsonl')))
  memory_budget.WatchThisProcess(FLAGS, False).Stop()
  assert os.environ[out_of_memory.LOG_LEVEL_ENV] == '1'
  assert paths == [('worker', 1, '127.0.0.1:3')]
  assert (tmp_path / 'report.jsonl').exists()


def test_plan_needs_a_budget_and_a_device_count():
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  with flagsaver.flagsaver(plan='auto'):
    with pytest.raises(ValueError, match='pass --device_memory_mb'):
      memory_budget.PlanIfAsked(p, FLAGS)
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, num_devices=0,
                           run_locally='cpu'):
    with pytest.raises(ValueError, match='pass --num_devices'):
      memory_budget.PlanIfAsked(p, FLAGS)
  with flagsaver.flagsaver(plan='none'):
    assert memory_budget.PlanIfAsked(p, FLAGS) is None


def test_a_capped_process_quotes_its_own_shared_limit(monkeypatch):
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  monkeypatch.setenv(memory_limit.BFC_ENV, 'true')
  monkeypatch.setenv(memory_limit.LIMIT_ENV, '12')
  diagnosis = memory_budget.Diagnosis(p, FLAGS, ['/CPU:0', '/CPU:1'], None,
                                      None, None, last_good=None)
  assert (diagnosis.limit_mb, diagnosis.shared_limit) == (12, True)


@pytest.mark.parametrize('hosts, at_once', [
    (('127.0.0.1', 'localhost'), 2), (('127.0.0.1', 'h1.example'), None)])
def test_plan_lets_workers_on_this_host_take_turns_on_its_cores(
    monkeypatch, hosts, at_once):
  from tfpipe.gpipe import planner  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import auto_plan  # pylint: disable=g-import-not-at-top
  chosen = []
  monkeypatch.setattr(auto_plan, 'Choose',
                      lambda p, devices, **unused: chosen.append(devices))
  monkeypatch.setattr(planner.os, 'sched_getaffinity', lambda pid: {0, 1, 2, 3},
                      raising=False)
  spec = f'controller=127.0.0.1:1;worker={hosts[0]}:2,{hosts[1]}:3'
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, job='controller',
                           cluster_spec=spec, intra_op_threads=2):
    memory_budget.PlanIfAsked(p, FLAGS)
  assert chosen[0].count == 2 and chosen[0].computing_at_once == at_once
  # Workers on this host send to each other at loopback speed.
  assert bool(chosen[0].bandwidth_bytes_per_s) == (at_once is not None)
