"""Meshes and parameter placement: the only place that maps logical axes to mesh axes."""
from dropless.parallel.mesh import (LOGICAL_RULES, NodeMesh, batch_axes, batch_sharding,
                                    logical_to_spec, make_mesh, mesh_axis_size, node_mesh,
                                    train_mesh)
from dropless.parallel.sharding import (PARAM_AXES, param_axes, param_shardings, param_specs,
                                        shard_params, state_shardings)

__all__ = ["LOGICAL_RULES", "NodeMesh", "PARAM_AXES", "batch_axes", "batch_sharding",
           "logical_to_spec", "make_mesh", "mesh_axis_size", "node_mesh", "param_axes",
           "param_shardings", "param_specs", "shard_params", "state_shardings", "train_mesh"]
