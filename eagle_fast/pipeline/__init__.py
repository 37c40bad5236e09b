"""The offline extraction pipeline: jsonl in, a sharded, checksummed EAGLE-3 dataset out.

`plan` (`ExtractConfig`, `extract`'s settings, checked and resolved once by `resolve` into the
frozen `config.ExtractPlan` the stages take; `extract`, `dry_run`), `prepare` (the dataset
directory: manifest, sidecars), `disk` (the bytes a plan writes, the space check), `run` (engine
calls and the writer thread), `distributed` (`extract(..., ray=RayOptions())`: the same shards on
Ray actors), `merge` (per-node parts into one dataset), `verify` (recompute samples with
transformers), `inspect` (summarise a dataset). The package re-exports nothing, so each submodule
stays reachable by its name.
"""
