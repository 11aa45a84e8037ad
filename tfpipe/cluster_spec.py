"""Cluster specs: which tasks a multi-process job has, and at what address.

A tfpipe cluster is one controller and W workers (see tfpipe.multihost).
Its spec comes from --cluster_spec, in JSON or the compact form
'controller=h:p;worker=h:p,h:p', or from the TF_CONFIG variable that other
TensorFlow launchers set. This module reads and writes those forms and names
the tasks, without importing TensorFlow (the launcher and the flag checks
run before it loads); only `ParseClusterSpec` builds a tf.train.ClusterSpec.

`IsLoopbackAddress` decides by address, not by spelling, whether a host is
loopback: the servers refuse a loopback bind they cannot honour
(tfpipe.servers), and a wrong answer there would serve on the network.
`BindAddressProblem` refuses a bind address that is not one of this host's
(an empty or mistyped one), which would otherwise be taken for the choice to
serve on the network.
"""

import ipaddress
import json
import os
import socket

CONTROLLER_JOB = 'controller'
WORKER_JOB = 'worker'


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


def TaskAddress(cluster_spec, job, task):
  """'host:port' of one task; None if the spec has no such task."""
  return dict(JobTasks(cluster_spec, job)).get(TaskName(job, task))


def _ResolvedAddresses(host):
  """The IP addresses `host` stands for: a literal needs no name lookup."""
  host = host.strip().strip('[]')
  try:
    infos = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
  except (socket.gaierror, UnicodeError):
    name = host.rstrip('.').lower()
    if name == 'localhost' or name.endswith('.localhost'):
      return [ipaddress.ip_address('127.0.0.1')]  # RFC 6761: always loopback.
    try:
      infos = socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError, OSError):
      return []
  addresses = [ipaddress.ip_address(info[4][0].split('%')[0])
               for info in infos]
  return list(dict.fromkeys(addresses))  # One per address, in order.


def _IsLoopback(address):
  if getattr(address, 'ipv4_mapped', None) is not None:
    address = address.ipv4_mapped
  return address.is_loopback


def _CanBind(address):
  """True if a socket can bind to `address` here: an address of this host."""
  family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as s:
      s.bind((str(address), 0))
  except OSError:
    return False
  return True


def BindAddressProblem(host):
  """None if `host` is an address a server of this host can mean, else why.

  Accepted: loopback, the unspecified addresses ('0.0.0.0', '::': every
  interface), and names or addresses that resolve only to addresses of this
  host (ones a socket can bind to). A name that does not resolve, such as a
  mistyped 'locahost' or '127.0.0.l', is not an address of this host.
  """
  text = str(host).strip()
  if not text:
    return 'it is empty'
  addresses = _ResolvedAddresses(text)
  if not addresses:
    return 'it is neither an IP address nor a name that resolves'
  foreign = [str(a) for a in addresses
             if not (_IsLoopback(a) or a.is_unspecified or _CanBind(a))]
  if foreign:
    return (f'it stands for {", ".join(foreign)}, which no interface of this '
            'host has')
  return None


def IsLoopbackAddress(host):
  """True when every address `host` resolves to is in 127.0.0.0/8 or ::1.

  By address, not by spelling: '127.0.0.2', '127.1', '[::1]',
  '::ffff:127.0.0.1' and 'localhost.' are all loopback. A name that does not
  resolve is not.
  """
  addresses = _ResolvedAddresses(str(host))
  return bool(addresses) and all(_IsLoopback(a) for a in addresses)
