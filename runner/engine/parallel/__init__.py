"""Parallelism inside one worker, by job: mesh (the parallel dimensions, the process group, this
process's place and device), wrap (the model's parallelize functions, gradient-sync control), collectives
(reductions across ranks) and state (full state dicts). Callers import the helpers from here."""
from runner.engine.parallel.collectives import (all_reduce_max, all_reduce_sum, barrier, broadcast_object,
                                                gather_objects, global_count)
from runner.engine.parallel.mesh import (DistEnv, ParallelDims, in_torchrun, init_process_group, nominal_world,
                                         pick_device, place, resolve_dims)
from runner.engine.parallel.state import (clip_grad_norm, clip_grad_value, full_model_state, full_state, full_tensor,
                                          grad_norm, load_full_state, load_model_state, local_tensor_of)
from runner.engine.parallel.wrap import parameter_device, shard_blocks, sync_gradients, wrap

__all__ = ["DistEnv", "ParallelDims", "all_reduce_max", "all_reduce_sum", "barrier", "broadcast_object", "clip_grad_norm",
           "clip_grad_value", "grad_norm",
           "full_model_state", "full_state", "gather_objects", "global_count", "in_torchrun", "init_process_group",
           "load_full_state", "load_model_state", "full_tensor", "local_tensor_of", "nominal_world", "parameter_device", "pick_device",
           "place", "resolve_dims", "shard_blocks", "sync_gradients", "wrap"]
