"""Tests of tfpipe.cluster_spec: the spec's forms, task names, loopback hosts.

A user relies on: both spec forms (compact and JSON/TF_CONFIG) reading the
same, flags winning over TF_CONFIG, errors that name the flag, and a host
being called loopback by its address whatever its spelling (a wrong answer
there would let a "loopback" server listen on the network).
"""

import pytest

from tfpipe import cluster_spec


def test_compact_and_json_forms_read_the_same():
  jobs = cluster_spec.ParseClusterJobs(
      'controller=127.0.0.1:1000; worker=127.0.0.1:1001,127.0.0.1:1002')
  assert jobs == {'controller': ['127.0.0.1:1000'],
                  'worker': ['127.0.0.1:1001', '127.0.0.1:1002']}
  assert cluster_spec.ParseClusterJobs(
      cluster_spec.FormatClusterSpec(jobs)) == jobs
  assert cluster_spec.ParseClusterJobs(
      '{"cluster": {"worker": ["127.0.0.1:1001", "127.0.0.1:1002"], '
      '"controller": ["127.0.0.1:1000"]}, "task": {"type": "worker"}}') == jobs
  spec = cluster_spec.ParseClusterSpec('{"worker": ["127.0.0.1:5"]}')
  assert spec.as_dict() == {'worker': ['127.0.0.1:5']}
  assert cluster_spec.JobTasks(jobs) == [
      ('/job:worker/task:0', '127.0.0.1:1001'),
      ('/job:worker/task:1', '127.0.0.1:1002')]
  assert cluster_spec.TaskAddress(jobs, 'controller', 0) == '127.0.0.1:1000'
  assert cluster_spec.TaskAddress(jobs, 'controller', 1) is None


@pytest.mark.parametrize('text,match', [
    ('', 'is empty'), ('worker', 'job=host:port'),
    ('worker=127.0.0.1', 'not host:port'), ('worker=h:0', 'not host:port'),
    ('{"worker": []}', 'needs a list'), ('{bad', 'invalid JSON')])
def test_parse_errors_name_the_flag(text, match):
  with pytest.raises(ValueError, match=match) as e:
    cluster_spec.ParseClusterJobs(text)
  assert '--cluster_spec' in str(e.value)


def test_split_address_reads_ipv6_brackets():
  assert cluster_spec.SplitAddress('[::1]:2222') == ('::1', 2222)
  assert cluster_spec.SplitAddress('host.example:80') == ('host.example', 80)


def test_resolve_cluster_from_tf_config_with_flags_winning():
  env = {'TF_CONFIG': '{"cluster": {"worker": ["127.0.0.1:7", '
                      '"127.0.0.1:8"]}, "task": {"type": "worker", '
                      '"index": 1}}'}
  spec, job, task = cluster_spec.ResolveCluster('', None, None, env)
  assert (job, task) == ('worker', 1)
  assert spec.num_tasks('worker') == 2
  _, job, task = cluster_spec.ResolveCluster('', 'worker', 0, env)
  assert task == 0
  assert cluster_spec.ResolveCluster('', None, None, {}) is None
  with pytest.raises(ValueError, match='--task=5'):
    cluster_spec.ResolveCluster('', 'worker', 5, env)
  with pytest.raises(ValueError, match="--job='ps'"):
    cluster_spec.ResolveCluster('', 'ps', 0, env)
  with pytest.raises(ValueError, match='no "cluster" entry'):
    cluster_spec.ResolveCluster('', 'worker', 0, {'TF_CONFIG': '{}'})


@pytest.mark.parametrize('host', [
    '127.0.0.1', '127.0.0.2', '127.1', '127.255.255.254', '::1', '[::1]',
    '::ffff:127.0.0.1', 'localhost', 'localhost.', 'LOCALHOST'])
def test_loopback_is_recognised_by_address(host):
  assert cluster_spec.IsLoopbackAddress(host)


@pytest.mark.parametrize('host', [
    '0.0.0.0', '::', '10.0.0.1', '128.0.0.1', '126.255.255.255', '::2',
    '[::ffff:10.0.0.1]', '192.168.1.127', ''])
def test_routable_addresses_are_not_loopback(host):
  assert not cluster_spec.IsLoopbackAddress(host)

