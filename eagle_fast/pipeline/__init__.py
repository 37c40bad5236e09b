"""The offline extraction pipeline: jsonl in, a sharded, checksummed EAGLE-3 dataset out.

`config` (the settings and their checks), `prepare` (plan, layout, resume), `run` (`extract`:
engine calls and the writer thread), `distributed` (`extract(..., ray=RayOptions())`: the same
shards on Ray actors), `merge` (per-node parts into one dataset), `verify`
(recompute samples with transformers), `inspect` (summarise a dataset). The package re-exports
nothing, so each submodule stays reachable by its name.
"""
