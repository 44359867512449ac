"""What parc can say about a plan before it runs: support, review, cost, report.

Reading order, each file one job:

  support.py      which feature combinations the runtime implements (compile refuses the rest)
  review.py       the plan against a world size and a hardware preset: located findings for `parc check`
  activations.py  per-layer activation statistics from the traced graph (needs torch.fx)
  cost.py         memory and step-time estimates from the plan and those statistics (no torch)
  compute.py      compute time per operation: matmul/attention efficiency tables, memory-bound bytes
  presets.py      the shipped a100/h100/h200 tables and where their figures come from
  calibrate.py    `parc calibrate`: measure this device into a preset file (torch)
  calibrate_step.py  calibrate on a CPU: a probe model's step timed in place against the tables (`in_step`)
  probe_model.py  that probe, a model file in docs/model-convention.md's form
  preset_file.py  read a calibrated preset file back (cost.py's, without importing calibrate)
  report.py       `parc report`: the estimates as a table or JSON
  experts.py      expert parallelism's all-to-all volume and time in the estimate
  schedules.py    a memo of pipeline schedules and their simulations, for many estimates
  planner.py      `parc plan`: search the plan space with the cost model
  plan_experts.py `parc plan`'s expert-parallel candidates

Nothing here changes the graph; the passes (passes/) and the runtime (runtime/)
never import this package.
"""
