"""TensorFlow's gRPC servers: starting them, connecting to them, seeing them answer.

In a tfpipe cluster every worker runs a `tf.distribute.Server` and only
serves; the controller connects to all of them
(`tf.config.experimental_connect_to_cluster`), builds the pipeline with cell
k of replica r on a remote device, and drives every step. Variables,
gradients and checkpoints are all handled by the controller's program, so a
multi-host run computes exactly what a single-process run computes.

TensorFlow's server listens on every interface, whatever address the spec
gives, and has no authentication. So "bind to 127.0.0.1" can only be
honoured by running the whole job in a loopback-only network namespace
(tfpipe.network_namespace); `StartServer` and `ConnectToCluster` refuse a
loopback bind address outside one (`CheckBindAddress`) instead of silently
listening on the network.

`ProbeGrpc` tells whether a server answers, which a TCP connect cannot (the
kernel accepts connections for a stopped process); `WaitForTasks` waits for
a set of them with a deadline, and the controller's watchdog
(tfpipe.multihost) probes them while it trains.

TensorFlow is imported only inside the functions that need it.
"""

import os
import socket
import sys
import time

from tfpipe import cluster_spec as cluster_spec_lib
from tfpipe import memory_limit
from tfpipe import network_namespace

# HTTP/2 connection preface followed by an empty SETTINGS frame. A live gRPC
# server answers with its own SETTINGS frame (type 4) at once.
_HTTP2_PREFACE = (b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' +
                  b'\x00\x00\x00\x04\x00\x00\x00\x00\x00')


def CheckBindAddress(bind_address, address, what):
  """Refuses a loopback bind that TensorFlow would turn into 0.0.0.0.

  Args:
    bind_address: --bind_address: a loopback address, or the explicit choice
      to serve on the network ('0.0.0.0', '::' or an address of this host).
    address: this task's 'host:port' in the cluster spec.
    what: the task, for messages.

  Raises:
    ValueError: a bind address that is none of these (empty, mistyped, or
      another host's); a loopback bind outside a loopback-only network
      namespace, or for a task whose address is not loopback.
  """
  host, _ = cluster_spec_lib.SplitAddress(address, what)
  problem = cluster_spec_lib.BindAddressProblem(bind_address)
  if problem:
    raise ValueError(
        f'{what}: --bind_address={bind_address!r} is not an address of this '
        f'host ({problem}). Give 127.0.0.1 (this host only), 0.0.0.0 or :: '
        '(serve on the network on purpose), or one of this host\'s '
        'addresses.')
  if not cluster_spec_lib.IsLoopbackAddress(bind_address):
    print(f'{what}: --bind_address={bind_address}: TensorFlow\'s gRPC server '
          f'listens on every interface of this host at {address}, with no '
          'authentication; keep its port reachable only inside a trusted '
          'network.', file=sys.stderr, flush=True)
    return
  if not cluster_spec_lib.IsLoopbackAddress(host):
    raise ValueError(
        f'{what} is at {address}, not a loopback address, but '
        f'--bind_address={bind_address}. Give loopback addresses in '
        '--cluster_spec, or pass --bind_address=0.0.0.0 to serve on the '
        'network on purpose.')
  if not network_namespace.OnlyLoopbackInterfaces():
    raise ValueError(
        f'{what}: --bind_address={bind_address}, but TensorFlow\'s gRPC '
        'server always listens on 0.0.0.0 and this network namespace has '
        'interfaces other than lo. Start the job with `python -m '
        'tfpipe.launcher` (which runs it in a loopback-only namespace), or '
        'run it under `unshare --net --map-root-user`, or pass '
        '--bind_address=0.0.0.0 to serve on the network on purpose.')


def _TaskAddress(cluster_spec, job, task):
  """This task's address; ValueError naming the task if the spec lacks it."""
  address = cluster_spec_lib.TaskAddress(cluster_spec, job, task)
  if address is None:
    raise ValueError(
        f'The cluster spec has no {cluster_spec_lib.TaskName(job, task)}; add '
        f'it, e.g. "{job}=127.0.0.1:PORT;worker=...".')
  return address


