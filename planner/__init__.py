"""stepflow: planner, `make plan` (docs/real-model.md): a config checked and its cost estimated per
stage before anything loads, and the same memory estimate each stage checks at its start.

plan (the record: GPU types, models, data, launches, stage costs, findings), resolve (models and
data), launch (accelerate configs and the running launch), memory (one GPU's items and their check),
costs (each stage's work, memory and GPU-hours), searchers (the asynchronous mode's GPUs), make
(make_plan), render (the report), runtime (stage_memory, share_key: what a stage reads at its
start), doc (the make plan blocks a doc quotes).
"""
