"""The decision kernel, compiled with numba: cache bookkeeping, eviction orders, routing, the
policies' decisions and the replay loop. Shared by the engine and the simulator; it works
on numpy arrays and never calls back into the engine."""
