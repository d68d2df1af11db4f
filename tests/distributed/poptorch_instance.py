"""One instance of tiny.py's run, as ipu-run starts it: ``python poptorch_instance.py OUT_DIR``.

It writes its weights, losses and random numbers to ``OUT_DIR/instance<index>.npz``.
"""

import os
import sys

import numpy as np

import ipu_backend.distributed as popdist
from tests.distributed import tiny

index = popdist.getInstanceIndex()
net, losses, noises = tiny.train(popdist.poptorch.Options(), popdist.getReplicaIndexOffset(),
                                 popdist.getNumLocalReplicas())
np.savez(os.path.join(sys.argv[1], f"instance{index}.npz"), losses=np.stack(losses), noises=np.stack(noises),
         **{name: p.detach().numpy() for name, p in net.named_parameters()})
