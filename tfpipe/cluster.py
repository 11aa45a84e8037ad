"""Multi-host pipelines on TensorFlow's distributed runtime.

A tfpipe cluster is one controller and W workers. Every worker runs a
`tf.distribute.Server` and only serves; the controller connects to all of
them (`tf.config.experimental_connect_to_cluster`), builds the pipeline with
cell k of replica r on a remote device, and drives every step. Variables,
gradients and checkpoints are all handled by the controller's program, so a
multi-host run computes exactly what a single-process run computes.

Three facts of TensorFlow's runtime shape this module:

* TensorFlow's gRPC server always listens on every interface ("0.0.0.0"/"[::]"
  is hard-coded in grpc_server_lib.cc; no ServerDef or ConfigProto field
  changes it) and has no authentication. So "bind to 127.0.0.1" can only be
  honoured by running the whole job in a network namespace whose only
  interface is loopback; `StartServer` and `ConnectToCluster` refuse a
  loopback bind address outside such a namespace instead of silently
  listening on the network. The launcher creates that namespace.
* RPCs to a worker that is stopped or unreachable can hang for minutes, so
  the controller runs a `Watchdog` that speaks the first step of HTTP/2 to
  every worker and aborts the process with an error naming the task and its
  address when one stops answering.
* Tearing down an eager context whose workers died can hang too, so fatal
  cluster errors end the process with `os._exit`.
"""

import json
import os
import socket
import struct
import sys
import threading
import time

CONTROLLER_JOB = 'controller'
WORKER_JOB = 'worker'
LOOPBACK_ADDRESSES = ('127.0.0.1', 'localhost', '::1')
# Exit status of a controller that lost a worker.
EXIT_WORKER_LOST = 3

# HTTP/2 connection preface followed by an empty SETTINGS frame. A live gRPC
# server answers with its own SETTINGS frame (type 4) at once.
_HTTP2_PREFACE = (b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' +
                  b'\x00\x00\x00\x04\x00\x00\x00\x00\x00')
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


# ---- cluster specs ----------------------------------------------------------


def ParseClusterJobs(text, flag='--cluster_spec'):
  """{job: ['host:port', ...]} from text, without importing TensorFlow.

  Args:
    text: JSON ('{"worker": ["h:p", ...], ...}', or a TF_CONFIG with a
      "cluster" entry) or the compact form 'controller=h:p;worker=h:p,h:p'.
    flag: how the value is named in error messages.

  Raises:
    ValueError: saying what is malformed.
  """
  text = (text or '').strip()
  if not text:
    raise ValueError(f'{flag} is empty; give e.g. '
                     '"controller=127.0.0.1:2222;worker=127.0.0.1:2223".')
  if text.startswith('{'):
    try:
      jobs = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f'{flag}: invalid JSON: {e}') from None
    if isinstance(jobs.get('cluster'), dict):
      jobs = jobs['cluster']
  else:
    jobs = {}
    for part in filter(None, (p.strip() for p in text.split(';'))):
      name, sep, addresses = part.partition('=')
      if not sep or not name.strip():
        raise ValueError(f'{flag}: {part!r} is not "job=host:port,...".')
      jobs[name.strip()] = [a.strip() for a in addresses.split(',')
                            if a.strip()]
  for name, addresses in jobs.items():
    if not isinstance(addresses, list) or not addresses:
      raise ValueError(f'{flag}: job {name!r} needs a list of host:port.')
    for address in addresses:
      SplitAddress(address, f'{flag} (job {name})')
  return jobs


