"""The step loop and its state."""
