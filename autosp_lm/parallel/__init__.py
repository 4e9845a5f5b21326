"""Process groups and mesh, collectives with autograd, the hand-written Ulysses and ring
attention, the head-split policy, batch slicing and gradient reduction."""
from .grads import reduce_gradients
from .state import ParallelState, destroy_parallel, init_parallel, layout

__all__ = ["ParallelState", "init_parallel", "destroy_parallel", "layout", "reduce_gradients"]
