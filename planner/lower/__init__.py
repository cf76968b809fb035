"""The eager lowering of a plan: checkpointed GraphModules and module-level checkpointing (README.md)."""
