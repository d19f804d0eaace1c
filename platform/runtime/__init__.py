"""The runtime layer: what runs in Ray (the driver, the Coordinator, the workers, the pool, the state
store, checkpoints, transport, process set-up)."""
