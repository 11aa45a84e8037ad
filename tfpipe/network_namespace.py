"""A network namespace that holds only loopback, for servers meant for this host.

TensorFlow's gRPC server always listens on every interface ("0.0.0.0"/"[::]"
is hard-coded in grpc_server_lib.cc; no ServerDef or ConfigProto field
changes it) and has no authentication. A job whose servers should be reached
from this host only must therefore run where the network cannot reach it: a
new network namespace, whose only interface is lo. `unshare --net
--map-root-user` makes one without root.

    network_namespace.EnterLoopbackNamespace('tfpipe.launcher', sys.argv)

re-executes `python -m tfpipe.launcher ...` in such a namespace (or, already
in one, only brings lo up), so everything the program starts afterwards
inherits it. The launcher and the benchmarks that start worker processes
call it first; tfpipe.servers refuses a loopback bind outside such a
namespace.
"""

import os
import shutil
import socket
import struct
import sys

# Set in the re-executed program so that it knows it already is in a
# namespace, and refuses to loop if the namespace still has other interfaces.
NAMESPACE_ENV = 'TFPIPE_LOOPBACK_NAMESPACE'

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


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


def EnterLoopbackNamespace(module, argv):
  """Runs this program in a loopback-only network namespace.

  In one already: brings lo up and returns. Otherwise replaces this process
  (os.execv, so it never returns) with `python -m module argv[1:]` under
  `unshare --net --map-root-user`. unshare runs without --fork: it enters
  the namespaces and executes the program in its own process, so the
  program keeps this process's id and gets every signal sent to it. (With
  --fork, as --kill-child implies, the id that schedulers, `timeout` and the
  shell signal would be unshare's, and unshare ignores SIGINT and SIGTERM
  while it waits for its child.)

  Args:
    module: the program's module, as `python -m` takes it.
    argv: the program's sys.argv; argv[1:] are passed on.

  Raises:
    RuntimeError: `unshare` is missing, or the new namespace still has
      interfaces other than lo.
  """
  if OnlyLoopbackInterfaces():
    BringUpLoopback()
    return
  if os.environ.get(NAMESPACE_ENV):
    raise RuntimeError(
        'The new network namespace still has interfaces other than lo; '
        'refusing to start servers that TensorFlow would expose on them.')
  unshare = shutil.which('unshare')
  if not unshare:
    raise RuntimeError(
        '`unshare` (util-linux) is needed to keep the gRPC servers on '
        'loopback (TensorFlow listens on 0.0.0.0); install util-linux.')
  os.environ[NAMESPACE_ENV] = '1'
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(unshare, [unshare, '--net', '--map-root-user', sys.executable,
                     '-m', module] + list(argv[1:]))
