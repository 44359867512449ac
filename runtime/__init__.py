"""The back end: what `torchrun -m parc.run compiled/` executes on every rank.

Reading order: train.py (`Trainer`: one rank's programs, state, optimizer and step), then
parallel/ (the collectives and one file per parallel axis), then checkpoint/ (where state comes
from and goes to). Beside them, one file each: context (process groups from the mesh), compiled
(loading the generated programs), data, precision, dropout, optim_step, param_groups,
schedule_lr, divergence, metrics, memory, saved (what autograd saves, as ZeRO-3, sequence parallelism
and the memory probe each change or watch it), evaluate, launch and placement (torchrun and the
topology), verify, verify_grads and serial_reference (`--verify`), recompute_policy. Surviving
failures (docs/fault-tolerance.md): lifeline (workers die with their launcher), watchdog (hung ranks
named), faults (the chaos test's injected faults); the checkpoint side is checkpoint/.
"""