def ParseClusterSpec(text, flag='--cluster_spec'):
  """A tf.train.ClusterSpec from the text ParseClusterJobs reads."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.train.ClusterSpec(ParseClusterJobs(text, flag))


def _Jobs(cluster_spec):
  """{job: [addresses]} of a ClusterSpec or of such a dict."""
  jobs = cluster_spec if isinstance(cluster_spec, dict) else (
      cluster_spec.as_dict())
  return {job: _TaskAddresses(tasks) for job, tasks in jobs.items()}


def FormatClusterSpec(cluster_spec):
  """The compact text form that ParseClusterJobs reads."""
  jobs = _Jobs(cluster_spec)
  return ';'.join(f'{job}=' + ','.join(jobs[job]) for job in sorted(jobs))


def _TaskAddresses(tasks):
  if isinstance(tasks, dict):
    return [tasks[i] for i in sorted(tasks)]
  return list(tasks)


def SplitAddress(address, what='address'):
  """(host, port) of 'host:port' or '[v6]:port'; ValueError if malformed."""
  host, sep, port = str(address).rpartition(':')
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f'{what}: {address!r} is not host:port.')
  return host.strip('[]'), int(port)


def ClusterFromTfConfig(tf_config):
  """(ClusterSpec, job, task) from the text of a TF_CONFIG variable."""
  try:
    config = json.loads(tf_config)
  except json.JSONDecodeError as e:
    raise ValueError(f'TF_CONFIG: invalid JSON: {e}') from None
  if 'cluster' not in config:
    raise ValueError('TF_CONFIG has no "cluster" entry.')
  spec = ParseClusterSpec(json.dumps(config['cluster']), 'TF_CONFIG cluster')
  task = config.get('task', {})
  return spec, task.get('type'), int(task.get('index', 0))


def ResolveCluster(cluster_spec_text, job, task, environ=None):
  """(ClusterSpec, job, task) from flags, else from TF_CONFIG; None if neither.

  Explicit flags win over TF_CONFIG field by field.
  """
  environ = os.environ if environ is None else environ
  if cluster_spec_text:
    spec, env_job, env_task = ParseClusterSpec(cluster_spec_text), None, 0
  elif environ.get('TF_CONFIG'):
    spec, env_job, env_task = ClusterFromTfConfig(environ['TF_CONFIG'])
  else:
    return None
  job = job or env_job
  task = env_task if task is None else task
  jobs = _Jobs(spec)
  if job not in jobs:
    raise ValueError(f'--job={job!r} is not a job of the cluster spec '
                     f'({sorted(jobs)}); set --job to one of them.')
  if not 0 <= task < len(jobs[job]):
    raise ValueError(f'--task={task} but job {job!r} has {len(jobs[job])} '
                     'task(s); give a task index in range.')
  return spec, job, task


def TaskName(job, task):
  return f'/job:{job}/task:{task}'


def JobTasks(cluster_spec, job=WORKER_JOB):
  """[(task name, 'host:port')] of every task of `job`, in task order."""
  return [(TaskName(job, i), a)
          for i, a in enumerate(_Jobs(cluster_spec).get(job, []))]


# ---- devices ----------------------------------------------------------------


def PipelineDevices(num_stages, num_workers, num_replicas=1,
                    device_type='CPU', job=WORKER_JOB, devices_per_worker=1):
  """R*K device names, replica-major, spread over W workers.

  Slot i = r*K + k (replica r, stage k) goes to worker i % W, device
  (i // W) % devices_per_worker: with W >= R*K every cell has its own worker;
  with fewer workers they are shared round-robin.
  """
  for name, value in (('num_stages', num_stages), ('num_workers', num_workers),
                      ('num_replicas', num_replicas),
                      ('devices_per_worker', devices_per_worker)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f'{name} must be an int >= 1; received {value!r}.')
  return [f'/job:{job}/replica:0/task:{i % num_workers}/device:{device_type}:'
          f'{(i // num_workers) % devices_per_worker}'
          for i in range(num_stages * num_replicas)]


def DeviceMeshText(devices, num_replicas):
  """The (replicas, stages) mesh of a replica-major device list."""
  k = len(devices) // num_replicas
  rows = [f'device mesh: {num_replicas} replica(s) x {k} stage(s)']
  for r in range(num_replicas):
    rows.append(f'  replica {r}: ' + '  '.join(
        f'[{s}] {d}' for s, d in enumerate(devices[r * k:(r + 1) * k])))
  return '\n'.join(rows)


# ---- loopback-only network namespaces ---------------------------------------


def OnlyLoopbackInterfaces():
  """True when this process's network namespace has no interface but lo."""
  return [name for _, name in socket.if_nameindex()] == ['lo']


def BringUpLoopback():
  """Sets 'lo' up (a fresh network namespace starts with it down)."""
  import fcntl  # pylint: disable=g-import-not-at-top
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack('16sH14x', b'lo', 0)
    flags = struct.unpack('16sH14x', fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
    if not flags & _IFF_UP:
      fcntl.ioctl(s, _SIOCSIFFLAGS,
                  struct.pack('16sH14x', b'lo', flags | _IFF_UP))


def CheckBindAddress(bind_address, address, what):
  """Refuses a loopback bind that TensorFlow would turn into 0.0.0.0.

  Args:
    bind_address: --bind_address: a loopback address, or the explicit choice
      of a routable one ('0.0.0.0' or the host's address).
    address: this task's 'host:port' in the cluster spec.
    what: the task, for messages.

  Raises:
    ValueError: a loopback bind outside a loopback-only network namespace,
      or a loopback bind for a task whose address is not loopback.
  """
  host, _ = SplitAddress(address, what)
  if bind_address not in LOOPBACK_ADDRESSES:
    print(f'{what}: --bind_address={bind_address}: TensorFlow\'s gRPC server '
          f'listens on every interface of this host at {address}, with no '
          'authentication; keep its port reachable only inside a trusted '
          'network.', file=sys.stderr, flush=True)
    return
  if host not in LOOPBACK_ADDRESSES:
    raise ValueError(
        f'{what} is at {address}, not a loopback address, but '
        f'--bind_address={bind_address}. Give loopback addresses in '
        '--cluster_spec, or pass --bind_address=0.0.0.0 to serve on the '
        'network on purpose.')
  if not OnlyLoopbackInterfaces():
    raise ValueError(
        f'{what}: --bind_address={bind_address}, but TensorFlow\'s gRPC '
        'server always listens on 0.0.0.0 and this network namespace has '
        'interfaces other than lo. Start the job with `python -m '
        'tfpipe.launcher` (which runs it in a loopback-only namespace), or '
        'run it under `unshare --net --map-root-user`, or pass '
        '--bind_address=0.0.0.0 to serve on the network on purpose.')


# ---- servers and the controller ---------------------------------------------


def StartServer(cluster_spec, job, task, bind_address='127.0.0.1',
                num_devices=1):
  """Starts this task's tf.distribute.Server with `num_devices` CPU devices."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  address = dict(JobTasks(cluster_spec, job))[TaskName(job, task)]
  CheckBindAddress(bind_address, address, TaskName(job, task))
  config = tf.compat.v1.ConfigProto(device_count={'CPU': num_devices})
  try:
    return tf.distribute.Server(cluster_spec, job_name=job, task_index=task,
                                protocol='grpc', config=config, start=True)
  except (tf.errors.OpError, RuntimeError) as e:
    raise RuntimeError(f'{TaskName(job, task)}: cannot start a server at '
                       f'{address}: {e}. Is the port in use?') from e


def Serve(cluster_spec, job, task, bind_address='127.0.0.1', num_devices=1):
  """Starts the server and serves until the process is killed."""
  server = StartServer(cluster_spec, job, task, bind_address, num_devices)
  address = dict(JobTasks(cluster_spec, job))[TaskName(job, task)]
  print(f'Serving {TaskName(job, task)} at {address} with {num_devices} '
        'CPU device(s).', flush=True)
  server.join()


def ConnectToCluster(cluster_spec, job=CONTROLLER_JOB, task=0,
                     bind_address='127.0.0.1'):
  """Connects this process (a task of the spec) to every other task."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  address = dict(JobTasks(cluster_spec, job)).get(TaskName(job, task))
  if address is None:
    raise ValueError(f'The cluster spec has no {TaskName(job, task)}; add '
                     f'the controller, e.g. "{job}=127.0.0.1:PORT;worker=...".')
  CheckBindAddress(bind_address, address, TaskName(job, task))
  tf.config.experimental_connect_to_cluster(cluster_spec, job_name=job,
                                            task_index=task, protocol='grpc')


# ---- liveness ---------------------------------------------------------------


def ProbeGrpc(address, timeout_s):
  """None if a gRPC server answers at `address` within the timeout, else why.

  A TCP connect alone is not enough: the kernel accepts connections for a
  stopped process. The HTTP/2 SETTINGS answer needs the server's I/O loop.
  """
  host, port = SplitAddress(address)
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


def UnreachableMessage(task_name, address, reason):
  return (f'Worker {task_name} at {address} is unreachable ({reason}). '
          'Check that its process is running and its port is reachable, '
          'then restart the job: training resumes from the last checkpoint.')


class Watchdog:
  """Probes every worker on a thread; aborts the process when one is lost.

  A worker is declared lost after `max_failures` consecutive failed probes,
  so the bound on detection is `bound_s` = max_failures * (interval_s +
  timeout_s) after it stopped answering.
  """

  def __init__(self, tasks, interval_s=2.0, timeout_s=3.0, max_failures=2,
               on_lost=None):
    """Creates a stopped watchdog; Start() starts it.

    Args:
      tasks: [(task name, 'host:port')] to probe.
      interval_s: seconds between rounds of probes.
      timeout_s: seconds one probe may take.
      max_failures: consecutive failed probes that make a task lost.
      on_lost: called with the message when a task is lost; by default
        prints it and exits the process with EXIT_WORKER_LOST.
    """
    self.tasks = list(tasks)
    self.interval_s = interval_s
    self.timeout_s = timeout_s
    self.max_failures = max_failures
    self._on_lost = on_lost or AbortWorkerLost
    self._stop = threading.Event()
    self._thread = None
    self.lost = None

  @property
  def bound_s(self):
    return self.max_failures * (self.interval_s + self.timeout_s)

  def CheckOnce(self, failures):
    """Probes all tasks, counting `failures`; a message if one is lost."""
    for name, address in self.tasks:
      reason = ProbeGrpc(address, self.timeout_s)
      failures[name] = 0 if reason is None else failures.get(name, 0) + 1
      if failures[name] >= self.max_failures:
        return UnreachableMessage(name, address, reason)
    return None

  def _Run(self):
    failures = {}
    while not self._stop.wait(self.interval_s):
      message = self.CheckOnce(failures)
      if message and not self._stop.is_set():
        self.lost = message
        self._on_lost(message)
        return

  def Start(self):
    self._thread = threading.Thread(target=self._Run, name='tfpipe-watchdog',
                                    daemon=True)
    self._thread.start()
    return self

  def Stop(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=self.interval_s + self.timeout_s + 1)


def AbortWorkerLost(message):
  """Prints the message and ends the process now (no hanging teardown)."""
  print(f'ERROR: {message}', file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(EXIT_WORKER_LOST)  # pylint: disable=protected-access


def WaitForTasks(tasks, timeout_s, interval_s=0.25):
  """Waits until every task answers; raises TimeoutError naming the rest."""
  deadline = time.monotonic() + timeout_s
  pending = list(tasks)
  while True:
    pending = [(n, a) for n, a in pending if ProbeGrpc(a, 1.0) is not None]
    if not pending:
      return
    if time.monotonic() >= deadline:
      raise TimeoutError(
          f'{len(pending)} task(s) did not start serving within '
          f'{timeout_s:g}s: ' + ', '.join(f'{n} at {a}' for n, a in pending) +
          '. Start them (or check their logs) and retry.')
    time.sleep(interval_s)


def RunController(fn, tasks, watchdog=None):
  """Runs fn() with a watchdog; a lost worker ends the process clearly.

  Connection errors raised by TensorFlow (UnavailableError and friends) are
  traced to the worker that no longer answers, reported, and the process
  exits with EXIT_WORKER_LOST.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  watchdog = watchdog or Watchdog(tasks)
  watchdog.Start()
  try:
    return fn()
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.AbortedError, tf.errors.CancelledError,
          tf.errors.InternalError) as e:
    for name, address in tasks:
      reason = ProbeGrpc(address, watchdog.timeout_s)
      if reason is not None:
        AbortWorkerLost(UnreachableMessage(name, address, reason))
    raise
  finally:
    watchdog.Stop()

