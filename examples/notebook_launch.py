"""Multi-process training from a notebook or a REPL: ``trainperf.ddp.launch(start_method="fork")``.

    python examples/notebook_launch.py     # or paste the cells (# %%) into Jupyter, one by one

A notebook defines its training function in a cell, where spawned workers, which import
``main`` by name, cannot find it. On Linux, ``start_method="fork"`` copies the running
interpreter instead: the workers see every function and tensor defined so far, closures and
lambdas included, and start in a fraction of a second. Two gloo ranks on the CPU here; call
``launch`` before anything initialises CUDA (fork and an initialised CUDA do not mix, and
``launch`` refuses with a ``DeviceError`` that says so).

Like a notebook, this script has no ``if __name__ == "__main__":`` guard: fork does not
re-import it.
"""

# %% Cell 1: imports and data, as a notebook would have them
from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import trainperf.ddp as ddp

g = torch.Generator().manual_seed(0)
features = torch.randn(512, 8, generator=g)
targets = features @ torch.randn(8, 1, generator=g)
data = TensorDataset(features, targets)  # forked workers inherit it: nothing is pickled


# %% Cell 2: the training function, defined in the notebook
def train(epochs: int, lr: float) -> dict[str, float]:
    torch.manual_seed(0)
    model = ddp.wrap_model(nn.Linear(8, 1))
    loader = ddp.distributed_loader(data, batch_size=32, seed=0)  # this rank's half
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
    ddp.print0(f"  {ddp.world_size()} ranks, {len(loader)} batches per epoch each")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": ddp.rank(), "loss": loss.item(), "weights_sum": weights.sum().item()}


# %% Cell 3: launch it on 2 CPU ranks; the value is rank 0's
start = time.perf_counter()
result = ddp.launch(train, 3, lr=0.05, nprocs=2, backend="gloo", start_method="fork")
print(f"launch -> rank 0 returned {result} in {time.perf_counter() - start:.1f} s")

# %% Cell 4: every rank's value, indexed by rank
values = ddp.launch_all(train, 3, lr=0.05, nprocs=2, backend="gloo", start_method="fork")
for value in values:
    print(f"launch_all -> rank {value['rank']}: loss {value['loss']:.4f}")
in_sync = len({round(v["weights_sum"], 5) for v in values}) == 1
print(f"ranks hold the same weights after training: {in_sync}")

# %% Cell 5: closures and lambdas work under fork; spawn explains why it cannot take them
scale = 10
print(
    "a lambda under fork:",
    ddp.launch_all(lambda: ddp.rank() * scale, nprocs=2, backend="gloo", start_method="fork"),
)
try:
    ddp.launch(lambda: 0, nprocs=2, backend="gloo", start_method="spawn")
except ValueError as e:
    print(f"the same under spawn: ValueError: {e}")
