"""One instance of a bare jax.distributed run, as ipu-run starts it: ``python collective_instance.py
OUT_DIR``. Each instance feeds its replicas' rows of a global batch; a program over the global mesh
sums every replica's rows and hands each instance back its own replicas' rows, and a replicated
value stays process 0's. The instance writes what it got to ``OUT_DIR/instance<index>.npz``.

With ``KILL_INSTANCE=i`` set, instance ``i`` kills itself with SIGKILL after the first sum, having
written the time to ``OUT_DIR/killed``, while the others go on summing.
"""

import os
import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import ipu_backend.distributed as popdist
from ipu_backend.runtime import processes

REPLICAS, ROWS = 4, 3
index, local = popdist.getInstanceIndex(), popdist.getNumLocalReplicas()
devices, per_process = processes.devices_for(local, popdist.getNumInstances())
mesh = Mesh(np.array(devices), ("replica",))
everything = np.arange(REPLICAS * ROWS, dtype=np.float32).reshape(REPLICAS, ROWS)
mine = everything[popdist.getReplicaIndexOffset():popdist.getReplicaIndexOffset() + local]


def program(weight, rows):
    return weight + jax.lax.psum(rows.sum(0), "replica"), rows * weight


step = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P(), P("replica")), out_specs=(P(), P("replica"))))
weight = processes.replicated(np.float32([index + 1.0] * ROWS), mesh, first_process=True)
batch, = processes.batch_on_mesh([mine], mesh, P("replica"))
for call in range(3):
    total, scaled = step(weight, batch)
    total.block_until_ready()
    if os.environ.get("KILL_INSTANCE") == str(index):
        with open(os.path.join(sys.argv[1], "killed"), "w") as out:
            out.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
np.savez(os.path.join(sys.argv[1], f"instance{index}.npz"), total=processes.local_rows(total),
         scaled=processes.local_rows(scaled), devices=per_process)
