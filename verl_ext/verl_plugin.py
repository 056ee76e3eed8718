"""Registers HeteroRL's losses and advantage estimators into verl (entry point group verl.plugins)."""
