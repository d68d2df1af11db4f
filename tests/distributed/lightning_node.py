"""One node of a Lightning run with ``Trainer(accelerator="ipu", devices=2, num_nodes=2)``, as a launcher
starts it: ``python lightning_node.py OUT_DIR``.

It fits ``nodes.module()`` for one epoch with validation, checkpointing into ``OUT_DIR``, and writes
to ``OUT_DIR/node<rank>.npz`` its weights, the values it logged, the global step, the world size and
how many checkpoints it wrote itself.
"""

import os
import sys

import lightning.pytorch as pl
import numpy as np

from tests.distributed import nodes

out = sys.argv[1]
module = nodes.module()
io, metrics = nodes.CountingCheckpointIO(), nodes.MetricsAfterValidation()
trainer = pl.Trainer(accelerator="ipu", devices=2, num_nodes=2, max_epochs=1, plugins=[io],
                     callbacks=[nodes.checkpoints(out), metrics], **nodes.FLAGS)
nodes.fit(trainer, module)
np.savez(os.path.join(out, f"node{trainer.global_rank}.npz"), saves=io.saves, global_step=trainer.global_step,
         world_size=trainer.world_size,
         **{f"weight/{name}": p.detach().numpy() for name, p in module.named_parameters()},
         **{f"metric/{name}": value.numpy() for name, value in metrics.epochs[0].items()})
