"""What runs inside each Ray Train worker: the model, the step, the loop, checkpoints."""
