"""Process groups, collectives with autograd, hand-written SP baselines, gradient reduction."""
from .grads import reduce_gradients
from .state import ParallelState, destroy_parallel, init_parallel, layout

__all__ = ["ParallelState", "init_parallel", "destroy_parallel", "layout", "reduce_gradients"]
