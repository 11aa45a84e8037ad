"""A test's probe process: loopback workers, its checks, then the workers killed.

Starting TensorFlow processes costs seconds, so a test file that needs
worker processes runs itself as a module (`python -m MODULE probe`): the
probe enters a loopback-only network namespace (as the launcher does), starts
the workers (the same module, `MODULE worker SPEC TASK`), makes itself
their controller, runs the checks, which print what the tests read, and
kills the workers whatever happened.
"""
# bazel: deps=//tfpipe:cluster_spec,//tfpipe:local_cluster,//tfpipe:network_namespace,//tfpipe:servers

import os
import subprocess
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def Probe(module, num_workers, checks, startup_timeout_s=90):
  """In a loopback-only namespace: starts `num_workers` workers of
  `module`, connects to them, runs `checks()`, kills the workers."""
  # pylint: disable=g-import-not-at-top
  from tfpipe import cluster_spec
  from tfpipe import local_cluster
  from tfpipe import network_namespace
  network_namespace.EnterLoopbackNamespace(module, sys.argv)
  children = local_cluster.ChildProcesses(module.rsplit('.', 1)[-1])
  try:
    jobs = local_cluster.LocalClusterJobs(num_workers)
    spec = cluster_spec.FormatClusterSpec(jobs)
    local_cluster.StartWorkers(
        children, jobs, lambda k: [sys.executable, '-m', module, 'worker',
                                   spec, str(k)], startup_timeout_s,
        cwd=_REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import tensorflow as tf
    from tfpipe import servers
    servers.ConnectToCluster(tf.train.ClusterSpec(jobs))
    checks()
  finally:
    children.Close()


def Serve(spec, task, num_devices):
  """A worker of the probe: serves `num_devices` CPU devices until killed."""
  # pylint: disable=g-import-not-at-top
  from tfpipe import cluster_spec
  from tfpipe import servers
  servers.Serve(cluster_spec.ParseClusterSpec(spec), cluster_spec.WORKER_JOB,
                task, num_devices=num_devices, intra_op_threads=1,
                inter_op_threads=2)
