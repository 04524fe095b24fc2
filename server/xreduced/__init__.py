"""xreduced: the per-node cross-device reduction daemon."""