def StartServer(cluster_spec, job, task, bind_address='127.0.0.1',
                num_devices=1, intra_op_threads=0, inter_op_threads=0):
  """Starts this task's tf.distribute.Server with `num_devices` CPU devices.

  Args:
    cluster_spec: a tf.train.ClusterSpec.
    job: this task's job.
    task: this task's index in `job`.
    bind_address: see CheckBindAddress.
    num_devices: CPU devices the server exposes.
    intra_op_threads: threads one op may use; 0: TensorFlow's default.
    inter_op_threads: ops run at once; 0: TensorFlow's default. A worker
      that runs pipeline cells needs two or more even when it should
      compute one op at a time: one runs the current action (a call on
      the single-threaded executor, gpipe/cell_runtime.py), the other
      hands tensors on to its neighbours.

  Raises:
    ValueError: see CheckBindAddress; or the spec has no such task.
    RuntimeError: the server did not start (e.g. its port is in use).
  """
  # The ConfigProto below sizes the pools of graph sessions only; the
  # functions a controller runs here (eager remote execution, which is how
  # tfpipe drives workers) use the process's default pools, sized from
  # these variables when the runtime starts. Without them a worker asked
  # for one thread ran its ops on as many as the machine has cores.
  for variable, threads in (('TF_NUM_INTRAOP_THREADS', intra_op_threads),
                            ('TF_NUM_INTEROP_THREADS', inter_op_threads)):
    if threads:
      os.environ[variable] = str(threads)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  name = cluster_spec_lib.TaskName(job, task)
  address = _TaskAddress(cluster_spec, job, task)
  CheckBindAddress(bind_address, address, name)
  # A capped worker is an emulated accelerator: its memory one region.
  memory_limit.OpenOneRegion()
  config = tf.compat.v1.ConfigProto(
      device_count={'CPU': num_devices},
      intra_op_parallelism_threads=intra_op_threads,
      inter_op_parallelism_threads=inter_op_threads)
  try:
    return tf.distribute.Server(cluster_spec, job_name=job, task_index=task,
                                protocol='grpc', config=config, start=True)
  except (tf.errors.OpError, RuntimeError) as e:
    raise RuntimeError(f'{name}: cannot start a server at {address}: {e}. '
                       'Is the port in use?') from e


def Serve(cluster_spec, job, task, bind_address='127.0.0.1', num_devices=1,
          why='', **thread_options):
  """Starts the server (StartServer's arguments) and serves until killed.

  `why`, if given, ends the line that says it serves (e.g. that TF_CONFIG
  made this process a worker).
  """
  server = StartServer(cluster_spec, job, task, bind_address, num_devices,
                       **thread_options)
  print(f'Serving {cluster_spec_lib.TaskName(job, task)} at '
        f'{_TaskAddress(cluster_spec, job, task)} with {num_devices} CPU '
        'device(s).' + (f' {why}' if why else ''), flush=True)
  server.join()


def ConnectToCluster(cluster_spec, job=cluster_spec_lib.CONTROLLER_JOB,
                     task=0, bind_address='127.0.0.1'):
  """Connects this process (a task of the spec) to every other task."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  address = _TaskAddress(cluster_spec, job, task)
  CheckBindAddress(bind_address, address, cluster_spec_lib.TaskName(job, task))
  tf.config.experimental_connect_to_cluster(cluster_spec, job_name=job,
                                            task_index=task, protocol='grpc')


def ProbeGrpc(address, timeout_s):
  """None if a gRPC server answers at `address` within the timeout, else why.

  A TCP connect alone is not enough: the kernel accepts connections for a
  stopped process. The HTTP/2 SETTINGS answer needs the server's I/O loop.
  """
  host, port = cluster_spec_lib.SplitAddress(address)
  deadline = time.monotonic() + timeout_s
  try:
    with socket.create_connection((host, port), timeout=timeout_s) as s:
      s.sendall(_HTTP2_PREFACE)
      data = b''
      while len(data) < 9:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = s.recv(64)
        if not chunk:
          return 'it closed the connection'
        data += chunk
      if data[3] != 4:
        return f'it answered frame type {data[3]} instead of SETTINGS'
      return None
  except socket.timeout:
    return f'no answer within {timeout_s:g}s'
  except OSError as e:
    return e.strerror or str(e)


def WaitForTasks(tasks, timeout_s, exit_status=None, interval_s=0.25,
                 hint='Start them (or check their logs) and retry.',
                 each_round=None):
  """Waits until every task's server answers.

  Args:
    tasks: [(task name, 'host:port')].
    timeout_s: how long to wait for all of them.
    exit_status: for tasks whose processes the caller started: called with a
      task name, returns the process's exit status, or None while it runs.
    interval_s: seconds between rounds of probes.
    hint: the end of the error messages: what the user should do.
    each_round: called before each round of probes; it may raise to stop
      the wait (the launcher does, once a signal asked it to stop).

  Raises:
    TimeoutError: naming the tasks that did not answer in time.
    RuntimeError: naming a task whose process exited before serving.
  """
  deadline = time.monotonic() + timeout_s
  pending = list(tasks)
  while True:
    if each_round:
      each_round()
    pending = [(n, a) for n, a in pending if ProbeGrpc(a, 1.0) is not None]
    if not pending:
      return
    for name, address in pending:
      status = exit_status(name) if exit_status else None
      if status is not None:
        raise RuntimeError(f'{name} at {address} exited with status {status} '
                           f'before serving. {hint}')
    if time.monotonic() >= deadline:
      raise TimeoutError(
          f'{len(pending)} task(s) did not start serving within '
          f'{timeout_s:g}s: ' + ', '.join(f'{n} at {a}' for n, a in pending) +
          f'. {hint}')
    time.sleep(interval_s)
