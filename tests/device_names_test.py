"""Tests of tfpipe.device_names: one canonical name per device, pipeline layouts.

A user relies on: every spelling of a device meaning that device (the
pipeline's device check and the placement audit compare canonical names, so
a mismatch would either refuse a valid device or miss a misplaced op);
replica-major layouts over workers; and a mesh table that shows each
replica's stages.
"""

import pytest
import tensorflow as tf

from tfpipe import device_names


@pytest.mark.parametrize('name', [
    '/CPU:0', '/device:CPU:0', '/cpu:0', '/job:localhost/device:CPU:0',
    '/job:localhost/replica:0/task:0/device:CPU:0'])
def test_every_spelling_of_a_local_device_is_one_name(name):
  assert device_names.CanonicalDevice(name) == (
      '/job:localhost/replica:0/task:0/device:CPU:0')


def test_names_of_different_devices_stay_apart():
  assert device_names.SameDevice('/job:worker/task:1/device:CPU:0',
                                 '/job:worker/replica:0/task:1/device:CPU:0')
  assert not device_names.SameDevice('/CPU:0', '/CPU:1')
  assert not device_names.SameDevice('/CPU:0', '/GPU:0')
  assert not device_names.SameDevice('/job:worker/task:0/device:CPU:0',
                                     '/job:worker/task:1/device:CPU:0')
  assert not device_names.SameDevice('/job:worker/task:0/device:CPU:0',
                                     '/CPU:0')


def test_another_process_is_told_by_job_and_task_not_device_type():
  """This process (not in a cluster) is job 'localhost': its logical devices
  are its own; a worker task's CPU and GPU are another process's."""
  for local in ('/CPU:1', '/GPU:0', '/job:localhost/replica:0/task:0/CPU:0'):
    assert not device_names.OnOtherProcess(local), local
  for remote in ('/job:worker/replica:0/task:1/device:CPU:0',
                 '/job:worker/task:0/device:GPU:0'):
    assert device_names.OnOtherProcess(remote), remote


def test_memory_queries_take_the_short_name_of_any_spelling():
  for name in ('/GPU:1', '/device:GPU:1',
               '/job:localhost/replica:0/task:0/device:GPU:1'):
    assert device_names.AllocatorName(name) == 'GPU:1'
  assert device_names.AllocatorName('/cpu:0') == 'CPU:0'


def test_a_variable_reports_the_canonical_name_of_its_device():
  with tf.device('/CPU:1'):
    v = tf.Variable(1.0)
  assert device_names.CanonicalDevice(v.device) == (
      device_names.CanonicalDevice('/CPU:1'))


def test_a_name_that_is_not_a_device_is_refused():
  with pytest.raises(ValueError):
    device_names.CanonicalDevice('/CPU:0/GPU:0:x')


def test_pipeline_devices_are_replica_major_over_the_workers():
  assert device_names.WorkerDevices(2, 2) == [
      '/job:worker/replica:0/task:0/device:CPU:0',
      '/job:worker/replica:0/task:1/device:CPU:0']
  devices = device_names.WorkerDevices(2, 4, num_replicas=2)
  assert [d.split('/')[3] for d in devices] == [
      'task:0', 'task:1', 'task:2', 'task:3']
  shared = device_names.WorkerDevices(4, 2, devices_per_worker=2)
  assert [d.split('/', 3)[3] for d in shared] == [
      'task:0/device:CPU:0', 'task:1/device:CPU:0', 'task:0/device:CPU:1',
      'task:1/device:CPU:1']
  with pytest.raises(ValueError, match='num_workers'):
    device_names.WorkerDevices(2, 0)


def test_device_mesh_text_shows_each_replica_s_stages():
  devices = device_names.WorkerDevices(2, 4, num_replicas=2)
  text = device_names.DeviceMeshText(devices, 2)
  assert text.splitlines() == [
      'device mesh: 2 replica(s) x 2 cell(s)',
      '  replica 0: [0] /job:worker/replica:0/task:0/device:CPU:0  '
      '[1] /job:worker/replica:0/task:1/device:CPU:0',
      '  replica 1: [0] /job:worker/replica:0/task:2/device:CPU:0  '
      '[1] /job:worker/replica:0/task:3/device:CPU:0']
  with pytest.raises(ValueError, match='3 devices do not make 2 equal'):
    device_names.DeviceMeshText(devices[:3], 2)
