"""Parallelism inside one worker, by job: mesh (the parallel dimensions, the process group, this
process's place and device), wrap (the model's parallelize functions, gradient-sync control), collectives
(reductions across ranks) and state (sharded state dicts for checkpoints). Callers import the helpers from here."""
from runner.engine.parallel.collectives import (all_reduce_max, all_reduce_sum, barrier, broadcast_object,
                                                gather_objects, global_count)
from runner.engine.parallel.mesh import (DistEnv, ParallelDims, in_torchrun, init_process_group, nominal_world,
                                         pick_device, place, resolve_dims)
from runner.engine.parallel.state import (AVERAGES, clip_grad_norm, clip_grad_value, flat_full_state, full_model_state,
                                          full_state, full_tensor, grad_norm, load_sharded, local_tensor_of, merged_groups,
                                          saved_names, sharded_state, tied_names)
from runner.engine.parallel.wrap import parameter_device, shard_blocks, sync_gradients, wrap

__all__ = ["AVERAGES", "DistEnv", "ParallelDims", "all_reduce_max", "all_reduce_sum", "barrier", "broadcast_object", "clip_grad_norm",
           "clip_grad_value", "grad_norm",
           "full_model_state", "full_state", "gather_objects", "global_count", "in_torchrun", "init_process_group",
           "flat_full_state", "load_sharded", "merged_groups", "saved_names", "sharded_state", "tied_names", "full_tensor", "local_tensor_of", "nominal_world", "parameter_device", "pick_device",
           "place", "resolve_dims", "shard_blocks", "sync_gradients", "wrap"]
