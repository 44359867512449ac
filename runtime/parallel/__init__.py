"""The parallel mechanisms at run time, one file per axis, on top of `ops`.

Reading order:

  ops.py              the collectives a generated program calls, as autograd-aware
                      `torch.ops.parc.*` custom ops, and the axis → process group binding
  data_parallel.py    dp: bucketed gradient all-reduce, overlapped with backward
  tensor_parallel.py  tp at step time: the partial gradients summed once per step
  sequence_regather.py  tp's sequence parallelism: gathered inputs kept as slices, gathered again in backward
  pipeline.py         pp: the schedule executor (compute actions, P2P sends and receives)
  zero.py             ZeRO 1–3: the sharded optimizer executing the compiler's partition table
  expert_parallel.py  ep: the token all-to-all, expert gradients and expert ZeRO
  grad_norm.py        the global gradient norm for clipping, shared by every mix of the above
"""
