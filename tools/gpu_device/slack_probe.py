"""Where a fresh device holds more than its variables and slots (MLP K=4).

Run from the repository root (checks.sh slack_probe on the device machine;
on a CPU the logical devices share one allocator, so only the path runs).
Nine logical devices: the trainer's task built on 0-3 (each one's held
bytes against its tensors, then one step's peak), then each cell built
alone on a fresh device (4-7), then the cells one after another on device
8, each freed before the next. On an H200 (benchmarks/RESULTS.md, "Third
H200 run"): 4 MiB of allocator slack on every fresh device, the same for
a cell alone on a fresh device, and none for cell 1 on device 8.
"""
import gc, json, os, sys
sys.path.insert(0, os.getcwd())
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
from tfpipe import quiet
tf = quiet.ImportTensorFlow()
MIB = 2.0**20
N = 9
gpus = tf.config.list_physical_devices('GPU')
kind = 'GPU' if gpus else 'CPU'
if gpus:
  tf.config.set_logical_device_configuration(gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=1024)] * N)
else:
  tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * N)
names = [f'/job:localhost/replica:0/task:0/device:{kind}:{i}' for i in range(N)]
cur = lambda i: tf.config.experimental.get_memory_info(f'{kind}:{i}')['current'] / MIB
peak = lambda i: tf.config.experimental.get_memory_info(f'{kind}:{i}')['peak'] / MIB
from benchmarks import memory_model_accuracy as mma
from tfpipe.gpipe import memory_profile, pipelining_layer
from tfpipe.trainer import memory_report, optimizer as optimizer_lib
def On(vs, i):
  return memory_profile.Bytes([v for v in vs if v.value.device.endswith(f'{kind}:{i}')]) / MIB
p = mma.ExperimentParams('mlp')
p.task.pipeline.Set(num_partitions=4, num_micro_batches=1, devices=names[:4])
task = p.task.Instantiate()
allv = list(task.pipe.variables) + list(task.optimizer.variables)
for k in range(4):
  print(f'task build device {k}: held {cur(k):.3f} tensors {On(allv, k):.3f} slack {cur(k) - On(allv, k):.3f}', flush=True)
example = memory_report.ExampleBatch(p)
with tf.device('/CPU:0'):
  inputs, targets = tf.nest.map_structure(tf.convert_to_tensor, example)
float(task.TrainStep((inputs, targets))['loss'])
for k in range(4):
  tf.config.experimental.reset_memory_stats(f'{kind}:{k}')
float(task.TrainStep((inputs, targets))['loss'])
for k in range(4):
  print(f'after step device {k}: held {cur(k):.3f} peak {peak(k):.3f}', flush=True)
cells, shapes = task.cell_params, memory_report.CellInputShapes(task.cell_params, task.model.InputShape())
def Probe(i, dev):
  gc.collect()
  before = cur(dev)
  pipe = pipelining_layer.PipeliningLayer.Params().Set(name=f'probe{i}_{dev}', cell_tpl=[cells[i].Copy()], num_micro_batches=1,
      devices=[names[dev]], executor='threads', schedule='gpipe').Instantiate()
  pipe.build(shapes[i])
  opt = optimizer_lib.BuildOptimizer(p.task.train.optimizer, 1e-3)
  with tf.device(names[dev]):
    opt.build(pipe.trainable_variables)
  vs = list(pipe.variables) + list(opt.variables)
  held = cur(dev) - before
  print(f'  probe cell {i} on device {dev}: held {held:.3f} tensors {On(vs, dev):.3f} slack {held - On(vs, dev):.3f}', flush=True)
  return pipe, opt
print('each cell on a fresh device:')
keep = [Probe(i, 4 + i) for i in range(4)]
print('cells one after another on one device, freed between:')
for i in range(4):
  r = Probe(i, 8); del r
